"""HF-style split export with a dynamic KV cache: ORT vs torch, growing whole-cache outputs, HF generate."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ivq_debug.errors import InputError, UsageError
from ivq_debug.vlm import task
from ivq_debug.vlm.export_dynamic import SCHEMA, export_dynamic_parts, load_dynamic_manifest
from ivq_debug.vlm.scheduler_dynamic import DynamicScheduler

from .conftest import MODELS


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("fault", ["correct", "restart"], ids=["positions", "no-positions"])
def test_dynamic_export_verifies_fp32(name, fault, session_parts):
    res = session_parts(name, "dynamic", fault)
    m = load_dynamic_manifest(res.folder)
    assert {c.part for c in res.checks} == {"vision", "prefill", "decode"}
    assert (m["num_layers"], m["deepstack"]) == ((3, 2) if name == "qwen3vl-tiny" else (2, 0))
    vision = {"image_features", *[f"deepstack_features.{k}" for k in range(m["deepstack"])]}
    llm = {"logits", *[f"present.{i}.{kind}" for i in range(m["num_layers"]) for kind in ("key", "value")]}
    for c in res.checks:
        assert c.ok and c.worst <= 1e-5, (c.part, c.max_abs)
        assert set(c.max_abs) == (vision if c.part == "vision" else llm)
    assert m["schema"] == SCHEMA and m["cache"] == "dynamic" and m["decode_position_input"] is (fault == "correct")
    assert (res.folder / m["config"]).is_file() and (res.folder / m["embedding"]).is_file()


@pytest.mark.parametrize("name", MODELS)
def test_decode_cache_is_an_input_and_present_holds_the_whole_growing_cache(name, session_parts):
    res = session_parts(name, "dynamic", "correct")
    dec = onnx.load(str(res.path("decode"))).graph
    ins = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in dec.input}
    outs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in dec.output}
    assert ins["past_key_values.0.key"] == [1, 2, "past_sequence_length", 16]
    assert ins["attention_mask"] == [1, "total_sequence_length"]
    assert outs["present.0.key"] == [1, 2, "total_sequence_length", 16] and outs["logits"] == [1, 1, 32]
    assert {i.type.tensor_type.elem_type for i in dec.input if i.name in ("attention_mask", "position_ids")} == {
        onnx.TensorProto.INT64}
    # run it: the present cache is the past plus one slot, the past slots unchanged
    sess = ort.InferenceSession(str(res.path("decode")), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for P in (5, 21):
        feeds = {"inputs_embeds": rng.standard_normal((1, 1, 64), np.float32),
                 "attention_mask": np.ones((1, P + 1), np.int64),
                 "position_ids": np.full((1, 1) if "intern" in name else (3, 1, 1), P, np.int64)}
        feeds |= {n: rng.standard_normal((1, 2, P, 16), np.float32) for n in ins if n.startswith("past_key_values")}
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
        assert got["present.1.value"].shape == (1, 2, P + 1, 16)
        assert np.array_equal(got["present.0.key"][:, :, :P], feeds["past_key_values.0.key"])


def test_no_position_variant_has_no_position_input(session_parts):
    res = session_parts("internvl-tiny", "dynamic", "restart")
    names = [i.name for i in onnx.load(str(res.path("decode"))).graph.input]
    assert "position_ids" not in names and names[:2] == ["inputs_embeds", "attention_mask"]
    assert load_dynamic_manifest(res.folder)["decode_position_offset"] == -20


@pytest.mark.parametrize("name", MODELS)
def test_dynamic_scheduler_equals_hf_generate(name, session_parts):
    from ivq_debug.vlm.load import load_vlm
    from ivq_debug.vlm.torch_generate import hf_generate

    model = load_vlm(name).model
    sched = DynamicScheduler.from_export(session_parts(name, "dynamic").folder)
    for s in task.eval_set(112, 3):
        g, h = sched.generate(s.image), hf_generate(model, s.image)
        assert g.tokens == h.tokens and g.cache_len[1:] == list(range(20, 20 + len(g.tokens) - 1))
        assert float(np.abs(g.logits - h.logits).max()) <= 1e-4


def test_dynamic_prefill_takes_the_deepstack_inputs_and_the_knob_applies(session_parts):
    """Qwen3-VL: the dynamic prefill has the DeepStack inputs; dropping them changes the prefill logits."""
    res = session_parts("qwen3vl-tiny", "dynamic")
    names = [i.name for i in onnx.load(str(res.path("prefill"))).graph.input]
    assert names == ["inputs_embeds", "attention_mask", "position_ids", "deepstack_embeds.0", "deepstack_embeds.1"]
    image = task.eval_set(112, 1)[0].image
    clean = DynamicScheduler.from_export(res.folder).generate(image, max_new_tokens=1)
    dropped = DynamicScheduler.from_export(res.folder, deepstack="dropped").generate(image, max_new_tokens=1)
    assert float(np.abs(clean.logits - dropped.logits).max()) > 0.1


def test_dynamic_export_errors(session_parts, tmp_path):
    from ivq_debug.vlm.load import load_vlm

    res = session_parts("internvl-tiny", "dynamic")
    with pytest.raises(UsageError, match="already exists"):
        export_dynamic_parts(load_vlm("internvl-tiny").model, res.folder)
    with pytest.raises(UsageError, match="exporter"):
        export_dynamic_parts(load_vlm("internvl-tiny").model, tmp_path, exporter="tflite")
    with pytest.raises(InputError, match="unknown export schema"):
        load_dynamic_manifest(session_parts("internvl-tiny", "fixed").folder)
    with pytest.raises(UsageError, match="needs a decode graph with a position_ids"):
        DynamicScheduler.from_export(session_parts("internvl-tiny", "dynamic", "restart").folder, positions="restart")


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_dynamic_export_with_dynamo(name, tmp_path):
    """torch.export + onnxscript with ``dynamic_shapes`` (about 30 s per model on 2 cores)."""
    from ivq_debug.vlm.load import load_vlm
    from ivq_debug.vlm.torch_generate import hf_generate

    model = load_vlm(name).model
    res = export_dynamic_parts(model, tmp_path, exporter="dynamo")
    assert all(c.ok for c in res.checks) and len(res.checks) == 3, [(c.part, c.max_abs) for c in res.checks]
    assert res.parts[-1].inputs["past_key_values.0.key"] == [1, 2, "past_sequence_length", 16]
    s = task.eval_set(112, 1)[0]
    assert DynamicScheduler.from_export(tmp_path).generate(s.image).tokens == hf_generate(model, s.image).tokens
