"""``ivq diff``: the same as ``ivq-diff``."""

from __future__ import annotations

import argparse

from ivq_debug.cli.diff import add_diff_arguments, execute_diff


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq diff`` (those of ``ivq-diff``)."""

    add_diff_arguments(p)


def execute(args: argparse.Namespace) -> int:
    """Run the diff."""

    return execute_diff(args)
