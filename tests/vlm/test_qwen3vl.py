"""qwen3vl-tiny: DeepStack really runs, interleaved M-RoPE, the positions rule and the Qwen3-VL fault knobs."""

from __future__ import annotations

import numpy as np
import pytest

from ivq_debug.errors import UsageError
from ivq_debug.vlm import task
from ivq_debug.vlm.build import DEFAULT_BUCKET, QWEN3VL_DEEPSTACK_INDEXES, prefill_len
from ivq_debug.vlm.inputs import mrope_frequency_axes
from ivq_debug.vlm.scheduler import DeepStackPolicy, Scheduler

NAME = "qwen3vl-tiny"


def _image_rows(bucket: int) -> np.ndarray:
    from ivq_debug.vlm.build import num_image_tokens

    return np.asarray(task.prompt_ids(num_image_tokens(bucket))) == task.VOCAB[task.IMAGE]


def test_deepstack_taps_lie_inside_the_tiny_vision_tower(loaded):
    cfg = loaded(NAME).model.config
    vc = cfg.vision_config
    assert list(vc.deepstack_visual_indexes) == list(QWEN3VL_DEEPSTACK_INDEXES)
    assert max(vc.deepstack_visual_indexes) < vc.depth  # a full-size [8, 16, 24] would never fire at depth 3
    assert len(vc.deepstack_visual_indexes) < cfg.text_config.num_hidden_layers  # every add precedes the last layer
    assert len(loaded(NAME).model.model.visual.deepstack_merger_list) == len(vc.deepstack_visual_indexes)


