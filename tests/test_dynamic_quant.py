"""``ivq quantize --dynamic``: ONNX Runtime's quantize_dynamic behind the CLI, and what the tool then does with a
dynamic INT8 model against its float model (align, diff, replay of the dynamic units). Real ORT runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

import ivq_debug as ivq
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.diagnose.replay import find_dynamic_units, replay, replay_units
from ivq_debug.dynamic_quant import quantize_dynamic_model
from ivq_debug.errors import UsageError
from ivq_debug.onnxgraph.load import load_model
from tests.support.dynamic_models import build_mlp, mlp_input, run_ivq


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dyn")
    out = {"float": build_mlp(d / "m.onnx"), "outlier": build_mlp(d / "o.onnx", outlier=1)}
    np.savez(d / "x.npz", **mlp_input())
    out["x"] = d / "x.npz"
    return out


def weights(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in load_model(path).graph.initializer}


def test_cli_writes_each_weight_flavour(work: dict[str, Path], tmp_path: Path, capfd) -> None:
    code, out, err = run_ivq(["quantize", work["float"], "-o", tmp_path / "s8.onnx", "--dynamic"], capfd)
    assert code == 0, err
    assert "5 MatMulInteger, 5 DynamicQuantizeLinear" in out
    s8 = weights(tmp_path / "s8.onnx")
    assert s8["fc1_0.w_quantized"].dtype == np.int8 and s8["fc1_0.w_scale"].shape == ()
    assert np.abs(s8["fc1_0.w_quantized"].astype(int)).max() == 127
    code, _, err = run_ivq(["quantize", work["float"], "-o", tmp_path / "rr.onnx", "--dynamic", "--reduce-range",
                            "--per-channel"], capfd)
    assert code == 0, err
    rr = weights(tmp_path / "rr.onnx")
    assert np.abs(rr["fc1_0.w_quantized"].astype(int)).max() <= 64 and rr["fc1_0.w_scale"].shape == (128,)
    r = quantize_dynamic_model(work["float"], tmp_path / "u8.onnx", weight_type="QUInt8")
    assert weights(r.model_path)["fc1_0.w_quantized"].dtype == np.uint8 and r.integer_ops == {"MatMulInteger": 5}


@pytest.mark.parametrize(("extra", "needle"), [
    (["--calibration", "x.npz"], "--calibration applies to QDQ quantization"),
    (["--preset", "a8w8", "--max-samples", "3"], "--max-samples applies to QDQ"),
])
def test_cli_refuses_qdq_options_with_dynamic(work: dict[str, Path], tmp_path: Path, capfd, extra, needle) -> None:
    code, _, err = run_ivq(["quantize", work["float"], "-o", tmp_path / "q.onnx", "--dynamic", *extra], capfd)
    assert code == 2 and needle in err and not (tmp_path / "q.onnx").exists()


def test_refuses_overwrite_and_quantized_input(work: dict[str, Path], tmp_path: Path) -> None:
    out = quantize_dynamic_model(work["float"], tmp_path / "q.onnx").model_path
    with pytest.raises(UsageError, match="output exists"):
        quantize_dynamic_model(work["float"], out)
    with pytest.raises(UsageError, match="already quantized"):
        quantize_dynamic_model(out, tmp_path / "qq.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]  # no partial left behind


def test_dynamic_units_are_found_unfused_fused_and_in_convs(work: dict[str, Path], tmp_path: Path) -> None:
    dq = quantize_dynamic_model(work["float"], tmp_path / "q.onnx").model_path
    units = find_dynamic_units(load_model(dq))
    assert [u.output for u in units] == ["/blocks.0/fc1/Add_output_0", "/blocks.0/fc2/Add_output_0",
                                         "/blocks.1/fc1/Add_output_0", "/blocks.1/fc2/Add_output_0", "y"]
    assert [n.op_type for n in units[0].nodes] == ["DynamicQuantizeLinear", "Mul", "MatMulInteger", "Cast", "Mul", "Add"]
    assert units[0].inputs == ["/blocks.0/ln/out"]
    # the per-node units of their members are gone: each LayerNorm, Gelu and residual Add is still its own unit
    every = replay_units(load_model(dq))
    assert len(every) == 5 + 2 * 3 and not any(u.op_type in ("Cast", "DynamicQuantizeLinear") for u in every)
    # ONNX Runtime's own graph at ORT_ENABLE_ALL: one DynamicQuantizeMatMul per unit, on the same tensors
    runner = make_runner("onnx", dq, optimization="all", selection=Selection())
    assert runner.kernels is not None
    fused = [t for t, k in runner.kernels["tensors"].items() if k["op"] == "com.microsoft.DynamicQuantizeMatMul"]
    assert fused == [u.output for u in units]


def test_diff_and_replay_name_the_layer_that_introduces_the_error(work: dict[str, Path], tmp_path: Path) -> None:
    """Block 1's fc1 weight has one 40× column: its per-tensor scale is too coarse for the rest (injected fault)."""
    dq = quantize_dynamic_model(work["outlier"], tmp_path / "o.dq.onnx").model_path
    feeds = [dict(np.load(work["x"]))]
    for name, model in (("float", work["outlier"]), ("dq", dq)):
        capture(make_runner("onnx", model, selection=Selection()), feeds, tmp_path / f"{name}.h5", progress=None)
    cmp = ivq.compare(tmp_path / "float.h5", tmp_path / "dq.h5")
    # every float tensor aligns by name; only the integer / scale tensors of the dynamic model stay unmatched
    assert cmp.alignment.unmatched_ref == []
    assert all(e.name.endswith(("_quantized", "_scale", "_zero_point", "_cast_output", ":0"))
               for e in cmp.alignment.unmatched_test)
    worst = cmp.worst(1).iloc[0]["ref_name"]
    assert worst.startswith("/blocks.1/")  # the error shows from the faulty block on
    r = replay(dq, tmp_path / "float.h5", cumulative=cmp, progress=False)
    t = r.table.set_index("tensor")
    dyn = t[t["op_type"] == "MatMulInteger"]
    assert len(dyn) == 5 and dyn["intro_sqnr_db"].idxmin() == "/blocks.1/fc1/Add_output_0"
    assert dyn.loc["/blocks.1/fc1/Add_output_0", "intro_sqnr_db"] < dyn.drop("/blocks.1/fc1/Add_output_0")[
        "intro_sqnr_db"].min() - 6
    # the first unit inherits nothing: its introduced error is its cumulative error
    first = dyn.loc["/blocks.0/fc1/Add_output_0"]
    assert first["inherited_share"] == pytest.approx(0.0, abs=1e-9)
    assert first["intro_sqnr_db"] == pytest.approx(first["cum_sqnr_db"], abs=1e-9)
    # a dynamic unit quantizes its own float inputs: both attributions agree, and no weight split is claimed
    np.testing.assert_allclose(dyn["local_sqnr_db"], dyn["iso_sqnr_db"], rtol=1e-12)
    assert dyn["weight_share"].isna().all()
    # float ops fed the reference introduce nothing
    assert np.isinf(t.loc["/blocks.1/ln/out", "intro_sqnr_db"])
    # replayed fused (ORT_ENABLE_ALL: DynamicQuantizeMatMul) the units introduce the same error
    fused = replay(dq, tmp_path / "float.h5", progress=False,
                   runner_factory=lambda p: make_runner("onnx", p, optimization="all")).table.set_index("tensor")
    np.testing.assert_allclose(fused.loc[dyn.index, "intro_sqnr_db"], dyn["intro_sqnr_db"], atol=0.05)


