"""Split export: verification against torch (both exporters), graph conventions, static shapes."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from ivq_debug.errors import InputError, UsageError
from ivq_debug.vlm.build import BUCKETS, DEFAULT_BUCKET, MAX_CACHE, num_image_tokens, prefill_len
from ivq_debug.vlm.export import MASK_ADD_NODE, MASK_ADD_OUTPUT, MASK_ADD_ROLE, export_parts
from ivq_debug.vlm.manifest import load_manifest

from .conftest import MODELS, TEST_BUCKETS


@pytest.mark.parametrize("name", MODELS)
def test_legacy_export_verifies_fp32(name, exported):
    res = exported(name)
    assert res.exporter == "legacy" and res.opset >= 17
    parts = {(c.part, c.bucket) for c in res.checks}
    assert parts == {("vision", b) for b in TEST_BUCKETS} | {("prefill", b) for b in TEST_BUCKETS} | {("decode", None)}
    for c in res.checks:
        assert c.ok and c.worst <= 1e-5, (c.part, c.bucket, c.max_abs)
        assert set(c.max_abs) >= {"image_features"} if c.part == "vision" else {"logits", "present.0.key"}
    df = res.checks_frame()
    assert len(df) == sum(len(c.max_abs) for c in res.checks) and df["ok"].all()


@pytest.mark.parametrize(  # the dynamo export of the demo's model in the default run, the other two slow (~25 s each)
    "name", [n if n == "internvl-tiny" else pytest.param(n, marks=pytest.mark.slow) for n in MODELS]
)
def test_dynamo_export_verifies_fp32(name, loaded, tmp_path):
    res = export_parts(loaded(name).model, tmp_path, buckets=[DEFAULT_BUCKET], exporter="dynamo")
    assert len(res.checks) == 3
    for c in res.checks:
        assert c.ok and c.worst <= 1e-5, (c.part, c.max_abs)
    import onnx

    # dynamo keeps module provenance in node metadata
    g = onnx.load(str(res.path("prefill", DEFAULT_BUCKET))).graph
    scopes = [p.value for n in g.node for p in n.metadata_props if p.key == "pkg.torch.onnx.name_scopes"]
    assert any("model.language_model.layers.0.self_attn" in s for s in scopes)
    _check_conventions(res, name)


@pytest.mark.parametrize("name", MODELS)
def test_graph_conventions_legacy(name, exported):
    _check_conventions(exported(name), name)


def _check_conventions(res, name):
    import onnx

    m = load_manifest(res.folder)
    L = m["num_layers"]
    for p in res.parts:
        model = onnx.load(p.path)
        g = model.graph
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
        ops = collections.Counter(n.op_type for n in g.node)
        assert "Erf" not in ops and "CumSum" not in ops, ops
        for v in [*g.input, *g.output]:  # static shapes everywhere
            dims = v.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") and d.dim_value > 0 for d in dims), (p.path, v.name)
        casts_to_int32 = [n for n in g.node if n.op_type == "Cast" and any(a.i == 6 for a in n.attribute)]
        assert not casts_to_int32
        if p.part == "vision":
            assert ops["Gelu"] >= 1  # GELU as the op (QNN HTP), not an Erf chain
            n_img = num_image_tokens(p.bucket)
            assert p.outputs["image_features"] == [1, n_img, m["hidden_size"]]
            continue
        # explicit mask + scores Add per layer, stable names, finite additive float mask input
        ins = {i.name: i for i in g.input}
        assert ins["attention_mask"].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert ins["position_ids"].type.tensor_type.elem_type == onnx.TensorProto.INT64
        adds = {n.name: n for n in g.node if n.op_type == "Add"}
        for i in range(L):
            node = adds[MASK_ADD_NODE.format(layer=i)]
            assert node.output[0] == MASK_ADD_OUTPUT.format(layer=i)
            assert "attention_mask" in node.input
            meta = {q.key: q.value for q in node.metadata_props}
            assert meta["ivq.role"] == MASK_ADD_ROLE and meta["ivq.layer"] == str(i)
        if p.part == "prefill":
            S = prefill_len(p.bucket)
            assert p.inputs["attention_mask"] == [1, 1, S, S]
            assert p.inputs["position_ids"] == ([1, S] if "internvl" in name else [3, 1, S])
        else:
            assert p.inputs["attention_mask"] == [1, 1, 1, MAX_CACHE + 1]
            assert p.inputs["past.0.key"][2] == MAX_CACHE and p.outputs["present.0.key"][2] == 1


def test_legacy_scopes_map_to_hf_module_paths(exported, loaded):
    import onnx

    res = exported("internvl-tiny")
    modules = {n for n, _ in loaded("internvl-tiny").model.named_modules()}
    vis = onnx.load(str(res.path("vision", DEFAULT_BUCKET))).graph
    names = [n.name for n in vis.node]
    assert "/vision_tower/encoder/layer.0/attention/q_proj/MatMul" in names
    assert "/multi_modal_projector/linear_1/MatMul" in names
    pre = onnx.load(str(res.path("prefill", DEFAULT_BUCKET))).graph
    for n in pre.node:
        scope = ".".join(n.name.split("/")[1:-1])
        if scope:
            assert any(mod.endswith(scope) for mod in modules), n.name


def test_manifest_and_embedding(exported, loaded):
    res = exported("qwen2vl-tiny")
    m = load_manifest(res.folder)
    assert m["buckets"] == list(TEST_BUCKETS) and m["max_cache"] == MAX_CACHE and m["mask_value"] == -1e4
    emb = np.load(res.folder / m["embedding"], allow_pickle=False)
    assert np.array_equal(emb, loaded("qwen2vl-tiny").model.get_input_embeddings().weight.detach().numpy())
    assert len(m["prompt_ids"]["56"]) == prefill_len(56) == 8
    assert np.asarray(m["prefill_position_ids"]["112"]).shape == (3, 1, 20)


def test_bucket_geometry():
    assert BUCKETS == (56, 84, 112)
    assert [num_image_tokens(b) for b in BUCKETS] == [4, 9, 16]
    assert [prefill_len(b) for b in BUCKETS] == [8, 13, 20]
    assert max(prefill_len(b) for b in BUCKETS) + 8 - 1 <= MAX_CACHE


def test_export_errors(loaded, tmp_path):
    model = loaded("internvl-tiny").model
    with pytest.raises(UsageError):
        export_parts(model, tmp_path, exporter="tflite")
    with pytest.raises(UsageError):
        export_parts(model, tmp_path, opset=13)
    with pytest.raises(InputError):
        load_manifest(tmp_path / "nothing")