def test_deepstack_injection_changes_llm_hidden_states_at_image_tokens(loaded):
    """Through HF's own forward: the input of LLM layer k+1 is layer k's output plus DeepStack feature k,
    exactly at the image-token rows (text rows untouched)."""
    import torch

    from ivq_debug.vlm.inputs import hf_inputs

    model = loaded(NAME).model
    s = task.eval_set(DEFAULT_BUCKET, 1)[0]
    inputs = hf_inputs("qwen3vl", s.image, DEFAULT_BUCKET)
    layers = model.model.language_model.layers
    outs: dict[int, torch.Tensor] = {}
    ins: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o.detach().clone()))
             for i, layer in enumerate(layers)]
    hooks += [layer.register_forward_pre_hook(lambda m, a, kw, i=i: ins.__setitem__(i, kw["hidden_states"]
                                                                                     if "hidden_states" in kw else a[0]),
                                              with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(**inputs)
            vis = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    finally:
        for h in hooks:
            h.remove()
    rows = _image_rows(DEFAULT_BUCKET)
    for k, feat in enumerate(vis.deepstack_features):
        jump = (ins[k + 1] - outs[k])[0].numpy()
        assert np.abs(jump[~rows]).max() == 0.0  # text rows: nothing added
        np.testing.assert_allclose(jump[rows], feat[0].numpy(), atol=1e-5)  # image rows: feature k
        rel = np.linalg.norm(jump[rows]) / np.linalg.norm(outs[k][0].numpy()[rows])
        assert rel > 0.05, (k, rel)  # a real change of the residual stream, not a rounding-size one


def test_interleaved_mrope_layout_is_what_transformers_computes(loaded):
    import torch

    from ivq_debug.vlm.parts import mrope_axes_of, rope_layout

    model = loaded(NAME).model
    rp = model.config.text_config.rope_parameters
    assert rp["mrope_section"] == [3, 3, 2] and rp["mrope_interleaved"] is True
    rot = model.model.language_model.rotary_emb
    F = sum(rp["mrope_section"])
    probe = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, F).clone()  # row r holds r
    got = rot.recomposition_frequencies(probe.clone())[0, 0, :F].long().numpy()
    assert got.tolist() == mrope_frequency_axes([3, 3, 2], "interleaved").tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert np.array_equal(mrope_axes_of(model), got)
    with rope_layout(model, "sectioned"):
        sec = rot.recomposition_frequencies(probe.clone())[0, 0, :F].long().numpy()
    assert sec.tolist() == mrope_axes_of(model, "sectioned").tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert np.array_equal(rot.recomposition_frequencies(probe.clone())[0, 0, :F].long().numpy(), got)  # restored
    # text tokens (t = h = w) rotate identically under both layouts; image tokens do not
    x = torch.zeros(1, 1, 16)
    text_pos = torch.tensor([5, 9]).view(1, 1, 2).expand(3, 1, 2)
    image_pos = torch.tensor([[[2, 2]], [[2, 3]], [[4, 5]]])
    with torch.no_grad():
        for pos, same in ((text_pos, True), (image_pos, False)):
            cos_i, _ = rot(x, pos)
            with rope_layout(model, "sectioned"):
                cos_s, _ = rot(x, pos)
            assert torch.equal(cos_i, cos_s) is same
    with pytest.raises(UsageError, match="cannot be applied"):
        with rope_layout(loaded("qwen2vl-tiny").model, "interleaved"):
            pass


def test_decode_positions_are_cache_position_plus_rope_delta(loaded, exported):
    """The model's own rule: the rope delta HF generate computes, decode position = cache position + delta."""
    from ivq_debug.vlm.torch_generate import hf_generate

    model = loaded(NAME).model
    sched = Scheduler.from_export(exported(NAME).folder, DEFAULT_BUCKET)
    s = task.eval_set(DEFAULT_BUCKET, 1)[0]
    hf_generate(model, s.image, DEFAULT_BUCKET)
    S = prefill_len(DEFAULT_BUCKET)
    assert sched.spec.rope_delta == int(model.model.rope_deltas.item()) == 8 - S
    g = sched.generate(s.image, forced_tokens=task.caption_ids(s.caption))
    for k in range(1, len(g.tokens)):
        assert g.position_ids[k] == [g.cache_len[k] + sched.spec.rope_delta] * 3


def test_split_export_carries_deepstack_and_the_sectioned_variant(exported):
    """Vision returns the DeepStack features, prefill adds them after layers 0 and 1, decode has none;
    the sectioned variant is exported and verified like the deployment graphs."""
    import onnx

    from ivq_debug.vlm.build import num_image_tokens
    from ivq_debug.vlm.export import DEEPSTACK_ADD_NODE, DEEPSTACK_ADD_ROLE
    from ivq_debug.vlm.manifest import load_manifest

    from .conftest import TEST_BUCKETS

    res = exported(NAME)
    m = load_manifest(res.folder)
    assert (m["deepstack"], m["mrope_layout"], m["variants"]) == (2, "interleaved", ["mrope_sectioned"])
    assert {(c.part, c.bucket) for c in res.checks if c.part == "prefill"} == {("prefill", b) for b in TEST_BUCKETS}
    assert all(c.worst <= 1e-5 for c in res.checks)
    for b in TEST_BUCKETS:
        N, S = num_image_tokens(b), prefill_len(b)
        vision = next(p for p in res.parts if p.part == "vision" and p.bucket == b)
        assert vision.outputs == {"image_features": [1, N, 64], "deepstack_features.0": [1, N, 64],
                                  "deepstack_features.1": [1, N, 64]}
        for variant in (None, "mrope_sectioned"):
            part = next(p for p in res.parts if p.part == "prefill" and p.bucket == b and p.variant == variant)
            assert list(part.inputs)[3:] == ["deepstack_embeds.0", "deepstack_embeds.1"]
            assert part.inputs["deepstack_embeds.1"] == [1, S, 64] and part.check.ok
            g = onnx.load(part.path).graph
            nodes = {n.name: n for n in g.node}
            for k in range(2):
                node = nodes[DEEPSTACK_ADD_NODE.format(k=k)]
                meta = {q.key: q.value for q in node.metadata_props}
                assert meta == {"ivq.role": DEEPSTACK_ADD_ROLE, "ivq.deepstack": str(k), "ivq.after_layer": str(k)}
                # it reads layer k's residual output and feeds layer k + 1
                assert f"/language_model/layers.{k}/Add_1_output_0" in node.input
                assert any(node.output[0] in n.input and n.name.startswith(f"/language_model/layers.{k + 1}/")
                           for n in g.node)
    decode = next(p for p in res.parts if p.part == "decode")
    assert not any(name.startswith("deepstack") for name in decode.inputs)
    # the interleaved M-RoPE's shape arithmetic folds away (one folding pass left a Shape -> Concat piece that
    # QNN HTP rejects with "zero graph inputs")
    for part in res.parts:
        ops = {n.op_type for n in onnx.load(part.path).graph.node}
        assert not ops & {"Shape", "ConstantOfShape"}, (part.part, part.bucket, part.variant)
    assert res.path("prefill", 56, "mrope_sectioned").name == "prefill_b56.mrope_sectioned.onnx"


def _kv(outs: dict, layer: int, kind: str = "key") -> np.ndarray:
    return outs[f"present.{layer}.{kind}"][0]  # [H_kv, S, d]


def test_fault_knobs_change_the_prefill_where_they_should(exported):
    """Each Qwen3-VL knob perturbs exactly what it should in the prefill KV cache (ORT, one image)."""
    folder = exported(NAME).folder
    s = task.eval_set(DEFAULT_BUCKET, 1)[0]
    rows = _image_rows(DEFAULT_BUCKET)
    runs = {}
    for label, knobs in {"clean": {}, "dropped": {"deepstack": "dropped"},
                         "before_layer": {"deepstack": "before_layer"},
                         "sectioned": {"mrope_layout": "sectioned"}}.items():
        sched = Scheduler.from_export(folder, DEFAULT_BUCKET, **knobs)
        feats = sched.runners["vision"].run(sched.vision_feeds(s.image))
        deep = [feats[f"deepstack_features.{k}"] for k in range(sched.spec.deepstack)]
        runs[label] = sched.runners["prefill"].run(sched.prefill_feeds(feats["image_features"], deep))
    clean = runs["clean"]
    # dropped: layer 0 sees nothing of DeepStack (it is added after it); every later layer differs
    assert np.array_equal(_kv(runs["dropped"], 0), _kv(clean, 0))
    assert np.abs(_kv(runs["dropped"], 1) - _kv(clean, 1)).max() > 0.1
    # one layer early: feature 0 already enters layer 0, at the image rows only
    d0 = np.abs(_kv(runs["before_layer"], 0) - _kv(clean, 0)).max(axis=(0, 2))
    assert d0[~rows].max() == 0.0 and d0[rows].min() > 1e-3
    # sectioned M-RoPE: layer-0 keys change at image rows only; values (no RoPE) not at all
    dk = np.abs(_kv(runs["sectioned"], 0) - _kv(clean, 0)).max(axis=(0, 2))
    assert dk[~rows].max() <= 1e-6 and dk[rows].max() > 1e-2
    assert np.abs(_kv(runs["sectioned"], 0, "value") - _kv(clean, 0, "value")).max() <= 1e-6


def test_knobs_are_recorded_and_validated(exported, tmp_path):
    from ivq_debug.dump import DumpWriter, open_dump

    folder = exported(NAME).folder
    sched = Scheduler.from_export(folder, 56, deepstack="dropped", mrope_layout="sectioned")
    with DumpWriter(tmp_path / "d.h5", backend=sched.backend) as w:
        sched.generate(task.eval_set(56, 1)[0].image, writer=w, max_new_tokens=2)
    d = open_dump(tmp_path / "d.h5")
    for key, rid in d.record_keys().items():
        meta = d.record_meta(rid)
        assert (meta["deepstack_policy"], meta["mrope_layout"], meta["positions_policy"]) == (
            "dropped", "sectioned", "correct"), key
    ds1 = d.read("deepstack_embeds.1", d.record_keys()[(0, "prefill", 0)], kind="input")
    assert ds1.shape == (1, prefill_len(56), 64) and not ds1.any()  # dropped: zeros fed
    assert sched.runners["prefill"].model_path.name == "prefill_b56.mrope_sectioned.onnx"
    with pytest.raises(UsageError, match="DeepStack models"):
        Scheduler.from_export(exported("qwen2vl-tiny").folder, 56, deepstack="dropped")
    with pytest.raises(UsageError, match="does not apply"):
        Scheduler.from_export(exported("qwen2vl-tiny").folder, 56, mrope_layout="interleaved")
    with pytest.raises(UsageError):
        DeepStackPolicy("sideways")


def test_sectioned_knob_needs_the_variant_graphs(loaded, exported, tmp_path):
    import json
    import shutil

    from ivq_debug.vlm.export import export_parts
    from ivq_debug.vlm.manifest import MANIFEST

    plain = tmp_path / "plain"  # the same export without its variant graphs
    shutil.copytree(exported(NAME).folder, plain)
    m = json.loads((plain / MANIFEST).read_text())
    m["parts"] = [p for p in m["parts"] if not p.get("variant")]
    (plain / MANIFEST).write_text(json.dumps(m))
    Scheduler.from_export(plain, 56)  # the deployment graphs alone still schedule
    with pytest.raises(UsageError, match="mrope_sectioned"):
        Scheduler.from_export(plain, 56, mrope_layout="sectioned")
    with pytest.raises(UsageError, match="interleaved"):
        export_parts(loaded("qwen2vl-tiny").model, tmp_path / "q2", buckets=[56], variants=("mrope_sectioned",))


def test_ort_knobs_equal_the_torch_knobs(loaded, exported):
    """The fault graphs/feeds on ORT compute what the torch wrappers compute under the same knob."""
    from ivq_debug.vlm.torch_generate import torch_generate

    model = loaded(NAME).model
    s = task.eval_set(56, 2)[1]
    forced = task.caption_ids(s.caption)
    for knobs in ({"deepstack": "before_layer"}, {"mrope_layout": "sectioned"}):
        go = Scheduler.from_export(exported(NAME).folder, 56, **knobs).generate(s.image, forced_tokens=forced)
        gt = torch_generate(model, s.image, 56, forced_tokens=forced, **knobs)
        assert go.tokens == gt.tokens and np.abs(go.logits - gt.logits).max() <= 1e-4, knobs


#: caption exact match on 16 eval images of bucket 112 must fall at least this far below the clean path
KNOB_CAPTION_DROP = 0.2


@pytest.fixture(scope="module")
def clean_captions(exported):
    """Caption accuracy of the clean ORT path on the knob test images."""
    from ivq_debug.vlm.scheduler import evaluate

    return evaluate(Scheduler.from_export(exported(NAME).folder, DEFAULT_BUCKET), task.eval_set(DEFAULT_BUCKET, 16))


@pytest.mark.parametrize(
    "knobs",
    [{"deepstack": "dropped"}, {"deepstack": "before_layer"}, {"mrope_layout": "sectioned"},
     {"positions": "mrope_text_len"}],
    ids=lambda k: "=".join(*k.items()),
)
def test_each_knob_changes_the_captions(knobs, exported, clean_captions):
    from ivq_debug.vlm.scheduler import evaluate

    bad = evaluate(Scheduler.from_export(exported(NAME).folder, DEFAULT_BUCKET, **knobs),
                   task.eval_set(DEFAULT_BUCKET, 16))
    assert clean_captions.exact_match == 1.0
    assert bad.exact_match <= clean_captions.exact_match - KNOB_CAPTION_DROP, bad.as_dict()
