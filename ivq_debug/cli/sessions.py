"""The backend session flags every command that makes a runner takes, parsed one way: ``ivq capture onnx|qnn`` and
``ivq diagnose --backend cpu|qnn`` give the same options to :func:`ivq_debug.capture.base.make_runner`.

``--optimization`` (ORT graph optimization level), ``--session-option KEY=VALUE`` (ONNX Runtime session config
entries, the ``onnx`` backend), and the QNN HTP session settings (``--soc-model``, ``--htp-arch``,
``--allow-cpu-fallback``, ``--qnn-cache`` / ``--no-qnn-cache``, ``--fast-compile``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ivq_debug.errors import UsageError

#: ORT graph optimization levels (``OrtRunner``'s ``optimization``)
OPTIMIZATION_LEVELS = ["disable", "basic", "extended", "all"]


def add_session_arguments(p: argparse.ArgumentParser, optimization_help: str) -> None:
    """Add the session flags to a command's parser (``optimization_help``: what the level means there)."""
    p.add_argument("--optimization", default="disable", choices=OPTIMIZATION_LEVELS, help=optimization_help)
    p.add_argument("--session-option", action="append", default=[], metavar="KEY=VALUE",
                   help="onnx: an ONNX Runtime session config entry as the deployment sets it, e.g. "
                        "session.x64quantprecision=1 (repeatable); recorded in the dump")
    p.add_argument("--soc-model", default=None, help="qnn: SoC model id (default from ivq_debug.defaults)")
    p.add_argument("--htp-arch", default=None, help="qnn: HTP architecture (default from ivq_debug.defaults)")
    p.add_argument("--allow-cpu-fallback", action="store_true", help="qnn: let unsupported nodes run on the CPU")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--qnn-cache", default=None, metavar="DIR",
                       help="qnn: compiled-context cache folder (default $IVQ_QNN_CACHE or "
                            "${XDG_CACHE_HOME:-~/.cache}/ivq-debug/qnn-contexts)")
    cache.add_argument("--no-qnn-cache", action="store_true", help="qnn: compile every session, cache nothing")
    p.add_argument("--fast-compile", action="store_true",
                   help="qnn: QNN's faster, less optimized finalization (outputs can differ by a step; recorded)")


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
    default). ``--session-option`` on ``qnn`` is a :class:`UsageError`."""
    config = session_config(args.session_option)
    opts: dict[str, Any] = {"optimization": args.optimization}
    qnn = {"soc_model": args.soc_model, "htp_arch": args.htp_arch, "allow_cpu_fallback": args.allow_cpu_fallback or None,
           "qnn_cache": False if args.no_qnn_cache else args.qnn_cache, "fast_compile": args.fast_compile or None}
    if backend == "onnx":  # (the qnn flags are ignored on the CPU, as their help says)
        opts["session_config"] = config or None
    elif config:
        raise UsageError("--session-option applies to the onnx backend only")
    else:
        opts.update(qnn)
    return opts
