"""A torch module as a runner: numpy feeds in, outputs named like the ONNX graph's, module outputs captured.

:class:`TorchPartRunner` runs a torch part wrapper (:mod:`ivq_debug.vlm.parts`) and captures per-module tensors
with :class:`~ivq_debug.capture.torch.hooks.TorchCapture`, so :mod:`ivq_debug.vlm.torch_generate` drives torch
through the same scheduler as ONNX Runtime (any runner of :mod:`ivq_debug.capture.base` plugs in the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ivq_debug.capture.torch.hooks import TorchCapture


class TorchPartRunner:
    """Runs a torch part wrapper with numpy feeds; outputs named like the ONNX graph's outputs.

    With a writer, the part outputs are stored under their ONNX output names (``image_features``,
    ``logits``, ``present.{i}.key``, …) and, when ``selection`` is given (a ``Selection``, e.g.
    :func:`~ivq_debug.capture.torch.hooks.default_selection`), the per-module outputs of ``hf_model`` are
    captured with ``TorchCapture`` while the forward runs (HF module paths).
    """

    def __init__(self, module: Any, output_names: Sequence[str], hf_model: Any, selection: Any = None) -> None:
        import torch
        import transformers

        self.module = module
        self.output_names = list(output_names)
        self.hf_model = hf_model
        self.selection = selection
        self.backend = "torch"
        self.info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": "cpu",
                     "dtype": "float32"}

    def run(self, feeds: dict[str, np.ndarray], writer: Any = None) -> dict[str, np.ndarray]:
        """Run the wrapper on ``feeds`` (in order); with ``writer``, capture module outputs."""
        import contextlib

        import torch

        args = [torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values()]
        ctx: Any = contextlib.nullcontext()
        if writer is not None and self.selection is not None:
            ctx = TorchCapture(self.hf_model, writer, self.selection)
        with torch.no_grad(), ctx:
            outs = self.module(*args)
        outs = (outs,) if isinstance(outs, torch.Tensor) else outs
        result = {n: t.detach().numpy() for n, t in zip(self.output_names, outs, strict=True)}
        if writer is not None:
            for name, value in result.items():
                writer.add_tensor(name, value, op_type="output")
        return result
