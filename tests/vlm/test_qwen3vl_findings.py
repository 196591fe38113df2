"""Issue 13 acceptance: each Qwen3-VL fault knob, run for real (qwen3vl-tiny on ORT, teacher-forced on the clean
run's tokens) and compared from the ``ivq-diff`` command line, gives its finding at its location; the clean run
gives no error finding; a text-only prompt does not give ``mrope_layout``.

One export (the session's ``exported`` fixture) and one capture per knob (module-cached) at bucket 56: 8 prompt
tokens, image rows 2-5, 3 LLM layers, DeepStack features after layers 0 and 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.cli.common import run
from ivq_debug.cli.diff import _main as ivq_diff
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.vlm import task
from ivq_debug.vlm.build import num_image_tokens
from ivq_debug.vlm.manifest import model_attrs
from ivq_debug.vlm.pipeline import capture_run
from ivq_debug.vlm.scheduler import Scheduler

NAME = "qwen3vl-tiny"
BUCKET = 56
NEW_KINDS = ("deepstack_missing", "deepstack_misrouted", "mrope_layout", "position_id_offset")
KNOBS = {"clean": {}, "dropped": {"deepstack": "dropped"}, "before_layer": {"deepstack": "before_layer"},
         "sectioned": {"mrope_layout": "sectioned"}, "delta": {"positions": "mrope_text_len"}}
IMAGE_ROWS = [i for i, t in enumerate(task.prompt_ids(num_image_tokens(BUCKET))) if t == task.VOCAB[task.IMAGE]]


def _ort(part: str, path: Path):
    return make_runner("onnx", path, selection=Selection())


@pytest.fixture(scope="module")
def runs(exported, tmp_path_factory):
    """label -> ORT dump of one eval image under that knob, teacher-forced on the clean run's tokens (lazy)."""
    folder = exported(NAME).folder
    tmp = tmp_path_factory.mktemp("q3findings")
    image = task.eval_set(BUCKET, 1)[0].image
    forced = Scheduler.from_export(folder, BUCKET).generate(image).tokens
    cache: dict[str, Path] = {}

    def get(label: str) -> Path:
        if label not in cache:
            cache[label] = capture_run(folder, BUCKET, [image], tmp / f"{label}.h5", forced=[forced],
                                       **KNOBS[label])
        return cache[label]

    get.folder, get.image, get.forced, get.tmp = folder, image, forced, tmp
    return get


def _diff(ref: Path, test: Path, tmp: Path, *extra: str) -> tuple[int, list[dict]]:
    out = tmp / f"{ref.stem}-vs-{test.stem}.json"
    code = run("ivq-diff", ivq_diff, [str(ref), str(test), "--json", str(out), "--force", "-q", *extra])
    return code, json.loads(out.read_text())["findings"]


def _of(findings: list[dict], kind: str) -> list[dict]:
    return [f for f in findings if f["kind"] == kind]


def test_clean_run_has_no_error_finding(runs, loaded):
    """The torch split reference against the clean ORT run: nothing at error severity, none of the new kinds, no
    first divergence at all.

    ``model.visual`` returns a ModelOutput whose ``last_hidden_state`` *is* the last block's output, whose
    ``pooler_output`` *is* the merger's and whose ``deepstack_features`` *are* the DeepStack mergers' outputs. The
    capture keeps one copy of a tensor object per record: kept, these fields were aligned by scope with other
    same-shaped tensors of the subtree (``last_hidden_state`` with the merger's LayerNorm: a false
    ``first_divergence`` at 0.8 dB; ``deepstack_features`` with the main merger: a false ``projector_drift``)."""
    from ivq_debug.capture.torch.hooks import default_selection
    from ivq_debug.vlm.torch_generate import torch_scheduler

    ts = torch_scheduler(loaded(NAME).model, BUCKET, selection=default_selection())
    ref = capture(ts, [runs.image], runs.tmp / "torch.h5", model=model_attrs(runs.folder), progress=None,
                  record=lambda w, i, _: ts.generate(runs.image, sample=i, writer=w, forced_tokens=runs.forced))
    with open_dump(ref) as d:
        names = {e.name for e in d.entries}
    assert "model.visual.blocks.2" in names and "model.visual.merger.linear_fc2" in names
    assert not {n for n in names if n.startswith("model.visual.") and n.split(".")[2] in
                ("last_hidden_state", "pooler_output", "deepstack_features")}, names
    code, found = _diff(ref, runs("clean"), runs.tmp)
    assert code == 0 and not [f for f in found if f["severity"] == "error"], found
    assert not [f for f in found if f["kind"] == "first_divergence"], found
    with open_dump(runs("clean")) as d:  # the DeepStack inputs hold this backend's vision output: not a contract
        facts = d.record_meta(d.record_keys()[(0, "prefill", 0)])["inputs"]
    assert [facts[f"deepstack_embeds.{k}"]["role"] for k in range(2)] == ["carried", "carried"]
    assert not [f for f in found if f["kind"] in NEW_KINDS]
    code, found = _diff(runs("clean"), runs("clean"), runs.tmp)  # ORT against itself: the knob tests' reference
    assert code == 0 and not [f for f in found if f["kind"] in NEW_KINDS]


