"""What the search does not run twice or to the end (issue 33): a lever's trial stops at the sample that proves it
cannot matter (:class:`ivq_debug.tune.search.Below`), and the chosen lever's files are delivered with the figures
its job measured (:func:`ivq_debug.tune.search._deliver`). Real ORT CPU-QDQ trials of the two-head model of
``tests/support/lever_models.py`` on six samples, the trials on their target (``target="cpu"``: no check on another
backend may refuse the choice afterwards), a search with early stops against the same search without."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ivq_debug.inputfiles import sha256_file
from ivq_debug.tune.search import (
    Lever,
    global_levers,
    hardest_first,
    lever_label,
    sample_scores,
    search,
    unit_levers,
)
from ivq_debug.tune.suggest import Suggestion
from ivq_debug.tune.verify import CHECKPOINT, Tuner, one_trial
from tests.support.cli import ivq_cli
from tests.support.lever_models import two_causes_files, two_causes_trial_inputs

#: per-cause unit fixes of the two heads (a 16-bit activation for head B, per-channel weight of head A)
UNITS = [Suggestion("rb", "a16", "resolution", 0.0, 4.0), Suggestion("wa", "w_per_channel", "weight spread", axis=0)]


pytestmark = pytest.mark.slow  # five searches of 11-14 levers each (~25 s on 2 loaded cores)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``True``: early stops, the frontier measured in full (``frontier=True``); ``"choice"``: early stops, only
    what may be chosen measured in full (the default); ``False``: no early stop. ``("choice" | True, 0)``: the
    same without the combination step (whose ranking of parts runs a stopped lever in full again)."""
    d = tmp_path_factory.mktemp("stop")
    u = two_causes_trial_inputs(d, evaluation=6)
    out = {}
    for early in (True, "choice", False, (True, 0), ("choice", 0)):
        mode, combos = early if isinstance(early, tuple) else (early, 6)
        t = Tuner(u["model"], u["cal"], u["feeds"], u["ref"], d / f"wd-{mode}-{combos}", backend="cpu",
                  target="cpu", resume=False, preprocess=False)
        before = t.trial("before", [])
        res = search(t, before, global_levers(t) + unit_levers(t, UNITS), early_stop=bool(mode),
                     frontier=mode is True, combinations=combos)
        out[early] = {"tuner": t, "res": res, "rows": {r["lever"]: r for r in res.table}}
    return out


def _samples_run(rows: dict) -> int:
    return sum((r.get("stopped") or {}).get("samples", 0 if r.get("same_model_as") else 6) for r in rows.values()
               if r["sqnr_db"] is not None or r.get("stopped"))


def test_a_choice_only_search_stops_more_and_chooses_the_same(runs) -> None:
    """Without ``frontier``, a lever stops once it cannot be chosen, whatever its cost: fewer samples run, the
    same choice and delivered model; every lever measured in full has the figures of the search without early
    stops, and a frontier mark is never claimed that the full search denies (an open mark names who may beat it)."""
    choice, full = runs["choice"], runs[False]
    c0, f0 = runs[("choice", 0)]["rows"], runs[(True, 0)]["rows"]
    # measured: calibration percentile stops after 1 of 6 samples (5 with --frontier), unit weights after 1 (6)
    assert _samples_run(c0) < _samples_run(f0) < _samples_run(full["rows"])
    assert {n for n, r in c0.items() if r.get("stopped")} > {n for n, r in f0.items() if r.get("stopped")}
    assert runs[("choice", 0)]["res"].chosen.name == runs[(True, 0)]["res"].chosen.name
    stopped = {n: r for n, r in choice["rows"].items() if r.get("stopped")}
    for name, r in stopped.items():
        whole = full["rows"][name]
        assert whole["sqnr_db"] <= r["stopped"]["at_most_db"] and whole["status"] != "chosen"
        if r["stopped"]["dominated"]:
            assert r["status"].endswith("(not run to the end: --frontier would)"), r
    keys = ("sqnr_db", "gain_db", "model_bytes", "cost", "efficiency", "eligible", "task")
    for name, r in choice["rows"].items():
        if name not in stopped:
            assert {k: r[k] for k in keys} == {k: full["rows"][name][k] for k in keys}, name
            assert not r["frontier"] or full["rows"][name]["frontier"], name
            if full["rows"][name]["frontier"] and not r["frontier"]:  # settled only by a lever stopped early
                assert set(r["frontier_open"]) <= set(stopped), r
    assert choice["res"].chosen.name == full["res"].chosen.name
    a, b = choice["res"].report.to_dict(), full["res"].report.to_dict()
    for k in ("recommended", "changed", "end_to_end", "overrides", "samples", "resolved_types"):
        assert a[k] == b[k], k
    assert sha256_file(a["after"]["qdq_model"]) == sha256_file(b["after"]["qdq_model"])


