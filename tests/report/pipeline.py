"""A small real pipeline for the report tests.

A tiny transformer-like ONNX model (exporter-style node names; the Gelu output is literally named
``<img src=x onerror=alert(1)>``) is quantized a8w8 with ``quantize_for_qnn`` and captured over four
records (a prefill and three decode steps, one run each): float and CPU-QDQ with ``OrtRunner``, QNN HTP
(emulated on x86_64) with ``QnnHtpRunner(profiling_level="detailed")`` so the profiling table is real.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

XSS = "<img src=x onerror=alert(1)>"
S, D, F, V = 8, 32, 64, 16
HAVE_QNN = importlib.util.find_spec("onnxruntime_qnn") is not None


def build_model(seed: int = 0) -> onnx.ModelProto:
    """LayerNorm → attention (q, k, Kᵀ, scores, softmax, P·x) → residual → MLP (fc1, Gelu, fc2) → residual →
    LM head. The Gelu output carries the XSS name."""
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []

    def add(name: str, arr: np.ndarray) -> None:
        inits.append(nh.from_array(np.asarray(arr), name))

    def weight(name: str, rows: int, cols: int) -> None:
        add(name, (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32))

    add("ln_g", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    add("ln_b", np.zeros(D, np.float32))
    for w, r, c in (("Wq", D, D), ("Wk", D, D), ("W1", D, F), ("W2", F, D), ("Wh", D, V)):
        weight(w, r, c)
    add("b1", (0.1 * rng.standard_normal(F)).astype(np.float32))
    add("scale", np.array(1 / np.sqrt(D), np.float32))
    nodes = [
        h.make_node("LayerNormalization", ["x", "ln_g", "ln_b"], ["/blk/ln/out"], name="/blk/ln/LayerNormalization",
                    axis=-1),
        h.make_node("MatMul", ["/blk/ln/out", "Wq"], ["/blk/attn/q"], name="/blk/attn/q_proj/MatMul"),
        h.make_node("MatMul", ["/blk/ln/out", "Wk"], ["/blk/attn/k"], name="/blk/attn/k_proj/MatMul"),
        h.make_node("Transpose", ["/blk/attn/k"], ["/blk/attn/kT"], name="/blk/attn/Transpose", perm=[0, 2, 1]),
        h.make_node("MatMul", ["/blk/attn/q", "/blk/attn/kT"], ["/blk/attn/s0"], name="/blk/attn/qk/MatMul"),
        h.make_node("Mul", ["/blk/attn/s0", "scale"], ["/blk/attn/s"], name="/blk/attn/Mul"),
        h.make_node("Softmax", ["/blk/attn/s"], ["/blk/attn/p"], name="/blk/attn/Softmax", axis=-1),
        h.make_node("MatMul", ["/blk/attn/p", "/blk/ln/out"], ["/blk/attn/ctx"], name="/blk/attn/pv/MatMul"),
        h.make_node("Add", ["x", "/blk/attn/ctx"], ["/blk/h1"], name="/blk/resid1/Add"),
        h.make_node("MatMul", ["/blk/h1", "W1"], ["/blk/mlp/f0"], name="/blk/mlp/fc1/MatMul"),
        h.make_node("Add", ["/blk/mlp/f0", "b1"], ["/blk/mlp/f1"], name="/blk/mlp/fc1/Add"),
        h.make_node("Gelu", ["/blk/mlp/f1"], [XSS], name="/blk/mlp/act/Gelu"),
        h.make_node("MatMul", [XSS, "W2"], ["/blk/mlp/f2"], name="/blk/mlp/fc2/MatMul"),
        h.make_node("Add", ["/blk/h1", "/blk/mlp/f2"], ["/blk/h2"], name="/blk/resid2/Add"),
        h.make_node("MatMul", ["/blk/h2", "Wh"], ["logits"], name="/lm_head/MatMul"),
    ]
    g = h.make_graph(nodes, "tiny_block", [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, D])],
                     [h.make_tensor_value_info("logits", TensorProto.FLOAT, [1, S, V])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 20)], producer_name="ivq-debug-tests")
    m.ir_version = 10
    onnx.checker.check_model(m, full_check=True)
    return m


def feeds(seed: int, n: int) -> list[dict[str, np.ndarray]]:
    """``n`` random inputs."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, S, D)).astype(np.float32)} for _ in range(n)]


def capture(runner, path: Path, inputs: list[dict[str, np.ndarray]], model: Path) -> Path:
    """Record 0 = prefill, records 1.. = decode steps 1.. (one run each)."""
    from ivq_debug.dump import DumpWriter
    from ivq_debug.inputfiles import sha256_file

    ident = {"path": str(model), "sha256": sha256_file(model), "part": "model"}
    with DumpWriter(path, backend=runner.backend, backend_info=runner.info, model=ident,
                    command="pytest tests/report") as w:
        for k, f in enumerate(inputs):
            w.begin_record(sample=0, part="prefill" if k == 0 else "decode", step=k)
            runner.run(f, w)
    return path


def build_pipeline(d: Path, n_records: int = 4) -> dict[str, Path]:
    """Float model, its a8w8 QDQ model, and float / CPU-QDQ / HTP dumps (HTP only with onnxruntime-qnn)."""
    from ivq_debug.capture.base import Selection
    from ivq_debug.capture.onnxrt.runner import OrtRunner
    from ivq_debug.qnn.quantize import quantize_for_qnn

    out: dict[str, Path] = {"dir": d}
    out["model"] = d / "tiny.onnx"
    onnx.save(build_model(), str(out["model"]))
    out["qdq"] = quantize_for_qnn(out["model"], d / "tiny.a8w8.onnx", feeds(1, 8), preset="a8w8").model_path
    inputs = feeds(5, n_records)
    out["float"] = capture(OrtRunner(out["model"], selection=Selection(), optimization="disable"), d / "float.h5",
                           inputs, out["model"])
    out["cpu"] = capture(OrtRunner(out["qdq"], selection=Selection(), optimization="disable"), d / "cpu-qdq.h5",
                         inputs, out["qdq"])
    if HAVE_QNN:
        from ivq_debug.capture.qnn_ep.runner import QnnHtpRunner

        htp = QnnHtpRunner(out["qdq"], selection=Selection(), profiling_level="detailed",
                           profiling_path=d / "htp-profile.csv")
        try:
            out["htp"] = capture(htp, d / "htp.h5", inputs, out["qdq"])
        finally:
            htp.close()
    return out
