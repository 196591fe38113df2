"""OCR-like recognizers and a ViT in torch (random init, no downloads): the graphs whose QNN HTP compile cost
``docs/qnn-compile.md`` measures, shared by ``bench/bench_qnn_compile.py`` and ``tests/capture/qnn_ep/``.

* ``crnn``: classic CRNN / PP-OCRv2-like: a VGG-like conv backbone, a 2-layer BiLSTM over 80 steps (unrolled by
  the QNN EP: 806 QNN ops), a CTC head. Its LSTM returns ``Y_h`` / ``Y_c`` nothing reads (dead tensors).
* ``svtr``: PP-OCRv3/v4-like: an LCNet backbone (depthwise / hardswish / SE), an SVTR neck (2 attention blocks).
* ``vit12``: transformers ``ViTModel``, 12 layers, hidden 192, 224²; ``vit-tiny``: 1 layer, hidden 32, 32².
* ``ocr``: PP-OCRv4-like (the shape of the recognizer the user of issue 18 met), 1×3×48×320: an LCNetV3-like
  backbone whose blocks sum re-parameterizable branches (four 3×3 depthwise, a 1×1, a BatchNorm) and apply a
  learnable affine (``x * a + b``), so most of its tensors are channels-last (the compile-time explosion: every
  one exposed as NCHW adds a QNN Transpose); an SVTR neck (attention over the width), a CTC head.
* ``ocr-small``: the same backbone, smaller (1×3×32×64, one branch, 5 blocks), with a BiLSTM neck (whose unused
  ``Y_h`` / ``Y_c`` are dead tensors): seconds to compile, for the default test run.

``build(name, folder)`` exports one with the legacy exporter (opset 17) and returns the float model path, its
input shape and a seeded sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

NAMES = ("crnn", "svtr", "vit12", "vit-tiny", "ocr", "ocr-small")


def _cbr(ci: int, co: int, k: Any = 3, s: Any = 1, p: Any = 1, g: int = 1, act: Any = nn.ReLU) -> nn.Module:
    return nn.Sequential(nn.Conv2d(ci, co, k, s, p, groups=g, bias=False), nn.BatchNorm2d(co), act())


class Block(nn.Module):
    """Pre-LN attention block (torch MultiheadAttention) + GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(nn.functional.gelu(self.fc1(self.n2(x))))