def test_an_early_stopped_lever_is_provably_dominated_and_the_choice_is_the_same(runs) -> None:
    fast, full = runs[True], runs[False]
    stopped = {n: r for n, r in fast["rows"].items() if r.get("stopped")}
    assert stopped, fast["res"].table  # measured: calibration percentile after 5 of 6, a16w16 + unit weights 3 of 6
    assert not any(r.get("stopped") for r in full["res"].table)
    assert any(r["stopped"]["dominated"] for r in stopped.values())
    for name, r in stopped.items():
        whole = full["rows"][name]
        st = r["stopped"]
        assert st["samples"] < st["of"] == 6
        # a worst SQNR only falls as samples are added: the bound holds for the lever's figure over every sample
        assert whole["sqnr_db"] <= st["at_most_db"] < st["floor_db"], (r, whole)
        assert r["sqnr_db"] is None and r["gain_db"] is None and not r["eligible"] and not r["frontier"]
        assert not whole["frontier"] and whole["status"] != "chosen", whole  # it could not have mattered
        if st["dominated"]:
            assert r["status"].startswith("dominated: at most") and "neither chosen over" in r["status"]
            # an eligible lever of no greater cost measured above its bound
            assert any(o["eligible"] and o["cost"] <= r["cost"] and o["sqnr_db"] > st["at_most_db"]
                       for o in fast["res"].table), r
        else:
            assert r["status"].startswith("lowers y: at most") and whole["status"].startswith("lowers y from")
    # every lever measured in full: the same figures, statuses and frontier marks to the bit
    keys = ("sqnr_db", "gain_db", "model_bytes", "cost", "efficiency", "eligible", "status", "frontier", "task")
    for name, r in fast["rows"].items():
        if name not in stopped:
            assert {k: r[k] for k in keys} == {k: full["rows"][name][k] for k in keys}, name
    assert fast["res"].chosen.name == full["res"].chosen.name
    assert fast["res"].chosen.knobs() == full["res"].chosen.knobs()
    a, b = fast["res"].report.to_dict(), full["res"].report.to_dict()
    for k in ("recommended", "changed", "end_to_end", "overrides", "samples", "resolved_types", "target_check"):
        assert a[k] == b[k], k
    assert sha256_file(a["after"]["qdq_model"]) == sha256_file(b["after"]["qdq_model"])


def test_the_chosen_lever_is_delivered_with_its_jobs_figures_not_run_again(runs) -> None:
    run = runs[True]
    t, res = run["tuner"], run["res"]
    label = lever_label(res.chosen)
    entry = next(e for e in json.loads((t.workdir / CHECKPOINT).read_text())["trials"].values()
                 if e["label"] == label)
    qdq = t.workdir / entry["qdq_model"]
    assert entry["from_job"] == sha256_file(qdq) == sha256_file(res.report.after.qdq_model)  # the job's bytes
    # the same lever run again in full from its delivered suggestions: the figures delivered, to the bit
    vt = t.__class__(**{**{f: getattr(t, f) for f in ("float_model", "calibration", "feeds", "reference")},
                        "workdir": t.workdir / "again", "backend": "cpu", "target": "cpu", "resume": False,
                        "preprocess": False, "preset": res.chosen.preset, "watch": ("y",),
                        "quantize_kw": {"per_channel": res.chosen.per_channel,
                                        "calibrate_method": res.chosen.calibrate_method}})
    again = one_trial(vt, label, list(res.chosen.suggestions))
    after = res.report.after
    assert sha256_file(again.qdq_model) == sha256_file(qdq)
    assert again.sqnr("y") == after.sqnr("y") and again.samples == after.samples and again.task == after.task
    assert again.model_bytes == after.model_bytes
    assert {s.tensor for s in again.suggestions} == {s.tensor for s in after.suggestions}


def test_the_cli_stops_a_lever_that_lowers_the_output_and_no_early_stop_runs_it_whole(tmp_path) -> None:
    """``ivq tune --search`` (CPU-QDQ trials for an HTP target: only the refusal a stop makes certain applies) and
    the same command with ``--no-early-stop``: the same choice and overrides; the stopped lever's full figure lowers
    the output below its bound."""
    u = two_causes_files(tmp_path, evaluation=6)
    docs = {}
    for flag in ([], ["--no-early-stop"]):
        wd = tmp_path / ("full" if flag else "fast")
        code = ivq_cli("tune", u["model"], "--calibration", u["cal"], *u["evals"], "-o", wd, "--backend", "cpu",
                       "--search", "--no-diagnose", "--combinations", "0", *flag)
        assert code == 0
        docs[bool(flag)] = json.loads((wd / "tune.json").read_text())
    fast, full = ({r["lever"]: r for r in docs[k]["search"]["table"]} for k in (False, True))
    stopped = [n for n, r in fast.items() if r.get("stopped")]
    assert stopped and not any(r.get("stopped") for r in full.values())
    for n in stopped:
        assert fast[n]["status"].startswith("lowers y: at most") and not fast[n]["stopped"]["dominated"]
        assert full[n]["sqnr_db"] <= fast[n]["stopped"]["at_most_db"] and full[n]["status"].startswith("lowers y")
    assert docs[False]["search"]["chosen"] == docs[True]["search"]["chosen"]
    assert docs[False]["overrides"] == docs[True]["overrides"]
    assert docs[False]["end_to_end"] == docs[True]["end_to_end"]


