"""A small real PyTorch model for the capture, dump and diff tests: embedding → 3 pre-LN MLP blocks → head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln(x)))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(tmp: Path, dynamo: bool = False) -> tuple[Tiny, np.ndarray, Path]:
    """The model (seeded), an input and its ONNX export in ``tmp``."""
    torch.manual_seed(0)
    m = Tiny().eval()
    x = torch.randn(2, 8, 16)
    path = tmp / ("tiny.dynamo.onnx" if dynamo else "tiny.onnx")
    if dynamo:
        torch.onnx.export(m, (x,), str(path), input_names=["x"], output_names=["logits"], dynamo=True,
                          opset_version=18).save(str(path))
    else:
        torch.onnx.export(m, (x,), str(path), input_names=["x"], output_names=["logits"], dynamo=False,
                          opset_version=17)
    return m, x.numpy(), path


def capture_torch(m: Tiny, x: np.ndarray, out: Path) -> Path:
    from ivq_debug.capture.torch.hooks import TorchCapture
    from ivq_debug.dump import DumpWriter

    with DumpWriter(out, backend="torch") as w, TorchCapture(m, w):
        w.begin_record()
        w.add_input("x", x)
        with torch.no_grad():
            y = m(torch.from_numpy(x))
        w.add_tensor("logits", y)
    return out


def capture_ort(model: Path, x: np.ndarray, out: Path, **kw) -> Path:
    from ivq_debug.capture.base import Selection, capture
    from ivq_debug.capture.onnxrt.runner import OrtRunner

    return capture(OrtRunner(model, selection=Selection(), **kw), [{"x": x}], out, progress=None)