def test_deepstack_dropped_is_missing_after_layers_0_and_1(runs):
    page = runs.tmp / "dropped.html"
    code, found = _diff(runs("clean"), runs("dropped"), runs.tmp, "--report", str(page))
    assert code == 1
    missing = _of(found, "deepstack_missing")
    assert [(f["where"]["layer"], f["evidence"]["feature"]) for f in missing] == [(0, 0), (1, 1)]
    for f in missing:
        ev = f["evidence"]
        assert f["severity"] == "error" and f["where"]["record"] == {"sample": 0, "part": "prefill", "step": 0}
        assert f["where"]["positions"] == ev["positions"] == IMAGE_ROWS
        assert f["where"]["tensor"] == f"/language_model/DeepStackAdd_{ev['feature']}_output_0"
        assert ev["ref_jump"] > 0.3 and ev["test_jump"] == 0.0  # a real jump in the reference, none in the test
    assert not _of(found, "deepstack_misrouted") and not _of(found, "mrope_layout")
    assert not _of(found, "position_id_offset")
    # the report's heatmap: per boundary a reference / test / difference row, one cell per image row
    table = missing[0]["evidence"]["table"]
    assert table["rows"] == IMAGE_ROWS and all(v == 0.0 for b in ("1", "2") for v in table["test"][b])
    html = page.read_text()
    section = html[html.index('id="deepstack"'):]
    section = section[:section.index("</section>")]
    assert section.count("after layer 1 · reference jump") == 1 and section.count("<td title=") == 9 * len(IMAGE_ROWS)


def test_deepstack_before_layer_is_misrouted_one_layer_early(runs):
    code, found = _diff(runs("clean"), runs("before_layer"), runs.tmp)
    assert code == 1
    mis = _of(found, "deepstack_misrouted")
    # feature 0 belongs after layer 0 and came onto the input embeddings; feature 1 after layer 1, came after 0
    assert [(f["where"]["layer"], f["evidence"]["found_after_layer"]) for f in mis] == [(0, -1), (1, 0)]
    for f in mis:
        ev = f["evidence"]
        assert ev["error_by_boundary"][str(ev["found_at"])] < 1e-5  # the reference's jump, exactly, elsewhere
        assert ev["error_by_boundary"][str(ev["boundary"])] > 0.5  # and not where it belongs
        assert ev["positions"] == IMAGE_ROWS
    assert not _of(found, "deepstack_missing") and not _of(found, "mrope_layout")


def test_sectioned_mrope_is_named_at_the_image_tokens(runs):
    code, found = _diff(runs("clean"), runs("sectioned"), runs.tmp)
    assert code == 1
    (f,) = _of(found, "mrope_layout")
    ev = f["evidence"]
    assert (ev["layout"], ev["model_layout"], ev["layer"]) == ("sectioned", "interleaved", 0)
    assert f["where"]["record"] == {"sample": 0, "part": "prefill", "step": 0}
    assert f["where"]["tensor"] == "present.0.key"
    assert set(ev["positions"]) <= set(IMAGE_ROWS) and ev["first_position"] == ev["positions"][0]
    assert ev["residual"]["sectioned"] < 1e-5 and ev["residual"]["interleaved"] > 0.05
    assert abs(ev["shift"] - 1.0) < 1e-4  # all the way from the interleaved rotation to the sectioned one
    assert ev["residual_other_tokens"] < 1e-5  # text tokens: no layout tells them apart
    assert not _of(found, "deepstack_missing") and not _of(found, "deepstack_misrouted")


