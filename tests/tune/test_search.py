"""``ivq tune --search`` (issue 29): the whole lever space measured, the frontier reported, the choice by gain
under a budget; on a model where only a16w8 + per-channel recovers the output, the tuner finds the combination
(the CLI path), and what it delivers reproduces with ``ivq quantize``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import ivq_cli
from tests.support.lever_models import build_two_causes, two_causes_sample
from tests.tune.test_deliver import reproduces


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("search")
    model = build_two_causes(d / "two.onnx")
    (d / "cal").mkdir()
    for i in range(8):
        np.savez(d / "cal" / f"{i:02d}.npz", **two_causes_sample(i))
    evals = []
    for i in range(4):
        evals += ["--inputs", d / f"eval{i}.npz"]
        np.savez(d / f"eval{i}.npz", **two_causes_sample(100 + i))
    return {"model": model, "cal": d / "cal", "evals": evals}


def _search(user, wd: Path, *extra: object, diagnose: bool = False) -> tuple[int, dict]:
    code = ivq_cli("tune", user["model"], "--calibration", user["cal"], *user["evals"], "-o", wd, "--backend", "cpu",
                   "--search", *([] if diagnose else ["--no-diagnose"]), *extra)
    return code, json.loads((wd / "tune.json").read_text())


@pytest.mark.slow  # two searches of 14 levers (~45 s on 2 loaded cores)
def test_search_finds_the_combination_only_both_levers_recover(user, tmp_path: Path, capsys) -> None:
    base = _search(user, tmp_path / "t0", diagnose=True)[1]
    # unit levers from the diagnosis' fixes by cause (diagnose/remedy.py): per-channel on head A's weight
    remedy = {r["lever"]: r for r in base["search"]["table"]}["remedy weight_spread"]
    assert remedy["overrides"] == 1 and 2 < remedy["gain_db"] < 4
    target = next(r["before"] for r in base["end_to_end"] if r["what"] == "sqnr_db y") + 10
    code, rep = _search(user, tmp_path / "t", "--target-metric", f"{target:.3f}")
    out = capsys.readouterr().out
    assert code == 0 and rep["recommended"]
    rows = {r["lever"]: r for r in rep["search"]["table"]}
    # the model's premise, measured by the tuner itself: each lever alone < +4 dB, both > +10 dB
    assert rows["per-channel"]["gain_db"] < 4 and rows["a16w8"]["gain_db"] < 4
    assert rows["a16w8 + per-channel"]["gain_db"] > 10
    # the cheapest lever that reaches the target: the combination, not a16w16 (twice the weight bytes)
    assert rep["search"]["chosen"] == "a16w8 + per-channel", rows
    assert rows["a16w16"]["cost"] > rows["a16w8 + per-channel"]["cost"]
    assert rep["search"]["quantize"] == {"preset": "a16w8", "per_channel": True, "calibrate_method": "minmax"}
    # without a target: the largest gain (not the first lever that passes)
    best = max((r for r in base["search"]["table"] if r["eligible"]), key=lambda r: r["gain_db"])
    assert base["search"]["chosen"] == best["lever"] and best["gain_db"] > 10
    assert rep["search"]["frontier"] and rep["search"]["chosen"] in rep["search"]["frontier"]
    assert "frontier" in out and "a16w8 + per-channel" in out  # the table on stdout
    # CPU-QDQ trials: the chosen set compiled and measured once on HTP, both figures in the report
    chk = rep["target_check"]
    if chk.get("checked"):
        (hb, ha) = chk["watch"]["y"]["htp"]
        assert ha > hb + 10  # measured: 15.2 -> 30.6 dB on the emulated HTP
    reproduces(user["model"], user["cal"], tmp_path / "t", tmp_path, *rep["search"]["command"].split())


def test_a_size_budget_excludes_what_it_cannot_afford(user, tmp_path: Path) -> None:
    code, rep = _search(user, tmp_path / "b", "--max-size", "1.0001")  # no lever may grow the model
    rows = {r["lever"]: r for r in rep["search"]["table"]}
    assert rows["a16w16"]["status"].startswith("over budget")
    assert all(r["model_bytes"] <= rep["end_to_end"][-1]["before"] * 1.0001 for r in rep["search"]["table"]
               if r["eligible"])
    assert code in (0, 1)
    # a finished run keeps what the report needs: no dump, the checkpoint and the QDQ models it names
    assert not list((tmp_path / "b").rglob("*.h5")) and rep["workdir"]["pruned"]
    assert (tmp_path / "b" / "trials" / "checkpoint.json").exists() and Path(rep["before"]["qdq_model"]).exists()
