"""The search's combination step (:func:`ivq_debug.tune.search.grow`) from real ORT CPU-QDQ trials on the two-head
model of ``tests/support/lever_models.py``, where only a16w8 + per-channel recovers the output (each lever alone
< +4 dB, both > +10 dB): given the two levers *separately* (not their merged global), the step finds their
combination, ranks by measured gain per cost, stops when a round adds less than the minimum gain, and keeps to its
budget of extra trials."""

from __future__ import annotations

import numpy as np
import pytest

from ivq_debug.tune.search import Lever, global_levers, grow, search, unit_levers
from ivq_debug.tune.suggest import Suggestion
from ivq_debug.tune.verify import Tuner
from tests.support.cli import ivq_cli
from tests.support.lever_models import two_causes_trial_inputs

#: per-cause unit fixes of the two heads (a 16-bit activation for head B, per-channel weight of head A)
UNITS = [Suggestion("rb", "a16", "resolution", 0.0, 4.0), Suggestion("wa", "w_per_channel", "weight spread", axis=0)]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    """The model, its calibration and evaluation samples, the float reference and the a8w8 baseline trial."""
    d = tmp_path_factory.mktemp("combine")
    u = two_causes_trial_inputs(d, evaluation=4)
    tuner = Tuner(u["model"], u["cal"], u["feeds"], u["ref"], d / "wd", backend="cpu", target="cpu", resume=False,
                  preprocess=False)
    np.savez(d / "cal.npz", x=np.concatenate([c["x"] for c in u["cal"]]))
    np.savez(d / "eval.npz", **u["feeds"][0])
    return {"tuner": tuner, "before": tuner.trial("before", []), "cal": d / "cal.npz", "eval": d / "eval.npz"}


def _levers(tuner: Tuner, *names: str) -> list[Lever]:
    got = {lv.name: lv for lv in global_levers(tuner)}
    return [got[n] for n in names]


def test_the_combination_step_finds_a16w8_with_per_channel_from_the_levers_alone(two) -> None:
    tuner = two["tuner"]
    res = search(tuner, two["before"], _levers(tuner, "per-channel", "a16w8", "calibration percentile"),
                 combinations=4)
    rows = {r["lever"]: r for r in res.table}
    # the premise, measured: each lever alone < +4 dB
    assert rows["per-channel"]["gain_db"] < 4 and rows["a16w8"]["gain_db"] < 4
    combos = [r for r in res.table if r["kind"] == "combination"]
    assert 1 <= len(combos) <= 4  # the budget of extra trials
    both = [r for r in combos if {"a16w8", "per-channel"} <= set(r["lever"].split(" + "))]
    assert both and max(r["gain_db"] for r in both) > 10, combos
    # chosen: a combination of both levers (the largest gain), its knobs a16w8 with per-channel weights
    assert res.chosen is not None and {"a16w8", "per-channel"} <= set(res.chosen.parts), res.chosen
    assert res.chosen.preset == "a16w8" and res.chosen.per_channel
    assert rows[res.chosen.name]["status"] == "chosen" and rows[res.chosen.name]["frontier"]
    # the first round grows the best lever alone by the others, best gain per cost first (two jobs per round)
    best_alone = max(("per-channel", "a16w8", "calibration percentile"), key=lambda n: rows[n]["gain_db"] or -1e9)
    assert combos[0]["lever"].startswith(best_alone + " + ")


def test_the_combination_step_stops_when_a_round_adds_too_little_and_keeps_its_budget(two) -> None:
    tuner, before = two["tuner"], two["before"]
    levers = _levers(tuner, "per-channel", "a16w8") + unit_levers(tuner, UNITS)
    # a minimum gain no combination adds (a target nobody reaches: the minimum gain then only drives the step):
    # one round of two combinations, then the step stops
    res = search(tuner, before, levers, combinations=6, min_gain_db=100.0, target=1000.0)
    assert [r["kind"] for r in res.table].count("combination") == 2, res.table
    # a budget of one extra trial: one combination; none: none
    res = search(tuner, before, levers, combinations=1)
    assert [r["kind"] for r in res.table].count("combination") == 1
    res = search(tuner, before, levers, combinations=0)
    assert [r["kind"] for r in res.table].count("combination") == 0 and res.table[-1]["lever"] == levers[-1].name