def _without_positions(src: Path, dst: Path) -> Path:
    """``src`` as a device that kept no ``position_ids`` (inputs and meta)."""
    with open_dump(src) as d, DumpWriter(dst, backend=d.backend, model=d.model, overwrite=True) as w:
        for (sample, part, step), rid in sorted(d.record_keys().items()):
            meta = {k: v for k, v in d.record_meta(rid).items() if k not in ("position_ids", "sample", "part", "step")}
            w.begin_record(sample=sample, part=part, step=step, **meta)
            for e in d.tensors(rid, kind="input"):
                if e.name != "position_ids":
                    w.add_input(e.name, d.read(e))
            for e in d.tensors(rid):
                w.add_tensor(e.name, d.read(e), op_type=e.op_type, order=e.order, scope=e.scope)
    return dst


def test_rope_delta_dropped_is_named_direct_and_from_the_keys(runs):
    sched = Scheduler.from_export(runs.folder, BUCKET)
    delta = sched.spec.rope_delta
    assert delta < 0
    code, found = _diff(runs("clean"), runs("delta"), runs.tmp)
    assert code == 1
    (f,) = _of(found, "position_id_offset")
    ev = f["evidence"]
    assert (ev["method"], ev["cause"], ev["offset"], ev["first_wrong_step"]) == ("direct", "rope_delta_dropped",
                                                                               -delta, 1)
    assert f["where"]["record"]["step"] == 1 and "rope delta is dropped" in f["message"]
    blind = _without_positions(runs("delta"), runs.tmp / "delta-blind.h5")
    code, found = _diff(runs("clean"), blind, runs.tmp)
    (f,) = _of(found, "position_id_offset")
    ev = f["evidence"]
    assert (ev["method"], ev["cause"], ev["offset"], ev["first_wrong_step"]) == ("inferred", "rope_delta_dropped",
                                                                               -delta, 1)
    assert ev["fit"] > 0.999 and ev["confidence"] > 0.99
    assert not [g for g in found if g["kind"] in NEW_KINDS[:3]]


def test_text_only_prompt_does_not_trigger_mrope_layout(runs, tmp_path):
    """The sectioned prefill graph on a text-only prompt (t = h = w): the same keys, no mrope_layout finding."""
    from ivq_debug.vlm.parts import prefill_mask

    spec = Scheduler.from_export(runs.folder, BUCKET).spec
    S = spec.prefill_len
    ids = (task.caption_ids(task.eval_set(BUCKET, 1)[0].caption) * S)[:S]
    feeds = {"inputs_embeds": spec.embedding[ids][None].astype(np.float32), "attention_mask": prefill_mask(S),
             "position_ids": np.broadcast_to(np.arange(S, dtype=np.int64), (3, 1, S)).copy()}
    feeds |= {f"deepstack_embeds.{k}": np.zeros((1, S, spec.embedding.shape[1]), np.float32)
              for k in range(spec.deepstack)}
    dumps = {}
    for label, path in (("clean", spec.part_paths["prefill"]), ("sectioned", spec.variant_paths["mrope_sectioned"]["prefill"])):
        dumps[label] = capture(_ort("prefill", path), [feeds], tmp_path / f"text-{label}.h5", part="prefill",
                               model=model_attrs(runs.folder), progress=None)
    with open_dump(dumps["clean"]) as a, open_dump(dumps["sectioned"]) as b:
        k = (0, "prefill", 0)
        assert np.abs(a.read("present.0.key", k) - b.read("present.0.key", k)).max() <= 1e-6
    code, found = _diff(dumps["clean"], dumps["sectioned"], tmp_path)
    assert code == 0 and not _of(found, "mrope_layout"), found


