"""Ingest of qnn-net-run output folders: recovers the direct QNN EP capture exactly; clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.capture.qnn_net_run.outputs import ingest_output
from ivq_debug.dump.quant import dequantize
from ivq_debug.errors import InputError
from ivq_debug.qnn.netjson import read_net_json
from tests.support.qnn_fixtures import FIX, MODEL, MULTI, SINGLE, one_line


def test_single_graph_recovers_the_direct_capture(ref, sites) -> None:  # type: ignore[no-untyped-def]
    ing = ingest_output(SINGLE / "output", SINGLE / "model_net.json", model=MODEL)
    assert ing.complete and ing.results == {"model": [0, 1]} and len(ing.tensors) == 34
    assert [p.kind for p in ing.problems] == ["duplicate", "duplicate"]  # float graph outputs vs their Q outputs
    n_exact = 0
    for _g, i, tensors in ing.records():
        assert len(tensors) == 17
        for t in tensors:
            q = ref[("single", i, t.onnx_name)]  # the uint16 integers the session returned
            d = t.read()
            assert d.raw is not None and d.raw.dtype == np.uint16 and np.array_equal(d.raw, q)
            expect = dequantize(q, sites[t.onnx_name].encoding)  # ONNX DequantizeLinear of the model's params
            assert d.values.dtype == np.float32 and d.values.shape == q.shape
            assert np.array_equal(d.values.view(np.uint32), expect.view(np.uint32))  # bit-exact
            assert d.max_mismatch == 0.0  # the .raw float file equals the dequantized _native.raw
            assert t.key == sites[t.onnx_name].name and t.order == sites[t.onnx_name].order
            n_exact += 1
    assert n_exact == 34
    conv = next(t for t in ing.tensors if t.key == "/conv1/Conv_output_0" and t.result == 0)
    assert conv.layout == "NCHW" and conv.tensor.dims == (1, 4, 4, 8) and conv.read().values.shape == (1, 8, 4, 4)


def test_without_a_model_every_file_is_kept_under_its_qnn_name(ref) -> None:  # type: ignore[no-untyped-def]
    ing = ingest_output(SINGLE / "output", SINGLE / "model_net.json")
    assert ing.complete and not ing.problems and len(ing.tensors) == 38
    for i in (0, 1):
        v = ing.values("model", i)
        assert np.array_equal(v["logits"], ref[("single", i, "logits")])  # float output: exact
        assert np.array_equal(v["_conv1_Conv_output_0"], ref[("single", i, "/conv1/Conv_output_0")])  # NHWC → NCHW


def test_multi_graph_native_only_recovers_both_graphs(ref, sites) -> None:  # type: ignore[no-untyped-def]
    ing = ingest_output(MULTI / "output", [MULTI / "vision_net.json", MULTI / "text_net.json"], model=MODEL)
    assert ing.complete and ing.results == {"vision": [0, 1], "text": [0, 1]}
    n = 0
    for g, i, tensors in ing.records():
        for t in tensors:
            assert t.float_file is None and t.native_file is not None  # native_only: dequantized from integers
            q = ref[(g, i, t.onnx_name)]
            d = t.read()
            assert np.array_equal(d.raw, q)
            assert np.array_equal(d.values.view(np.uint32), dequantize(q, sites[t.onnx_name].encoding).view(np.uint32))
            n += 1
    assert n == 2 * (5 + 12)
    # the vision graph's last output is the text graph's input, bit for bit
    v = ing.values("vision", 1)["/tok/Transpose_output_0"]
    tt = next(t for t in ing.tensors if t.graph == "text" and t.result == 1 and t.key == "text.embeds")
    assert v.shape == (1, 16, 8) and tt.read().values.shape == (1, 16, 8)


def test_graph_folder_mapping_and_single_result_dir(tmp_path: Path) -> None:
    g = {"vision": read_net_json(MULTI / "vision_net.json"), "text": MULTI / "text_net.json"}
    assert ingest_output(MULTI / "output", g).complete
    one = ingest_output(SINGLE / "output" / "Result_1", SINGLE / "model_net.json")
    assert one.results == {"model": [1]} and len(one.tensors) == 19
    out = tmp_path / "out"
    shutil.copytree(MULTI / "output", out)
    (out / "vision").rename(out / "Graph_0")  # unnamed graphs are written as Graph_<idx>
    assert ingest_output(out, [MULTI / "vision_net.json", MULTI / "text_net.json"]).complete
    with pytest.raises(InputError, match="Result folders without a <graph>/ level, but 2 graphs"):
        ingest_output(SINGLE / "output", [MULTI / "vision_net.json", MULTI / "text_net.json"])


def test_recursive_walk_and_ort_named_graph(tmp_path: Path, ref) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    shutil.copytree(SINGLE / "output", out)
    r0 = out / "Result_0"
    (r0 / "_mlp").mkdir()  # SNPE-style sub folders: "_mlp/act_Gelu…" is "_mlp_act_Gelu…" once flattened
    (r0 / "_mlp_act_Gelu_output_0_QuantizeLinear_Output.raw").rename(r0 / "_mlp" / "act_Gelu_output_0_QuantizeLinear_Output.raw")
    ing = ingest_output(out, SINGLE / "model_net.json", model=MODEL)
    assert ing.complete and len(ing.tensors) == 34
    # the ORT dump keeps ONNX names (and NCHW dims): files with sanitized names still find their tensors
    ort = tmp_path / "ort"
    (ort / "Result_0").mkdir(parents=True)
    ref[("single", 0, "/attn/Softmax_output_0_QuantizeLinear_Output")].tofile(
        ort / "Result_0" / "_attn_Softmax_output_0_QuantizeLinear_Output_native.raw")
    ing = ingest_output(ort, FIX / "ort_dump_json_qnn_graph.json", model=MODEL, expect_outputs=False)
    (t,) = ing.tensors
    assert t.key == "/attn/Softmax_output_0" and t.read().values.shape == (1, 16, 16)


def _first_error(out: Path, **kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError) as ei:
        ingest_output(out, out.parent / "model_net.json", model=MODEL, **kw)
    assert ei.value.exit_code == 3
    return one_line(ei.value)


def test_missing_raw_file(single_copy: Path) -> None:
    f = single_copy / "output" / "Result_1" / "_attn_Softmax_output_0_QuantizeLinear_Output.raw"
    g = single_copy / "output" / "Result_1" / "_attn_Softmax_output_0_QuantizeLinear_Output_native.raw"
    f.unlink()
    g.unlink()
    msg = _first_error(single_copy / "output")
    assert msg == (f"{f}: missing raw file for tensor '_attn_Softmax_output_0_QuantizeLinear_Output' "
                   "(present in Result_0)")
    ing = ingest_output(single_copy / "output", single_copy / "model_net.json", model=MODEL, strict=False)
    assert not ing.complete and [p.kind for p in ing.fatal] == ["missing_file"]
    assert len(ing.tensors) == 33


def test_missing_graph_output_in_every_result(single_copy: Path) -> None:
    for r in (0, 1):
        (single_copy / "output" / f"Result_{r}" / "logits.raw").unlink()
    msg = _first_error(single_copy / "output")
    assert msg.endswith("Result_0/logits.raw: missing raw file for tensor 'logits' (a graph output)")


def test_wrong_byte_size(single_copy: Path) -> None:
    f = single_copy / "output" / "Result_0" / "input_1_QuantizeLinear_Output_native.raw"
    f.write_bytes(f.read_bytes()[:-2])
    msg = _first_error(single_copy / "output")
    assert msg == (f"{f}: wrong byte size 382, expected 384 ([1, 8, 8, 3] x uint16) "
                   "for tensor 'input_1_QuantizeLinear_Output'")


def test_unknown_tensor_name(single_copy: Path) -> None:
    f = single_copy / "output" / "Result_0" / "_not_a_tensor.raw"
    f.write_bytes(b"\0" * 8)
    msg = _first_error(single_copy / "output")
    assert msg.startswith(f"{f}: tensor '_not_a_tensor' is not in graph 'model'")


def test_float_native_disagreement_is_detected(single_copy: Path) -> None:
    f = single_copy / "output" / "Result_0" / "_mix_Add_output_0_QuantizeLinear_Output.raw"
    a = np.fromfile(f, "<f4")
    a[3] += 0.5
    a.tofile(f)
    ing = ingest_output(single_copy / "output", single_copy / "model_net.json", model=MODEL)
    t = next(t for t in ing.tensors if t.key == "/mix/Add_output_0" and t.result == 0)
    assert t.read().max_mismatch == pytest.approx(0.5, abs=1e-3)


def test_bad_folders(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such output folder"):
        ingest_output(tmp_path / "nope", SINGLE / "model_net.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no Result_<i> folders"):
        ingest_output(tmp_path / "empty", SINGLE / "model_net.json")


def test_native_file_without_usable_encoding(tmp_path: Path) -> None:
    """ORT's dump has no per-channel scales: a native-only file of such a tensor cannot be dequantized."""
    r0 = tmp_path / "out" / "Result_0"
    r0.mkdir(parents=True)
    f = r0 / "conv1_weight_quantized_native.raw"
    f.write_bytes(bytes(3 * 3 * 3 * 8))
    with pytest.raises(InputError) as ei:
        ingest_output(tmp_path / "out", FIX / "ort_dump_json_qnn_graph.json", expect_outputs=False)
    assert one_line(ei.value) == (f"{f}: cannot dequantize 'conv1.weight_quantized': the graph JSON has "
                                  "no per-channel parameters for it")
