"""A small transformer-style MLP block with a gate, built in the repo, and the faults the effect / remedy tests inject.

``y = x + fc2(reshape(fc1(x))) + gate(x) · (x / 1000)`` on ``x`` [1, 8, 32]; ORT's QNN flow quantizes the
Reshape's output with its input's encoding (one scale initializer): a copy that shares it. The faults:

- ``act``: fc1's output encoding (the bias ``Add``'s, shared with its Reshape copy) × 0.05: it clips;
- ``weight``: fc2's weight re-quantized with a 4× coarser scale;
- ``gate`` (in every faulty model): the Sigmoid gate's output encoding × 0.05: it clips ~all of its values, but the
  gate multiplies a branch 1000× below the residual, so its error never reaches the output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx import numpy_helper as nh

from tests.support.vit import scale_activation, scale_weight

D, H, T = 32, 64, 8
#: the activation fault's tensor, its producer and its Reshape copy; the weight fault's node and weight
FC1_TENSOR, FC1_NODE, FC1_COPY = "fc1_out", "fc1/Add", "fc1_flat"
FC2_NODE, FC2_WEIGHT = "fc2/MatMul", "fc2.w"
GATE_TENSOR, GATE_NODE = "gate", "gate/Sigmoid"


def build(path: Path, seed: int = 0) -> Path:
    """The float model (input ``x`` [1, 8, 32], output ``y``)."""
    rng = np.random.RandomState(seed)

    def init(name: str, *shape: int, s: float = 0.2) -> onnx.TensorProto:
        return nh.from_array((rng.randn(*shape) * s).astype(np.float32), name)

    inits = [init("fc1.w", D, H), init("fc1.b", H, s=0.05), init("fc2.w", H, D, s=0.15), init("fc2.b", D, s=0.05),
             init("gate.w", D, D), nh.from_array(np.array(1e-3, np.float32), "small"),
             nh.from_array(np.array([T, H], np.int64), "flat"), nh.from_array(np.array([1, T, D], np.int64), "back")]
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.w"], ["fc1_mm"], name="fc1/MatMul"),
        helper.make_node("Add", ["fc1_mm", "fc1.b"], [FC1_TENSOR], name="fc1/Add"),
        helper.make_node("Reshape", [FC1_TENSOR, "flat"], [FC1_COPY], name="fc1/Reshape"),
        helper.make_node("MatMul", [FC1_COPY, "fc2.w"], ["fc2_mm"], name=FC2_NODE),
        helper.make_node("Reshape", ["fc2_mm", "back"], ["fc2_3d"], name="fc2/Reshape"),
        helper.make_node("Add", ["fc2_3d", "fc2.b"], ["fc2_out"], name="fc2/Add"),
        helper.make_node("Add", ["x", "fc2_out"], ["res"], name="res/Add"),
        helper.make_node("MatMul", ["x", "gate.w"], ["gate_logits"], name="gate/MatMul"),
        helper.make_node("Sigmoid", ["gate_logits"], [GATE_TENSOR], name="gate/Sigmoid"),
        helper.make_node("Mul", ["x", "small"], ["branch"], name="branch/Mul"),
        helper.make_node("Mul", [GATE_TENSOR, "branch"], ["gated"], name="gated/Mul"),
        helper.make_node("Add", ["res", "gated"], ["y"], name="out/Add"),
    ]
    g = helper.make_graph(nodes, "remedy_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, T, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, T, D])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


def sample(seed: int) -> dict[str, np.ndarray]:
    """One input."""
    return {"x": np.random.RandomState(seed).randn(1, T, D).astype(np.float32)}


def models(d: Path) -> dict[str, Path]:
    """The float model, its clean a8w8 QDQ model (ORT's QNN flow), the gate-only fault (``gate``: the fault-free
    baseline of the others), ``act`` and ``weight`` (each with the gate fault too), and the float reference of
    two evaluation inputs (``ref``)."""
    from ivq_debug.capture.base import Selection, capture, make_runner
    from ivq_debug.qnn.quantize import quantize_for_qnn

    out: dict[str, Path] = {"float": build(d / "block.onnx")}
    out["qdq"] = quantize_for_qnn(out["float"], d / "block.qdq.onnx", [sample(100 + i) for i in range(8)]).model_path
    out["gate"], out["act"] = d / "block.gate.qdq.onnx", d / "block.act.qdq.onnx"
    scale_activation(out["qdq"], out["gate"], GATE_TENSOR, 0.05)  # one scale initializer: the copy's too
    scale_activation(out["gate"], out["act"], FC1_TENSOR, 0.05)
    scale_weight(out["gate"], d / "block.weight.qdq.onnx", FC2_WEIGHT, 4.0)
    out["weight"] = d / "block.weight.qdq.onnx"
    out["ref"] = capture(make_runner("onnx", out["float"], selection=Selection()), [sample(7), sample(8)],
                         d / "ref.h5", progress=None)
    return out
