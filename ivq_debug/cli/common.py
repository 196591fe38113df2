"""What every CLI entry point shares: the error wrapper and small formatting helpers."""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ivq_debug import defaults, interrupt
from ivq_debug.errors import EXIT_FAIL, EXIT_USAGE, IvqError, UsageError, missing_extra, one_line, printable
from ivq_debug.outputs import WRITE_ERRNOS, atomic_write_json, check_outputs


def run(prog: str, fn: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """Run a CLI body; turn :class:`IvqError` into a one-line message and its exit code.

    SIGINT and SIGTERM interrupt the body as an exception (what it was writing is removed) and exit 130 / 143
    (128 + the signal). An ``OSError`` that only writing can raise (no space left, quota, file too large,
    read-only file system) is an output that cannot be written: one line, exit 2. A module of a missing optional
    extra (pandas, torch, ...) exits 5 naming the extra to install (:func:`~ivq_debug.errors.missing_extra`).
    Other unexpected exceptions print one line too, exit 1 (set ``IVQ_TRACEBACK=1`` to see the traceback).
    Messages are escaped (:func:`~ivq_debug.errors.printable`): names in them come from files.
    """
    argv = sys.argv[1:] if argv is None else argv
    previous: dict[int, Any] = {}
    interrupt.reset()
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, interrupt.on_signal)
    except ValueError:  # not the main thread: leave the handlers alone
        pass
    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_unraisable, hook)
    try:
        rc = fn(argv)
        interrupt.raise_if_signalled()  # a signal whose exception a weakref callback or __del__ swallowed
        return rc
    except IvqError as e:
        print(f"{prog}: error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        interrupt.remove_registered()  # (what a signal between a temp file's creation and its `try` left)
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{prog}: {'terminated' if signum == signal.SIGTERM else 'interrupted'}", file=sys.stderr)
        return 128 + int(signum)
    except BrokenPipeError:
        return EXIT_FAIL
    except OSError as e:
        if e.errno not in WRITE_ERRNOS or os.environ.get("IVQ_TRACEBACK"):
            return _internal(prog, argv, e)
        where = f"{printable(os.fsdecode(e.filename))}: " if e.filename else ""
        print(f"{prog}: error: {where}cannot write output ({os.strerror(e.errno)})", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # last resort, keeps the one-line contract
        return _internal(prog, argv, e)
    finally:
        sys.unraisablehook = hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_with(prog: str, fn: Callable[[list[str]], int], argv: list[str] | None = None) -> NoReturn:
    """A console script's end: :func:`run`, then ``SystemExit`` with its code.

    Run as the process's own command (``argv`` None: the console script, ``python -m ivq_debug``), what the command
    leaves is frozen (``gc.freeze``) before the interpreter's teardown, whose cyclic collections would otherwise walk
    every object the imports and the command made: 0.15-0.25 s at the end of an ``ivq diagnose`` of a 12-block ViT,
    0.05-0.1 s after its capture (``docs/scale.md``, eighth pass). Reference counting still frees them, ``atexit``
    handlers still run; only garbage in cycles is left to the process's end. Given ``argv`` (tests, notebooks, a
    forked child), nothing is frozen: the caller's process goes on.
    """
    code = run(prog, fn, argv)
    if argv is None:
        gc.freeze()
    raise SystemExit(code)


def _unraisable(previous: Callable[[Any], Any], u: Any) -> None:
    """``sys.unraisablehook`` of a CLI run: a signal raised inside a weakref callback or ``__del__`` is not
    printed as "Exception ignored ..." with a traceback (:mod:`ivq_debug.interrupt` remembers it and the run
    exits 130 / 143 with one line); anything else goes to the previous hook."""
    if isinstance(u.exc_value, KeyboardInterrupt):
        return
    previous(u)


def _internal(prog: str, argv: list[str], e: Exception) -> int:
    command = next((a for a in argv if not a.startswith("-")), None) if prog == "ivq" else None
    extra = missing_extra(e, f"`{prog} {command}`" if command else f"`{prog}`")
    if extra is not None:  # an optional extra's module is not installed (exit 5)
        print(f"{prog}: error: {extra.one_line()}", file=sys.stderr)
        return extra.exit_code
    if os.environ.get("IVQ_TRACEBACK"):
        raise e
    msg = one_line(f"{type(e).__name__}: {e}", 500)
    print(f"{prog}: internal error: {msg} (set IVQ_TRACEBACK=1 for details)", file=sys.stderr)
    return EXIT_FAIL


# ------------------------------------------------------------------------------------------ the one output check
#: the role of every string option of every command, by argparse ``dest`` (:func:`check_args_io`): ``input`` (a
#: file or folder the command reads), ``output`` (a file it writes), ``workdir`` (a folder it writes into) or
#: ``value`` (not a path). ``tests/cli/test_io_roles.py`` fails for an option of no role, so a new command cannot
#: skip the check.
ROLES: dict[str, str] = {
    **dict.fromkeys(("dump", "ref", "test", "baseline", "expected", "map", "model", "inputs", "output_dir", "graph",
                     "input_list", "config", "profiling", "spec", "vision", "prefill", "decode", "model_dir",
                     "vision_model", "prefill_model", "decode_model", "session", "calibration", "overrides",
                     "float_model", "shards", "reference", "replay", "extra", "encodings", "qnn_cache", "image_processor"),
                    "input"),
    **dict.fromkeys(("output", "json", "report", "perfetto", "model_explorer", "junit"), "output"),
    **dict.fromkeys(("workdir", "golden", "reports"), "workdir"),
    **dict.fromkeys(("name", "record", "records", "budget", "rank_by", "max_unmatched", "part", "include", "exclude",
                     "op_types", "session_option", "soc_model", "htp_arch", "dim", "device", "grid_thw",
                     "exclude_nodes", "nodes", "ray_address", "tensors", "watch", "task_metric", "groups",
                     "precisions", "title", "overlay_metric", "source", "command", "missing_input"), "value"),
}
#: command → the options whose role differs there (``ivq demo --model`` names a built-in model, not a file)
COMMAND_ROLES: dict[str, dict[str, str]] = {"demo": {"model": "value"}}


#: the least value of every numeric option, by argparse ``dest`` (None: any number); NaN is refused for every
#: float option (a NaN threshold compares false and passes everything). ``tests/cli/test_io_roles.py`` fails for
#: a numeric option missing here.
NUMBER_MIN: dict[str, float | None] = {
    "samples": 1, "eval": 1, "limit": 0, "values": 0, "top": 0, "max_outputs_per_run": 1, "threads": 1,
    "first_step": 0, "max_samples": 1, "workers": 1, "bins": 1, "samples_per_job": 1, "max_candidates": 1,
    "drilldowns": 0, "max_rows": 1, "max_points": 1, "max_abs": 0, "min_coverage": 0,
    "combinations": 0,
    "min_sqnr": None, "min_cosine": None, "max_ratio": None, "budget_sqnr": None, "min_gain": None, "budget": None,
    "max_size": None, "max_cycles": None, "target_metric": None,  # tune --search checks > 0 itself
}


def check_args_numbers(args: Any) -> None:
    """Every numeric option's value before work starts: no NaN, nothing below its :data:`NUMBER_MIN`
    (``--workers 0``, ``--top -1``). :class:`UsageError` (exit 2) naming the option."""
    for dest, value in sorted(vars(args).items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, float) and math.isnan(value):
            raise UsageError(f"{flag} must be a number, got nan")
        least = NUMBER_MIN.get(dest)
        if least is not None and value < least:
            raise UsageError(f"{flag} must be at least {least:g}, got {value:g}")


def check_args(args: Any, command: str, extra_inputs: Any = ()) -> None:
    """What both entry points check once the command line is parsed, before the command runs: the numbers
    (:func:`check_args_numbers`) and the outputs against the inputs (:func:`check_args_io`)."""
    check_args_numbers(args)
    check_args_io(args, command, extra_inputs)


def io_role(command: str, dest: str) -> str | None:
    """The role of option ``dest`` of ``command`` (:data:`ROLES`), None when undeclared."""
    return COMMAND_ROLES.get(command, {}).get(dest) or ROLES.get(dest)


def _paths(value: Any) -> list[str]:
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _paths(v)]
    return [os.fspath(value)] if isinstance(value, (str, os.PathLike)) else []


def check_args_io(args: Any, command: str, extra_inputs: Any = ()) -> None:
    """The one output check of every writer, run by both entry points (``ivq``, ``ivq-diff``) after parsing and
    before the command starts: no output (``output`` role) is an input (``input`` role, ``extra_inputs``: what
    a command reads besides its options, e.g. the folders of a session spec), by path, real path or inode, nor a
    file inside an input folder (the shard folder ``--json`` must not land in), even with ``--force``; no two
    outputs are one file; an existing output needs ``--force``; a ``workdir`` is not an existing file.

    Raises:
        UsageError: exit 2, "output would replace an input", before any work.
    """
    ins: list[str] = [*(_paths(extra_inputs))]
    outs: list[str] = []
    for dest, value in sorted(vars(args).items()):
        role = io_role(command, dest)
        if role == "input":
            ins += _paths(value)
        elif role == "output":
            outs += _paths(value)
        elif role == "workdir":
            for w in _paths(value):
                if os.path.exists(w) and not os.path.isdir(w):
                    raise UsageError("the working folder is a file, not a folder", w)
    check_outputs(outs, ins, bool(getattr(args, "force", False)))


def _soc_id(value: str) -> str:
    """``--soc-model``: a QNN SoC id is a number (checked before a model is compiled for it)."""
    if not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"a QNN SoC id is a number like {defaults.QNN_SOC_MODEL}, got {value!r}")
    return value.strip()


