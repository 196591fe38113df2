"""Model intake on a model as third-party exporters write it (tests/support/thirdparty_models.py): Constant-node
weights, metadata, opset 12, a dynamic width axis; real ORT quantizer, real ORT sessions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ivq_debug.errors import EXIT_RUN, CheckError, UsageError
from ivq_debug.metrics import compute
from ivq_debug.onnxgraph import intake
from ivq_debug.qnn.quantize import quantize_for_qnn
from ivq_debug.tune.suggest import Suggestion, write_suggestions
from tests.support.cli import ivq_cli
from tests.support.thirdparty_models import METADATA, build_textline, save_textline, textline_feeds


def _run(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("thirdparty")
    save_textline(d)
    return d


def test_constants_become_initializers_with_bit_identical_outputs() -> None:
    m = build_textline()
    before = _run(m, textline_feeds(0, 1)[0])
    moved = intake.constants_to_initializers(m)
    assert len(moved) == 15 and "conv2.w" in moved and "head.b" in moved
    assert not [n for n in m.graph.node if n.op_type == "Constant"]
    onnx.checker.check_model(m)
    assert np.array_equal(_run(m, textline_feeds(0, 1)[0]), before)


def test_a16w8_holds_after_intake_and_metadata_is_restored(folder: Path, tmp_path: Path) -> None:
    r = quantize_for_qnn(folder / "textline.onnx", tmp_path / "q.onnx", textline_feeds(1, 4), preset="a16w8")
    eff = r.effective
    assert eff["mismatches"] == []
    assert eff["counts"]["weight"] == {"uint8": 7}  # 2 convs + 5 MatMuls: the preset's 8-bit weights
    assert eff["counts"]["bias"] == {"int32": 2} and set(eff["counts"]["activation"]) == {"uint16"}
    assert r.intake["metadata"] == sorted(METADATA) and len(r.intake["constants_to_initializers"]) == 15
    q = onnx.load(str(tmp_path / "q.onnx"))
    props = {p.key: p.value for p in q.metadata_props}
    assert {k: props[k] for k in METADATA} == METADATA  # restored verbatim (qnn_preprocess_model raised on them)
    stored = intake.read_quantization_metadata(q)
    by_name = {t["tensor"]: t for t in stored["tensors"]}
    assert by_name["conv2.w"]["role"] == "weight" and by_name["conv2.w"]["dtype"] == "uint8"
    assert by_name["attn.probs"]["dtype"] == "uint16" and stored["requested"]["weight"] == "uint8"


def test_constant_weights_without_intake_show_the_preset_did_not_hold(folder: Path, tmp_path: Path) -> None:
    """What ORT's quantizer does with Constant-node weights: 'a16w8' is really a16w16, and it is visible."""
    r = quantize_for_qnn(folder / "textline.onnx", tmp_path / "q.onnx", textline_feeds(1, 4), preset="a16w8",
                         constants_to_initializers=False)
    eff = r.effective
    assert eff["counts"]["weight"] == {"uint16": 7}
    assert any("7 weight(s) are uint16, not uint8" in m for m in eff["mismatches"])
    assert any("quantized at run time as activations" in m for m in eff["mismatches"])


def test_per_channel_on_opset_12_is_upgraded_and_valid(folder: Path, tmp_path: Path) -> None:
    cal, test = textline_feeds(1, 8), textline_feeds(2, 4)
    pt = quantize_for_qnn(folder / "textline.onnx", tmp_path / "pt.onnx", cal, preset="a8w8")
    pc = quantize_for_qnn(folder / "textline.onnx", tmp_path / "pc.onnx", cal, preset="a8w8", per_channel=True)
    assert pc.intake["opset_from"] == 12 and pc.opset["ai.onnx"] == 13
    assert pc.effective["per_channel_weights"] == 2 and pc.effective["mismatches"] == []
    tensors = {t["tensor"]: t for t in intake.read_quantization_metadata(onnx.load(str(pc.model_path)))["tensors"]}
    assert tensors["conv2.w"]["per_channel"] and tensors["conv2.w"]["axis"] == 0
    # the model written per-channel runs on ORT CPU, as close to float as per-tensor (measured: 33.8 dB both)
    ref = np.concatenate([_run(build_textline(), f) for f in test])
    s_pt = compute(ref, np.concatenate([_run(pt.model_path, f) for f in test]))["sqnr_db"]
    s_pc = compute(ref, np.concatenate([_run(pc.model_path, f) for f in test]))["sqnr_db"]
    print(f"logits SQNR a8w8 per-tensor {s_pt:.1f} dB, per-channel {s_pc:.1f} dB")
    assert s_pc > 30 and abs(s_pc - s_pt) < 1, (s_pt, s_pc)


