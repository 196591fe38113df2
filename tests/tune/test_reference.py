"""What a tune keeps and repeats (issues 29 and 33): the float reference made in memory as the trials read it (no
``reference.h5``), the baseline compared in memory (no ``before.h5``), one quantization per distinct setting, a
trial run again in the same run reused — each with the figures of the code that wrote and read the dumps, to the
bit."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.diagnose.replay import replay
from ivq_debug.dump import open_dump
from ivq_debug.tune.reference import LiveReference
from ivq_debug.tune.suggest import Suggestion
from ivq_debug.tune.verify import Stop, Trial, Tuner, one_trial, refused_already
from tests.diagnose.test_weight_spread import build_conv
from tests.support.cli import ivq_cli
from tests.support.lever_models import build_two_causes, two_causes_sample

#: an activation on 16 bits and head A's weight per channel (the quantizer resolves a type: a fix is measured too)
SUGGESTIONS = [Suggestion("rb", "a16", "test", 0.0, 4.0), Suggestion("wa", "w_per_channel", "test", axis=0)]


@pytest.fixture(scope="module")
def lever(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("live")
    model = build_two_causes(d / "two.onnx")
    feeds = [two_causes_sample(100 + i) for i in range(3)]
    ref = capture(make_runner("onnx", model, selection=Selection()), feeds, d / "ref.h5", progress=None)
    return {"model": model, "cal": [two_causes_sample(i) for i in range(8)], "feeds": feeds, "ref": ref}


def _tuner(lever: dict, wd: Path, reference: Path | None) -> Tuner:
    return Tuner(lever["model"], lever["cal"], lever["feeds"], reference, wd, backend="cpu", resume=False,
                 preprocess=False)


def test_the_live_reference_gives_the_figures_of_a_reference_dump(lever, tmp_path: Path) -> None:
    dumped, live = _tuner(lever, tmp_path / "d", lever["ref"]), _tuner(lever, tmp_path / "l", None)
    b0, b1 = dumped.trial("before", []), live.trial("before", [])
    # the baseline: every pair of every sample, no dump written, the same table to the bit
    assert not b0.dump.exists() and not b1.dump.exists() and not list((tmp_path / "l").glob("*.h5"))
    assert len(b1.comparison.table) == len(b0.comparison.table) > 3 * 5
    assert b1.comparison.table.equals(b0.comparison.table)  # every metric column
    assert b1.sqnr_table == b0.sqnr_table and b1.samples == b0.samples
    # what the diagnosis reads: the first sample, test and reference, held in memory; the same replay
    r0 = replay(b0.qdq_model, lever["ref"], cumulative=b0.comparison, float_model=lever["model"], progress=False)
    r1 = replay(b1.qdq_model, b1.comparison.ref, cumulative=b1.comparison, float_model=lever["model"], progress=False)
    assert r1.table[["node", "intro_sqnr_db"]].equals(r0.table[["node", "intro_sqnr_db"]])
    b1.release()
    # a trial: the measured tensors' figures identical; the second trial reads the arrays the first kept
    t0, t1 = one_trial(dumped, "x", SUGGESTIONS), one_trial(live, "x", SUGGESTIONS)
    assert t1.sqnr_table == t0.sqnr_table and t1.samples == t0.samples and len(t1.sqnr_table) >= 2
    lr = live.live()
    assert lr is not None and lr.forwards == 3  # the baseline, one per sample: what the trials read was kept
    again = one_trial(live, "y", SUGGESTIONS)
    assert again.sqnr_table == t0.sqnr_table and lr.forwards == 3
    assert 0 < lr.kept_bytes() <= lr.keep_bytes


def test_a_value_not_kept_is_made_again_to_the_same_bits(lever, tmp_path: Path) -> None:
    tight = replace(_tuner(lever, tmp_path, None), _live=LiveReference(lever["model"], lever["feeds"], keep_bytes=0))
    a, b = one_trial(tight, "a", SUGGESTIONS), one_trial(tight, "b", SUGGESTIONS)
    assert tight.live().kept_bytes() == 0 and tight.live().forwards == 3 * 2  # each trial ran the float model
    assert a.sqnr_table == b.sqnr_table == one_trial(_tuner(lever, tmp_path / "d", lever["ref"]), "c",
                                                     SUGGESTIONS).sqnr_table
    rec = tight.live().record(1)
    first = {e.name: rec.read(e).copy() for e in rec.entries}
    rec.close()  # nothing kept: the next read runs the float model again
    assert all(np.array_equal(rec.read(e), first[e.name]) and rec.read(e).tobytes() == first[e.name].tobytes()
               for e in rec.entries)


def test_one_quantization_per_setting_and_a_trial_run_again_is_reused(lever, tmp_path: Path) -> None:
    tuner = _tuner(lever, tmp_path, None)
    a = tuner.trial("a", list(SUGGESTIONS))
    b = tuner.trial("b", list(SUGGESTIONS[:1]))  # another set: quantized
    c = one_trial(tuner, "c", SUGGESTIONS)  # the same quantization under another label: the model from the cache
    assert tuner.timings["quantize_reused"] == 1 and tuner.timings["quantize"] >= 2
    digest = [hashlib.sha256(t.qdq_model.read_bytes()).hexdigest() for t in (a, b, c)]
    assert digest[0] == digest[2] != digest[1] and c.sqnr_table == a.sqnr_table
    # the same trial again in this run (a target check's baseline, once per candidate): its entry, not a new run
    again = tuner.trial("a", list(SUGGESTIONS))
    assert again.reused and again.sqnr_table == a.sqnr_table and tuner.timings["quantize_reused"] == 1


def test_a_tune_writes_no_float_reference_nor_baseline_dump(tmp_path: Path) -> None:
    """The CLI a user runs: the workdir never holds a dump (sampled while it runs), and the calibration ranges are
    the ones a summary dump's statistics gave, to the bit."""
    conv = build_conv(tmp_path)
    (tmp_path / "cal").mkdir()
    for i in range(6):
        np.savez(tmp_path / "cal" / f"{i}.npz", x=np.random.RandomState(i).randn(1, 3, 16, 16).astype(np.float32))
    for i in range(3):
        np.savez(tmp_path / f"e{i}.npz", x=np.random.RandomState(50 + i).randn(1, 3, 16, 16).astype(np.float32))
    wd = tmp_path / "t"
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(p.name for p in wd.rglob("*.h5")) if wd.exists() else None
            stop.wait(0.005)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        code = ivq_cli("tune", conv, "--calibration", tmp_path / "cal", *[x for i in range(3) for x in
                       ("--inputs", tmp_path / f"e{i}.npz")], "-o", wd, "--backend", "cpu", "--preset", "a16w8")
    finally:
        stop.set()
        th.join()
    assert code == 0
    assert not seen, seen  # nor a capture of the calibration data (its ranges are taken in memory)
    doc = json.loads((wd / "tune.json").read_text())
    assert doc["recommended"] and doc["timings"]["reference_forwards"] >= 3 and doc["timings"]["quantize"] >= 2
    # --keep-dumps keeps them, the float reference included
    code = ivq_cli("tune", conv, "--calibration", tmp_path / "cal", "--inputs", tmp_path / "e0.npz", "-o",
                   tmp_path / "k", "--backend", "cpu", "--preset", "a16w8", "--keep-dumps")
    assert code == 0 and (tmp_path / "k" / "reference.h5").exists() and (tmp_path / "k" / "trials" / "before.h5").exists()