def add_qnn_target_arguments(p: argparse.ArgumentParser, note: str = "") -> None:
    """``--soc-model`` (a number) and ``--htp-arch`` (one of ``defaults.QNN_HTP_ARCHS``), checked by the parser:
    a usage error before anything is compiled (``--soc-model abc`` was exit 7 after compiling, ``--htp-arch
    9999`` exit 0). ``note`` prefixes the help (``"qnn: "``)."""
    p.add_argument("--soc-model", default=None, type=_soc_id,
                   help=f"{note}QNN SoC model id, a number (default {defaults.QNN_SOC_MODEL})")
    p.add_argument("--htp-arch", default=None, choices=defaults.QNN_HTP_ARCHS,
                   help=f"{note}HTP architecture (default {defaults.QNN_HTP_ARCH})")


def parse_record(sel: str | None) -> str | tuple[int, str, int] | None:
    """A ``--record`` value: a record id (``r000001``) or ``sample/part/step`` (``0/decode/3``)."""
    if sel is None or sel.startswith("r"):
        return sel
    try:
        s, part, step = sel.split("/")
        return (int(s), part, int(step))
    except ValueError:
        raise UsageError(f"--record takes rNNNNNN or sample/part/step, got {sel!r}") from None


def comma_list(value: str | None, flag: str) -> list[str] | None:
    """The items of a comma-separated option (stripped; None when the option is not given). A value that names
    nothing (``","``, ``" "``) is a usage error rather than silently meaning the default."""
    if value is None:
        return None
    items = [s.strip() for s in value.split(",") if s.strip()]
    if not items:
        raise UsageError(f"{flag} {value!r} names nothing (give comma-separated names, or leave the option out)")
    return items


