"""What machine a capture ran on: recorded in a dump's ``backend_info["platform"]`` (docs/dump-format.md).

Two captures of one model on two machines (x86_64 vs an ARM64 board, AVX2 vs AVX-512 VNNI) differ only where
ONNX Runtime picked a different kernel; :mod:`ivq_debug.diagnose.platform` reads these facts to say which
platforms it compares and which fix applies (``reduce_range``, ``session.x64quantprecision``, s8s8 vs u8s8).

``cpu_features`` are the instruction-set extensions detected at run time (numpy's CPU dispatch: CPUID on
x86, HWCAP on ARM), the same kind of probe ONNX Runtime's MLAS uses to choose its kernels, so they hold under
emulation too: under ``qemu-x86_64 -cpu Haswell`` they are Haswell's (AVX2, no AVX-512/VNNI) while
``/proc/cpuinfo`` still shows the host's flags (recorded as ``cpuinfo_flags``, measured here).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from typing import Any

CPUINFO = "/proc/cpuinfo"


def cpuinfo(path: str = CPUINFO) -> dict[str, Any]:
    """The first processor's model and feature flags from ``/proc/cpuinfo`` (x86 ``flags``, ARM ``Features``)."""
    out: dict[str, Any] = {"cpu_model": None, "cpuinfo_flags": []}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return out
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    flags = fields.get("flags") or fields.get("features") or ""
    out["cpuinfo_flags"] = sorted(set(flags.split()))
    if "model name" in fields:
        out["cpu_model"] = fields["model name"]
    elif "cpu part" in fields:  # ARM: implementer + part number (0x41 / 0xd0b = Arm cortex-a76)
        out["cpu_model"] = f"implementer {fields.get('cpu implementer', '?')} part {fields['cpu part']}"
    return out


def cpu_features() -> list[str]:
    """Instruction-set extensions this process can use, as numpy's run-time dispatch detected them."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy < 2
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            return []
    return sorted(k for k, v in features.items() if v)


def platform_info(*, threads: int | None, optimization: str, session_config: Mapping[str, str]) -> dict[str, Any]:
    """The platform facts of an ONNX Runtime capture (``threads=None``: ORT's default, one per core)."""
    import onnxruntime as ort

    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpu_features": cpu_features(),
        **cpuinfo(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "intra_op_threads": threads,
        "graph_optimization_level": optimization,
        "session_options": dict(session_config),
    }
