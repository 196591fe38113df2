"""A search lever whose quantized model has the bytes of a model measured in full takes its figures instead of
running (``search.same_model``): at 16-bit activations entropy calibration is MinMax (a 65536-level grid is finer
than the histogram: ``ivq_debug.qnn.entropy.ENTROPY_BINS``), so on an a16w8 baseline the ``calibration entropy`` lever
is the baseline's model. Real quantizations and CPU-QDQ trials; the figures taken are checked against the lever
run in full."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.inputfiles import sha256_file
from ivq_debug.tune.search import lever_job
from ivq_debug.tune.verify import Tuner
from tests.support.cli import ivq_cli
from tests.support.lever_models import two_causes_files


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict:
    return two_causes_files(tmp_path_factory.mktemp("same"), evaluation=4)


def _tuner(user: dict, wd: Path, method: str) -> Tuner:
    feeds = [dict(np.load(p)) for p in user["evals"][1::2]]
    return Tuner(user["model"], user["cal"], feeds, None, wd, backend="cpu", resume=False, preset="a16w8",
                 quantize_kw={"calibrate_method": method})


def test_a_lever_of_the_baselines_bytes_takes_its_figures_which_a_full_run_gives(user, tmp_path: Path) -> None:
    base = _tuner(user, tmp_path / "base", "minmax")
    before = base.trial("before", [])
    assert before.error is None
    ent = _tuner(user, tmp_path / "ent", "entropy")
    full = lever_job(ent.worker(tmp_path / "job-full"), "lever-calibration-entropy", [])  # run on every sample
    assert full["model_sha256"] == sha256_file(before.qdq_model)  # the premise: entropy = MinMax bytes at a16
    held = {"lever": "the baseline", "sqnr": dict(before.sqnr_table), "task": dict(before.task),
            "cycles": before.cycles, "samples": dict(before.samples)}
    worker = ent.worker(tmp_path / "job-same")
    runs = worker.timing_summary().get("run_compare_cpu", 0)  # (the copies of a tuner share its timings)
    same = lever_job(worker, "lever-calibration-entropy", [], same={full["model_sha256"]: held})
    assert same["same_model_as"] == "the baseline" and "same_model_as" not in full
    assert worker.timing_summary().get("run_compare_cpu", 0) == runs == 1  # no sample ran for it
    for k in ("model_sha256", "model_bytes", "task", "samples", "stopped", "error", "suggestions", "fixes"):
        assert same[k] == full[k], k
    assert same["sqnr"]["y"] == full["sqnr"]["y"] == before.sqnr("y")
    assert {k: same["sqnr"][k] for k in full["sqnr"]} == full["sqnr"]
    # other bytes (per-channel), or figures that do not cover what the lever measures: the lever runs
    pc = _tuner(user, tmp_path / "pc", "minmax")
    pc.quantize_kw["per_channel"] = True
    assert "same_model_as" not in lever_job(pc.worker(tmp_path / "job-pc"), "lever-per-channel", [],
                                            same={full["model_sha256"]: held})
    bare = held | {"sqnr": {}}
    assert "same_model_as" not in lever_job(ent.worker(tmp_path / "job-bare"), "lever-calibration-entropy", [],
                                            same={full["model_sha256"]: bare})


def test_the_cli_search_reports_the_lever_as_the_baselines_model(user, tmp_path: Path, capsys) -> None:
    code = ivq_cli("tune", user["model"], "--calibration", user["cal"], *user["evals"], "-o", tmp_path / "t",
                   "--backend", "cpu", "--preset", "a16w8", "--search", "--no-diagnose")
    rep = json.loads((tmp_path / "t" / "tune.json").read_text())
    out = capsys.readouterr().out
    assert code == 0
    rows = {r["lever"]: r for r in rep["search"]["table"]}
    ent = rows["calibration entropy"]
    assert ent["same_model_as"] == "the baseline" and ent["gain_db"] == 0.0
    y0 = next(r["before"] for r in rep["end_to_end"] if r["what"] == "sqnr_db y")
    assert round(ent["sqnr_db"], 2) == round(y0, 2)
    assert "the model of the baseline, the same bytes" in ent["status"] and "the same bytes" in out
    assert not any(r.get("same_model_as") for n, r in rows.items() if n != "calibration entropy")
