"""Tiny real ONNX models for the QNN EP tests, built with ``onnx.helper`` (named nodes, fixed seeds).

``build_block``: one transformer block — LayerNormalization, Q/K/V MatMul, RoPE (MatMul of positions and
inverse frequencies, Sin, Cos, Concat, Slice, Neg, Mul, Add), Kᵀ (a Transpose that QNN fuses into the
score MatMul), scaled scores, Softmax, P·V, output projection and residual, LayerNormalization, FFN with
the ``Gelu`` op (opset 20), residual and an LM head. ``build_erf``: MatMul → bare ``Erf`` → MatMul (QNN
HTP does not take a quantized Erf). ``build_conv``: an NCHW image model for image calibration.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

from ivq_debug.dump import DumpWriter

HAVE_QNN = importlib.util.find_spec("onnxruntime_qnn") is not None
needs_qnn = pytest.mark.skipif(not HAVE_QNN, reason="onnxruntime-qnn is not installed (QNN HTP emulation)")

#: the calibration seed and the capture-feed seed every test uses
CAL_SEED, FEED_SEED = 1, 5

S, D, F, V = 8, 32, 64, 16


def capture_feeds(runner: Any, feeds: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """Capture one forward of ``runner`` on ``feeds`` into the dump ``path`` (one ``model`` record, its inputs
    recorded); returns the graph outputs."""
    with DumpWriter(path, backend=runner.backend, backend_info=runner.info, model={"path": str(runner.model_path)}) as w:
        w.begin_record(sample=0, part="model", step=0)
        for k, v in feeds.items():
            w.add_input(k, v)
        return runner.run(feeds, w)


def block_feeds(seed: int, n: int = 1) -> list[dict[str, np.ndarray]]:
    """``n`` feeds for :func:`build_block`: random hidden states, positions 0..S-1."""
    rng = np.random.default_rng(seed)
    pos = np.arange(S, dtype=np.float32).reshape(S, 1)
    return [{"x": rng.standard_normal((1, S, D)).astype(np.float32), "pos": pos} for _ in range(n)]


def build_block(seed: int = 0) -> onnx.ModelProto:
    """The transformer block (see the module docstring)."""
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []

    def add(name: str, arr: np.ndarray) -> None:
        inits.append(nh.from_array(np.asarray(arr), name))

    def weight(name: str, rows: int, cols: int) -> None:
        add(name, (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32))

    half = D // 2
    add("inv_freq", (1.0 / 10000 ** (np.arange(half) * 2 / D)).reshape(1, half).astype(np.float32))
    add("ln1_g", (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    add("ln1_b", np.zeros(D, np.float32))
    add("ln2_g", np.ones(D, np.float32))
    add("ln2_b", np.zeros(D, np.float32))
    for w in ("Wq", "Wk", "Wv", "Wo"):
        weight(w, D, D)
    weight("W1", D, F)
    add("b1", (0.1 * rng.standard_normal(F)).astype(np.float32))
    weight("W2", F, D)
    weight("Wh", D, V)
    add("s0", np.array([0], np.int64))
    add("sh", np.array([half], np.int64))
    add("sD", np.array([D], np.int64))
    add("ax", np.array([-1], np.int64))
    add("scale", np.array(1 / np.sqrt(D), np.float32))
    n = [
        h.make_node("LayerNormalization", ["x", "ln1_g", "ln1_b"], ["x1"], name="ln1", axis=-1),
        h.make_node("MatMul", ["pos", "inv_freq"], ["ang"], name="rope_angle"),
        h.make_node("Sin", ["ang"], ["sin_h"], name="rope_sin"),
        h.make_node("Cos", ["ang"], ["cos_h"], name="rope_cos"),
        h.make_node("Concat", ["sin_h", "sin_h"], ["sin"], name="rope_sin_cat", axis=-1),
        h.make_node("Concat", ["cos_h", "cos_h"], ["cos"], name="rope_cos_cat", axis=-1),
    ]
    n += [h.make_node("MatMul", ["x1", f"W{p}"], [p], name=f"{p}_proj") for p in ("q", "k", "v")]
    for p in ("q", "k"):
        n += [
            h.make_node("Slice", [p, "s0", "sh", "ax"], [f"{p}_lo"], name=f"{p}_rope_slice_lo"),
            h.make_node("Slice", [p, "sh", "sD", "ax"], [f"{p}_hi"], name=f"{p}_rope_slice_hi"),
            h.make_node("Neg", [f"{p}_hi"], [f"{p}_nhi"], name=f"{p}_rope_neg"),
            h.make_node("Concat", [f"{p}_nhi", f"{p}_lo"], [f"{p}_rot"], name=f"{p}_rope_cat", axis=-1),
            h.make_node("Mul", [p, "cos"], [f"{p}_c"], name=f"{p}_rope_mulcos"),
            h.make_node("Mul", [f"{p}_rot", "sin"], [f"{p}_s"], name=f"{p}_rope_mulsin"),
            h.make_node("Add", [f"{p}_c", f"{p}_s"], [f"{p}_r"], name=f"{p}_rope_add"),
        ]
    n += [
        h.make_node("Transpose", ["k_r"], ["kT"], name="k_T", perm=[0, 2, 1]),
        h.make_node("MatMul", ["q_r", "kT"], ["sc0"], name="qk"),
        h.make_node("Mul", ["sc0", "scale"], ["sc"], name="qk_scale"),
        h.make_node("Softmax", ["sc"], ["p"], name="softmax", axis=-1),
        h.make_node("MatMul", ["p", "v"], ["ctx"], name="pv"),
        h.make_node("MatMul", ["ctx", "Wo"], ["o"], name="o_proj"),
        h.make_node("Add", ["x", "o"], ["h1"], name="resid1"),
        h.make_node("LayerNormalization", ["h1", "ln2_g", "ln2_b"], ["x2"], name="ln2", axis=-1),
        h.make_node("MatMul", ["x2", "W1"], ["f0"], name="fc1"),
        h.make_node("Add", ["f0", "b1"], ["f1"], name="fc1_bias"),
        h.make_node("Gelu", ["f1"], ["g"], name="gelu"),
        h.make_node("MatMul", ["g", "W2"], ["f2"], name="fc2"),
        h.make_node("Add", ["h1", "f2"], ["h2"], name="resid2"),
        h.make_node("MatMul", ["h2", "Wh"], ["logits"], name="lm_head"),
    ]
    g = h.make_graph(
        n, "block",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, D]),
         h.make_tensor_value_info("pos", TensorProto.FLOAT, [S, 1])],
        [h.make_tensor_value_info("logits", TensorProto.FLOAT, [1, S, V])],
        inits,
    )
    return _finish(g)


def build_erf(seed: int = 0, erfs: int = 1) -> onnx.ModelProto:
    """``x → MatMul → Erf → MatMul → y``: the quantized Erf is not supported by QNN HTP. ``erfs`` > 1 repeats
    ``MatMul → Erf`` (``fc1_<i>``, ``bare_erf_<i>``): a refusal naming more nodes than one line lists."""
    rng = np.random.default_rng(seed)
    w1 = nh.from_array((rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32), "W1")
    w2 = nh.from_array((rng.standard_normal((D, V)) / np.sqrt(D)).astype(np.float32), "W2")
    nodes = [h.make_node("MatMul", ["x", "W1"], ["a"], name="fc1"), h.make_node("Erf", ["a"], ["e"], name="bare_erf")]
    inits = [w1, w2]
    for i in range(2, erfs + 1):
        prev = nodes[-1].output[0]
        inits.append(nh.from_array((rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32), f"W1_{i}"))
        nodes += [h.make_node("MatMul", [prev, f"W1_{i}"], [f"a_{i}"], name=f"fc1_{i}"),
                  h.make_node("Erf", [f"a_{i}"], [f"e_{i}"], name=f"bare_erf_{i}")]
    g = h.make_graph(
        [*nodes, h.make_node("MatMul", [nodes[-1].output[0], "W2"], ["y"], name="fc2")],
        "erf",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, D])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, S, V])],
        inits,
    )
    return _finish(g)


def build_conv(seed: int = 0, hw: int = 16) -> onnx.ModelProto:
    """``pixel_values [1,3,hw,hw] → Conv 3x3 → Relu → GlobalAveragePool``."""
    rng = np.random.default_rng(seed)
    w = nh.from_array((0.2 * rng.standard_normal((4, 3, 3, 3))).astype(np.float32), "conv_w")
    g = h.make_graph(
        [h.make_node("Conv", ["pixel_values", "conv_w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         h.make_node("Relu", ["c"], ["r"], name="relu"),
         h.make_node("GlobalAveragePool", ["r"], ["y"], name="gap")],
        "conv",
        [h.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, 3, hw, hw])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 1, 1])],
        [w],
    )
    return _finish(g)


def _finish(g: onnx.GraphProto) -> onnx.ModelProto:
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 20)], producer_name="ivq-debug-tests")
    m.ir_version = 10
    onnx.checker.check_model(m, full_check=True)
    return m


def block_files(folder: Path, samples: int = 2) -> tuple[Path, Path, list[object]]:
    """The float block, its a8w8 QDQ model (``quantize_for_qnn``, 4 calibration feeds) and the CLI's ``--inputs`` of
    ``samples`` feeds saved as ``.npz`` in ``folder``."""
    from ivq_debug.qnn.quantize import quantize_for_qnn

    fm = folder / "block.onnx"
    onnx.save(build_block(0), str(fm))
    qm = quantize_for_qnn(fm, folder / "block.a8w8.onnx", block_feeds(CAL_SEED, 4)).model_path
    for i, feeds in enumerate(block_feeds(7, samples)):
        np.savez(folder / f"in{i}.npz", **feeds)
    return fm, qm, [x for i in range(samples) for x in ("--inputs", folder / f"in{i}.npz")]
