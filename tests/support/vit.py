"""A small ViT built from transformers' own ``ViTModel``, exported like a user would, and the faults the replay tests
inject into its QDQ model.

``build(…, opset=14)`` exports the LayerNorms decomposed (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul,
Add); the Linear layers are MatMul + Add and the GELU is the Erf subgraph, which ORT's QNN flow
(``qnn_preprocess_model``) turns into Gemm between reshapes and Gelu. ``outliers=True`` makes two channels of the
patch embedding sum their whole patch: a bright patch gives a massive activation there, in every block's residual
stream (calibration images with a bright patch set the ``x²`` encodings; the evaluation image has a milder one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

OUTLIER_CHANNELS = (5, 17)
IMAGE = 32


class _Pixels(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(pixel_values=x).last_hidden_state


def build(tmp: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, mlp: int = 128, opset: int = 14,
          outliers: bool = False, seed: int = 0, name: str = "vit", size: int = IMAGE, patch: int = 8) -> Path:
    """Export the model to ``tmp/<name>.onnx`` (input ``x`` [1, 3, size, size], output ``y``)."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=mlp,
                    image_size=size, patch_size=patch, num_channels=3)
    m = ViTModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # trained-looking weights: non-trivial biases and norms
        for p in m.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.normal_(0, 0.02)
        for layer in m.layers:
            layer.layernorm_before.weight.fill_(1.0)
            layer.layernorm_after.weight.fill_(1.0)
        m.layernorm.weight.fill_(1.0)
        if outliers:
            m.embeddings.patch_embeddings.projection.weight[list(OUTLIER_CHANNELS)] = 0.1
    path = tmp / f"{name}.onnx"
    x = torch.zeros(1, 3, size, size)
    torch.onnx.export(_Pixels(m), (x,), str(path), input_names=["x"], output_names=["y"], opset_version=opset,
                      dynamo=False)
    return path


def image(seed: int, bright: float = 0.0, size: int = IMAGE) -> dict[str, np.ndarray]:
    """A noise image (one feed); ``bright`` is added to one 8x8 patch."""
    a = np.random.RandomState(seed).randn(1, 3, size, size).astype(np.float32)
    a[..., 8:16, 8:16] += bright
    return {"x": a}


def calibration(n: int = 8, bright: float = 0.0, size: int = IMAGE) -> list[dict[str, np.ndarray]]:
    """Calibration feeds; every second image has a bright patch of ``bright``."""
    return [image(100 + i, bright if i % 2 else 0.0, size) for i in range(n)]


def scale_activation(src: Path, dst: Path, tensor: str, factor: float) -> None:
    """An activation-scale fault: the Q/DQ scale of ``tensor`` multiplied by ``factor``."""
    m = onnx.load(str(src))
    q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    init = next(i for i in m.graph.initializer if i.name == q.input[1])
    v = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((v * factor).astype(v.dtype), init.name))
    onnx.save(m, str(dst))


def scale_weight(src: Path, dst: Path, weight: str, factor: float) -> None:
    """A weight-scale fault: ``weight`` re-quantized with a ``factor`` times coarser scale (a bad weight encoding)."""
    m = onnx.load(str(src))
    inits = {i.name: i for i in m.graph.initializer}
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == weight + "_quantized")
    q, s = numpy_helper.to_array(inits[dq.input[0]]), numpy_helper.to_array(inits[dq.input[1]])
    zp = numpy_helper.to_array(inits[dq.input[2]]) if len(dq.input) > 2 else np.zeros((), q.dtype)
    w = (q.astype(np.float64) - zp) * s
    s2 = (s * factor).astype(s.dtype)
    info = np.iinfo(q.dtype)
    q2 = np.clip(np.rint(w / s2) + zp, info.min, info.max).astype(q.dtype)
    inits[dq.input[0]].CopyFrom(numpy_helper.from_array(q2, dq.input[0]))
    inits[dq.input[1]].CopyFrom(numpy_helper.from_array(s2, dq.input[1]))
    onnx.save(m, str(dst))


_CACHE: dict[str, dict[str, Path]] = {}


def models(tmp_path_factory) -> dict[str, Path]:
    """Built once per test session (any test folder): the clean 2-block ViT (``float``, its QNN-flow ``qdq``, the
    ``act`` and ``weight`` faults, their units ``act_unit`` / ``weight_unit``) and the outlier ViT
    (``x2_float``, ``x2_qdq``), with float references of the evaluation images (``ref``, ``x2_ref``)."""
    if "m" in _CACHE:
        return _CACHE["m"]
    from ivq_debug.capture.base import Selection, capture, make_runner
    from ivq_debug.qnn.quantize import quantize_for_qnn

    d = tmp_path_factory.mktemp("vit")
    out: dict[str, Path] = {}
    out["float"] = build(d, layers=2)
    out["qdq"] = quantize_for_qnn(out["float"], d / "vit.qdq.onnx", calibration()).model_path
    scale_activation(out["qdq"], d / "vit.act.qdq.onnx", ACT_TENSOR, 20.0)
    scale_weight(out["qdq"], d / "vit.weight.qdq.onnx", weight_of(out["qdq"], WEIGHT_NODE), 20.0)
    out["act"], out["weight"] = d / "vit.act.qdq.onnx", d / "vit.weight.qdq.onnx"
    out["ref"] = capture(make_runner("onnx", out["float"], selection=Selection()), [image(7), image(8)],
                         d / "ref.h5", progress=None)
    out["x2_float"] = build(d, layers=2, outliers=True, name="vit_x2")
    out["x2_qdq"] = quantize_for_qnn(out["x2_float"], d / "vit_x2.qdq.onnx", calibration(bright=3.0)).model_path
    out["x2_ref"] = capture(make_runner("onnx", out["x2_float"], selection=Selection()), [image(7, bright=1.0)],
                            d / "x2_ref.h5", progress=None)
    _CACHE["m"] = out
    return out


#: the injected faults: the attention output projection's output encoding (shared by the Gemm and the reshape
#: after it: the Gemm is the unit that produces it) and the first MLP layer's weight encoding, both in block 1
ACT_TENSOR = "/m/layers.1/attention/o_proj/Add_output_0"
ACT_NODE = "/m/layers.1/attention/o_proj/MatMul/MatMulAddFusion"
WEIGHT_NODE = "/m/layers.1/mlp/fc1/MatMul/MatMulAddFusion"


def weight_of(qdq: Path, node: str) -> str:
    """The float name of a QDQ compute node's weight (its DequantizeLinear input without ``_quantized``)."""
    m = onnx.load(str(qdq), load_external_data=False)
    n = next(x for x in m.graph.node if x.name == node)
    dq = next(x for x in m.graph.node if x.output and x.output[0] == n.input[1])
    return dq.input[0].removesuffix("_quantized")


def cpu_qdq(model: Path, seeds: list[int], path: Path) -> Path:
    """A CPU-QDQ capture of ``model`` (every tensor) on the evaluation images of ``seeds``: a test dump."""
    from ivq_debug.capture.base import Selection, capture, make_runner

    return capture(make_runner("onnx", model, selection=Selection()), [image(s) for s in seeds], path, progress=None)