def fmt_num(v: Any, digits: int = 4) -> str:
    """Compact number formatting for tables (``-`` for missing)."""
    if v is None:
        return "-"
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(f):
        return "-"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f != 0 and (abs(f) < 1e-3 or abs(f) >= 1e5):
        return f"{f:.{digits - 1}e}"
    return f"{f:.{digits}g}"


def fmt_bytes(n: int) -> str:
    """Human-readable byte count."""
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return f"{n} B"


def escape(text: Any) -> str:
    """Untrusted text (tensor names, paths, messages from files) made safe to print with rich: control,
    surrogate and bidi characters written as visible escapes (:func:`~ivq_debug.errors.printable`), then
    rich markup escaped."""
    from rich.markup import escape as _escape

    return _escape(printable(text))


def safe(text: Any) -> str:
    """Untrusted text for a terminal where no markup is parsed (``rich.text.Text``): control, surrogate and
    bidi characters escaped, markup left alone."""
    return printable(text)


def write_json(doc: Any, path: str, overwrite: bool = True) -> None:
    """Write JSON to ``path`` atomically (``-`` writes to stdout)."""
    import json

    if path == "-":
        json.dump(doc, sys.stdout, indent=1, allow_nan=False)  # in chunks, as the file below
        sys.stdout.write("\n")
        sys.stdout.flush()
        return
    atomic_write_json(path, doc, overwrite=overwrite)
