"""The backend session flags of every command that makes a runner, parsed one way: ``ivq capture onnx|qnn`` and
``ivq diagnose --backend cpu|qnn`` give the same options to :func:`ivq_debug.capture.base.make_runner`.

``--optimization`` (ORT graph optimization level), ``--session-option KEY=VALUE`` (ONNX Runtime session config
entries, the ``onnx`` backend), and the QNN HTP session settings (``--soc-model``, ``--htp-arch``,
``--allow-cpu-fallback``, ``--qnn-cache`` / ``--no-qnn-cache``, ``--fast-compile``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ivq_debug.cli.common import add_qnn_target_arguments
from ivq_debug.errors import UsageError

#: ORT graph optimization levels (``OrtRunner``'s ``optimization``)
OPTIMIZATION_LEVELS = ["disable", "basic", "extended", "all"]
#: the QNN session flags: (flag, runner option)
QNN_FLAGS = (("--soc-model", "soc_model"), ("--htp-arch", "htp_arch"), ("--allow-cpu-fallback", "allow_cpu_fallback"),
             ("--qnn-cache", "qnn_cache"), ("--no-qnn-cache", "qnn_cache"), ("--fast-compile", "fast_compile"))


def add_optimization_argument(p: argparse.ArgumentParser, help: str) -> None:
    """``--optimization`` (``help``: what the level means for the command)."""
    p.add_argument("--optimization", default="disable", choices=OPTIMIZATION_LEVELS, help=help)


def add_onnx_session_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The ONNX Runtime session flags (``prefix``: e.g. ``"cpu: "`` on a command with several backends)."""
    p.add_argument("--session-option", action="append", default=[], metavar="KEY=VALUE",
                   help=f"{prefix}an ONNX Runtime session config entry as the deployment sets it, e.g. "
                        "session.x64quantprecision=1 (repeatable); recorded in the dump")


def add_qnn_session_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The QNN HTP session flags (``prefix``: e.g. ``"qnn: "`` on a command with several backends)."""
    add_qnn_target_arguments(p, prefix)
    p.add_argument("--allow-cpu-fallback", action="store_true", help=f"{prefix}let unsupported nodes run on the CPU")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--qnn-cache", default=None, metavar="DIR",
                       help=f"{prefix}compiled-context cache folder (default $IVQ_QNN_CACHE or "
                            "${XDG_CACHE_HOME:-~/.cache}/ivq-debug/qnn-contexts)")
    cache.add_argument("--no-qnn-cache", action="store_true", help=f"{prefix}compile every session, cache nothing")
    p.add_argument("--fast-compile", action="store_true",
                   help=f"{prefix}QNN's faster, less optimized finalization (outputs can differ by a step; recorded)")


def session_config(items: list[str]) -> dict[str, str]:
    """``--session-option KEY=VALUE`` values as a dict (a repeated key keeps the last value)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(f"--session-option takes KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def session_options(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """The runner options of the session flags for ``backend`` (``onnx`` or ``qnn``; ``None``: the runner's
    default). A flag of the other backend, when the command has it, is a :class:`UsageError` naming it."""
    opts: dict[str, Any] = {"optimization": args.optimization}
    config = session_config(getattr(args, "session_option", None) or [])
    qnn = {"soc_model": getattr(args, "soc_model", None), "htp_arch": getattr(args, "htp_arch", None),
           "allow_cpu_fallback": getattr(args, "allow_cpu_fallback", False) or None,
           "qnn_cache": False if getattr(args, "no_qnn_cache", False) else getattr(args, "qnn_cache", None),
           "fast_compile": getattr(args, "fast_compile", False) or None}
    if backend == "onnx":
        given = [flag for flag, k in QNN_FLAGS if qnn[k] is not None and (flag != "--qnn-cache" or qnn[k])]
        if given:
            raise UsageError(f"{given[0]} applies to the qnn backend only")
        opts["session_config"] = config or None
    elif config:
        raise UsageError("--session-option applies to the onnx backend only")
    else:
        opts.update(qnn)
    return opts
