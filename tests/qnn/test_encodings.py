"""Overrides / encodings: legacy, 1.0.0, AIMET 2.x, ORT TensorQuantOverrides; round trips and validation."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from ivq_debug.errors import InputError, UsageError
from ivq_debug.qnn.encodings import (
    Encoding,
    EncodingSet,
    encodings_from_qdq_model,
    from_ort_overrides,
    parse_encodings,
    read_encodings,
    to_legacy,
    to_ort_overrides,
    to_v1,
    write_encodings,
)
from tests.support.qnn_fixtures import FIX, FLOAT_MODEL, MODEL, one_line

LEGACY = {  # the example of notes §3.1
    "activation_encodings": {
        "/conv1/Conv_output_0": [{"bitwidth": 8, "dtype": "int", "is_symmetric": "False", "max": 6.0, "min": 0.0,
                                  "offset": 0, "scale": 0.0235294}]},
    "param_encodings": {
        "conv1.weight": [{"bitwidth": 8, "dtype": "int", "is_symmetric": "True", "max": 0.51, "min": -0.52,
                          "offset": -128, "scale": 0.00406}]},
}
V1 = {
    "version": "1.0.0",
    "activation_encodings": [{"name": "/fc1/Gemm_output_0", "enc_type": "PER_TENSOR", "dtype": "INT", "bw": 16,
                              "is_sym": False, "scale": [6.05e-05], "offset": [-35799]}],
    "param_encodings": [{"name": "fc1.weight", "enc_type": "PER_CHANNEL", "dtype": "INT", "bw": 8, "is_sym": True,
                         "scale": [0.0041, 0.0038], "offset": [-128, -128]}],
    "quantizer_args": {"activation_bitwidth": 16},
    "excluded_layers": [],
}


def _real() -> EncodingSet:
    """The encodings the fixture QDQ model really uses (u16 activations, per-channel conv weight, int32 bias)."""
    return encodings_from_qdq_model(MODEL)


def test_legacy_read() -> None:
    e = parse_encodings(LEGACY)
    a, w = e.activations["/conv1/Conv_output_0"], e.params["conv1.weight"]
    assert e.format == "legacy" and not a.symmetric and a.offsets == (0,) and a.zero_point == (0,)
    assert w.symmetric and w.offsets == (-128,) and w.zero_point == (128,) and not w.signed
    assert (w.min, w.max) == ((-0.52,), (0.51,))


def test_legacy_converter_rules() -> None:
    d = {"param_encodings": {"w": [{"bitwidth": 8, "is_symmetric": "True", "scale": 0.1, "offset": 0}]},
         "activation_encodings": {"a": [{"bitwidth": 8, "is_symmetric": "false", "scale": 0.1, "offset": 5}]}}
    e = parse_encodings(d)
    assert e.params["w"].offsets == (-128,)  # symmetric offset 0 → -2^(bw-1)
    assert e.activations["a"].offsets == (-5,)  # offsets are forced negative


def test_v1_and_aimet2_read() -> None:
    e = parse_encodings(V1)
    assert e.format == "1.0.0" and e.params["fc1.weight"].per_channel and e.params["fc1.weight"].channels == 2
    assert e.activations["/fc1/Gemm_output_0"].zero_point == (35799,)
    a2 = parse_encodings({"version": "2.0.0", "activation_encodings": [
        {"name": "x", "output_dtype": "uint8", "y_scale": 0.02, "y_zero_point": 128},
        {"name": "h", "output_dtype": "float16"}],
        "param_encodings": [{"name": "w", "output_dtype": "int8", "y_scale": [0.1, 0.2], "y_zero_point": [0, 0], "axis": 0},
                            {"name": "b", "output_dtype": "int4", "y_scale": [0.1], "block_size": 32}]})
    assert a2.activations["x"].offsets == (-128,) and a2.activations["x"].symmetric
    assert a2.activations["h"].is_float and a2.activations["h"].bitwidth == 16
    w = a2.params["w"]
    assert w.signed and w.symmetric and w.axis == 0 and w.offsets == (-128, -128)
    assert a2.dropped == [("b", "block encodings are not supported")]


def test_round_trip_legacy_v1_ort_preserves_every_real_encoding() -> None:
    real = _real()
    ort_ready = EncodingSet(activations=real.activations,
                            params={k: v for k, v in real.params.items() if v.bitwidth <= 16})
    assert len(ort_ready) == 24 and len(real) == 26  # the two int32 biases have no ORT override form
    legacy = parse_encodings(json.loads(json.dumps(to_legacy(ort_ready))))
    assert legacy.params["conv1.weight"].axis is None  # legacy / 1.0.0 files carry no axis ...
    v1 = parse_encodings(json.loads(json.dumps(to_v1(legacy)))).infer_axes(FLOAT_MODEL)  # ... the model gives it
    ort_np = from_ort_overrides(to_ort_overrides(v1), model=FLOAT_MODEL)
    ort_js = from_ort_overrides(json.loads(json.dumps(to_ort_overrides(ort_np, json_safe=True))), model=FLOAT_MODEL)
    back = parse_encodings(json.loads(json.dumps(to_legacy(ort_js))))
    for step in (legacy, v1, ort_np, ort_js, back):
        assert step.equivalent(ort_ready, check_axis=False), step.format
    # exact on every number: scales (float32 values survive JSON), QNN offsets, bitwidths, symmetry
    for name, e in ort_ready.items():
        b = back.get(name)
        assert b.scale == e.scale and b.offsets == e.offsets and b.bitwidth == e.bitwidth
        assert b.symmetric == e.symmetric
    assert to_legacy(back) == to_legacy(legacy)
    # the per-channel axis survives through ORT; legacy / 1.0.0 have no axis field (inferred from the model)
    assert ort_np.params["conv1.weight"].axis == 0
    assert read_encodings(_write(legacy, "legacy"), model=FLOAT_MODEL).params["conv1.weight"].axis == 0


_tmp_counter = [0]


def _write(e: EncodingSet, fmt: str) -> Path:
    import tempfile

    _tmp_counter[0] += 1
    p = Path(tempfile.mkdtemp()) / f"e{_tmp_counter[0]}.json"
    return write_encodings(e, p, fmt)


def test_ort_overrides_reproduce_the_quantization_exactly(tmp_path: Path) -> None:
    """Feed the real encodings as init_overrides to ORT's QNN quantizer: the new QDQ model has the same
    scales and zero points, tensor by tensor."""
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    real = _real()
    over = to_ort_overrides(real, skip_unsupported=True)  # int32 biases are derived by ORT
    feeds = np.load(FIX / "reference.npz", allow_pickle=False)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"input.1": feeds["feeds|0|input.1"], "text.embeds": feeds["feeds|0|text.embeds"]}])

        def get_next(self):  # type: ignore[no-untyped-def]
            return next(self.it, None)

    cfg = get_qnn_qdq_config(str(FLOAT_MODEL), Reader(), activation_type=QuantType.QUInt16,
                             weight_type=QuantType.QUInt8, per_channel=True, init_overrides=over)
    out = tmp_path / "requant.onnx"
    quantize(str(FLOAT_MODEL), str(out), cfg)
    again = encodings_from_qdq_model(out)
    assert again.equivalent(real), [n for n, e in real.items() if not e.equivalent(again.get(n) or e)]
    assert again.activations["/attn/Softmax_output_0"].scale == real.activations["/attn/Softmax_output_0"].scale


@pytest.mark.parametrize("fmt", ["legacy", "1.0.0"])
def test_quantize_cli_applies_qnn_overrides_files_exactly(tmp_path: Path, fmt: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``ivq quantize --overrides`` with the real encodings written as a QNN legacy / 1.0.0 file (32-bit bias
    encodings included, as AIMET writes them): accepted, and the new QDQ model has the same scales and zero
    points tensor by tensor (per-channel axes inferred from the model; biases left to ORT, noted)."""
    from ivq_debug.cli.main import main

    real = _real()
    ov = tmp_path / f"overrides.{fmt}.json"
    write_encodings(real, ov, fmt)
    assert any(e.bitwidth == 32 for _, e in real.items())
    feeds = np.load(FIX / "reference.npz", allow_pickle=False)
    np.savez(tmp_path / "calib.npz", **{"input.1": feeds["feeds|0|input.1"], "text.embeds": feeds["feeds|0|text.embeds"]})
    out = tmp_path / "requant.onnx"
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(FLOAT_MODEL), "-o", str(out), "--calibration", str(tmp_path / "calib.npz"),
              "--preset", "a16w8", "--per-channel", "--overrides", str(ov)])
    err = capsys.readouterr().err
    assert e.value.code == 0, err
    assert "ORT derives bias quantization" in err
    again = encodings_from_qdq_model(out)
    assert again.equivalent(real), [n for n, x in real.items() if not x.equivalent(again.get(n) or x)]


