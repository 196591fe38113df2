"""Partitioned capture (``max_outputs_per_run``): one forward through consecutive subgraphs, bit-identical to
a whole-model capture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ivq_debug.capture.base import Selection
from ivq_debug.capture.onnxrt.partition import plan_partitions
from ivq_debug.capture.onnxrt.runner import OrtRunner
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.errors import UsageError
from ivq_debug.onnxgraph.load import load_model
from tests.support import tiny

QDQ_MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "qnn" / "model.qdq.onnx"


def capture(model: Path, feeds: dict[str, np.ndarray], out: Path, selection: Selection | None = None,
            **kw) -> OrtRunner:
    r = OrtRunner(model, selection=selection or Selection(), **kw)
    with DumpWriter(out, backend=r.backend, backend_info=r.info) as w:
        w.begin_record()
        r.run(feeds, w)
    return r


def assert_same_dump(a: Path, b: Path) -> int:
    """Every tensor (and raw integer value) of ``a`` and ``b`` is bit-identical; returns the count."""
    da, db = open_dump(a), open_dump(b)
    ea = {e.name: e for e in da.tensors()}
    eb = {e.name: e for e in db.tensors()}
    assert sorted(ea) == sorted(eb)
    for name, e in ea.items():
        x, y = da.read(e), db.read(eb[name])
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
        assert e.order == eb[name].order and e.op_type == eb[name].op_type, name
        rx, ry = da.read_raw(e), db.read_raw(eb[name])
        assert (rx is None) == (ry is None) and (rx is None or rx.tobytes() == ry.tobytes()), name
    return len(ea)


def test_plan_covers_every_node_once_with_bounded_groups(tmp_path: Path) -> None:
    _m, _x, path = tiny.build(tmp_path)
    r = OrtRunner(path, selection=Selection())
    model = load_model(path)
    plan = plan_partitions(model, r.sites, 4)
    assert plan is not None and len(plan) == -(-len(r.sites) // 4)
    covered = [i for p in plan.pieces for i in range(p.start, p.stop)]
    assert covered == list(range(len(model.graph.node)))
    assert sorted(s.name for p in plan.pieces for s in p.sites) == sorted(s.name for s in r.sites)
    assert all(0 < len(p.sites) <= 4 for p in plan.pieces)
    assert "logits" in plan.pieces[-1].outputs and "x" in plan.pieces[0].inputs
    # every boundary value a piece reads is an output of exactly one earlier piece
    for k, p in enumerate(plan.pieces):
        for v in p.inputs:
            if v != "x":
                assert [j for j, q in enumerate(plan.pieces[:k]) if v in q.outputs] != []
                assert plan.last_use[v] >= k


@pytest.mark.parametrize("n", [1, 5])
def test_partitioned_float_capture_is_bit_identical(tmp_path: Path, n: int) -> None:
    _m, x, path = tiny.build(tmp_path)
    capture(path, {"x": x}, tmp_path / "full.h5")
    r = capture(path, {"x": x}, tmp_path / "part.h5", max_outputs_per_run=n, verify=True)
    assert r.plan is not None
    assert r.info["capture_runs"] == {"mode": "partitioned", "runs": len(r.plan)}
    assert len(r.plan) == -(-len(r.sites) // n)
    assert r.exposure_check == {"bit_identical": True, "max_abs": 0.0}  # model outputs == the plain model's
    assert assert_same_dump(tmp_path / "full.h5", tmp_path / "part.h5") == len(r.sites) + 1
    assert open_dump(tmp_path / "part.h5").backend_info["capture_runs"]["mode"] == "partitioned"


def test_partitioned_qdq_capture_keeps_raw_integers(tmp_path: Path) -> None:
    model = onnx.load(str(QDQ_MODEL))  # (the fixture exposes its tensors; keep only the model's output)
    keep = [o for o in model.graph.output if o.name == "logits"]
    del model.graph.output[:]
    model.graph.output.extend(keep)
    path = tmp_path / "model.qdq.onnx"
    onnx.save(model, str(path))
    rng = np.random.default_rng(0)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    full = capture(path, feeds, tmp_path / "full.h5")
    part = capture(path, feeds, tmp_path / "part.h5", max_outputs_per_run=2)
    assert full.qdq and part.plan is not None and len(part.plan) >= 5
    assert assert_same_dump(tmp_path / "full.h5", tmp_path / "part.h5") >= 10


def test_partitioned_capture_with_external_data_leaves_nothing_behind(tmp_path: Path) -> None:
    _m, x, path = tiny.build(tmp_path)
    ext = tmp_path / "ext"
    ext.mkdir()
    onnx.save_model(onnx.load(str(path)), str(ext / "tiny.onnx"), save_as_external_data=True,
                    location="tiny.data", size_threshold=0)
    capture(path, {"x": x}, tmp_path / "full.h5")
    r = capture(ext / "tiny.onnx", {"x": x}, tmp_path / "ext.h5", max_outputs_per_run=4)
    assert r.plan is not None
    assert assert_same_dump(tmp_path / "full.h5", tmp_path / "ext.h5") > 20
    assert sorted(p.name for p in ext.iterdir()) == ["tiny.data", "tiny.onnx"]


def _if_model(path: Path) -> Path:
    """x → Relu → If(cond){then: Neg(r) reading the outer value r, else: Identity(r)} → Abs → y."""
    then_g = helper.make_graph([helper.make_node("Neg", ["r"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["r"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("If", ["cond"], ["b"], name="if", then_branch=then_g, else_branch=else_g),
             helper.make_node("Abs", ["b"], ["a"], name="abs"),
             helper.make_node("Sigmoid", ["a"], ["y"], name="sig")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                       helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_control_flow_falls_back_to_whole_model_runs(tmp_path: Path) -> None:
    path = _if_model(tmp_path / "if.onnx")
    feeds = {"x": np.arange(-3, 3, dtype=np.float32).reshape(2, 3), "cond": np.array(True)}
    r = capture(path, feeds, tmp_path / "if.h5", max_outputs_per_run=1)
    assert r.plan is None and r.info["capture_runs"] == {"mode": "whole-model", "runs": 3}
    d = open_dump(tmp_path / "if.h5")
    np.testing.assert_array_equal(d.read("b"), -np.maximum(feeds["x"], 0))
    with pytest.raises(UsageError, match="cannot be cut"):
        OrtRunner(path, selection=Selection(), max_outputs_per_run=1, partition=True)
    with pytest.raises(UsageError, match="optimization='disable'"):
        OrtRunner(path, selection=Selection(), max_outputs_per_run=1, partition=True, optimization="basic")
    assert OrtRunner(path, selection=Selection(), max_outputs_per_run=1, partition=False).plan is None


@pytest.mark.parametrize("extra, mode, runs", [([], "partitioned", 6), (["--whole-model-runs"], "whole-model", 6)])
def test_cli_capture_in_subsets(tmp_path: Path, extra: list[str], mode: str, runs: int) -> None:
    from ivq_debug.cli.common import run
    from ivq_debug.cli.main import _main

    _m, x, path = tiny.build(tmp_path)
    np.savez(tmp_path / "x.npz", x=x)
    capture(path, {"x": x}, tmp_path / "full.h5")
    out = tmp_path / "sub.h5"
    argv = ["capture", "onnx", str(path), "--inputs", str(tmp_path / "x.npz"), "-o", str(out),
            "--max-outputs-per-run", "7", *extra]
    assert run("ivq", _main, argv) == 0
    assert open_dump(out).backend_info["capture_runs"] == {"mode": mode, "runs": runs}
    assert assert_same_dump(tmp_path / "full.h5", out) > 30


def _save(path: Path, nodes: list, opset: int = 17, inits: tuple = ()) -> Path:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=list(inits))
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def _whole_vs_partitioned(tmp_path: Path, path: Path, sel: Selection, x: np.ndarray) -> OrtRunner:
    capture(path, {"x": x}, tmp_path / "whole.h5", selection=sel, max_outputs_per_run=1, partition=False)
    r = capture(path, {"x": x}, tmp_path / "part.h5", selection=sel, max_outputs_per_run=1)
    assert r.plan is not None
    assert assert_same_dump(tmp_path / "whole.h5", tmp_path / "part.h5") >= 2
    return r


X = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)


@pytest.mark.parametrize("kind", ["sequence", "float8", "bfloat16"])
def test_values_numpy_cannot_carry_never_cross_a_cut(tmp_path: Path, kind: str) -> None:
    """x → Abs → (a value numpy cannot carry) v, Neg(x), `back` to float, + Neg(x) → Sigmoid → y. One tensor
    per run would cut after Neg, which v crosses: the cut moves past v's last reader instead."""
    if kind == "sequence":
        make = [helper.make_node("SplitToSequence", ["a"], ["v"], name="split", axis=0)]
        back = [helper.make_node("SequenceAt", ["v", "zero"], ["f"], name="at")]
    else:
        to = TensorProto.FLOAT8E4M3FN if kind == "float8" else TensorProto.BFLOAT16
        make = [helper.make_node("Cast", ["a"], ["v"], name="cast", to=to)]
        back = [helper.make_node("Cast", ["v"], ["f"], name="back", to=TensorProto.FLOAT)]
    nodes = [helper.make_node("Abs", ["x"], ["a"], name="abs"), *make,
             helper.make_node("Neg", ["x"], ["n"], name="neg"), *back,
             helper.make_node("Add", ["f", "n"], ["s"], name="add"),
             helper.make_node("Sigmoid", ["s"], ["y"], name="sig")]
    path = _save(tmp_path / f"{kind}.onnx", nodes, opset=19,
                 inits=(helper.make_tensor("zero", TensorProto.INT64, [], [0]),))
    r = _whole_vs_partitioned(tmp_path, path, Selection(op_types=["Abs", "Neg", "Add"]), X)
    assert all("v" not in p.inputs for p in r.plan.pieces)
    assert [(p.start, p.stop) for p in r.plan.pieces] == [(0, 1), (1, 4), (4, 6)]  # the Neg cut moved past `back`
    first = np.abs(X)[:1] if kind == "sequence" else np.abs(X)  # (1, 3) row broadcast, or the whole tensor
    np.testing.assert_array_equal(open_dump(tmp_path / "part.h5").read("s"), first - X)