def test_a_per_channel_override_on_opset_12_is_upgraded_like_per_channel(folder: Path, tmp_path: Path) -> None:
    """One weight per channel through an overrides file (the tuner's per-channel lever on a unit): ORT writes its
    bias's DequantizeLinear per channel too, which opset 12 cannot say; the model was invalid ("Unrecognized
    attribute: axis for operator DequantizeLinear", PP-OCRv4's ``conv2d_180.b_0``) before the intake upgraded it."""
    ov, _ = write_suggestions([Suggestion("conv2.w", "w_per_channel", "test", axis=0)], tmp_path / "ov.json",
                              float_model=folder / "textline.onnx")
    assert ivq_cli("quantize", folder / "textline.onnx", "--calibration", _cal_folder(tmp_path), "--overrides", ov,
                   "-o", tmp_path / "q.onnx") == 0
    q = onnx.load(str(tmp_path / "q.onnx"))
    assert intake.opset_of(q) == 13
    tensors = {t["tensor"]: t for t in intake.read_quantization_metadata(q)["tensors"]}
    assert tensors["conv2.w"]["per_channel"] and not tensors["conv1.w"]["per_channel"]


def _cal_folder(tmp_path: Path) -> Path:
    d = tmp_path / "cal"
    d.mkdir()
    for i, f in enumerate(textline_feeds(1, 4)):
        np.savez(d / f"{i}.npz", **f)
    return d


def test_check_refuses_what_checker_or_ort_refuses(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    inits = [numpy_helper.from_array(np.ones((4, 4), np.uint8), "w"), numpy_helper.from_array(np.ones(4, np.float32), "s"),
             numpy_helper.from_array(np.zeros(4, np.uint8), "z")]
    nodes = [helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wd"], axis=0),
             helper.make_node("MatMul", ["x", "wd"], ["y"])]
    for opset, ok in ((12, False), (13, True)):  # per-channel DequantizeLinear needs opset 13
        p = tmp_path / f"pc{opset}.onnx"
        onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                                    opset_imports=[helper.make_opsetid("", opset)]), str(p))
        if ok:
            intake.check_written_model(p)
        else:
            with pytest.raises(CheckError, match=r"onnx\.checker: Unrecognized attribute: axis") as ei:
                intake.check_written_model(p)
            assert ei.value.exit_code == EXIT_RUN and str(p) in str(ei.value)
    p = tmp_path / "unknown_op.onnx"  # onnx.checker passes an unknown domain; ORT does not load it
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], domain="com.example")],
                                                  "g", [x], [y]),
                                opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.example", 1)]),
              str(p))
    with pytest.raises(CheckError, match="does not load in ONNX Runtime"):
        intake.check_written_model(p)


def test_dynamic_dims_fixed_from_samples_or_named_in_the_error() -> None:
    m = build_textline()
    assert intake.input_shapes(m, textline_feeds(0, 2, 40)) == {"x": (1, 3, 8, 40)}
    mixed = textline_feeds(0, 1, 32) + textline_feeds(0, 1, 48)
    assert intake.input_shapes(m, mixed) == {}  # a backend with dynamic shapes keeps the axis open
    with pytest.raises(UsageError) as ei:
        intake.input_shapes(m, mixed, required=True, flag="--inputs")
    msg = ei.value.one_line()
    assert "input 'x' axis 3 ('width') is dynamic" in msg and "[1, 3, 8, 32], [1, 3, 8, 48]" in msg
    assert "--inputs" in msg
    lines = intake.fix_input_dims(m, {"x": (1, 3, 8, 40)})
    assert lines == ["input 'x' axis 3 ('width') = 40 from the inputs"]
    assert [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim] == [1, 40, 10]  # same dim_param
    with pytest.raises(UsageError, match="axis 2 is 9, the model expects 8"):
        intake.fix_input_dims(build_textline(), {"x": (1, 3, 9, 40)})


def test_append_metadata_extends_the_file_without_reserializing(tmp_path: Path) -> None:
    p = tmp_path / "m.onnx"
    onnx.save(build_textline(metadata={"a": "1"}), str(p))
    size = p.stat().st_size
    assert intake.append_metadata(p, {"a": "x", "b": "2"}, existing=["a"]) == ["b"]
    m = onnx.load(str(p))
    assert {q.key: q.value for q in m.metadata_props} == {"a": "1", "b": "2"} and p.stat().st_size < size + 16
    onnx.checker.check_model(m)


def test_weights_in_place_intake_copy_beside_the_model_is_removed(tmp_path: Path, monkeypatch) -> None:
    """A large model is loaded with its weights referenced in the file (external data relative to its folder): the
    intake copy must live beside it while the quantizer runs, and nothing may remain there afterwards."""
    from ivq_debug.onnxgraph import load

    m = build_textline()
    intake.constants_to_initializers(m)  # initializers > 4 KiB (conv2.w) become in-place references
    src = tmp_path / "model" / "m.onnx"
    src.parent.mkdir()
    onnx.save(m, str(src))
    monkeypatch.setattr(load, "IN_PLACE_MIN_BYTES", 0)  # what a >= 64 MB file gets
    assert load.has_external_data(load.load_model(src))
    r = quantize_for_qnn(src, tmp_path / "q.onnx", textline_feeds(1, 2))
    assert sorted(p.name for p in src.parent.iterdir()) == ["m.onnx"]
    assert r.intake["metadata"] == sorted(METADATA) and r.effective["mismatches"] == []
    assert np.isfinite(_run(r.model_path, textline_feeds(2, 1)[0])).all()