def test_the_calibration_ranges_are_a_summary_dumps_statistics(lever, tmp_path: Path) -> None:
    tuner = _tuner(lever, tmp_path, None)
    d = capture(make_runner("onnx", lever["model"], selection=Selection()), lever["cal"], tmp_path / "c.h5",
                summary_only=True, progress=None)
    want: dict[str, tuple[float, float]] = {}
    with open_dump(d) as dump:
        for e in [*dump.tensors(), *dump.tensors(kind="input")]:
            lo, hi = e.stats["min"], e.stats["max"]
            cur = want.get(e.name)
            want[e.name] = (min(lo, cur[0]), max(hi, cur[1])) if cur else (float(lo), float(hi))
    assert tuner.calibration_ranges() == want and len(want) > 5
    assert not list(tmp_path.glob("calibration*"))


def _figures(y: float) -> Trial:
    return Trial("t", [], Path("m"), Path("d"), None, sqnr_table={"y": y})


def test_a_check_stops_at_the_sample_that_makes_its_refusal_certain(lever, tmp_path: Path) -> None:
    tuner = replace(_tuner(lever, tmp_path, None), output_metric=lambda outs: {"n": float(len(outs))})
    full = tuner.trial("full", list(SUGGESTIONS))
    worst_seen = []
    fresh = replace(tuner, _ran=set())  # (this run's finished trial of the same set would be reused: whole figures)
    part = fresh.trial("part", list(SUGGESTIONS), stop=lambda w: worst_seen.append(dict(w)) or True)
    assert full.stopped is None and full.task == {"task n": 3.0}
    assert part.stopped == {"samples": 1, "of": 3} and part.task == {}  # no task metric on a part of the set
    assert part.samples["y"]["n"] == 1 and worst_seen[0]["y"] == part.sqnr("y") >= full.sqnr("y")
    assert not replace(fresh, resume=True).trial("part", list(SUGGESTIONS)).reused  # a stopped one never is
    told: list[dict] = []

    class Told(Stop):  # a stop told the trial's cost (Stop.observe), as the search's Below is
        def observe(self, **cost: object) -> None:
            told.append(cost)

        def __call__(self, worst: object) -> bool:
            return True

    seen = replace(tuner, _ran=set()).trial("seen", list(SUGGESTIONS), stop=Told())
    assert seen.stopped == part.stopped and seen.sqnr_table == part.sqnr_table
    # its model's bytes once quantized, then the HTP cycles of the first sample (none on CPU-QDQ: no profile)
    assert told == [{"model_bytes": seen.model_bytes}, {"cycles": None}] and seen.model_bytes > 1000
    # PP-OCRv4's a16w16 (docs/tune.md): CPU-QDQ 2.73 -> 20.40 dB, HTP baseline 3.88; refused as soon as one line on
    # HTP is below 3.88 + 50% of the 17.67 dB gain; a set that holds is measured on every sample
    stop = refused_already(_figures(2.73), _figures(20.40), _figures(3.88), ["y"])
    assert stop({"y": 12.0}) and stop({"y": 3.0}) and not stop({"y": 13.0}) and not stop({})


def test_a_whole_comparison_does_not_push_out_what_the_trials_measure(lever, tmp_path: Path) -> None:
    """Each sample keeps its share: first the tensors the trials measure (``expect``, then what they read), not what
    a whole comparison read (it used to keep the smallest tensors of the first sample it trimmed, and the trials
    after it ran the float model again on every other sample)."""
    live = LiveReference(lever["model"], lever["feeds"], keep_bytes=3 * (2048 + 512 + 64))  # y + rb per sample
    tuner = replace(_tuner(lever, tmp_path, None), _live=live)
    live.expect(tuner.measured(SUGGESTIONS, tuner.outputs()))
    a = one_trial(tuner, "a", SUGGESTIONS)
    assert live.forwards == 3 and live.kept_bytes() == 3 * (2048 + 512)  # y and rb of each sample
    before = tuner.trial("before", [])  # every pair of every sample, the first sample held for a diagnosis
    before.release()
    forwards = live.forwards
    b = one_trial(tuner, "b", SUGGESTIONS)
    assert live.forwards == forwards and b.sqnr_table == a.sqnr_table and b.samples == a.samples
