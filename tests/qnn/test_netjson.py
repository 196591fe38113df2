"""QNN graph JSON readers: converter net JSON, ORT dump_json_qnn_graph, context-binary JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ivq_debug.errors import InputError
from ivq_debug.qnn.names import qnn_sanitize
from ivq_debug.qnn.netjson import (
    QnnQuant,
    data_type_code,
    numpy_dtype,
    read_context_json,
    read_net_json,
    read_qnn_json,
)
from tests.support.qnn_fixtures import FIX, MODEL, SINGLE, one_line


def _model_qparams() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    m = onnx.load(MODEL)
    arr = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    return {n.output[0]: (arr[n.input[1]], arr[n.input[2]]) for n in m.graph.node
            if n.op_type == "QuantizeLinear" and n.input[1] in arr}


def test_ort_dump_quant_params_match_the_qdq_model() -> None:
    g = read_net_json(FIX / "ort_dump_json_qnn_graph.json")
    qp = _model_qparams()
    outs = [t for t in g.outputs if t.is_quantized]
    assert len(outs) == 17 and len(g.inputs) == 2
    for t in outs:
        scale, zp = qp[t.name]
        assert t.data_type == 1046 and t.dtype == np.uint16 and t.bitwidth == 16
        assert np.float32(t.quant.scale[0]) == scale  # QNN scale is the model's float32 scale
        assert int(t.quant.zero_point[0]) == int(zp)  # offset = -zero_point
    logits = g.tensors["logits"]
    assert logits.type == "APP_READ" and logits.quant is None and logits.is_float
    assert g.tensors["input.1"].type == "APP_WRITE"
    assert g.nodes["/attn/q/MatMul"].type == "FullyConnected"
    assert g.order()["/attn/Softmax_output_0_QuantizeLinear_Output"] > g.order()["/mix/Add_output_0_QuantizeLinear_Output"]


def test_ort_dump_per_channel_union_is_decoded() -> None:
    g = read_net_json(FIX / "ort_dump_json_qnn_graph.json")
    w, b = g.tensors["conv1.weight_quantized"], g.tensors["conv1.bias_quantized"]
    assert w.type == "STATIC" and w.dims == (3, 3, 3, 8)
    assert w.quant.encoding == "AXIS_SCALE_OFFSET" and w.quant.per_channel_missing
    assert (w.quant.axis, w.quant.num_channels) == (3, 8)  # HWIO: output channels last
    assert (b.quant.axis, b.quant.num_channels) == (0, 8)
    with pytest.raises(ValueError):
        w.quant.dequantize(np.zeros(w.dims, np.uint8))


def test_converter_net_json_layout_and_per_channel() -> None:
    g = read_net_json(SINGLE / "model_net.json")
    assert g.name == "model"
    x = g.tensors["input_1"]
    assert x.dims == (1, 8, 8, 3) and x.permute_order_to_src == (0, 3, 1, 2) and x.src_shape == (1, 3, 8, 8)
    assert x.src_layout == "NCHW"
    a = np.arange(192, dtype=np.float32).reshape(1, 3, 8, 8)
    assert np.array_equal(x.to_source(x.from_source(a)), a)
    assert np.array_equal(x.from_source(a), a.transpose(0, 2, 3, 1))
    w = g.tensors["conv1_weight_quantized"]
    assert not w.quant.per_channel_missing and w.quant.axis == 3 and w.quant.scale.size == 8
    scale = numpy_helper.to_array(next(i for i in onnx.load(MODEL).graph.initializer if i.name == "conv1.weight_scale"))
    assert np.array_equal(w.quant.scale.astype(np.float32), scale)
    assert np.all(w.quant.offset == -128)


def test_context_json_both_shapes_agree_with_the_net_json() -> None:
    net = read_net_json(SINGLE / "model_net.json")
    for f in ("context_wrapped.json", "context_plain.json"):
        (g,) = read_context_json(FIX / "context" / f)
        assert g.name == "model" and g.kind == "context_json"
        assert [t.name for t in g.inputs] == [t.name for t in net.inputs]
        assert [t.name for t in g.outputs] == [t.name for t in net.outputs]
        for t in g:
            n = net.tensors[t.name]
            assert (t.dims, t.data_type, t.type) == (n.dims, n.data_type, n.type)
            if n.is_quantized:
                assert np.array_equal(t.quant.scale, n.quant.scale) and np.array_equal(t.quant.offset, n.quant.offset)
            else:
                assert t.quant is None
        assert read_qnn_json(FIX / "context" / f)[0].name == "model"
    assert read_qnn_json(SINGLE / "model_net.json")[0].name == "model"


def test_data_type_codes() -> None:
    assert data_type_code(1046) == data_type_code("0x0416") == data_type_code("QNN_DATATYPE_UFIXED_POINT_16") == 0x416
    assert numpy_dtype(0x0308) == np.int8 and numpy_dtype(0x0216) == np.float16
    assert data_type_code("bogus") is None


def test_dequantize_matches_the_sdk_arithmetic() -> None:
    q = QnnQuant("SCALE_OFFSET", np.array([0.0235294]), np.array([-128]))
    x = np.array([0, 127, 128, 255], np.uint8)
    want = np.array([((v - 128.0) * float(np.float32(0.0235294))) for v in x]).astype(np.float32)
    assert np.array_equal(q.dequantize(x), want)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"graph": {"tensors": {', "bad JSON at line 1"),
        ('{"graph": {}}', "no graph.tensors"),
        ('{"graph": {"tensors": {"t": {"data_type": 562, "dims": "x"}}}}', "dims: must be a list"),
        ('{"graph": {"tensors": {"t": {"data_type": 7, "dims": [1]}}}}', "unknown data_type"),
        ('{"graph": {"tensors": {"t": {"data_type": 562, "dims": [1, 2], "permute_order_to_src": [0, 0]}}}}',
         "not a permutation"),
    ],
)
def test_bad_net_json_is_one_line_naming_the_file(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "bad_net.json"
    p.write_text(text)
    with pytest.raises(InputError) as ei:
        read_net_json(p)
    msg = one_line(ei.value)
    assert msg.startswith(str(p)) and needle in msg and ei.value.exit_code == 3


def test_missing_and_bad_context_json(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such graph JSON"):
        read_net_json(tmp_path / "nope.json")
    p = tmp_path / "ctx.json"
    p.write_text(json.dumps({"info": {"graphs": []}}))
    with pytest.raises(InputError, match="no graphs list"):
        read_context_json(p)


def test_sanitized_names_of_ort_dump_match_converter_names() -> None:
    ort = read_net_json(FIX / "ort_dump_json_qnn_graph.json")
    conv = read_net_json(SINGLE / "model_net.json")
    assert {qnn_sanitize(n) for n in ort.tensors} == set(conv.tensors)
