"""BatchNormalization -> Mul + Add at intake (onnxgraph.batchnorm, issue 29): exact in float, names kept, and on the
emulated HTP a standalone BatchNormalization that no pre-processing folds (here after a residual Add) computes
closer to float once rewritten. Real ORT CPU sessions and the real QNN HTP emulation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ivq_debug.onnxgraph import intake
from ivq_debug.onnxgraph.batchnorm import batchnorm_to_mul_add
from tests.support.cli import ivq_cli
from tests.support.qnn_models import needs_qnn


def conv_add_bn(path: Path) -> Path:
    """Conv(3→16) → Add(residual Conv) → BatchNormalization (variances 250–6000, not foldable into a Conv: it reads
    an Add) → Relu → Conv(16→8) → y."""
    rng = np.random.default_rng(3)
    c = 16
    arrays = {"w1": rng.standard_normal((c, 3, 3, 3)) * 3.0, "b1": rng.standard_normal(c),
              "w2": rng.standard_normal((c, 3, 1, 1)) * 3.0,
              "bn_scale": 1 + 0.5 * rng.standard_normal(c), "bn_bias": rng.standard_normal(c),
              "bn_mean": 2 * rng.standard_normal(c), "bn_var": 250 + 5750 * rng.random(c),
              "w3": rng.standard_normal((8, c, 1, 1)) * 0.3}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in arrays.items()]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1] * 4, name="conv1"),
             helper.make_node("Conv", ["x", "w2"], ["c2"], name="conv2"),
             helper.make_node("Add", ["c1", "c2"], ["s"], name="add"),
             helper.make_node("BatchNormalization", ["s", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["n"],
                              name="bn", epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w3"], ["y"], name="conv3")]
    g = helper.make_graph(nodes, "conv_add_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def feeds(seeds: range) -> list[dict[str, np.ndarray]]:
    return [{"x": (10 * np.random.default_rng(s).standard_normal((1, 3, 16, 16))).astype(np.float32)} for s in seeds]


CAL, EVAL = feeds(range(8)), feeds(range(100, 104))


def run_cpu(model: onnx.ModelProto | Path, feed: dict[str, np.ndarray], outputs: list[str] | None = None) -> list:
    """``outputs`` (default: the model's) of ``model`` on ORT CPU, no graph optimization (QDQ: exact fake-quant)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    m = onnx.load(str(model)) if isinstance(model, Path) else model
    for name in outputs or []:  # expose an intermediate tensor
        if name not in {o.name for o in m.graph.output}:
            m.graph.output.append(helper.make_empty_tensor_value_info(name))
    data = m.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(outputs, feed)


def sqnr(ref: list[np.ndarray], test: list[np.ndarray]) -> float:
    """Mean SQNR (dB) over the samples."""
    return float(np.mean([10 * np.log10((r.astype(np.float64) ** 2).sum() / ((r - t).astype(np.float64) ** 2).sum())
                          for r, t in zip(ref, test, strict=True)]))


def test_rewrite_is_exact_in_float_and_keeps_the_output_name(tmp_path: Path) -> None:
    src = conv_add_bn(tmp_path / "m.onnx")
    model, rep = intake.prepare(onnx.load(str(src)), batchnorm=True)
    assert rep.batchnorms_to_mul_add == ["bn"] and rep.changed
    assert any("1 BatchNormalization node(s) rewritten as Mul + Add" in n for n in rep.notes())
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops and ops.count("Mul") == 1 and ops.count("Add") == 2
    add = next(n for n in model.graph.node if n.name == "bn")  # the Add takes the node's name and output name
    assert add.op_type == "Add" and list(add.output) == ["n"]
    assert not {"bn_scale", "bn_bias", "bn_mean", "bn_var"} & {t.name for t in model.graph.initializer}
    for f in EVAL:  # the BatchNormalization output and the model output, both to float rounding
        before, after = run_cpu(onnx.load(str(src)), f, ["n", "y"]), run_cpu(onnx.ModelProto.FromString(model.SerializeToString()), f, ["n", "y"])
        for a, b in zip(before, after, strict=True):
            assert np.allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(a).max())), float(np.abs(a - b).max())
    # off by default; a graph without an inference-form BatchNormalization is left as it is
    assert intake.prepare(onnx.load(str(src)))[1].batchnorms_to_mul_add == []
    assert batchnorm_to_mul_add(model) == []


def test_training_form_and_non_constant_parameters_are_left(tmp_path: Path) -> None:
    m = onnx.load(str(conv_add_bn(tmp_path / "m.onnx")))
    bn = next(n for n in m.graph.node if n.op_type == "BatchNormalization")
    bn.input[4] = "s"  # the variance is an activation now: not a constant, not rewritten
    assert batchnorm_to_mul_add(m) == [] and "BatchNormalization" in [n.op_type for n in m.graph.node]


@needs_qnn
def test_htp_reads_the_rewritten_batchnorm_closer_to_float(tmp_path: Path) -> None:
    """``ivq quantize --unfuse-batchnorm`` against the same quantization without it, on the emulated HTP
    (measured: a16w16 13.4 -> 59.2 dB, a16w8 13.3 -> 39.6 dB; CPU-QDQ 70.4 / 69.6 and 39.8 / 39.8 dB)."""
    from ivq_debug.capture.qnn_ep.session import create_qnn_session

    src = conv_add_bn(tmp_path / "m.onnx")
    cal = tmp_path / "cal"
    cal.mkdir()
    for i, f in enumerate(CAL):
        np.savez(cal / f"{i:03d}.npz", **f)
    ref = [run_cpu(src, f)[0] for f in EVAL]
    htp: dict[tuple[str, bool], float] = {}
    cpu: dict[tuple[str, bool], float] = {}
    for preset in ("a16w16", "a16w8"):
        for unfuse in (False, True):
            q, js = tmp_path / f"{preset}-{unfuse}.onnx", tmp_path / f"{preset}-{unfuse}.json"
            flag = ["--unfuse-batchnorm"] if unfuse else []
            assert ivq_cli("quantize", src, "--calibration", cal, "--preset", preset, *flag, "-o", q,
                           "--json", js) == 0
            assert json.loads(js.read_text())["intake"]["batchnorms_to_mul_add"] == (["bn"] if unfuse else [])
            sess = create_qnn_session(q).session
            htp[(preset, unfuse)] = sqnr(ref, [sess.run(None, f)[0] for f in EVAL])
            cpu[(preset, unfuse)] = sqnr(ref, [run_cpu(q, f)[0] for f in EVAL])
    print("HTP", htp, "CPU-QDQ", cpu)
    assert htp[("a16w16", True)] > htp[("a16w16", False)] + 20, htp
    assert htp[("a16w8", True)] > htp[("a16w8", False)] + 10, htp
    assert all(cpu[(p, True)] > cpu[(p, False)] - 1.5 for p in ("a16w16", "a16w8")), cpu  # CPU-QDQ not hurt


def test_unfuse_batchnorm_is_refused_with_dynamic(tmp_path: Path) -> None:
    src = conv_add_bn(tmp_path / "m.onnx")
    assert ivq_cli("quantize", src, "--dynamic", "--unfuse-batchnorm", "-o", tmp_path / "d.onnx") == 2
    assert not (tmp_path / "d.onnx").exists()