@pytest.mark.slow
def test_findings_hold_on_a_quantized_test(runs):
    """CPU-QDQ a8w8 parts (ORT's exact fake-quant) as the test: the clean quantized run gives none of the
    Qwen3-VL findings, each knob still its own (the quantized vision tower perturbs the image-row keys by ~8 %,
    which the M-RoPE shift statistic averages out)."""
    from ivq_debug.qnn.quantize import quantize_for_qnn
    from ivq_debug.vlm.scheduler import collect_feeds

    sched = Scheduler.from_export(runs.folder, BUCKET)
    feeds = collect_feeds(sched, task.make_samples(8, BUCKET, 99))
    graphs = dict(sched.spec.part_paths) | {"sectioned": sched.spec.variant_paths["mrope_sectioned"]["prefill"]}
    qdq = {}
    for part, path in graphs.items():
        qdq[part] = runs.tmp / f"{part}.a8w8.qdq.onnx"
        quantize_for_qnn(path, qdq[part], feeds["prefill" if part == "sectioned" else part], preset="a8w8",
                         overwrite=True)
    expected = {"clean": set(), "dropped": {"deepstack_missing"}, "before_layer": {"deepstack_misrouted"},
                "sectioned": {"mrope_layout"}}
    for label, kinds in expected.items():
        paths = dict(qdq, prefill=qdq["sectioned"]) if label == "sectioned" else qdq
        knobs = {k: v for k, v in KNOBS[label].items() if k != "mrope_layout"}  # the graph is the knob here

        def factory(part: str, _path: Path, paths=paths):
            return make_runner("onnx", paths[part], selection=Selection())

        test = capture_run(runs.folder, BUCKET, [runs.image], runs.tmp / f"a8w8-{label}.h5", forced=[runs.forced],
                           runner_factory=factory, overwrite=True, **knobs)
        _, found = _diff(runs("clean"), test, runs.tmp)
        assert {f["kind"] for f in found} & set(NEW_KINDS[:3]) == kinds, (label, found)


def _patch_channels(patches: np.ndarray, fn) -> np.ndarray:
    """Apply ``fn(block, channel)`` to each colour channel's third of Qwen-VL patch vectors."""
    k = patches.shape[-1] // 3
    return np.concatenate([fn(patches[:, c * k:(c + 1) * k], c) for c in range(3)], axis=-1).astype(np.float32)


def test_preprocess_mismatch_tells_range_normalization_and_resize(runs, tmp_path):
    """The vision graph run on the pixels of other preprocessing pipelines: each named by its statistic."""
    from ivq_debug.vlm.inputs import qwen_patches

    spec = Scheduler.from_export(runs.folder, BUCKET).spec
    sample = task.eval_set(BUCKET, 1)[0]
    big = task.render(sample.scene, 2 * BUCKET)  # one picture, resampled two ways
    area = big.reshape(BUCKET, 2, BUCKET, 2, 3).mean(axis=(1, 3))
    ref_px = qwen_patches(area)[0]
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, not the model's 0.5 / 0.5
    variants = {
        "ref": ref_px,
        "range": qwen_patches(area * 255.0)[0],  # a 0-255 image where 0-1 is expected
        "normalization": _patch_channels(ref_px, lambda b, c: ((b * 0.5 + 0.5) - mean[c]) / std[c]),
        "resize": qwen_patches(big[::2, ::2])[0],  # nearest instead of area averaging
    }
    dumps = {label: capture(_ort("vision", spec.part_paths["vision"]), [{"pixel_values": px}],
                            tmp_path / f"px-{label}.h5", part="vision", progress=None)
             for label, px in variants.items()}
    for label in ("range", "normalization", "resize"):
        # other pixels are other external inputs: ivq-diff stops at the contract (exit 6) unless told to compare
        assert run("ivq-diff", ivq_diff, [str(dumps["ref"]), str(dumps[label]), "-q"]) == 6
        code, found = _diff(dumps["ref"], dumps[label], tmp_path, "--allow-input-mismatch")
        (f,) = _of(found, "preprocess_mismatch")
        assert code == 1 and f["evidence"]["verdict"] == label, (label, f)
        assert f["where"] == {"record": {"sample": 0, "part": "vision", "step": 0}, "tensor": "pixel_values"}
        r2 = [a["r2"] for a in f["evidence"]["affine"]]
        assert (min(r2) > 0.9999) is (label != "resize"), (label, r2)
    code, found = _diff(dumps["ref"], dumps["ref"], tmp_path)
    assert not _of(found, "preprocess_mismatch")
