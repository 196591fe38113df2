"""The ORT scheduler against HF generate, the positions policy, teacher forcing and step-aware dumps."""

from __future__ import annotations

import numpy as np
import pytest

from ivq_debug.errors import UsageError
from ivq_debug.vlm import task
from ivq_debug.vlm.build import DEFAULT_BUCKET, prefill_len
from ivq_debug.vlm.scheduler import NEXT_LOGITS, PositionsPolicy, Scheduler

from .conftest import MODELS, TEST_BUCKETS

N_SAMPLES = 6


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("bucket", [b if b == DEFAULT_BUCKET else pytest.param(b, marks=pytest.mark.slow)  # 56: slow
                                    for b in TEST_BUCKETS])
def test_ort_scheduler_equals_hf_generate(name, bucket, loaded, exported):
    from ivq_debug.vlm.torch_generate import hf_generate

    model = loaded(name).model
    sched = Scheduler.from_export(exported(name).folder, bucket)
    worst = 0.0
    preds, refs = [], []
    for s in task.eval_set(bucket, N_SAMPLES):
        g = sched.generate(s.image)
        h = hf_generate(model, s.image, bucket)
        assert g.tokens == h.tokens, (s.caption, g.tokens, h.tokens)
        assert g.logits.shape == h.logits.shape
        worst = max(worst, float(np.abs(g.logits - h.logits).max()))
        preds.append(g.text)
        refs.append(s.caption)
    assert worst <= 1e-4, worst
    assert task.caption_accuracy(preds, refs).exact_match >= 0.8


def _forced(sample):
    return task.caption_ids(sample.caption)


@pytest.mark.parametrize(
    ("name", "mode"),
    [("internvl-tiny", "correct"), ("internvl-tiny", "restart"), ("qwen2vl-tiny", "correct"),
     ("qwen2vl-tiny", "restart"), ("qwen2vl-tiny", "mrope_text_len"), ("qwen3vl-tiny", "correct"),
     ("qwen3vl-tiny", "mrope_text_len")],
)
def test_positions_policy_values(name, mode, exported):
    sched = Scheduler.from_export(exported(name).folder, DEFAULT_BUCKET, positions=mode)
    s = task.eval_set(DEFAULT_BUCKET, 1)[0]
    forced = _forced(s)
    g = sched.generate(s.image, forced_tokens=forced)
    S = prefill_len(DEFAULT_BUCKET)
    assert S == 20
    steps = len(g.tokens)
    assert steps == len(forced)
    prefill = np.asarray(sched.spec.prefill_positions)
    assert g.position_ids[0] == prefill.reshape(-1).tolist()
    if name == "internvl-tiny":
        assert prefill.reshape(-1).tolist() == list(range(S))
    else:
        # M-RoPE from get_rope_index: text 0,1; image grid 4x4 at 2..5 (h, w); then 6, 7
        assert prefill.shape == (3, 1, S) and int(prefill.max()) == 7
        assert prefill[:, 0, :2].tolist() == [[0, 1]] * 3 and prefill[:, 0, -2:].tolist() == [[6, 7]] * 3
        assert prefill[1, 0, 2:18].tolist() == [2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5]
        assert prefill[2, 0, 2:18].tolist() == [2, 3, 4, 5] * 4
    for k in range(1, steps):
        expect = {  # both Qwen families: cache position S + k - 1 plus the rope delta 8 - S
            ("internvl-tiny", "correct"): S + k - 1,
            ("internvl-tiny", "restart"): k - 1,
            ("qwen2vl-tiny", "correct"): 7 + k,
            ("qwen2vl-tiny", "restart"): k - 1,
            ("qwen2vl-tiny", "mrope_text_len"): S + k - 1,
            ("qwen3vl-tiny", "correct"): 7 + k,
            ("qwen3vl-tiny", "mrope_text_len"): S + k - 1,
        }[(name, mode)]
        rows = 1 if name == "internvl-tiny" else 3
        assert g.position_ids[k] == [expect] * rows, (k, g.position_ids[k])
        assert g.cache_len[k] == S + k - 1


@pytest.mark.parametrize("name", MODELS)
def test_fault_knob_changes_logits_from_step_1(name, exported):
    mode = "restart" if name == "internvl-tiny" else "mrope_text_len"
    folder = exported(name).folder
    s = task.eval_set(DEFAULT_BUCKET, 1)[0]
    forced = _forced(s)
    good = Scheduler.from_export(folder, DEFAULT_BUCKET).generate(s.image, forced_tokens=forced)
    bad = Scheduler.from_export(folder, DEFAULT_BUCKET, positions=mode).generate(s.image, forced_tokens=forced)
    d = np.abs(good.logits - bad.logits).max(axis=1)
    assert d[0] == 0.0  # the prefill is identical
    assert d[1:].max() > 0.1  # plausible-but-wrong logits from step 1 on
    assert good.fed == bad.fed == forced


