"""16-bit weights as QNN HTP computes them (issue 29): the a16w16 preset writes signed symmetric int16 weights
(``quantize.WEIGHT16``) and uint16 BatchNormalization scales (``quantize.BN_SCALE_TYPES``), measured on the
emulated HTP against the asymmetric uint16 weights it wrote before; per-channel 16-bit weights keep their int32
biases (ORT widens a weight scale whose bias would clip, for signed symmetric weights only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ivq_debug.qnn.quantize import quantize_for_qnn
from ivq_debug.tune.legal import violations
from tests.support.qnn_models import needs_qnn


def conv_bn_gemm(path: Path, *, dead: bool = False) -> Path:
    """Conv(3→16, 3×3, bias) → BatchNormalization → Relu → GlobalAveragePool → Flatten → Gemm(16→10, bias). With
    ``dead``: the Conv's output channel 0 has weights ~1e-6 and a bias of 2 (a near-dead channel: its per-channel
    16-bit weight scale times a 16-bit activation scale is far too small for its bias in int32)."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((16, 3, 3, 3)) * 0.3).astype(np.float32)
    b1 = (rng.standard_normal(16) * 0.1).astype(np.float32)
    if dead:
        w1[0] *= 1e-5
        b1[0] = 2.0
    arrays = {"w1": w1, "b1": b1,
              "bn_scale": 1 + 0.5 * rng.standard_normal(16), "bn_bias": 0.2 * rng.standard_normal(16),
              "bn_mean": 0.1 * rng.standard_normal(16), "bn_var": 0.5 + rng.random(16),
              "w2": rng.standard_normal((16, 10)) * 0.3, "b2": rng.standard_normal(10) * 0.1}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in arrays.items()]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1] * 4, name="conv"),
             helper.make_node("BatchNormalization", ["c", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["n"],
                              name="bn"),
             helper.make_node("Relu", ["n"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "w2", "b2"], ["y"], name="fc")]
    g = helper.make_graph(nodes, "conv_bn_gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def feeds(seeds: range) -> list[dict[str, np.ndarray]]:
    return [{"x": np.random.default_rng(s).standard_normal((1, 3, 16, 16)).astype(np.float32)} for s in seeds]


CAL, EVAL = feeds(range(8)), feeds(range(100, 104))


def sqnr(ref: list[np.ndarray], test: list[np.ndarray]) -> float:
    """Mean output SQNR (dB) over the evaluation samples."""
    return float(np.mean([10 * np.log10((r.astype(np.float64) ** 2).sum() / ((r - t).astype(np.float64) ** 2).sum())
                          for r, t in zip(ref, test, strict=True)]))


def outputs(model: Path, backend: str) -> list[np.ndarray]:
    """The model's output on :data:`EVAL`: ORT CPU (QDQ: exact fake-quant, no optimization) or the emulated HTP."""
    if backend == "qnn":
        from ivq_debug.capture.qnn_ep.session import create_qnn_session

        sess = create_qnn_session(model).session
    else:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    return [sess.run(None, f)[0] for f in EVAL]


def weight_zero_points(model: Path) -> dict[str, np.ndarray]:
    """Weight (initializer) name -> the zero point array of its DequantizeLinear."""
    m = onnx.load(str(model))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    return {n.input[0].removesuffix("_quantized"): inits[n.input[2]] for n in m.graph.node
            if n.op_type == "DequantizeLinear" and n.input[0] in inits and len(n.input) > 2}


def test_a16w16_writes_signed_symmetric_weights_and_uint16_batchnorm_scales(tmp_path: Path) -> None:
    q = quantize_for_qnn(conv_bn_gemm(tmp_path / "f.onnx"), tmp_path / "q.onnx", CAL, preset="a16w16")
    zp = weight_zero_points(q.model_path)
    for w in ("w1", "w2"):
        assert zp[w].dtype == np.int16 and not zp[w].any(), w
    assert zp["bn_scale"].dtype == np.uint16 and int(zp["bn_scale"]) == 32768
    assert q.weight_type == "QInt16" and any("BatchNormalization scale" in w for w in q.warnings)
    # stored so on purpose: counted, not reported as the preset not holding
    assert q.effective["counts"]["weight"] == {"int16": 2, "uint16": 1} and q.effective["mismatches"] == []
    assert violations(q.model_path, "qnn") == []


@needs_qnn
def test_a16w16_runs_on_htp_where_asymmetric_uint16_weights_were_refused(tmp_path: Path) -> None:
    """Measured on the emulated HTP (v73): the preset's model compiles whole and gains over a16w8 there (48.3 dB
    against 41.2, CPU-QDQ 70.7: the emulator computes 16x16 Conv / FullyConnected less exactly than fake-quant);
    the asymmetric uint16 weights the preset wrote before are refused (the Gemm) and break the HTP table's rule."""
    from ivq_debug.capture.qnn_ep.session import QnnUnsupportedError

    f = conv_bn_gemm(tmp_path / "f.onnx")
    ref = [ort.InferenceSession(str(f), providers=["CPUExecutionProvider"]).run(None, x)[0] for x in EVAL]
    w16 = quantize_for_qnn(f, tmp_path / "w16.onnx", CAL, preset="a16w16").model_path
    w8 = quantize_for_qnn(f, tmp_path / "w8.onnx", CAL, preset="a16w8").model_path
    cpu16, htp16, htp8 = sqnr(ref, outputs(w16, "cpu")), sqnr(ref, outputs(w16, "qnn")), sqnr(ref, outputs(w8, "qnn"))
    assert cpu16 > 65 and htp16 > htp8 + 4 and htp8 > 38, (cpu16, htp16, htp8)
    old = {w: {"quant_type": "QUInt16", "symmetric": False} for w in ("w1", "w2", "bn_scale")}
    u16 = quantize_for_qnn(f, tmp_path / "u16.onnx", CAL, preset="a16w16", overrides=old).model_path
    assert {v.what for v in violations(u16, "qnn")} == {"asymmetric16"}
    with pytest.raises(QnnUnsupportedError) as ei:
        outputs(u16, "qnn")
    assert "fc" in {u["name"] for u in ei.value.unsupported}


def test_a16w16_per_channel_keeps_its_int32_biases(tmp_path: Path) -> None:
    """A near-dead output channel: its per-channel 16-bit weight scale (1e-6 / 32767) times the input's 16-bit
    scale is ~1e-15, its bias 2 would be 2e15 steps in int32. ORT widens that weight scale for signed symmetric
    weights only: the preset's int16 keeps every bias (CPU-QDQ 70 dB); unsigned per-channel 16-bit weights (what
    the preset wrote before) clip it and the output collapses."""
    f = conv_bn_gemm(tmp_path / "f.onnx", dead=True)
    ref = [ort.InferenceSession(str(f), providers=["CPUExecutionProvider"]).run(None, x)[0] for x in EVAL]

    def clipped(model: Path) -> int:
        m = onnx.load(str(model))
        return sum(int((np.abs(numpy_helper.to_array(t).astype(np.int64)) >= 2**31 - 1).sum())
                   for t in m.graph.initializer if t.data_type == TensorProto.INT32)

    q = quantize_for_qnn(f, tmp_path / "pc.onnx", CAL, preset="a16w16", per_channel=True).model_path
    assert weight_zero_points(q)["w1"].shape == (16,)  # per channel
    good = sqnr(ref, outputs(q, "cpu"))
    u16 = {"w1": {"quant_type": "QUInt16", "symmetric": True, "axis": 0}}
    old = quantize_for_qnn(f, tmp_path / "u16.onnx", CAL, preset="a16w16", per_channel=True, overrides=u16).model_path
    bad = sqnr(ref, outputs(old, "cpu"))
    assert clipped(q) == 0 and clipped(old) >= 1
    assert good > 60 and bad < good - 20, (good, bad)
