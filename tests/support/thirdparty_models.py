"""ONNX files like those nobody here exported (issue 20): what a paddle2onnx-style exporter writes.

:func:`build_textline` is a small text-line recognizer graph written the way such exporters write it:
opset 12, every weight and bias a ``Constant`` node (no initializers), a decomposed LayerNorm
(ReduceMean / Sub / Pow-free Mul / Sqrt / Div), single-head attention, ``metadata_props`` on the model, and a
dynamic width axis on the input (``x: [1, 3, 8, "width"]``). Its second conv's per-output-channel weight ranges
spread by ``spread`` (default 5000×), as a folded BatchNorm leaves them; here the small channels barely reach the
logits, so per-channel weights are valid on it but do not change them (33.8 dB a8w8 either way,
``tests/onnxgraph/test_intake.py``).

Weights are seeded (``seed``); :func:`textline_feeds` gives matching inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 12
CHANNELS = (3, 8, 16)
HEIGHT = 8
CLASSES = 10
METADATA = {"model_author": "a third party", "preprocess": '{"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}',
            "character_dict": "0123456789"}


def build_textline(seed: int = 0, *, spread: float = 5000.0, opset: int = OPSET, width: int | str = "width",
                   metadata: dict[str, str] | None = None, shape_reshape: bool = False) -> onnx.ModelProto:
    """The model (see the module docstring); ``width`` an int makes the axis static. ``shape_reshape`` adds the
    ``Shape -> Gather -> Concat -> Reshape`` chain paddle2onnx writes for a dynamic reshape (QNN refuses
    ``Shape``: the model then runs on HTP only after ORT folds it, ``--optimization all``)."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value: np.ndarray) -> str:
        nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.asarray(value), name=name)))
        return name

    def node(op: str, inputs: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=out.replace(":0", ""), **attrs))
        return out

    c0, c1, c2 = CHANNELS
    w1 = (rng.standard_normal((c1, c0, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((c2, c1, 3, 3)) * 0.2).astype(np.float32)
    # per-output-channel ranges spread by `spread`: channel k scaled by spread ** (k / (c2 - 1)) / spread ** 0.5
    scales = spread ** (np.arange(c2) / (c2 - 1) - 0.5)
    w2 *= scales[:, None, None, None].astype(np.float32)
    h = node("Conv", ["x", const("conv1.w", w1), const("conv1.b", (rng.standard_normal(c1) * 0.1)
                                                      .astype(np.float32))], "conv1", pads=[1, 1, 1, 1])
    h = node("Relu", [h], "relu1")
    h = node("Conv", [h, const("conv2.w", w2), const("conv2.b", (rng.standard_normal(c2) * 0.1 * scales)
                                                    .astype(np.float32))], "conv2", pads=[1, 1, 1, 1])
    h = node("Relu", [h], "relu2")
    h = node("ReduceMean", [h], "pool", axes=[2], keepdims=0)                        # [1, C, W]
    h = node("Transpose", [h], "seq", perm=[0, 2, 1])                                # [1, W, C]
    h = node("Div", [h, const("seq.norm", np.array(float(np.sqrt(spread)), np.float32))], "seq_scaled")
    if shape_reshape:
        bw = node("Gather", [node("Shape", [h], "seq.shape"), const("seq.idx", np.array([0, 1], np.int64))],
                  "seq.bw", axis=0)
        target = node("Concat", [bw, const("seq.minus1", np.array([-1], np.int64))], "seq.target", axis=0)
        h = node("Reshape", [h, target], "seq.reshaped")
    # decomposed LayerNorm, as paddle2onnx writes it
    mu = node("ReduceMean", [h], "ln.mean", axes=[-1], keepdims=1)
    d = node("Sub", [h, mu], "ln.centered")
    var = node("ReduceMean", [node("Mul", [d, d], "ln.sq")], "ln.var", axes=[-1], keepdims=1)
    std = node("Sqrt", [node("Add", [var, const("ln.eps", np.array(1e-5, np.float32))], "ln.var_eps")], "ln.std")
    h = node("Div", [d, std], "ln.norm")
    h = node("Mul", [h, const("ln.gamma", (1 + 0.1 * rng.standard_normal(c2)).astype(np.float32))], "ln.scaled")
    h = node("Add", [h, const("ln.beta", (0.1 * rng.standard_normal(c2)).astype(np.float32))], "ln")
    # single-head attention
    proj = {k: const(f"attn.{k}.w", (rng.standard_normal((c2, c2)) / np.sqrt(c2)).astype(np.float32))
            for k in ("q", "k", "v", "o")}
    q = node("MatMul", [h, proj["q"]], "attn.q")
    k = node("MatMul", [h, proj["k"]], "attn.k")
    v = node("MatMul", [h, proj["v"]], "attn.v")
    s = node("MatMul", [q, node("Transpose", [k], "attn.kT", perm=[0, 2, 1])], "attn.scores")
    s = node("Mul", [s, const("attn.scale", np.array(1 / np.sqrt(c2), np.float32))], "attn.scaled")
    p = node("Softmax", [s], "attn.probs", axis=2)
    a = node("MatMul", [node("MatMul", [p, v], "attn.ctx"), proj["o"]], "attn.out")
    h = node("Add", [h, a], "attn.residual")
    h = node("MatMul", [h, const("head.w", (rng.standard_normal((c2, CLASSES)) / np.sqrt(c2))
                                 .astype(np.float32))], "head.mm")
    node("Add", [h, const("head.b", (0.1 * rng.standard_normal(CLASSES)).astype(np.float32))], "logits")
    graph = helper.make_graph(
        nodes, "textline",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c0, HEIGHT, width])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, width, CLASSES])],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="paddle2onnx-like",
                          ir_version=7)
    helper.set_model_props(m, dict(METADATA if metadata is None else metadata))
    onnx.checker.check_model(m)
    return m


def textline_feeds(seed: int, n: int, width: int = 32) -> list[dict[str, np.ndarray]]:
    """``n`` seeded inputs of width ``width`` (a text-line image normalized to [-1, 1])."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.uniform(-1, 1, (1, CHANNELS[0], HEIGHT, width)).astype(np.float32)} for _ in range(n)]


def save_textline(folder: Path, name: str = "textline.onnx", **kw) -> Path:
    """:func:`build_textline` saved to ``folder / name``."""
    path = Path(folder) / name
    onnx.save(build_textline(**kw), str(path))
    return path
