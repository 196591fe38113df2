"""QNN name sanitizing and the reverse map to ONNX names."""

from __future__ import annotations

import pytest

from ivq_debug.qnn.names import NameMap, name_forms, qnn_sanitize
from tests.support.qnn_fixtures import MODEL, SINGLE


@pytest.mark.parametrize(
    ("onnx", "qnn"),
    [
        ("onnx::Conv_497", "onnx__Conv_497"),  # seen in a QAIRT 2.39 model.cpp
        ("onnx::MatMul_227", "onnx__MatMul_227"),
        ("/conv1/Conv_output_0", "_conv1_Conv_output_0"),
        ("/conv1/Conv", "_conv1_Conv"),
        ("/model/model/embed_tokens/Gather_output_0", "_model_model_embed_tokens_Gather_output_0"),
        ("7", "_7"),
        ("layer1.0.conv1.weight", "layer1_0_conv1_weight"),
        ("input.1", "input_1"),
        ("_already", "_already"),
        ("", "_"),
    ],
)
def test_sanitize_per_char(onnx: str, qnn: str) -> None:
    assert qnn_sanitize(onnx) == qnn


def test_sanitize_legacy_collapses_runs() -> None:
    assert qnn_sanitize("onnx::Conv_497", legacy=True) == "onnx_Conv_497"
    assert qnn_sanitize("/a//b.0", legacy=True) == "_a_b_0"
    assert name_forms("/a::b")["alpha_prefix"] == "__a_b"  # the old Python backend's prefix rule


def test_name_map_resolves_every_form_of_the_fixture_model() -> None:
    nm = NameMap.from_onnx(MODEL)
    assert len(nm.tensors) > 50 and len(nm.nodes) > 40
    for t in nm.tensors:
        for form in ("identity", "per_char", "collapsed"):
            q = name_forms(t)[form]
            m = nm.resolve(q, kinds=("tensor",))
            if not m.ambiguous:
                assert m.onnx_name == t, (form, q, m)
    assert nm.lookup("_attn_Softmax_output_0_QuantizeLinear_Output") == "/attn/Softmax_output_0_QuantizeLinear_Output"
    assert nm.lookup("onnx__MatMul_q_quantized") == "onnx::MatMul_q_quantized"
    assert nm.lookup_node("_ln_LayerNormalization") == "/ln/LayerNormalization"
    assert nm.lookup("no_such_tensor") is None
    assert nm.collisions == []


def test_real_result_file_names_map_back() -> None:
    nm = NameMap.from_onnx(MODEL)
    stems = [p.name.removesuffix(".raw").removesuffix("_native") for p in (SINGLE / "output" / "Result_0").glob("*.raw")]
    assert len(stems) >= 30
    assert all(nm.lookup(s) is not None for s in stems)


def test_collisions_are_reported_not_guessed() -> None:
    nm = NameMap.from_names(["a/b", "a.b", "a_b", "x/y", "x.y"])
    cols = {c.qnn_name: c for c in nm.collisions}
    assert set(cols) == {"a_b", "x_y"}
    assert cols["a_b"].onnx_names == ("a.b", "a/b", "a_b")
    # identity wins when the QNN name is itself an ONNX name
    assert nm.lookup("a_b") == "a_b"
    m = nm.resolve("x_y")
    assert m.onnx_name is None and m.ambiguous and set(m.candidates) == {"x/y", "x.y"}
    assert "x_y" not in nm and "a_b" in nm
