"""Shape inference of graphs without value_info (onnxgraph.infer)."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from ivq_debug.onnxgraph.infer import value_types


def _custom_op_graph() -> onnx.ModelProto:
    """x -> my.dom::Foo -> Relu: an op of an unknown domain, so neither inference can finish."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Foo", ["x"], ["f"], domain="my.dom"), helper.make_node("Relu", ["f"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.dom", 1)])


def test_incomplete_inference_writes_nothing_in_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    # ONNX Runtime's SymbolicShapeInference.infer_shapes saves sym_shape_infer_temp.onnx into the working
    # directory when it stays incomplete; ours must leave a user's folder as it was
    monkeypatch.chdir(tmp_path)
    out = value_types(_custom_op_graph(), {"x": [2, 4]})
    assert os.listdir(tmp_path) == []
    assert out.get("f", (None, None))[1] is None  # the custom op's output stays unshaped, not guessed


def test_complete_graph_is_shaped_with_the_given_dims() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["r"]),
                                            helper.make_node("Transpose", ["r"], ["y"])], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    out = value_types(m, {"x": [3, 4]})
    assert out["r"] == (TensorProto.FLOAT, (3, 4))
    assert out["y"] == (TensorProto.FLOAT, (4, 3))
