"""One test per alignment strategy (ivq_debug.align.matcher.STRATEGIES), on tiny dumps written here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ivq_debug import defaults
from ivq_debug.align.matcher import STRATEGIES, align
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.errors import AlignmentError, UsageError


def _dump(path: Path, tensors: list[tuple], backend: str = "onnxruntime-cpu", inputs: dict | None = None):
    """tensors: (name, shape, scope) triples, written in order."""
    with DumpWriter(path, backend=backend) as w:
        w.begin_record()
        for k, v in (inputs or {}).items():
            w.add_input(k, v)
        for i, (name, shape, scope) in enumerate(tensors):
            w.add_tensor(name, np.full(shape, i, np.float32), order=i, scope=scope)
    return open_dump(path)


def _matches(al) -> dict[tuple[str, str], str]:
    return {(p.ref.name, p.test.name): p.match for p in al.pairs}


def test_strategy_names_and_order() -> None:
    assert [s.name for s in STRATEGIES] == ["map", "exact", "input", "qdq", "qnn", "qnn", "scope", "reshape", "fused"]


def test_map_wins_over_exact_names(tmp_path: Path) -> None:
    ref = _dump(tmp_path / "r.h5", [("a", (2,), None), ("b", (2,), None)])
    test = _dump(tmp_path / "t.h5", [("a", (2,), None), ("b", (2,), None)])
    m = _matches(align(ref, test, {"a": "b"}))
    assert m[("a", "b")] == "map"
    assert ("b", "a") not in m and len(m) == 1  # b on the ref side is left: its namesake was mapped away


def test_exact(tmp_path: Path) -> None:
    ref = _dump(tmp_path / "r.h5", [("x/y", (3,), None)])
    test = _dump(tmp_path / "t.h5", [("x/y", (3,), None)])
    assert _matches(align(ref, test)) == {("x/y", "x/y"): "exact"}


def test_graph_input_pairs_with_recorded_model_input(tmp_path: Path) -> None:
    x = np.ones((2,), np.float32)
    ref = _dump(tmp_path / "r.h5", [("h", (2,), None)], inputs={"pixel_values": x})
    test = _dump(tmp_path / "t.h5", [("pixel_values", (2,), None), ("h", (2,), None)])
    m = _matches(align(ref, test))
    assert m == {("h", "h"): "exact", ("pixel_values", "pixel_values"): "input"}


def test_qdq_suffixes_when_unique(tmp_path: Path) -> None:
    ref = _dump(tmp_path / "r.h5", [("logits", (2,), None), ("h", (2,), None), ("h_dequantized", (2,), None)])
    test = _dump(tmp_path / "t.h5", [("logits_QuantizeLinear_Input", (2,), None), ("h_quantized", (2,), None)])
    m = _matches(align(ref, test))
    assert m == {("logits", "logits_QuantizeLinear_Input"): "qdq"}  # "h" is ambiguous: two ref names strip to it


def test_qnn_sanitized_names_per_char_and_legacy(tmp_path: Path) -> None:
    ref = _dump(tmp_path / "r.h5", [("/blocks.0/fc1/MatMul_output_0", (2,), None), ("a..b", (2,), None)])
    test = _dump(tmp_path / "t.h5", [("_blocks_0_fc1_MatMul_output_0", (2,), None), ("a_b", (2,), None)])
    m = _matches(align(ref, test))
    assert m == {("/blocks.0/fc1/MatMul_output_0", "_blocks_0_fc1_MatMul_output_0"): "qnn", ("a..b", "a_b"): "qnn"}


def test_scope_torch_module_to_last_onnx_tensor_of_same_shape(tmp_path: Path) -> None:
    ref = _dump(tmp_path / "r.h5", [("encoder.mlp", (4,), "encoder.mlp")], backend="torch")
    test = _dump(tmp_path / "t.h5", [("/encoder/mlp/fc1/MatMul_output_0", (8,), "encoder.mlp.fc1"),
                                      ("/encoder/mlp/fc2/MatMul_output_0", (4,), "encoder.mlp.fc2"),
                                      ("/encoder/mlp/Reshape_output_0", (2, 3), "encoder.mlp")])
    m = _matches(align(ref, test))
    assert m == {("encoder.mlp", "/encoder/mlp/fc2/MatMul_output_0"): "scope"}


def _valued(path: Path, tensors: list[tuple[str, np.ndarray, str | None]]):
    """tensors: (name, values, op_type), written in order."""
    with DumpWriter(path, backend="onnxruntime-cpu-qdq") as w:
        w.begin_record()
        for i, (name, v, op) in enumerate(tensors):
            w.add_tensor(name, v, order=i, op_type=op)
    return open_dump(path)


def test_reshape_takes_the_partner_of_the_same_values_in_another_shape(tmp_path: Path) -> None:
    rs = np.random.RandomState(0)
    ln, add = rs.randn(1, 4, 6).astype(np.float32), rs.randn(1, 4, 8).astype(np.float32)
    ref = _valued(tmp_path / "r.h5", [("ln", ln, "Add"), ("fc/MatMul", add - 0.1, "MatMul"), ("fc/Add", add, "Add")])
    q = np.round(add * 10) / 10  # the quantized side
    test = _valued(tmp_path / "t.h5", [("ln", np.round(ln * 10) / 10, "Add"),
                                       ("gemm_input_reshape_arg", (np.round(ln * 10) / 10).reshape(4, 6), "Reshape"),
                                       ("gemm_output_reshape_arg", q.reshape(4, 8), "Gemm"),
                                       ("fc/Add", q, "Reshape"),
                                       ("other", rs.randn(4, 8).astype(np.float32), "Gemm")])
    m = _matches(align(ref, test))
    assert m[("ln", "gemm_input_reshape_arg")] == "reshape" and m[("fc/Add", "gemm_output_reshape_arg")] == "reshape"
    assert m[("fc/Add", "fc/Add")] == "exact" and not any(t == "other" and v == "reshape" for (_, t), v in m.items())


def test_fused_op_output_to_the_agreeing_reference_between_its_neighbours(tmp_path: Path) -> None:
    rs = np.random.RandomState(1)
    x = rs.randn(2, 16).astype(np.float32)
    gelu = x * 0.5 * (1 + np.tanh(x))
    ref = _valued(tmp_path / "r.h5", [("x", x, "Add"), ("act/Div", x / 1.41, "Div"), ("act/Erf", np.tanh(x), "Erf"),
                                      ("act/Mul_1", gelu, "Mul"), ("y", gelu + 1, "Add")])
    test = _valued(tmp_path / "t.h5", [("x", x, "Add"), ("gelu_fused", gelu + 0.01 * rs.randn(2, 16), "Gelu"),
                                       ("y", gelu + 1, "Add")])
    al = align(ref, test)
    assert _matches(al)[("act/Mul_1", "gelu_fused")] == "fused"
    assert {e.name for e in al.unmatched_ref} == {"act/Div", "act/Erf"}  # the fused interior stays ref-only


def test_unmatched_policy_in_the_api(tmp_path: Path) -> None:
    ref = _dump(tmp_path / "r.h5", [(f"t{i}", (2,), None) for i in range(10)])
    test = _dump(tmp_path / "t.h5", [(f"t{i}", (2,), None) for i in range(8)] + [("odd", (2,), None)])
    al = align(ref, test)
    assert al.unmatched_limit() == (1, 9, pytest.approx(9 * defaults.MAX_UNMATCHED_FRACTION))
    with pytest.raises(AlignmentError, match="1 of 9 tensors"):
        al.check(0)
    al.check(1)
    al.check(0.2)  # a fraction of the smaller side: 1.8 allowed
    with pytest.raises(AlignmentError):
        al.check(0.1)
    with pytest.raises(UsageError):
        al.check(-1)


@pytest.mark.parametrize("big", [False, True])
def test_reshape_value_check_shortcuts_decide_as_the_float64_test(tmp_path: Path, big: bool) -> None:
    """The value check's shortcuts (equal stored values; a float difference past the bound in its own dtype) give
    the float64 test's answer on every edge: equal, within and just past the tolerance, constant, zero, NaN,
    inf, values whose difference overflows float32, an integer pair, a float16 pair, different dtypes; small
    (contiguous) and large (chunked) datasets."""
    from ivq_debug.align.matcher import RESHAPE_RTOL, _same_values

    n = 70_000 if big else 48  # the large ones are chunked, read by os.pread
    rs = np.random.RandomState(1)
    b = rs.randn(n).astype(np.float32) * 3
    tol = float(np.max(np.abs(b.astype(np.float64)))) * RESHAPE_RTOL
    within, past = b.copy(), b.copy()
    within[5] = np.float32(b[5] + np.float32(tol * 0.5))
    past[5] = np.float32(b[5] + np.float32(tol * 4))
    nan, inf = b.copy(), b.copy()
    nan[3], inf[3] = np.nan, np.inf
    cases = {"equal": (b, b), "within": (within, b), "past": (past, b), "other": (rs.randn(n).astype(np.float32), b),
             "constant": (np.ones(n, np.float32), np.ones(n, np.float32)), "zero": (np.zeros(n, np.float32),) * 2,
             "nan": (nan, b), "nan-both": (nan, nan), "inf-both": (inf, inf), "inf": (inf, b),
             "int8": (rs.randint(-128, 127, n).astype(np.int8),) * 2,
             "int8-other": (rs.randint(-128, 127, n).astype(np.int8), rs.randint(-128, 127, n).astype(np.int8)),
             "float16": (b.astype(np.float16), (b * 1.5).astype(np.float16)), "dtypes": (b.astype(np.float16), b),
             "overflow": (np.full(n, 3e38, np.float32), np.where(np.arange(n) % 2, -3e38, 3e38).astype(np.float32))}
    tensors = []
    for k, (x, y) in cases.items():
        tensors += [(f"{k}/a", x.reshape(2, -1), None), (f"{k}/b", y.reshape(-1, 2), None)]
    d = _valued(tmp_path / "v.h5", tensors)
    for k, (x, y) in cases.items():
        ea, eb = d.entry(f"{k}/a"), d.entry(f"{k}/b")
        va, vb = x.astype(np.float64), y.astype(np.float64)
        with np.errstate(invalid="ignore"):
            scale = float(np.max(np.abs(vb)))
            want = bool(scale > 0 and float(np.std(vb)) > 0 and float(np.max(np.abs(va - vb))) <= RESHAPE_RTOL * scale)
            assert _same_values(d, ea, eb, {}, "test") is want, k
    assert _same_values(d, d.entry("within/a"), d.entry("within/b"), {}, "test")  # the cases decide both ways
    assert not _same_values(d, d.entry("past/a"), d.entry("past/b"), {}, "test")
