"""The shipped reference checkpoints: loading, learned captions, user folders, errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ivq_debug.errors import InputError
from ivq_debug.vlm import task
from ivq_debug.vlm.build import BUCKETS, family_of_reference, param_count
from ivq_debug.vlm.load import REFERENCE_DIR, load_vlm

from .conftest import MODELS

#: the bar the shipped checkpoints must clear on every bucket's fixed eval set (HF greedy)
MIN_EXACT_MATCH = 0.95


@pytest.mark.parametrize("name", MODELS)
def test_shipped_checkpoint_files_are_small_and_complete(name):
    folder = REFERENCE_DIR / name
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "ivq_reference.json", "generation_config.json"} <= files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)  # no pickles
    total = sum(p.stat().st_size for p in folder.iterdir())
    assert total < 3_000_000, total


#: the demo's model is evaluated in the default run; the other two shipped checkpoints (~15-20 s each) in the slow set
@pytest.mark.parametrize("name", [n if n == "internvl-tiny" else pytest.param(n, marks=pytest.mark.slow) for n in MODELS])
def test_shipped_checkpoints_caption_accurately(name, loaded):
    from ivq_debug.vlm.train import evaluate_model

    lv = loaded(name)
    assert lv.family == family_of_reference(name).name
    assert lv.model.config._attn_implementation == "eager"
    assert 100_000 < param_count(lv.model) < 1_000_000
    acc, margin = evaluate_model(lv.model, BUCKETS)
    for b, a in acc.items():
        assert a.exact_match >= MIN_EXACT_MATCH, (b, a.as_dict(), a.failures[:5])
        assert a.colour >= 0.95 and a.position >= 0.95
    assert margin > 1e-3  # robust argmax: ORT's ~1e-6 error cannot flip a token
    # the figures stored beside the checkpoint are the ones we measure
    stored = lv.meta["training"]["accuracy"]
    for b, a in acc.items():
        assert stored[str(b)]["exact_match"] == pytest.approx(a.exact_match)


@pytest.mark.parametrize("name", MODELS)
def test_reference_metadata(name, loaded):
    lv = loaded(name)
    meta = lv.meta
    assert meta["schema"] == "ivq-reference/1" and meta["family"] == lv.family
    assert meta["buckets"] == list(BUCKETS) and lv.buckets == list(BUCKETS)
    assert meta["vocab"] == task.VOCAB
    assert meta["mask_value"] == -1e4
    assert lv.tokenizer is not None and lv.tokenizer.convert_tokens_to_ids("red") == task.VOCAB["red"]


def test_user_checkpoint_folder_runs_through_the_same_path(tmp_path, loaded):
    """A copy saved with save_pretrained (plain folder, no ivq metadata) loads, exports and schedules."""
    from ivq_debug.vlm import pipeline
    from ivq_debug.vlm.torch_generate import hf_generate

    user = tmp_path / "my-model"
    loaded("qwen2vl-tiny").model.save_pretrained(user)
    task.save_tokenizer(user)
    lv = load_vlm(user)
    assert lv.path == user and lv.meta == {} and lv.family == "qwen2vl"
    ref = loaded("qwen2vl-tiny").model.state_dict()
    for k, v in lv.model.state_dict().items():
        assert np.array_equal(v.numpy(), ref[k].numpy()), k
    prep = pipeline.prepare(user, tmp_path / "work", bucket=84, n_samples=3)
    assert prep.export.ok and set(prep.paths) == {"vision", "prefill", "decode"}
    sched = pipeline.scheduler(prep)
    for s in prep.samples:
        assert sched.generate(s.image).tokens == hf_generate(lv.model, s.image).tokens
    acc = pipeline.evaluate(sched, prep.samples)
    assert acc.n == 3 and acc.exact_match >= 2 / 3

    # a copy of a shipped folder loads by path as well
    copy = tmp_path / "copy"
    shutil.copytree(REFERENCE_DIR / "internvl-tiny", copy)
    assert load_vlm(copy).meta["family"] == "internvl"


def test_load_errors_name_the_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(InputError, match="does not exist") as e:
        load_vlm(missing)
    assert e.value.path == str(missing) and e.value.exit_code == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match=r"no config\.json") as e:
        load_vlm(empty)
    assert str(empty) in str(e.value)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(InputError, match="not a supported VLM") as e:
        load_vlm(bert)
    assert e.value.path == str(bert)
    broken = tmp_path / "broken"
    shutil.copytree(REFERENCE_DIR / "internvl-tiny", broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InputError, match="cannot load") as e:
        load_vlm(broken)
    assert e.value.path == str(broken)
    with pytest.raises(InputError, match="unknown reference"):
        from ivq_debug.vlm.load import reference_path

        reference_path("llava-huge")
