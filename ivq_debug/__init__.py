"""ivq-debug: layer-wise numerical-accuracy debugging for VLMs going PyTorch → ONNX Runtime → QNN.

The notebook API::

    import ivq_debug as ivq
    ref, test = ivq.open_dump("golden/ref.h5"), ivq.open_dump("golden/htp.h5")
    cmp = ivq.compare(ref, test)
    cmp.table           # pandas DataFrame, one row per aligned tensor
    cmp.worst(10)
    cmp.first_divergence

Heavy modules (torch, onnxruntime, transformers) are imported only when a function needs them. On an install
without the extra a name needs (``pip install ivq-debug``: no pandas for ``ivq.compare``), the name raises
:class:`~ivq_debug.errors.MissingExtraError` (a ``ToolNotFoundError``, exit 5 in the CLI) naming the extra to
install, not a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from ivq_debug.errors import missing_extra

__version__ = "0.1.0"

_LAZY = {
    "open_dump": ("ivq_debug.dump", "open_dump"),
    "Dump": ("ivq_debug.dump", "Dump"),
    "DumpWriter": ("ivq_debug.dump", "DumpWriter"),
    "compare": ("ivq_debug.api", "compare"),
    "capture": ("ivq_debug.api", "capture"),
    "diagnose": ("ivq_debug.api", "diagnose"),
    "Comparison": ("ivq_debug.comparator", "Comparison"),
    "Budgets": ("ivq_debug.comparator", "Budgets"),
    "write_report": ("ivq_debug.report", "write_report"),
    "replay": ("ivq_debug.diagnose.replay", "replay"),
    "LocalExecutor": ("ivq_debug.executor", "LocalExecutor"),
    "RayExecutor": ("ivq_debug.executor", "RayExecutor"),
    "Tuner": ("ivq_debug.tune.verify", "Tuner"),
    "sweep": ("ivq_debug.tune.sweep", "sweep"),
}

__all__ = ["__version__", *sorted(_LAZY)]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except ImportError as e:
            extra = missing_extra(e, f"ivq.{name}")
            if extra is None:
                raise
            raise extra from e
        if not inspect.isfunction(obj):
            return obj

        @functools.wraps(obj)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return obj(*args, **kwargs)
            except ImportError as e:  # a module of an optional extra, imported when the function needs it
                extra = missing_extra(e, f"ivq.{name}")
                if extra is None:
                    raise
                raise extra from e

        return call
    raise AttributeError(f"module 'ivq_debug' has no attribute {name!r}")
