"""Alignment through the quantizer's preprocessing: a user's float ViT vs the QDQ model of ORT's QNN flow."""

from __future__ import annotations

import pytest

from ivq_debug.align.preprocess import check_outputs, graph_names, qdq_float_names, quantizer_reference
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.dump import open_dump
from tests.support import vit


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    return vit.models(tmp_path_factory)


def test_the_quantizers_preprocessing_is_identified_and_verified_by_values(m, tmp_path) -> None:
    missing = qdq_float_names(m["qdq"]) - graph_names(m["float"])
    assert any(n.startswith("gemm_output_reshape_arg") for n in missing)  # what the user's model does not name
    pre, how = quantizer_reference(m["float"], m["qdq"], tmp_path)
    assert pre is not None and pre.name == "vit.pre.onnx" and "qnn_preprocess_model" in how
    assert qdq_float_names(m["qdq"]) <= graph_names(pre)
    ref = open_dump(m["ref"])
    feeds = [{e.name: ref.read(e) for e in ref.tensors(rid, kind="input")} for rid in ref.records["rid"]]
    got = capture(make_runner("onnx", pre, selection=Selection()), feeds, tmp_path / "pre.h5", progress=None)
    chk = check_outputs(ref, open_dump(got), ["y"])
    assert chk["ok"] and chk["max_rel"] < 1e-5
    same, how2 = quantizer_reference(pre, m["qdq"], tmp_path / "again")
    assert same == pre and "names every" in how2