def test_mrope_knob_rejected_for_1d_rope(exported):
    with pytest.raises(UsageError, match="M-RoPE"):
        Scheduler.from_export(exported("internvl-tiny").folder, DEFAULT_BUCKET, positions="mrope_text_len")
    with pytest.raises(UsageError):
        PositionsPolicy("sideways")


def test_teacher_forcing_feeds_given_tokens_and_records_argmax(exported, tmp_path):
    from ivq_debug.dump import DumpWriter, open_dump

    sched = Scheduler.from_export(exported("internvl-tiny").folder, DEFAULT_BUCKET)
    s = task.eval_set(DEFAULT_BUCKET, 1)[0]
    wrong = task.caption_ids("yellow triangle below green circle")
    free = sched.generate(s.image)
    with DumpWriter(tmp_path / "tf.h5", backend=sched.backend) as w:
        g = sched.generate(s.image, writer=w, forced_tokens=wrong)
    assert g.forced and g.fed == wrong and len(g.tokens) == len(wrong)
    assert g.tokens[0] == free.tokens[0]  # step 0 sees the same prompt
    assert g.tokens != wrong  # the model disagrees with the forced caption, and we record that
    d = open_dump(tmp_path / "tf.h5")
    keys = d.record_keys()
    for k in range(len(wrong)):
        part = "prefill" if k == 0 else "decode"
        meta = d.record_meta(keys[(0, part, k)])
        assert meta["token"] == g.tokens[k] and meta["forced_token"] == wrong[k]
        if k:
            assert meta["input_ids"] == [wrong[k - 1]]
        assert np.array_equal(d.read(NEXT_LOGITS, keys[(0, part, k)]), g.logits[k])


@pytest.mark.parametrize("name", MODELS)
def test_dump_records_fault_positions(name, exported, tmp_path):
    from ivq_debug.dump import DumpWriter, open_dump

    mode = "restart" if name == "internvl-tiny" else "mrope_text_len"
    sched = Scheduler.from_export(exported(name).folder, DEFAULT_BUCKET, positions=mode)
    s = task.eval_set(DEFAULT_BUCKET, 1)[0]
    with DumpWriter(tmp_path / "d.h5", backend=sched.backend) as w:
        g = sched.generate(s.image, sample=3, writer=w)
    d = open_dump(tmp_path / "d.h5")
    keys = d.record_keys()
    assert (3, "vision", 0) in keys and (3, "prefill", 0) in keys
    n_dec = len(g.tokens) - 1
    assert [k for k in keys if k[1] == "decode"] == [(3, "decode", k) for k in range(1, n_dec + 1)]
    S, C = prefill_len(DEFAULT_BUCKET), sched.spec.max_cache
    for k in range(1, n_dec + 1):
        rid = keys[(3, "decode", k)]
        meta = d.record_meta(rid)
        expect = k - 1 if mode == "restart" else S + k - 1
        rows = 1 if name == "internvl-tiny" else 3
        assert meta["position_ids"] == [expect] * rows
        assert meta["positions_policy"] == mode
        assert meta["cache_len"] == S + k - 1
        assert meta["token"] == g.tokens[k]
        assert sum(meta["attention_mask"]) == S + k and len(meta["attention_mask"]) == C + 1
        pos_in = d.read("position_ids", rid, kind="input")
        assert pos_in.reshape(-1).tolist() == [expect] * rows
        mask_in = d.read("attention_mask", rid, kind="input")
        assert mask_in.shape == (1, 1, 1, C + 1) and mask_in.min() == -1e4 and mask_in.max() == 0.0
        assert int(d.read("cache_len", rid, kind="input")) == S + k - 1
        assert d.read("logits", rid).shape == (1, 1, task.VOCAB_SIZE)