def test_a_target_reached_stops_the_step(two) -> None:
    """The cheapest set reaching the target wins: once the grown set reaches it, more would only cost more."""
    tuner, before = two["tuner"], two["before"]
    s0 = before.sqnr("y")
    res = search(tuner, before, _levers(tuner, "per-channel", "a16w8"), combinations=6, target=s0 + 10)
    combos = [r for r in res.table if r["kind"] == "combination"]
    assert len(combos) == 1 and combos[0]["sqnr_db"] >= s0 + 10, combos
    assert res.chosen is not None and res.chosen.name == combos[0]["lever"]


def test_grow_skips_what_is_measured_over_budget_or_illegal() -> None:
    """The candidates of a round, without trials: a set of the same signature as a measured lever is not
    measured again, the size budget and the legality check exclude before a trial is spent."""
    levers = [Lever("a16w8", "global", "a16w8", False, "minmax"), Lever("per-channel", "global", "a8w8", True, "minmax"),
              Lever("a16w8 + per-channel", "combination", "a16w8", True, "minmax"),
              Lever("a16w16", "global", "a16w16", False, "minmax")]
    rows = [{"lever": n, "status": "ok", "gain_db": g, "model_bytes": b, "task": {}}
            for n, g, b in (("a16w8", 2.0, 110), ("per-channel", 3.0, 105), ("a16w8 + per-channel", 9.0, 115),
                            ("a16w16", 8.0, 190))]
    asked: list[list[str]] = []
    grow(levers, rows, lambda b: asked.append([lv.name for lv in b]), budget=6, base_bytes=100.0, max_size=1.5)
    # the best within budget grows; + a16w8 / + per-channel are itself (measured), + a16w16 is over the size budget
    assert asked == []
    grow(levers, rows, lambda b: asked.append([lv.name for lv in b]), budget=6, base_bytes=100.0)
    assert asked == [["a16w8 + per-channel + a16w16"]]  # no budget: a16w16 with per-channel (its own trial)
    asked.clear()
    grow(levers, rows, lambda b: asked.append([lv.name for lv in b]), budget=6, base_bytes=100.0,
         legal=lambda lv: lv.preset != "a16w16")
    assert asked == []


@pytest.mark.parametrize(("extra", "says"), [(["--search", "--combinations", "-1"], "--combinations must be at least 0"),
                                             (["--combinations", "2"], "are for --search"),
                                             (["--no-early-stop"], "are for --search"),
                                             (["--frontier"], "are for --search")])
def test_combinations_flag_is_checked_before_any_work(two, tmp_path, capsys, extra, says) -> None:
    t = two["tuner"]
    code = ivq_cli("tune", t.float_model, "--calibration", two["cal"], "--inputs", two["eval"], "-o", tmp_path / "w",
                   *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "w").exists()


def test_a_round_runs_a_stopped_lever_whole_only_when_it_could_rank_among_the_parts_it_takes() -> None:
    """Without trials: a lever the search stopped early as dominated (no gain figure, at most a bound) is run on
    every sample (``resolve``) only when its bound could rank it before a part the round takes; then the round is
    the one a search without early stops makes."""
    def lv(name: str) -> Lever:
        return Lever(name, "unit", "a8w8", False, "minmax", [Suggestion(name, "a16", "r", 0.0, 1.0)])

    levers = [lv(n) for n in ("big", "cheap", "mid", "stopped-low", "stopped-high")]
    rows = [{"lever": n, "status": "ok", "gain_db": g, "model_bytes": b, "task": {}}
            for n, g, b in (("big", 10.0, 200), ("cheap", 2.0, 101), ("mid", 1.0, 110))]
    rows += [{"lever": n, "status": "dominated: …", "gain_db": None, "model_bytes": b, "task": {},
              "stopped": {"dominated": True, "gain_at_most_db": g}}
             for n, g, b in (("stopped-low", 0.05, 150), ("stopped-high", 3.0, 101))]
    asked: list[list[str]] = []
    resolved: list[list[str]] = []

    def resolve(names) -> None:  # the lever measured in full: +2.5 dB at +1 % size ranks first (250 dB per unit)
        resolved.append(sorted(names))
        for r in rows:
            if r["lever"] in names:
                r.update(status="ok", gain_db=2.5 if r["lever"] == "stopped-high" else 0.01, stopped=None)

    grow(levers, rows, lambda b: asked.append([x.name for x in b]), budget=2, base_bytes=100.0, resolve=resolve)
    # stopped-low (at most +0.05 dB at +50 %) cannot rank before cheap or mid: never run again
    assert resolved == [["stopped-high"]]
    assert asked == [["big + stopped-high", "big + cheap"]]
