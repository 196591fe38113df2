"""A small torch model exported with a dynamic batch: the shape arithmetic torch's exporters leave in the graph.

``ShapeNet``: Conv → Relu → ``flatten(2).transpose`` → a ``cls`` token ``expand(b, -1, -1)``-ed and concatenated
(ViT's), a position ramp ``arange(t.shape[1])`` (``Range``), and the ``x.view(x.shape[0], -1)`` before the head
(``Linear``). With ``dynamic_axes`` the legacy exporter writes ``Shape → Gather → Unsqueeze → Concat → Reshape``,
``ConstantOfShape → Equal → Where → Expand`` and ``Shape → Gather → Cast → Range``; the dynamo exporter
``Shape → Concat → Expand / Reshape``. QNN HTP refuses ``Shape`` at ORT optimization level "disable".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

#: input shape of one sample (the batch axis is exported dynamic)
SHAPE = (1, 3, 4, 4)
#: ops of the shape arithmetic (what must be gone once folded)
SHAPE_ARITHMETIC = ("Shape", "Size", "ConstantOfShape", "Range", "Expand", "Equal", "Where", "Unsqueeze", "Gather",
                    "Cast")


class ShapeNet(nn.Module):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.fc = nn.Linear(8 * 17, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        t = h.flatten(2).transpose(1, 2)                                  # [B, 16, 8]
        t = torch.cat([self.cls.expand(h.shape[0], -1, -1), t], 1)        # [B, 17, 8]
        pos = torch.arange(t.shape[1], dtype=torch.float32).view(1, -1, 1)
        t = t + pos * 0.25
        return self.fc(t.reshape(t.shape[0], -1))


def build_shape_net(folder: Path, exporter: str = "legacy", name: str | None = None) -> Path:
    """:class:`ShapeNet` (seed 0) exported to ``folder/<name>`` with a dynamic batch axis (input ``x``, output
    ``y``): ``exporter`` ``legacy`` (TorchScript, opset 17) or ``dynamo`` (opset 18)."""
    torch.manual_seed(0)
    model = ShapeNet().eval()
    path = Path(folder) / (name or f"shape-{exporter}.onnx")
    example = (torch.rand(2, *SHAPE[1:]),)
    if exporter == "legacy":
        torch.onnx.export(model, example, str(path), input_names=["x"], output_names=["y"], opset_version=17,
                          dynamo=False, dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    else:
        torch.onnx.export(model, example, str(path), input_names=["x"], output_names=["y"], opset_version=18,
                          dynamo=True, dynamic_shapes={"x": {0: torch.export.Dim("batch")}}, verbose=False)
    return path


def shape_feeds(seed: int, n: int) -> list[dict[str, np.ndarray]]:
    """``n`` seeded samples of :data:`SHAPE`."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.uniform(-1, 1, SHAPE).astype(np.float32)} for _ in range(n)]
