"""``ivq diff``: the same as ``ivq-diff``."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq diff`` (those of ``ivq-diff``)."""
    from ivq_debug.cli.diff import add_diff_arguments

    add_diff_arguments(p)


def execute(args: argparse.Namespace) -> int:
    """Run the diff."""
    from ivq_debug.cli.diff import execute_diff

    return execute_diff(args)
