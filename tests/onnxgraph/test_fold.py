"""Folding the shape arithmetic of an exported model (onnxgraph.fold.fold_shape_chains, through the intake):
torch's two exporters with a dynamic batch axis, real ORT sessions, exact outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ivq_debug.onnxgraph import intake
from ivq_debug.onnxgraph.fold import fold_shape_chains
from tests.support.shape_models import SHAPE_ARITHMETIC, build_shape_net, shape_feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT folds nothing itself
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("shape-net")
    return {e: build_shape_net(d, e) for e in ("legacy", "dynamo")}


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_intake_folds_the_shape_chains_exactly_and_keeps_every_other_name(exports, exporter: str) -> None:
    src = onnx.load(str(exports[exporter]))
    ops = [n.op_type for n in src.graph.node]
    assert "Shape" in ops and "Reshape" in ops and "Expand" in ops  # what the exporter wrote
    feeds = shape_feeds(3, 2)
    model, rep = intake.prepare(onnx.load(str(exports[exporter])), samples=feeds)
    left = [n.op_type for n in model.graph.node]
    assert not set(left) & set(SHAPE_ARITHMETIC), left
    assert rep.folded_shapes and any(f.endswith("(Shape)") for f in rep.folded_shapes)
    assert rep.changed and any("shape node(s) folded into initializers" in n for n in rep.notes())
    onnx.checker.check_model(model)
    for f in feeds:  # exact: the folded values are what ORT computes at run time
        assert np.array_equal(_run(model, f)[0], _run(src, f)[0])
    # every weight a node left reads stays as it was (the conv and fc weights: the quantizer sees the same
    # weights); only the ones a folded node read (the cls token, now its Expand's output) go
    folded = {f.rsplit(" (", 1)[0] for f in rep.folded_shapes}
    weights = {t.name: numpy_helper.to_array(t) for t in src.graph.initializer if t.data_type == TensorProto.FLOAT}
    after = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    read = {x for n in model.graph.node for x in n.input}
    assert len([k for k in weights if k in read]) >= 4  # conv.weight / bias, fc.weight / bias
    assert all(np.array_equal(after[k], v) for k, v in weights.items() if k in read)
    assert all(n.name in folded for n in src.graph.node if "cls" in n.input)
    kept = {n.name for n in model.graph.node}
    assert kept <= {n.name for n in src.graph.node}
    assert {n.name for n in src.graph.node} - kept <= folded | {n.name for n in src.graph.node
                                                                if n.op_type == "Constant"}


def test_a_dynamic_axis_keeps_the_chains_that_read_it(exports) -> None:
    src = onnx.load(str(exports["legacy"]))
    model, folded = fold_shape_chains(onnx.load(str(exports["legacy"])))  # the batch axis is still dynamic
    # only the Shape of a static tensor folds (the rank-3 target of the cls token's expand); the four Shapes of
    # batch-sized tensors stay, and the model still takes any batch
    assert [f for f in folded if f[1] == "Shape"] == [("/Shape_2", "Shape")]
    assert [n.op_type for n in model.graph.node].count("Shape") == 4
    for batch in (1, 3):
        feeds = {"x": np.concatenate([f["x"] for f in shape_feeds(4, batch)])}
        assert np.array_equal(_run(model, feeds)[0], _run(src, feeds)[0])
    _, rep = intake.prepare(onnx.load(str(exports["legacy"])), samples=shape_feeds(3, 1), fold_shapes=False)
    assert rep.folded_shapes == []


def test_a_value_a_subgraph_reads_stays_and_size_folds() -> None:
    """``Size`` folds too; a folded value an ``If`` branch reads from the outer scope stays an initializer, and a
    constant that only fed a folded chain goes."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    then = helper.make_graph([helper.make_node("Mul", ["x", "nf"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["o"])], "else", [],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 3])])
    nodes = [helper.make_node("Size", ["x"], ["n"], name="size"),
             helper.make_node("Cast", ["two"], ["two_f"], name="cast_two", to=TensorProto.INT64),
             helper.make_node("Mul", ["n", "two_f"], ["n2"], name="twice"),
             helper.make_node("Cast", ["n2"], ["nf"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Greater", ["x_sum", "zero"], ["cond"], name="gt"),
             helper.make_node("ReduceSum", ["x"], ["x_sum"], name="sum", keepdims=0),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then, else_branch=other)]
    nodes = [nodes[5], *nodes[:4], nodes[4], nodes[6]]  # topological order
    g = helper.make_graph(nodes, "g", [x], [y], [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                                                 numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    want = _run(m, feeds)[0]
    m, folded = fold_shape_chains(m)
    assert [op for _, op in folded] == ["Size", "Mul", "Cast"]
    assert {n.name for n in m.graph.node} == {"sum", "gt", "if"}  # cast_two only fed the chain: gone
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    assert float(inits["nf"]) == 12.0 and "two" not in inits  # read by the If branch: kept, folded
    onnx.checker.check_model(m)
    assert np.array_equal(_run(m, feeds)[0], want)