def test_replay_against_a_dynamic_reference_runs(work: dict[str, Path], tmp_path: Path, capfd) -> None:
    """The reference may be a dump of the dynamic model itself (uint8 tensors; was KeyError dtype('uint8'))."""
    dq = quantize_dynamic_model(work["float"], tmp_path / "q.onnx").model_path
    capture(make_runner("onnx", dq, selection=Selection()), [dict(np.load(work["x"]))], tmp_path / "q.h5",
            progress=None)
    code, _, err = run_ivq(["diagnose", tmp_path / "q.h5", tmp_path / "q.h5", "--model", dq, "--json",
                            tmp_path / "r.json"], capfd)
    assert code == 0, err
    import json

    units = json.loads((tmp_path / "r.json").read_text())["units"]
    assert units and all(u["intro_status"] == "identical" for u in units)  # same platform: each unit is exact


def test_constant_node_weights_are_named_not_silently_left_float(tmp_path: Path) -> None:
    """ORT's quantize_dynamic quantizes initializer weights only: a MatMul whose weight is a Constant node stays
    float, and the result says so (the initializer one is quantized)."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal((16, 16)).astype(np.float32) for _ in range(2))
    g = helper.make_graph(
        [helper.make_node("Constant", [], ["w_const"], value=numpy_helper.from_array(w2, "w_const")),
         helper.make_node("MatMul", ["x", "w_init"], ["h"], name="mm_init"),
         helper.make_node("MatMul", ["h", "w_const"], ["y"], name="mm_const")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], [numpy_helper.from_array(w1, "w_init")])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    r = quantize_dynamic_model(src, tmp_path / "q.onnx")
    assert r.float_left == {"MatMul": 1} and sum(r.integer_ops.values()) == 1
    assert any("1 MatMul/Conv/Gemm weight(s) are Constant nodes" in w and "mm_const" in w for w in r.warnings)