def test_constant_nodes_are_copied_into_the_pieces_that_read_them(tmp_path: Path) -> None:
    """A Constant weight read after a cut: ORT prepacks a constant for MatMul (not a graph input), so it must
    stay a constant in the consumer's piece to be bit-identical (and a piece must not hold others' weights)."""
    w = np.random.default_rng(0).standard_normal((3, 257)).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(w, "w")),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Neg", ["r"], ["n"], name="neg"),
             helper.make_node("Transpose", ["w"], ["wt"], name="wt", perm=[1, 0]),  # computed from the weight only
             helper.make_node("Transpose", ["wt"], ["w2"], name="w2", perm=[1, 0]),
             helper.make_node("MatMul", ["n", "w2"], ["y"], name="mm")]
    r = _whole_vs_partitioned(tmp_path, _save(tmp_path / "c.onnx", nodes), Selection(), X)
    assert [p.inputs for p in r.plan.pieces] == [["x"], ["r"]]
    assert r.plan.pieces[1].nodes == [0, 2, 3, 4, 5]  # Constant and its Transposes pulled into the MatMul's piece


def test_a_dead_tail_makes_no_empty_piece(tmp_path: Path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=0, num_outputs=2),
             helper.make_node("Abs", ["a"], ["dead"], name="abs")]
    r = _whole_vs_partitioned(tmp_path, _save(tmp_path / "d.onnx", nodes, opset=18),
                              Selection(op_types=["Split", "Relu"]), X)
    assert all(p.outputs for p in r.plan.pieces)


