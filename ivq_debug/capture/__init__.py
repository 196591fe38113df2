"""Capture: one folder per backend (``onnxrt/``, ``qnn_ep/``, ``qnn_net_run/``, ``torch/``) and what they share
(:mod:`ivq_debug.capture.base`).

``ivq_debug.capture`` is both this package and, through ``import ivq_debug as ivq``, the one-call API
``ivq.capture(model, inputs, output, ...)`` (:func:`ivq_debug.api.capture`): Python binds a subpackage to its
parent's attribute once it is imported, so the package itself is made callable and forwards to the API.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ivq_debug.api import capture  # the API imports this package: resolved at call time

        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