@pytest.mark.parametrize("name", MODELS)
def test_torch_and_ort_dumps_align_record_by_record(name, loaded, exported, tmp_path):
    from ivq_debug.dump import DumpWriter, open_dump
    from ivq_debug.vlm.torch_generate import torch_generate

    model = loaded(name).model
    sched = Scheduler.from_export(exported(name).folder, DEFAULT_BUCKET)
    s = task.eval_set(DEFAULT_BUCKET, 2)[1]
    with DumpWriter(tmp_path / "ort.h5", backend=sched.backend) as w:
        go = sched.generate(s.image, writer=w)
    with DumpWriter(tmp_path / "torch.h5", backend="torch") as w:
        gt = torch_generate(model, s.image, DEFAULT_BUCKET, writer=w)
    assert go.tokens == gt.tokens
    do, dt = open_dump(tmp_path / "ort.h5"), open_dump(tmp_path / "torch.h5")
    assert do.record_keys().keys() == dt.record_keys().keys()
    for key, rid in do.record_keys().items():
        mo, mt = do.record_meta(rid), dt.record_meta(dt.record_keys()[key])
        for field in ("input_ids", "position_ids", "cache_len", "token", "attention_mask"):
            assert mo.get(field) == mt.get(field), (key, field)
        if key[1] != "vision":
            a = do.read(NEXT_LOGITS, rid)
            b = dt.read(NEXT_LOGITS, dt.record_keys()[key])
            assert np.abs(a - b).max() <= 1e-4
        out = "image_features" if key[1] == "vision" else "present.1.value"
        assert np.abs(do.read(out, rid) - dt.read(out, dt.record_keys()[key])).max() <= 1e-4


def test_runner_factory_drives_every_part(exported):
    from ivq_debug.capture.onnxrt.runner import OrtRunner

    calls: list[str] = []

    class CountingRunner(OrtRunner):
        def __init__(self, part, path):
            super().__init__(path)
            self.part = part

        def run(self, feeds, writer=None):
            calls.append(self.part)
            return super().run(feeds, writer)

    sched = Scheduler.from_export(exported("qwen2vl-tiny").folder, 56, runner_factory=CountingRunner)
    g = sched.generate(task.eval_set(56, 1)[0].image)
    assert calls == ["vision", "prefill"] + ["decode"] * (len(g.tokens) - 1)


def test_per_layer_capture_through_the_scheduler(loaded, exported, tmp_path):
    """Runners capture intermediates into the step records: ONNX names on ORT, HF paths on torch."""
    from ivq_debug.capture.base import Selection, runner_factory
    from ivq_debug.capture.torch.hooks import default_selection
    from ivq_debug.dump import DumpWriter, open_dump
    from ivq_debug.vlm.export import MASK_ADD_OUTPUT
    from ivq_debug.vlm.torch_generate import torch_generate

    name = "internvl-tiny"
    s = task.eval_set(56, 1)[0]
    sched = Scheduler.from_export(exported(name).folder, 56, runner_factory=runner_factory("onnx", selection=Selection()))
    with DumpWriter(tmp_path / "ort.h5", backend=sched.backend) as w:
        go = sched.generate(s.image, writer=w, max_new_tokens=3)
    with DumpWriter(tmp_path / "torch.h5", backend="torch") as w:
        gt = torch_generate(loaded(name).model, s.image, 56, writer=w, max_new_tokens=3, selection=default_selection())
    assert go.tokens == gt.tokens and len(go.tokens) == 3
    do, dt = open_dump(tmp_path / "ort.h5"), open_dump(tmp_path / "torch.h5")
    for key in [(0, "prefill", 0), (0, "decode", 2)]:
        ort_names = {e.name for e in do.tensors(key)}
        torch_names = {e.name for e in dt.tensors(key)}
        assert MASK_ADD_OUTPUT.format(layer=1) in ort_names
        assert "model.language_model.layers.1.self_attn.q_proj" in torch_names
        q_ort = do.read("/language_model/layers.1/self_attn/q_proj/Add_output_0", key)
        q_torch = dt.read("model.language_model.layers.1.self_attn.q_proj", key)
        assert np.abs(q_ort - q_torch).max() <= 1e-4
    vis = {e.name for e in dt.tensors((0, "vision", 0))}
    assert "model.multi_modal_projector.linear_2" in vis


def test_collect_feeds_for_calibration(exported):
    import onnx

    from ivq_debug.vlm.scheduler import collect_feeds

    sched = Scheduler.from_export(exported("qwen2vl-tiny").folder, 56)
    samples = task.eval_set(56, 2)
    feeds = collect_feeds(sched, samples, forced=True)
    assert len(feeds["vision"]) == len(feeds["prefill"]) == 2
    assert len(feeds["decode"]) == sum(len(task.caption_ids(s.caption)) - 1 for s in samples)
    for part, path in sched.spec.part_paths.items():
        names = [i.name for i in onnx.load(str(path)).graph.input]
        assert all(list(f) == names for f in feeds[part])
    # the recorded KV cache is real: later decode steps see more valid slots
    valid = [int((f["attention_mask"] == 0).sum()) for f in feeds["decode"]]
    assert valid[0] == 8 + 1 and max(valid) > valid[0]
    assert sched.runners["decode"].__class__.__name__ == "OrtRunner"  # wrappers removed afterwards