def test_failed_derived_graph_write_leaves_nothing_in_the_model_folder(tmp_path: Path, monkeypatch) -> None:
    from ivq_debug.errors import CaptureError

    _m, x, path = tiny.build(tmp_path)
    ext = tmp_path / "ext"
    ext.mkdir()
    onnx.save_model(onnx.load(str(path)), str(ext / "tiny.onnx"), save_as_external_data=True,
                    location="tiny.data", size_threshold=0)

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx, "save", full_disk)
    r = OrtRunner(ext / "tiny.onnx", selection=Selection(), max_outputs_per_run=4)
    with pytest.raises(CaptureError, match="No space left"), DumpWriter(tmp_path / "o.h5", backend=r.backend) as w:
        w.begin_record()
        r.run({"x": x}, w)
    assert sorted(p.name for p in ext.iterdir()) == ["tiny.data", "tiny.onnx"]
    assert not (tmp_path / "o.h5").exists()


def test_large_records_are_captured_in_bounded_runs_by_default(tmp_path: Path, monkeypatch) -> None:
    """Without ``max_outputs_per_run``, a capture whose exposed tensors of one record exceed
    ``defaults.CAPTURE_RUN_BYTES`` (here lowered to a quarter of the tiny model's) runs in partitioned pieces of
    about that size, bit-identical to one whole run; a choice of the caller (a group size, ``partition=False``)
    and a graph that cannot be cut (no N whole-model runs unasked) keep their single run."""
    from ivq_debug import defaults
    from ivq_debug.onnxgraph.fold import static_shapes

    _m, x, path = tiny.build(tmp_path)
    whole = capture(path, {"x": x}, tmp_path / "whole.h5")
    assert "capture_runs" not in whole.info  # the default limit (1 GiB) is far above the tiny model's record
    shapes = static_shapes(load_model(path))
    need = sum(4 * int(np.prod(shapes[s.output])) for s in whole.sites)
    monkeypatch.setattr(defaults, "CAPTURE_RUN_BYTES", need // 4)
    r = capture(path, {"x": x}, tmp_path / "auto.h5")
    runs = r.info["capture_runs"]
    assert runs["mode"] == "partitioned" and runs["auto"]["estimated_bytes"] == need
    assert 4 <= runs["runs"] <= 6 and runs["auto"]["per_run"] == len(r.sites) // 4
    assert assert_same_dump(tmp_path / "whole.h5", tmp_path / "auto.h5") == len(r.sites) + 1
    assert "capture_runs" not in capture(path, {"x": x}, tmp_path / "off.h5", partition=False).info
    assert capture(path, {"x": x}, tmp_path / "own.h5", max_outputs_per_run=3).info["capture_runs"]["runs"] == \
        -(-len(r.sites) // 3)
    feeds = {"x": np.arange(-3, 3, dtype=np.float32).reshape(2, 3), "cond": np.array(True)}
    monkeypatch.setattr(defaults, "CAPTURE_RUN_BYTES", 8)
    cf = capture(_if_model(tmp_path / "if.onnx"), feeds, tmp_path / "if.h5")
    assert cf.plan is None and "capture_runs" not in cf.info