def test_write_is_atomic_and_refuses_to_overwrite(tmp_path: Path) -> None:
    p = tmp_path / "o.encodings"
    e = parse_encodings(LEGACY)
    write_encodings(e, p)
    with pytest.raises(UsageError, match="output exists"):
        write_encodings(e, p, "1.0.0")
    write_encodings(e, p, "1.0.0", overwrite=True)
    assert json.loads(p.read_text())["version"] == "1.0.0"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["o.encodings"]
    write_encodings(e, tmp_path / "o.ort.json", "ort")
    assert read_encodings(tmp_path / "o.ort.json").format == "ort"


def test_float_and_signedness() -> None:
    f = parse_encodings({"activation_encodings": {"h": [{"bitwidth": 16, "dtype": "float"}]}})
    assert to_v1(f)["activation_encodings"][0] == {"name": "h", "enc_type": "PER_TENSOR", "dtype": "FLOAT", "bw": 16,
                                                   "is_sym": True}
    assert parse_encodings(to_v1(f)).equivalent(f)
    with pytest.raises(UsageError, match="float precision"):
        to_ort_overrides(f)
    assert to_ort_overrides(f, skip_unsupported=True) == {}
    s8 = Encoding(8, symmetric=True, scale=(0.1,), zero_point=(0,), signed=True)
    u8 = Encoding(8, symmetric=True, scale=(0.1,), zero_point=(128,), signed=False)
    assert s8.equivalent(u8) and s8.offsets == u8.offsets == (-128,)
    o = to_ort_overrides({"w": u8}, json_safe=True)["w"][0]
    assert o == {"quant_type": "QInt8", "scale": 0.1, "zero_point": 0}  # ORT / QNN EP convention for symmetric
    n = to_ort_overrides({"w": replace(u8, scale=(0.1,))})["w"][0]
    assert n["scale"].dtype == np.float32 and n["zero_point"].dtype == np.int8  # what ORT's quantizer wants


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"activation_encodings": {"a": [{"bitwidth": 7, "scale": 0.1, "offset": 0}]}}, "impossible bitwidth 7"),
        ({"activation_encodings": {"a": [{"bitwidth": 8, "dtype": "float"}]}}, "impossible bitwidth 8 for dtype float"),
        ({"param_encodings": {"w": [{"bitwidth": 8, "is_symmetric": "False", "scale": 0.1, "offset": -3},
                                    {"bitwidth": 8, "is_symmetric": "False", "scale": 0.2, "offset": -3}]}},
         "per-channel encoding is not symmetric"),
        ({"version": "1.0.0", "param_encodings": [{"name": "w", "enc_type": "PER_CHANNEL", "dtype": "INT", "bw": 8,
                                                   "is_sym": False, "scale": [0.1, 0.2], "offset": [0, 0]}]},
         "PER_CHANNEL encoding is not symmetric"),
        ({"activation_encodings": {"a": [{"bitwidth": 8, "is_symmetric": "True", "scale": 0.1, "offset": -5}]}},
         "symmetric encoding with QNN offset -5"),
        ({"activation_encodings": {"a": [{"bitwidth": 8, "scale": -0.1, "offset": 0}]}}, "not a positive finite"),
        ({"activation_encodings": {"a": [{"scale": 0.1, "offset": 0}]}}, "missing 'bitwidth'"),
        ({"activation_encodings": {"a": [{"bitwidth": 8, "is_symmetric": "yes", "scale": 0.1, "offset": 0}]}},
         "is_symmetric: must be 'True' or 'False'"),
        ({"activation_encodings": {"a": {"bitwidth": 8}}}, "non-empty list"),
        ({"activation_encodings": {"a": [{"bitwidth": 8}]}}, "needs 'scale'+'offset' or 'min'+'max'"),
        ({"activation_encodings": {"a": [{"bitwidth": 8, "scale": 0.1, "offset": -300}]}}, "below -(2^8-1)"),
        ([1, 2], "must be a JSON object"),
        ({"foo": 1}, "not an encodings file"),
    ],
)
def test_validation_errors_are_one_line_naming_the_file(tmp_path: Path, doc: object, needle: str) -> None:
    p = tmp_path / "bad.encodings"
    p.write_text(json.dumps(doc))
    with pytest.raises(InputError) as ei:
        read_encodings(p)
    msg = one_line(ei.value)
    assert msg.startswith(str(p)) and needle in msg, msg


