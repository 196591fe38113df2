"""``ivq``: the workbench CLI (subcommands). See ``ivq <command> --help``.

Exit codes are those of :mod:`ivq_debug.errors` (0 pass, 1 failed check, 2 usage, 3 bad input,
4 unmatched, 5 tool missing).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any, NoReturn

from ivq_debug import __version__
from ivq_debug.cli.common import check_args, exit_with
from ivq_debug.errors import UsageError

#: subcommand → (module, help); each module defines ``add_arguments(parser)`` and ``execute(args) -> int``
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("ivq_debug.cli.cmd_demo", "run the whole story on the embedded reference VLM"),
    "ls": ("ivq_debug.cli.cmd_inspect", "list a dump's manifest"),
    "show": ("ivq_debug.cli.cmd_inspect", "show one tensor's statistics"),
    "diff": ("ivq_debug.cli.cmd_diff", "compare two dumps, or two ONNX models in memory (same as ivq-diff)"),
    "capture": ("ivq_debug.cli.cmd_capture", "capture per-layer tensors (onnx, qnn)"),
    "ingest": ("ivq_debug.cli.cmd_ingest", "ingest qnn-net-run folders (one run, or a device session) into a dump"),
    "reference": ("ivq_debug.cli.cmd_reference",
                  "replay a device session's ONNX parts on ORT CPU: its inputs, the model's positions, its tokens"),
    "quantize": ("ivq_debug.cli.cmd_quantize", "quantize an ONNX model: QDQ for QNN, or dynamic INT8 for ORT CPU"),
    "diagnose": ("ivq_debug.cli.cmd_diagnose", "introduced vs inherited error: replay QDQ units on reference inputs"),
    "calib-stats": ("ivq_debug.cli.cmd_calib_stats",
                    "per-tensor statistics and encoding coverage over a calibration set, as resumable jobs"),
    "tune": ("ivq_debug.cli.cmd_tune", "suggest quantization overrides and verify them (QNN HTP or ORT CPU-QDQ)"),
    "report": ("ivq_debug.cli.cmd_report", "write the HTML report and exports (Perfetto, Model Explorer, JUnit)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ivq`` argument parser; only ``command``'s module is imported (every one when ``None``).

    Each command module imports what it runs at its top, so building the full parser would load every stage;
    ``ivq ls`` builds only its own.
    """
    p = _Parser(prog="ivq", description="ivq-debug: layer-wise accuracy debugging for VLMs on QNN.")
    p.add_argument("--version", action="version", version=f"ivq-debug {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (mod, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if command is None or name == command:
            importlib.import_module(mod).add_arguments(sp, name)
        sp.set_defaults(_module=mod)
    return p


def _main(argv: list[str]) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)
    p = build_parser(command if command in COMMANDS else None)
    args: Any = p.parse_args(argv)
    if not args.command:
        p.print_help()
        return 2
    module = importlib.import_module(args._module)
    extra = getattr(module, "extra_inputs", None)
    check_args(args, args.command, extra(args) if extra is not None else ())  # every writer, before any work
    return module.execute(args)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point (:func:`~ivq_debug.cli.common.exit_with`)."""
    exit_with("ivq", _main, argv)


if __name__ == "__main__":
    main()