def test_levers_run_sample_0_then_the_baselines_hardest_with_the_same_figures(runs, tmp_path) -> None:
    """``hardest_first``: sample 0 (the alignment's value checks are made on the first record), then the others by
    the baseline's score, lowest first; a lever's trial in that order has the figures of the sample order to the
    bit, and a stop at a floor comes no later."""
    t = runs[False]["tuner"]
    before = t.trial("before", [])
    order = hardest_first(sample_scores(before.comparison, ["y"]), 6)
    table = before.comparison.table
    score = table[table["ref_name"] == "y"].groupby("sample")["sqnr_db"].min()
    assert order[0] == 0 and sorted(order) == list(range(6)) and order != tuple(range(6))  # measured: not in order
    assert [score[i] for i in order[1:]] == sorted(score[i] for i in order[1:])
    got, runs_ = {}, {}
    for name, o in (("given", None), ("hardest", order)):
        runs_[name] = replace(t, workdir=tmp_path / name, order=o, _checkpoint=None, _ran=set(), resume=False)
        whole = runs_[name].trial("lever", [UNITS[0]], whole=False)
        got[name] = (whole.sqnr_table, whole.samples, whole.comparison.table)
    assert got["given"][:2] == got["hardest"][:2]
    lt = got["given"][2]
    mine = lt[lt["ref_name"] == "y"].groupby("sample")["sqnr_db"].min()
    floor = float(mine.min()) + 1e-9  # the stop fires at the lever's worst sample, wherever it runs
    ran = {}
    for name, vt in runs_.items():  # (a fresh tuner: not the finished trial of the same set again)
        vt = replace(vt, workdir=tmp_path / f"{name}-stop", _checkpoint=None, _ran=set())
        st = vt.trial("lever", [UNITS[0]], whole=False, stop=lambda worst: worst["y"] < floor).stopped
        ran[name] = (st or {"samples": 6})["samples"]
    # measured: the lever's worst sample is the baseline's hardest but one, run second instead of fifth
    assert ran["hardest"] == list(order).index(int(mine.idxmin())) + 1 < ran["given"] == int(mine.idxmin()) + 1, \
        (order, ran, mine.to_dict())


def test_a_combination_runs_hardest_first_for_the_set_it_grows(tmp_path, monkeypatch) -> None:
    """In the combination step a lever's samples run by the per-sample scores of the current set it is built on
    (that set's job's ``by_sample``); before it, by the baseline's. Each job's ``Tuner.order`` recorded as it
    starts, each finished job's scores as it ends (a real search: the spy only records)."""
    import ivq_debug.tune.search as S

    u = two_causes_trial_inputs(tmp_path, evaluation=6)
    t = Tuner(u["model"], u["cal"], u["feeds"], u["ref"], tmp_path / "wd", backend="cpu", target="cpu",
              resume=False, preprocess=False)
    before = t.trial("before", [])
    order: dict[str, tuple | None] = {}
    scores: dict[str, dict] = {}
    real = S.lever_job

    def job(tuner, label, suggestions, stop=None, same=None, watch=()):
        order[label] = tuner.order if stop is not None else "full"
        out = real(tuner, label, suggestions, stop, same, watch)
        scores[label] = {int(k): v for k, v in out.get("by_sample", {}).items()}
        return out

    monkeypatch.setattr(S, "lever_job", job)
    res = search(t, before, global_levers(t) + unit_levers(t, UNITS))
    base = hardest_first(sample_scores(before.comparison, ["y"]), 6)
    names = [r["lever"] for r in res.table]

    def label(name: str) -> str:
        return lever_label(Lever(name, "combination", "a8w8", False, "minmax"))

    grown = 0
    for name in names:
        if order.get(label(name)) in (None, "full"):
            continue
        # the current set a combination grows: the longest measured lever its name starts with
        parents = [p for p in names if name.startswith(p + " + ") and scores.get(label(p))]
        if parents and name != "a16w8 + per-channel":  # (a global lever of that name, not a grown one)
            parent = max(parents, key=len)
            assert order[label(name)] == hardest_first(scores[label(parent)], 6), (name, parent, order[label(name)])
            grown += order[label(name)] != base
        else:
            assert order[label(name)] == base, (name, order[label(name)], base)
    assert grown, order  # measured: the start's order differs from the baseline's
