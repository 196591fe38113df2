"""The one output check of every writer (issue 31): every string option of every command has a declared role
(``cli.common.ROLES``), so a new command's output is checked against its inputs without the command asking."""

from __future__ import annotations

import argparse

from ivq_debug.cli.common import NUMBER_MIN, io_role
from ivq_debug.cli.diff import _Parser, add_diff_arguments
from ivq_debug.cli.main import build_parser


def _options(parser: argparse.ArgumentParser, command: str) -> list[tuple[str, str]]:
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _options(sub, command or name)
            continue
        if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._StoreTrueAction,
                          argparse._StoreFalseAction, argparse._CountAction, argparse._StoreConstAction)):
            continue
        if a.type in (int, float) or a.choices is not None or a.dest.startswith("_"):
            continue
        out.append((command, a.dest))
    return out


def test_every_path_like_option_of_every_command_has_a_role() -> None:
    diff = _Parser(prog="ivq-diff")
    add_diff_arguments(diff)
    options = _options(build_parser(), "") + _options(diff, "diff")
    assert len(options) > 100
    undeclared = sorted({f"{c} --{d}" for c, d in options if io_role(c, d) is None})
    assert not undeclared, f"declare these options' role in ivq_debug/cli/common.py ROLES: {undeclared}"
    # the outputs every writer has: each command's output options are known as outputs
    outputs = {(c, d) for c, d in options if io_role(c, d) == "output"}
    assert {("reference", "output"), ("quantize", "output"), ("diagnose", "json"), ("diff", "json"),
            ("report", "junit"), ("calib-stats", "output"), ("capture", "output")} <= outputs
    assert io_role("diagnose", "shards") == "input" and io_role("tune", "workdir") == "workdir"


def _numeric(parser: argparse.ArgumentParser) -> set[str]:
    out = set()
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _numeric(sub)
        elif a.type in (int, float):
            out.add(a.dest)
    return out


def test_every_numeric_option_has_a_declared_least_value() -> None:
    diff = _Parser(prog="ivq-diff")
    add_diff_arguments(diff)
    missing = sorted((_numeric(build_parser()) | _numeric(diff)) - set(NUMBER_MIN))
    assert not missing, f"declare these options' least value in ivq_debug/cli/common.py NUMBER_MIN: {missing}"