class CRNN(nn.Module):
    """Conv backbone -> BiLSTM x2 -> CTC head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            _cbr(3, 32), nn.MaxPool2d(2, 2), _cbr(32, 64), nn.MaxPool2d(2, 2), _cbr(64, 128), _cbr(128, 128),
            nn.MaxPool2d((2, 1), (2, 1)), _cbr(128, 256), _cbr(256, 256), nn.MaxPool2d((2, 1), (2, 1)),
            _cbr(256, 256, k=(3, 1), p=0))
        self.rnn = nn.LSTM(256, 128, num_layers=2, bidirectional=True, batch_first=True)
        self.register_buffer("h0", torch.zeros(4, 1, 128))  # a static state: no Shape/Expand in the graph
        self.head = nn.Linear(256, 97)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.backbone(x).squeeze(2).permute(0, 2, 1), (self.h0, self.h0))
        return self.head(y).softmax(-1)


class SE(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))


class SVTR(nn.Module):
    """LCNet backbone -> SVTR neck (attention over tokens) -> CTC head."""

    def __init__(self) -> None:
        super().__init__()
        plan = [(16, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, (2, 1)), (128, 128, 1), (128, 256, (2, 1)),
                (256, 256, 1), (256, 256, 1), (256, 256, 1), (256, 512, (2, 1)), (512, 512, 1)]
        layers: list[nn.Module] = [_cbr(3, 16, 3, 2, 1, act=nn.Hardswish)]
        for i, (a, b, s) in enumerate(plan):
            layers += [_cbr(a, a, 3, s, 1, g=a, act=nn.Hardswish), SE(a) if i >= 9 else nn.Identity(),
                       _cbr(a, b, 1, 1, 0, act=nn.Hardswish)]
        self.backbone = nn.Sequential(*layers, nn.AvgPool2d(2, 2))
        self.c1, self.c2 = _cbr(512, 64, act=nn.SiLU), _cbr(64, 120, 1, 1, 0, act=nn.SiLU)
        self.mix = nn.Sequential(Block(120, 8), Block(120, 8))
        self.norm = nn.LayerNorm(120)
        self.c3, self.c4 = _cbr(120, 512, 1, 1, 0, act=nn.SiLU), _cbr(1024, 64, act=nn.SiLU)
        self.c5, self.head = _cbr(64, 120, 1, 1, 0, act=nn.SiLU), nn.Linear(120, 97)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.backbone(x)
        z = self.c2(self.c1(f))
        b, c, h, w = z.shape
        z = self.norm(self.mix(z.flatten(2).transpose(1, 2))).transpose(1, 2).reshape(b, c, h, w)
        z = self.c5(self.c4(torch.cat([f, self.c3(z)], 1)))
        return self.head(z.squeeze(2).transpose(1, 2)).softmax(-1)


class ViT(nn.Module):
    def __init__(self, hidden: int = 192, layers: int = 12, heads: int = 3, image: int = 224, patch: int = 16) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTModel

        cfg = ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * hidden, image_size=image, patch_size=patch)
        self.m = ViTModel(cfg, add_pooling_layer=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.m(pixel_values=pixel_values).last_hidden_state


class Affine(nn.Module):
    """PP-LCNetV3's learnable affine block: ``x * scale + bias`` (per channel)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(1, c, 1, 1))
        self.bias = nn.Parameter(0.1 * torch.randn(1, c, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.bias


class RepDW(nn.Module):
    """PP-LCNetV3's re-parameterizable depthwise block: ``branches`` k×k depthwise convs + a 1×1 depthwise conv +
    a BatchNorm identity branch, summed, hardswish, learnable affine; then a 1×1 pointwise conv, hardswish,
    affine (every intermediate is a channels-last tensor on HTP)."""

    def __init__(self, ci: int, co: int, s: Any, branches: int = 1) -> None:
        super().__init__()
        self.kk = nn.ModuleList([nn.Sequential(nn.Conv2d(ci, ci, 3, s, 1, groups=ci, bias=False), nn.BatchNorm2d(ci))
                                 for _ in range(branches)])
        self.k1 = nn.Sequential(nn.Conv2d(ci, ci, 1, s, 0, groups=ci, bias=False), nn.BatchNorm2d(ci))
        self.id = nn.BatchNorm2d(ci) if s == 1 else None
        self.a1, self.act1 = Affine(ci), nn.Hardswish()
        self.pw = nn.Sequential(nn.Conv2d(ci, co, 1, 1, 0, bias=False), nn.BatchNorm2d(co))
        self.a2, self.act2 = Affine(co), nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.k1(x)
        for k in self.kk:
            y = y + k(x)
        if self.id is not None:
            y = y + self.id(x)
        y = self.a1(self.act1(y))
        return self.a2(self.act2(self.pw(y)))


class OCR(nn.Module):
    """PP-OCR-like recognizer: LCNetV3-like backbone -> sequence neck (``"svtr"``: attention over the width, as
    PP-OCRv4; ``"lstm"``: a BiLSTM, as CRNN / PP-OCRv2) -> CTC head."""

    def __init__(self, plan: list[tuple[int, int, Any]], neck: str, d: int, branches: int = 1) -> None:
        super().__init__()
        c0 = plan[0][0]
        self.stem = nn.Sequential(_cbr(3, c0, 3, 2, 1, act=nn.Hardswish), Affine(c0))
        self.blocks = nn.Sequential(*[RepDW(a, b, s, branches) for a, b, s in plan])
        c = plan[-1][1]
        self.neck = neck
        if neck == "svtr":  # PP-OCRv4's SVTR neck: conv down to d, attention blocks over the width, conv back
            self.pool = nn.AvgPool2d((6, 2), (6, 2))
            self.c1, self.mix, self.c2 = _cbr(c, d, 1, 1, 0, act=nn.SiLU), nn.Sequential(Block(d, 4), Block(d, 4)), \
                _cbr(d, c, 1, 1, 0, act=nn.SiLU)
            self.head = nn.Linear(c, 97)
        else:
            self.pool = nn.AdaptiveAvgPool2d((1, None))
            self.rnn = nn.LSTM(c, d, bidirectional=True, batch_first=True)
            self.register_buffer("h0", torch.zeros(2, 1, d))  # a static state: no Shape/Expand in the graph
            self.head = nn.Linear(2 * d, 97)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.pool(self.blocks(self.stem(x)))  # N, C, 1, W
        if self.neck == "svtr":
            z = self.c1(f)
            b, c, h, w = z.shape
            z = self.mix(z.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(b, c, h, w)
            y = self.c2(z).squeeze(2).transpose(1, 2)
        else:
            y, _ = self.rnn(f.squeeze(2).permute(0, 2, 1), (self.h0, self.h0))
        return self.head(y).softmax(-1)


#: PP-OCRv4's PPLCNetV3 recognition plan (channels, strides): the first stages stay at 24×160
OCR_PLAN = [(16, 32, 1), (32, 64, 1), (64, 64, 1), (64, 128, (2, 1)), (128, 128, 1), (128, 256, (1, 2)),
            (256, 256, 1), (256, 256, 1), (256, 256, 1), (256, 256, 1), (256, 512, (2, 1)), (512, 512, 1),
            (512, 512, 1)]
OCR_SMALL_PLAN = [(8, 16, 1), (16, 32, 2), (32, 32, 1), (32, 48, (2, 1)), (48, 64, (2, 1))]


def torch_model(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """A random-init model (eval mode, BatchNorm with non-trivial statistics) and its input shape."""
    torch.manual_seed(0)
    makers = {"crnn": (CRNN, (1, 3, 48, 320)), "svtr": (SVTR, (1, 3, 48, 320)), "vit12": (ViT, (1, 3, 224, 224)),
              "vit-tiny": (lambda: ViT(32, 1, 2, 32, 8), (1, 3, 32, 32)),
              "ocr": (lambda: OCR(OCR_PLAN, "svtr", 120, branches=4), (1, 3, 48, 320)),
              "ocr-small": (lambda: OCR(OCR_SMALL_PLAN, "lstm", 16), (1, 3, 32, 64))}
    make, shape = makers[name]
    model = make().eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.1, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    return model, shape


def build(name: str, folder: Path) -> tuple[Path, tuple[int, ...], dict[str, np.ndarray]]:
    """Export ``name`` to ``folder/<name>.onnx`` (legacy exporter, opset 17, input ``x``, output ``y``); its input
    shape and a seeded uniform sample."""
    model, shape = torch_model(name)
    path = Path(folder) / f"{name}.onnx"
    # (not under no_grad: MultiheadAttention's inference fast path has no ONNX export)
    torch.onnx.export(model, (torch.rand(*shape),), str(path), input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False)
    rng = np.random.default_rng(0)
    return path, shape, {"x": rng.random(shape, dtype=np.float32)}


def calibration(shape: tuple[int, ...], n: int = 8) -> list[dict[str, np.ndarray]]:
    """``n`` seeded uniform calibration samples (the sample of :func:`build` is not among them)."""
    rng = np.random.default_rng(1)
    return [{"x": rng.random(shape, dtype=np.float32)} for _ in range(n)]