def test_unknown_tensor_names_against_a_model(tmp_path: Path) -> None:
    p = tmp_path / "o.json"
    d = json.loads(json.dumps(LEGACY))
    assert len(read_encodings(_dump(p, d), model=FLOAT_MODEL)) == 2  # both names are model tensors
    d["activation_encodings"]["/nope/Add_output_0"] = d["activation_encodings"]["/conv1/Conv_output_0"]
    with pytest.raises(InputError) as ei:
        read_encodings(_dump(p, d), model=FLOAT_MODEL)
    msg = one_line(ei.value)
    assert msg == f"{p}: 1 tensor name(s) not in the model: '/nope/Add_output_0'"
    ok = {"activation_encodings": {"_relu_Relu_output_0": d["activation_encodings"]["/conv1/Conv_output_0"]}}
    p.write_text(json.dumps(ok))
    with pytest.raises(InputError, match="'_relu_Relu_output_0'"):
        read_encodings(p, model=FLOAT_MODEL)
    assert len(read_encodings(p, model=FLOAT_MODEL, allow_sanitized=True)) == 1


def _dump(p: Path, d: object) -> Path:
    p.write_text(json.dumps(d))
    return p


def test_bad_json_file(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text('{"activation_encodings": {')
    with pytest.raises(InputError, match="bad JSON at line 1"):
        read_encodings(p)
    with pytest.raises(InputError, match="no such encodings file"):
        read_encodings(tmp_path / "none.json")


def test_qdq_model_encodings_match_its_initializers() -> None:
    real = _real()
    w = real.params["conv1.weight"]
    assert w.per_channel and w.axis == 0 and w.channels == 8 and w.symmetric and w.bitwidth == 8
    a = real.activations["/attn/Softmax_output_0"]
    assert a.bitwidth == 16 and a.zero_point == (0,) and not a.signed
    assert set(real.activations) >= {"input.1", "logits", "/mlp/act/Gelu_output_0"}
    assert real.params["conv1.bias"].bitwidth == 32 and real.params["conv1.bias"].signed
    assert onnx.load(MODEL).graph.node  # model readable


def test_encodings_of_an_external_data_model_from_any_folder(tmp_path: Path, monkeypatch) -> None:
    """Scales and zero points stored as external data are read from the model's folder, whatever the working
    directory (``ivq calib-stats --encodings`` on a model with a ``.data`` file used to fail outside its folder)."""
    ext = tmp_path / "m" / "ext.onnx"
    ext.parent.mkdir()
    onnx.save(onnx.load(str(MODEL)), str(ext), save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.onnx.data", size_threshold=0)
    monkeypatch.chdir(tmp_path)
    got, want = encodings_from_qdq_model(ext), _real()
    assert got.activations == want.activations and got.params == want.params and len(want.activations) > 10
