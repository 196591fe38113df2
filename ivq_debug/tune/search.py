"""Candidates from the whole lever space, measured and chosen by gain per cost under the user's budget
(``ivq tune --search``, issue 29; the search ModelOpt's ``auto_quantize`` and AIMET's AutoQuant do, verified end to
end).

**Levers**, cheapest first:

* *global* — quantizer knobs over the whole model, each a legal HTP configuration: per-channel weights everywhere,
  16-bit activations everywhere (a16w8), both, a16w16, and the calibration method (MinMax, entropy, percentile,
  ORT's quantizer);
* *pattern* — a pattern group of the introduced-error replay (``diagnose``), its suggestions as one set;
* *unit* — the per-cause suggestions (:func:`unit_levers`: weights, activations, all of them);
* *combination* — a16w8 + per-channel (a16w8 with ``per_channel``) among the globals; then the **combination
  step** (:func:`grow`): from the best lever measured (the start), first the unit levers of the start's own
  diagnosis (``search(diagnosis=…)``: what is left wrong once its knobs are set), then a greedy search over its
  combinations with every other
  lever that gained alone (global knobs merged — a16w8 + per-channel + a calibration method — and the unit
  levers' overrides added) or that the baseline's precision forbids but a 16-bit-activation set runs (16-bit
  weights), ranked by measured gain per cost, under a budget of extra trials (``--combinations``); each round
  measures the next few as jobs and keeps the best, and the step stops when a round adds less than the minimum
  gain, reaches the target, or the budget is spent.

Every lever is one trial (:meth:`~ivq_debug.tune.verify.Tuner.trial` on a tuner with the lever's knobs: written in
the delivered format, checked against the target's precision table, quantized, captured, compared on the
evaluation set). Per lever: ``gain`` = worst watched SQNR − the baseline's; ``cost`` = relative model-size increase
(or emulated HTP cycles when every trial has a profile), floored at 1 %; ``gain/cost``; within budget when
``--max-size`` / ``--max-cycles`` hold. **Choice**: among the levers that lower no watched tensor and no task metric
and are within budget, with ``--target-metric`` the *cheapest* that reaches it (then the larger gain), else the
largest gain (then the lower cost). The *frontier* is the levers no other lever beats on both gain and cost. The
chosen set is then confirmed on HTP when the trials ran on CPU-QDQ (:func:`~ivq_debug.tune.verify.confirm_on_target`);
when refused there, the next choice is tried.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ivq_debug.executor import Executor, Job, JobFailure, JobsFailedError, LocalExecutor, job_key, merge_check
from ivq_debug.inputfiles import sha256_file
from ivq_debug.jsonio import json_safe
from ivq_debug.onnxgraph.load import model_file_bytes
from ivq_debug.tune.legal import forbidden, refusal, violations
from ivq_debug.tune.suggest import SUGGESTION_SCHEMA, Suggestion
from ivq_debug.tune.sweep import RESULT_SCHEMA as SWEEP_RESULT
from ivq_debug.tune.sweep import SWEEP_FIELDS, job_meta
from ivq_debug.tune.verify import (
    Stop,
    Trial,
    Tuner,
    TuneReport,
    _default_watch,
    _suggestion_key,
    confirm_on_target,
    judge,
    sample_scores,
)

#: a lever's relative cost below this counts as this (a free lever ranks by its gain alone)
COST_FLOOR = 0.01
#: calibration methods tried as global levers (``CALIBRATE_METHODS`` keys; distribution is entropy's sibling)
CALIBRATION_LEVERS = ("minmax", "entropy", "percentile")
#: the job kind of a lever (its key)
KIND = "tune-search/1"
#: extra trials the combination step may run by default (``ivq tune --combinations``)
COMBINATIONS = 6
#: combinations measured per round of the combination step (one batch of jobs: parallel with ``--workers``)
COMBINATION_WIDTH = 2


@dataclass
class Lever:
    """One candidate: quantizer knobs plus override suggestions."""

    name: str
    kind: str  # global | pattern | unit | combination
    preset: str
    per_channel: bool
    calibrate_method: str
    suggestions: list[Suggestion] = field(default_factory=list)
    #: the measured levers it is made of (itself for a lever of the initial list)
    parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.parts = self.parts or (self.name,)

    def signature(self) -> tuple[Any, ...]:
        """What the trial depends on: two levers of one signature are one set (one job)."""
        return (self.preset, self.per_channel, self.calibrate_method,
                tuple(sorted(map(repr, map(_suggestion_key, self.suggestions)))))

    def knobs(self) -> dict[str, Any]:
        """What ``ivq quantize`` needs besides the overrides file."""
        return {"preset": self.preset, "per_channel": self.per_channel, "calibrate_method": self.calibrate_method}

    def command(self) -> str:
        """The ``ivq quantize`` flags that reproduce the lever's knobs."""
        flags = [f"--preset {self.preset}"]
        if self.per_channel:
            flags.append("--per-channel")
        if self.calibrate_method != "minmax":
            flags.append(f"--calibrate-method {self.calibrate_method}")
        return " ".join(flags)


def _knobs(tuner: Tuner) -> tuple[str, bool, str]:
    kw = tuner.quantize_kw
    return tuner.preset, bool(kw.get("per_channel")), str(kw.get("calibrate_method", "minmax")).lower()


def global_levers(tuner: Tuner) -> list[Lever]:
    """The quantizer knobs the baseline does not have yet, cheapest first (all legal on HTP)."""
    preset, pc, cm = _knobs(tuner)
    out: list[Lever] = []
    if not pc:
        out.append(Lever("per-channel", "global", preset, True, cm))
    for m in CALIBRATION_LEVERS:
        if m != cm:
            out.append(Lever(f"calibration {m}", "global", preset, pc, m))
    if preset == "a8w8":
        out.append(Lever("a16w8", "global", "a16w8", pc, cm))
        if not pc:
            out.append(Lever("a16w8 + per-channel", "combination", "a16w8", True, cm))
    if preset != "a16w16":
        out.append(Lever("a16w16", "global", "a16w16", pc, cm))
    return out


def remedy_suggestions(replay: Any, calibrated: dict[str, tuple[float, float]]) -> dict[str, list[Suggestion]]:
    """The fixes by cause of the replay's units over budget (:mod:`ivq_debug.diagnose.remedy`) as suggestions,
    by cause: a16 (on the calibrated range), widen (the remedy's range), per-channel / 16-bit weights (with the
    16-bit activations a w16 fix names), fp16 (the node left float). A weight re-quantized from its values
    (``requantize_weight``) has no override form here and is left out."""
    by: dict[str, dict[str, Suggestion]] = {}
    for node in getattr(replay, "evidence", {}) or {}:
        for r in replay.remedies(node):
            got = by.setdefault(r.cause, {})
            why = f"{r.cause}: {r.text}"
            if r.lever in ("w_per_channel", "w16"):
                for w in r.weights:
                    axis = (r.override or {}).get(w, [{}])[0].get("axis")
                    got[w] = Suggestion(w, r.lever, why, axis=axis, node=r.unit, group=r.cause)
            if r.lever == "fp16":
                got[r.unit] = Suggestion(r.tensors[0] if r.tensors else r.unit, "fp16", why, node=r.unit,
                                         group=r.cause)
                continue
            for t in r.tensors:
                entry = (r.override or {}).get(t, [{}])[0]
                if "rmin" in entry and "rmax" in entry:
                    got[t] = Suggestion(t, "widen", why, float(entry["rmin"]), float(entry["rmax"]), group=r.cause)
                elif t in calibrated:
                    got[t] = Suggestion(t, "a16", why, *calibrated[t], group=r.cause)
    return {c: list(v.values()) for c, v in by.items() if v}


def unit_levers(tuner: Tuner, suggestions: Sequence[Suggestion], replay: Any = None) -> list[Lever]:
    """Levers from per-cause fixes: with a replay that carries unit evidence, the remedies of
    :mod:`ivq_debug.diagnose.remedy` (one lever per cause, and all of them); then the ``suggest()`` suggestions:
    each pattern group, the weight entries, the activation entries, all. The one place unit levers are made."""
    preset, pc, cm = _knobs(tuner)
    sug = list(suggestions)
    out: list[Lever] = []
    if replay is not None:
        rem = remedy_suggestions(replay, tuner.calibrated())
        out += [Lever(f"remedy {cause}", "unit", preset, pc, cm, ss) for cause, ss in rem.items()]
        if len(rem) > 1:
            names: dict[str, Suggestion] = {}
            for ss in rem.values():
                names.update({s.tensor: s for s in ss})
            out.append(Lever("remedy all", "unit", preset, pc, cm, list(names.values())))
    groups: dict[str, list[Suggestion]] = {}
    for s in sug:
        if s.group:
            groups.setdefault(s.group, []).append(s)
    for g, ss in groups.items():
        if len(ss) < len(sug):
            out.append(Lever(f"pattern {g}", "pattern", preset, pc, cm, ss))
    w = [s for s in sug if s.is_weight]
    a = [s for s in sug if not s.is_weight]
    if w and a:
        out += [Lever("unit weights", "unit", preset, pc, cm, w), Lever("unit activations", "unit", preset, pc, cm, a)]
    if sug:
        out.append(Lever("unit all", "unit", preset, pc, cm, sug))
    return out


def combine(a: Lever, b: Lever) -> Lever:
    """Two levers at once: the larger preset, per-channel when either has it, ``a``'s calibration method unless it
    is the default, the suggestions of both (``b``'s entry for a tensor both name)."""
    order = ("a8w8", "a16w8", "a16w16")
    preset = max(a.preset, b.preset, key=order.index)
    cm = a.calibrate_method if a.calibrate_method != "minmax" else b.calibrate_method
    names = {s.tensor for s in b.suggestions}
    sug = [s for s in a.suggestions if s.tensor not in names] + list(b.suggestions)
    return Lever(f"{a.name} + {b.name}", "combination", preset, a.per_channel or b.per_channel, cm, sug,
                 a.parts + tuple(p for p in b.parts if p not in a.parts))


def grow(levers: Sequence[Lever], rows: Sequence[dict[str, Any]], measure: Callable[[Sequence[Lever]], None], *,
         budget: int = COMBINATIONS, width: int = COMBINATION_WIDTH, min_gain_db: float = 0.5,
         max_size: float | None = None, base_bytes: float = 0.0,
         reached: Callable[[dict[str, Any]], bool] | None = None,
         legal: Callable[[Lever], bool] | None = None,
         units: Callable[[Lever], Sequence[Lever]] | None = None,
         state: dict[str, Any] | None = None,
         resolve: Callable[[Collection[str]], None] | None = None) -> list[Lever]:
    """The combination step: greedy growth of the best measured lever by the other levers, at most ``budget``
    extra trials; returns the combinations measured (``measure`` runs a batch and appends their rows to ``rows``).

    *Parts*: the levers that gained alone (status ok, gain > 0), ranked by gain per relative size cost (floored at
    :data:`COST_FLOOR`), then the levers the baseline's precision forbids (``not run by``: 16-bit weights under
    8-bit activations, which a 16-bit-activation set runs), fewest overrides first. *Start*: the ok lever of the
    largest gain within ``max_size``. *Round*: the next ``width`` combinations of the current set with a part it
    does not hold — skipping a set already measured (same :meth:`Lever.signature`), one ``legal`` refuses (the
    target's precision table) and one whose estimated size
    (the parts' size increases summed) is over ``max_size`` — measured as one batch; the best of them becomes the
    current set when it adds at least ``min_gain_db`` (and lowers no task metric of the current set). Stops when a
    round does not, when ``reached(row)`` holds for the current set (a target met: more costs more), or when the
    budget is spent.

    ``units(start)``: the unit levers of the start's *own* diagnosis (what is left wrong once its knobs are set:
    on PP-OCRv4 the a8w8 baseline's diagnosis names activations, the diagnosis of a16w8 + per-channel names 20
    weights whose 16-bit grid takes the output from 9.7 to 44 dB); measured first, fewest overrides first, as one
    batch within the budget, each as the start with its overrides (``<start> + <lever> (its diagnosis)``); the
    best of them is grown on when it adds the minimum gain.

    ``state``: ``state["current"]`` is set to the current set's name before each batch is measured (the search's
    early stop of a combination that cannot grow it, :func:`search`). ``resolve(names)``: the search runs these
    levers it stopped early (rows with ``stopped``) on every sample. A round calls it for a stopped lever only when
    the lever could rank before the next part it takes (its gain at most ``stopped["gain_at_most_db"]``, its size
    known) and its combination with the current set would be tried; so the parts and the rounds are those without
    early stops (a lever stopped as dominated cannot be the start: a measured lever beat it)."""
    row = {r["lever"]: r for r in rows}
    by = {lv.name: lv for lv in levers}

    def rel(name: str) -> float | None:
        b = row[name].get("model_bytes")
        return float(b) / base_bytes - 1.0 if b and base_bytes else None

    def ok(name: str) -> bool:
        return name in row and row[name]["status"] == "ok" and row[name]["gain_db"] is not None

    def ranked() -> tuple[list[str], list[Lever]]:
        """The levers that gained alone by gain per size cost, and the parts (those, then the forbidden ones)."""
        gained = sorted((n for n in by if n in row and ok(n) and row[n]["gain_db"] > 0),
                        key=lambda n: -row[n]["gain_db"] / max(rel(n) or 0.0, COST_FLOOR))
        forbid = sorted((n for n in by if n in row and row[n]["status"].startswith("not run by")),
                        key=lambda n: len(by[n].suggestions))
        return gained, [by[n] for n in gained + forbid]

    gained, parts = ranked()
    affordable = [n for n in gained if max_size is None or (rel(n) or 0.0) <= max_size - 1.0]
    if not affordable or budget <= 0:
        return []
    current = by[max(affordable, key=lambda n: row[n]["gain_db"])]
    seen = {by[n].signature() for n in by} | {current.signature()}
    done: list[Lever] = []

    def keep_best(batch: Sequence[Lever]) -> bool:
        """Measure ``batch``; the current set becomes its best when that adds the minimum gain."""
        nonlocal current
        if state is not None:
            state["current"] = current.name
        measure(batch)
        done.extend(batch)
        row.update({r["lever"]: r for r in rows})
        cur = row[current.name]
        better = [c for c in batch if ok(c.name) and row[c.name]["gain_db"] >= cur["gain_db"] + min_gain_db
                  and all(row[c.name]["task"].get(k, v) >= v for k, v in cur["task"].items())]
        if better:
            current = max(better, key=lambda c: row[c.name]["gain_db"])
        return bool(better)

    if units is not None and not (reached and reached(row[current.name])):
        own = []
        for u in sorted(units(current), key=lambda u: len(u.suggestions)):
            c = combine(current, u)
            c = replace(c, name=f"{current.name} + {u.name} (its diagnosis)",
                        parts=(*current.parts, f"{u.name} (diagnosis of {current.name})"))
            if len(own) < budget and c.signature() not in seen and not (legal and not legal(c)):
                seen.add(c.signature())
                own.append(c)
        if own:
            keep_best(own)
    def efficiency(n: str, gain: float) -> float:
        return gain / max(rel(n) or 0.0, COST_FLOOR)

    def tried(p: Lever) -> Lever | None:
        """The combination of the current set with ``p`` a round measures, or None when it skips it."""
        if set(p.parts) <= set(current.parts):
            return None
        c = combine(current, p)
        grow_by = [rel(n) for n in c.parts if n in row]
        if c.signature() in seen or (legal and not legal(c)) or (
                max_size is not None and None not in grow_by and sum(grow_by) > max_size - 1.0):
            return None
        return c

    def unsure(above: float) -> list[str]:
        """Stopped levers that may rank at or before a part of efficiency ``above`` and would be tried."""
        return [n for n in by if n in row and (row[n].get("stopped") or {}).get("dominated")
                and row[n]["stopped"].get("gain_at_most_db", 0.0) > 0
                and efficiency(n, row[n]["stopped"]["gain_at_most_db"]) >= above and tried(by[n]) is not None]

    while len(done) < budget and not (reached and reached(row[current.name])):
        batch: list[Lever] = []
        need: list[str] = []
        for p in parts:
            if len(batch) >= min(width, budget - len(done)):
                break
            need = unsure(efficiency(p.name, row[p.name]["gain_db"]) if p.name in gained else -math.inf)
            if need:
                break
            c = tried(p)
            if c is None:
                continue
            seen.add(c.signature())
            batch.append(c)
        else:
            need = unsure(-math.inf)
        if need and resolve is not None:  # their figures decide this round: measured in full, the round again
            seen.difference_update(c.signature() for c in batch)
            resolve(need)
            row.update({r["lever"]: r for r in rows})
            gained, parts = ranked()
            continue
        if not batch:
            break
        if not keep_best(batch):
            break
    return done


@dataclass
class SearchResult:
    """Every lever measured, the frontier, the chosen lever and its report."""

    table: list[dict[str, Any]]
    chosen: Lever | None
    report: TuneReport
    cost_basis: str
    #: the levers as executor jobs: executor, total, run, resumed from shards, retried, the shard folder
    jobs: dict[str, Any] = field(default_factory=dict)

    @property
    def frontier(self) -> list[str]:
        """The levers no other eligible lever beats on both gain and cost, by cost."""
        return [r["lever"] for r in self.table if r.get("frontier")]

    def to_dict(self) -> dict[str, Any]:
        """The report's document with a ``search`` section (table, frontier, chosen lever and its knobs)."""
        doc = self.report.to_dict()
        doc["search"] = json_safe({"table": self.table, "frontier": self.frontier, "cost_basis": self.cost_basis,
                                   "chosen": self.chosen.name if self.chosen else None,
                                   "quantize": self.chosen.knobs() if self.chosen else None,
                                   "command": self.chosen.command() if self.chosen else None,
                                   "jobs": self.jobs})
        return doc


def hardest_first(scores: Mapping[int, float], n: int) -> tuple[int, ...] | None:
    """Sample 0, then the other ``n - 1`` evaluation samples by ``scores`` (:func:`sample_scores` of the set a lever
    is built on: the baseline's, or the combination step's current set's), lowest first, ties and samples without a
    score after, in sample order: the :attr:`~ivq_debug.tune.verify.Tuner.order` of a lever's trial. A lever that
    cannot matter usually falls below its floor on the samples hard for the set it changes, so its early stop
    comes after fewer samples. Sample 0 stays first: the alignment's value checks are made on the first record
    compared (:func:`~ivq_debug.align.matcher.align` ``memo``), as in a whole capture compared afterwards, so every
    figure is the one the sample order gives, to the bit. None without scores."""
    if not scores or n < 2:
        return None
    return (0, *sorted(range(1, n), key=lambda i: (scores.get(i, math.inf), i)))


def _variant(tuner: Tuner, lever: Lever) -> Tuner:
    kw = dict(tuner.quantize_kw) | {"per_channel": lever.per_channel, "calibrate_method": lever.calibrate_method}
    if not lever.per_channel:
        kw.pop("per_channel")
    return replace(tuner, preset=lever.preset, quantize_kw=kw, _checkpoint=tuner._ckpt(), _source=tuner._source,
                   _calibrated=tuner._calibrated, _ranges=tuner._ranges)


def _score(tr: Trial, watch: Sequence[str]) -> float | None:
    vals = [tr.sqnr(w) for w in watch]
    return None if not vals or any(v is None for v in vals) else min(vals)


def search(tuner: Tuner, before: Trial, levers: Sequence[Lever], *, watch: Sequence[str] = (),
           max_size: float | None = None, max_cycles: float | None = None, target: float | None = None,
           target_task: str | None = None, min_gain_db: float = 0.5, combinations: int = COMBINATIONS,
           progress: Callable[[str], None] | None = None, executor: Executor | None = None,
           shards: str | os.PathLike | None = None,
           diagnosis: Callable[[Tuner, Lever], Sequence[Lever]] | None = None,
           early_stop: bool = True, frontier: bool = False) -> SearchResult:
    """Measure ``levers``, then up to ``combinations`` combinations of them (:func:`grow`), choose, confirm on the
    target.

    Args:
        max_size / max_cycles: the largest model-size / HTP-cycle ratio to the baseline a lever may have.
        target: the value to reach: the worst watched SQNR (dB), or the task metric ``target_task`` when given.
        min_gain_db: the least gain of an eligible lever (without a target), and the least a combination must add
            to the set it grows.
        combinations: the combination step's budget of extra trials (0: none).
        executor: runs each lever as a job (:mod:`ivq_debug.executor`: ``LocalExecutor(n)``, ``RayExecutor``;
            default: one after the other in this process); each job is a partial capture in its own folder
            (:func:`lever_job`) and leaves a JSON shard, so an interrupted search resumes from the shards.
        shards: the shard folder (default ``<workdir>/search/shards``).
        diagnosis: ``(tuner with a lever's knobs, lever) -> unit levers`` of that lever's own diagnosis: the
            combination step's first round on its start (:func:`grow` ``units``).
        early_stop: a lever's trial ends at the sample that proves it cannot matter (:class:`Below`; the choice,
            the delivered files and the figures of every lever measured in full are the same without).
        frontier: measure the frontier in full: a lever that cannot be chosen still runs every sample unless an
            eligible lever of no greater cost scored above its bound (the frontier marks are then those of a
            search without early stops). Without it (default) such a lever stops once it cannot be chosen, and a
            lever measured in full whose frontier mark a stopped lever could overturn has the mark open
            (``frontier_open``: who could); the choice and the delivered files are the same either way.
    """
    watch = list(watch) or _default_watch(before)
    tuner = tuner.watching(watch)
    # each lever's samples run hardest first for the set it is built on (the baseline, or the combination step's
    # current set): its per-sample scores, by lever name ("" the baseline)
    by_sample: dict[str, dict[int, float]] = {"": sample_scores(before.comparison, watch)}
    s0 = _score(before, watch)
    rows: list[dict[str, Any]] = []
    trials: dict[str, tuple[Lever, Trial]] = {}
    shas: dict[str, str | None] = {}  # the model each lever's job measured
    root = Path(tuner.workdir).resolve() / "search"
    shards = Path(shards) if shards is not None else root / "shards"
    executor = executor or LocalExecutor(1)
    meta = job_meta(tuner)
    counted: set[str] = set()
    jobs_info: dict[str, Any] = {"executor": type(executor).__name__, "total": 0, "run": 0, "resumed": 0,
                                 "retried": [], "shards": str(shards)}

    state: dict[str, Any] = {}  # the combination step's current set (grow), "full": no early stop
    # the models measured in full, by SHA-256: a lever quantized to one of them takes its figures (same_model)
    same: dict[str, dict[str, Any]] = {}
    if not before.error and before.stopped is None and Path(before.qdq_model).is_file():
        same[sha256_file(before.qdq_model)] = {
            "lever": "the baseline", "sqnr": dict(before.sqnr_table) or {
                w: v for w in watch if (v := before.sqnr(w)) is not None},
            "task": dict(before.task), "cycles": before.cycles, "samples": dict(before.samples)}

    def over(r: dict[str, Any]) -> list[str]:
        """What of ``--max-size`` / ``--max-cycles`` a measured row breaks."""
        out = []
        size = float(r["model_bytes"] or 0) / float(before.model_bytes or 1)
        if max_size is not None and size > max_size:
            out.append(f"size x{size:.2f} > --max-size x{max_size:g}")
        if max_cycles is not None and r["cycles"] and before.cycles and r["cycles"] / before.cycles > max_cycles:
            out.append(f"cycles x{r['cycles'] / before.cycles:.2f} > --max-cycles x{max_cycles:g}")
        return out

    def eligible(r: dict[str, Any]) -> bool:
        """A row measured in full that the choice may take (the rule of the final pass below)."""
        return r["status"] == "ok" and r["gain_db"] is not None and not over(r) \
            and (target is not None or r["gain_db"] >= min_gain_db)

    def floor() -> tuple[Below, str] | None:
        """The early stop of the next batch's levers (:class:`Below`), and why a dominated one cannot matter: below
        the baseline's score it lowers a watched tensor (refused, never a part of a combination); below the best
        eligible lever measured (and ``target``; in a combination round, below the current set's score plus the
        minimum gain) it can be neither chosen, nor the combination step's start, nor grow the set — and with a
        rival of no greater cost above it, not on the frontier. That dominance only when the trials run on the
        target (no HTP check may refuse the choice afterwards) and the choice is by SQNR (no task target)."""
        if s0 is None or state.get("full") or not early_stop:
            return None
        elig = [r for r in rows if eligible(r)]
        cur = next((r for r in rows if r["lever"] == state.get("current")), None)
        lim, why = s0, ""
        if elig and not (target is not None and target_task) and tuner.backend == tuner.target:
            best = max(elig, key=lambda r: r["sqnr_db"])
            grows = math.inf
            if cur is not None and cur["sqnr_db"] is not None:  # to grow the set: the best of its round, + min gain
                grows = max([cur["sqnr_db"] + min_gain_db] + [
                    r["sqnr_db"] for r in rows if r["lever"] in state.get("round", ()) and r["status"] == "ok"
                    and r["sqnr_db"] >= cur["sqnr_db"] + min_gain_db
                    and all(r["task"].get(k, v) >= v for k, v in cur["task"].items())])
            lim = min(best["sqnr_db"], math.inf if target is None else target, grows)
            why = (f"neither chosen over {best['lever']} ({best['sqnr_db']:.2f} dB)"
                   + (f" nor reaching the target {target:g} dB" if target is not None else "")
                   + (f" nor growing {cur['lever']} by {min_gain_db:g} dB" if cur is not None else ""))
        rivals = tuple((r["sqnr_db"], r["model_bytes"], r["cycles"]) for r in elig) if lim > s0 else ()
        return Below(tuple(watch), s0, max(lim, s0), rivals, frontier=frontier), why

    def run(batch: Sequence[Lever]) -> None:
        """``batch`` in rounds of as many levers as the executor runs at once (:func:`run_jobs`), each round's
        early stop from what the rounds before measured."""
        step = max(1, int(getattr(executor, "workers", 0) or len(batch) or 1))
        state["round"] = []
        for i in range(0, len(batch), step):
            run_jobs(batch[i:i + step])
            state["round"] += [lv.name for lv in batch[i:i + step]]

    def run_jobs(batch: Sequence[Lever]) -> None:
        """The legal levers of ``batch`` as jobs on the executor (a rerun skips the shards there), each row
        filled from its shard; a job stops early when its worst watched SQNR so far is below :func:`floor`."""
        stop = floor()
        order = None if stop is None or tuner.order is not None else hardest_first(
            by_sample.get(state.get("current") or "") or by_sample[""], len(tuner.feeds))
        jobs: dict[str, Job] = {}
        todo: list[tuple[Lever, dict[str, Any], str]] = []
        for lv in batch:
            why = forbidden(lv.suggestions, tuner.source(), lv.preset, tuner.target)
            row: dict[str, Any] = {"lever": lv.name, "kind": lv.kind, "knobs": lv.command(),
                                   "overrides": len(lv.suggestions), "sqnr_db": None, "gain_db": None,
                                   "model_bytes": None, "cycles": None, "cost": None, "efficiency": None,
                                   "eligible": False, "status": "", "frontier": False, "task": {}}
            rows.append(row)
            if why:
                row["status"] = refusal(why, tuner.target)
                continue
            if progress:
                progress(lv.name)
            label = lever_label(lv)
            below = None if stop is None else replace(stop[0])
            key = job_key(kind=KIND, knobs=lv.knobs(), overrides=[_suggestion_key(x) for x in lv.suggestions],
                          watch=watch, **meta, **({"stop": below.key(), "order": list(order or ())}
                                                  if below else {}))
            if key not in jobs:  # two levers of the same knobs and overrides (two names of one set): one job
                worker = _variant(tuner, lv).worker(root / "jobs" / label)
                if order is not None:
                    worker = replace(worker, order=order)
                jobs[key] = Job(key, lever_job, {"tuner": worker, "label": label,
                                                 "suggestions": [x.to_dict() for x in lv.suggestions],
                                                 "stop": below, "same": dict(same), "watch": list(watch)}, meta)
            todo.append((lv, row, key))
        if not jobs:
            return
        live = tuner.live()
        if live is not None:  # the batch's measured tensors: the float reference keeps them from the first forward
            live.expect({t for lv, _, _ in todo for t in tuner.measured(lv.suggestions, tuner.outputs())})
        report = executor.run(list(jobs.values()), shards, "search", progress=False)
        if report.failures:
            names = {k: lv.name for lv, _, k in todo}
            raise JobsFailedError([JobFailure(f"{names.get(f.key, '?')} ({f.key})", f.error)
                                   for f in report.failures], shards)
        docs = {k: report.load(k, RESULT_SCHEMA) for k in jobs}
        merge_check(docs.values(), SWEEP_FIELDS)
        new = set(jobs) - counted  # a combination equal to a lever measured above is that lever's job
        counted.update(new)
        jobs_info["total"] += len(new)
        jobs_info["resumed"] += len(new & set(report.skipped))
        jobs_info["run"] += len(new - set(report.skipped))
        jobs_info["retried"] = sorted({*jobs_info["retried"], *report.retried})
        for lv, row, key in todo:
            tr = shard_trial(docs[key]["result"], Path(jobs[key].kwargs["tuner"].workdir))
            trials[lv.name] = (lv, tr)
            by_sample[lv.name] = {int(i): v for i, v in (docs[key]["result"].get("by_sample") or {}).items()}
            shas[lv.name] = docs[key]["result"].get("model_sha256")
            lv.suggestions = list(tr.suggestions)  # the types the quantizer resolved are part of the lever
            sc = _score(tr, watch)
            if tr.stopped and stop is not None and sc is not None:
                row |= {"model_bytes": tr.model_bytes, "cycles": tr.cycles,
                        "stopped": tr.stopped | {"at_most_db": sc, "gain_at_most_db": sc - s0,
                                                 "floor_db": stop[0].floor, "dominated": sc >= s0}}
                where = f"at most {sc:.2f} dB after {tr.stopped['samples']} of {tr.stopped['of']} samples (stopped)"
                w = min(watch, key=lambda n: tr.sqnr(n) if tr.sqnr(n) is not None else math.inf)
                row["status"] = (f"dominated: {where} < {stop[0].floor:.2f} dB, {stop[1]}" + (
                    ", and a lever of no greater cost measured above it" if frontier else
                    " (not run to the end: --frontier would)") if sc >= s0 else
                    f"lowers {w}: {where} < {before.sqnr(w):.2f} dB, the baseline's")
                continue
            bad = judge(before, tr, watch)
            row |= {"sqnr_db": sc, "gain_db": None if sc is None or s0 is None else sc - s0,
                    "model_bytes": tr.model_bytes, "cycles": tr.cycles, "task": dict(tr.task)}
            row["status"] = bad or "ok"
            res = docs[key]["result"]
            if res.get("same_model_as"):
                row["same_model_as"] = res["same_model_as"]
            elif not tr.error and tr.stopped is None and res.get("model_sha256"):
                same.setdefault(res["model_sha256"], {"lever": lv.name, "sqnr": dict(res["sqnr"]),
                                                      "task": dict(res["task"]), "cycles": res["cycles"],
                                                      "samples": dict(res["samples"])})

    # the quantizer's knobs first: the best of them is what the diagnosis' levers must beat to matter (:func:`floor`)
    order = {lv.name: i for i, lv in enumerate(levers)}
    run([lv for lv in levers if lv.kind in ("global", "combination")])
    run([lv for lv in levers if lv.kind not in ("global", "combination")])
    rows.sort(key=lambda r: order.get(r["lever"], len(order)))
    measured: list[Lever] = list(levers)

    def resolve(names: Collection[str] | None = None) -> None:
        """The levers stopped as dominated (of ``names``; default all) run again on every sample, in place: a
        later step needs their figures (the combination step's parts, a frontier their bound cannot settle)."""
        again = [(i, r) for i, r in enumerate(rows) if (r.get("stopped") or {}).get("dominated")
                 and (names is None or r["lever"] in names)]
        if not again:
            return
        by = {lv.name: lv for lv in measured}
        n = len(rows)
        state["full"] = True
        try:
            run([by[r["lever"]] for _, r in again])
        finally:
            state["full"] = False
        new = {r["lever"]: r for r in rows[n:]}
        del rows[n:]
        for i, r in again:
            rows[i] = new[r["lever"]]

    def reached(r: dict[str, Any]) -> bool:
        if target is None:
            return False
        v = r["task"].get(target_task) if target_task else r["sqnr_db"]
        return v is not None and v >= target

    measured += grow(levers, rows, run, budget=combinations, min_gain_db=min_gain_db, max_size=max_size,
                     base_bytes=float(before.model_bytes or 0), reached=reached,
                     legal=lambda lv: not forbidden(lv.suggestions, tuner.source(), lv.preset, tuner.target),
                     units=None if diagnosis is None else lambda lv: diagnosis(_variant(tuner, lv), lv),
                     state=state, resolve=resolve)

    def basis_now() -> str:
        return "cycles" if before.cycles and all(r["cycles"] for r in rows if r["status"] == "ok") else "model_bytes"

    def cost(r: dict[str, Any], basis: str) -> float:
        c0 = float(before.cycles or 0) if basis == "cycles" else float(before.model_bytes or 0)
        return (float(r[basis] or 0) / c0 if c0 else 1.0) - 1.0

    # a lever stopped as dominated is off the frontier when an eligible lever of no greater cost (in the table's
    # basis) measured above its bound; else (the HTP cycles it was stopped on moved) it runs again on every sample
    basis = basis_now()
    if frontier:
        resolve([r["lever"] for r in rows if (r.get("stopped") or {}).get("dominated") and not any(
            eligible(o) and o["sqnr_db"] > r["stopped"]["at_most_db"] and cost(o, basis) <= cost(r, basis)
            for o in rows)])
    basis = basis_now()
    for r in rows:
        if r.get("stopped"):
            r["cost"] = cost(r, basis)
        if r["gain_db"] is None:
            continue
        r["cost"] = cost(r, basis)
        r["efficiency"] = r["gain_db"] / max(r["cost"], COST_FLOOR)
        broke = over(r)
        if r["status"] == "ok":
            if broke:
                r["status"] = "over budget: " + "; ".join(broke)
            elif r["gain_db"] < min_gain_db and target is None:
                r["status"] = f"gain below {min_gain_db:g} dB"
            else:
                r["eligible"] = True
                r["status"] = "eligible"
    for r in rows:
        if r.get("same_model_as") and not r["eligible"]:
            r["status"] += f" (the model of {r['same_model_as']}, the same bytes: its figures, not run again)"
    elig = [r for r in rows if r["eligible"]]
    for r in elig:  # the frontier: no eligible lever with cost <= and gain >= (one of them strictly)
        r["frontier"] = not any(o is not r and o["cost"] <= r["cost"] and o["gain_db"] >= r["gain_db"]
                                and (o["cost"] < r["cost"] or o["gain_db"] > r["gain_db"]) for o in elig)
        # a lever stopped as dominated (not measured in full) that may beat it on both: the mark is open
        could = [o["lever"] for o in rows if (o.get("stopped") or {}).get("dominated") and o["cost"] is not None
                 and o["cost"] <= r["cost"] and o["stopped"]["gain_at_most_db"] >= r["gain_db"]]
        if r["frontier"] and could:
            r["frontier"], r["frontier_open"] = False, could

    def value(r: dict[str, Any]) -> float:
        if target_task:
            return float(r["task"].get(target_task, float("-inf")))
        return float(r["sqnr_db"])

    if target is not None:
        reach = sorted((r for r in elig if value(r) >= target), key=lambda r: (r["cost"], -r["gain_db"]))
        rest = sorted((r for r in elig if value(r) < target), key=lambda r: (-value(r), r["cost"]))
        order = reach + rest
    else:
        order = sorted(elig, key=lambda r: (-r["gain_db"], r["cost"]))
    refused: list[dict[str, Any]] = [{"candidate": r["lever"], "label": None, "reason": r["status"]}
                                     for r in rows if not r["eligible"] and r["status"] not in ("ok", "eligible")]
    for r in order:
        lv, tr = trials[r["lever"]]
        # the chosen lever in this workdir (checkpointed): the model and overrides the report delivers
        tr = _deliver(_variant(tuner, lv), lv, tr, shas.get(lv.name))
        why = judge(before, tr, watch)
        check: dict[str, Any] = {}
        if why is None:
            why, check = confirm_on_target(tuner, before, tr, watch, after_tuner=_variant(tuner, lv))
        if why is None:
            r["status"] = "chosen"
            rep = TuneReport(before, tr, watch, steps=[{"candidate": lv.name, "label": tr.label, "kept": True}],
                             refused=refused, backend=tuner.backend, format=tuner.fmt, target_check=check)
            return _done(SearchResult(rows, lv, rep, basis, jobs_info), root, tuner.keep_dumps)
        r["status"] = f"refused: {why}"
        refused.append({"candidate": lv.name, "label": tr.label, "reason": why})
    rep = TuneReport(before, replace(before, suggestions=[]), watch, refused=refused, recommended=False,
                     backend=tuner.backend, format=tuner.fmt)
    return _done(SearchResult(rows, None, rep, basis, jobs_info), root, tuner.keep_dumps)


def _deliver(tuner: Tuner, lever: Lever, measured: Trial, sha: str | None) -> Trial:
    """The chosen lever's files in the workdir — its model quantized again from the lever's suggestions (the run's
    model cache serves it: :meth:`~ivq_debug.tune.verify.Tuner.trial`), its overrides file — with the figures its
    job measured, checkpointed as a trial: the job ran these model bytes on the same samples, so running them again
    gives the same figures (a16w16 on the PP-OCRv4 recognizer: 12 lines of HTP emulation, ~130 s, not repeated).
    When the bytes differ from the job's (``sha``, or none recorded) the trial runs again, as it did before."""
    label, sug = measured.label, list(lever.suggestions)
    wd = Path(tuner.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    qdq = wd / f"{label}.qdq.onnx"
    if sha is None or measured.stopped or measured.error or tuner.keep_dumps:
        return tuner.trial(label, sug)
    ov_path, applied, fixes, exclude = tuner._quantize(label, sug, qdq)
    if sha256_file(qdq) != sha:
        return tuner.trial(label, sug)
    tr = replace(measured, suggestions=applied, qdq_model=qdq, dump=wd / f"{label}.h5", comparison=None,
                 model_bytes=model_file_bytes(qdq), overrides=ov_path, fixes=[f.to_dict() for f in fixes],
                 session=tuner.qnn_options() if tuner.backend == "qnn" else None)
    outs = tuner.outputs()
    tuner._save(tuner.key(sug), {
        "label": label, "suggestions": [s.to_dict() for s in sug], "qdq_model": tuner._rel(qdq),
        "dump": tuner._rel(tr.dump), "target": tuner.target, "session": tr.session,
        "overrides": tuner._rel(ov_path) if ov_path else None, "task": dict(tr.task), "fallback": bool(exclude),
        "model_bytes": tr.model_bytes, "cycles": tr.cycles, "seconds": round(tr.seconds, 2), "fixes": tr.fixes,
        "sqnr": tr.sqnr_table, "samples": tr.samples, "measured": sorted(tuner.measured(applied, outs)),
        "stopped": None, "from_job": sha})
    tuner._ran.add(tuner.key(sug))
    return tr


def _done(res: SearchResult, root: Path, keep: bool) -> SearchResult:
    """The job folders go unless ``keep`` (the shards stay: a rerun with the same settings resumes from them)."""
    if not keep:
        shutil.rmtree(root / "jobs", ignore_errors=True)
    return res


def lever_label(lv: Lever) -> str:
    """A lever's trial label (file names in the workdir)."""
    return "lever-" + "".join(c if c.isalnum() else "-" for c in lv.name).strip("-")


#: the ``result`` of a search job's shard (checked before the choice reads it)
RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "search shard result",
    "required": ["label", "error", "sqnr", "task", "model_bytes", "cycles", "suggestions", "fixes", "samples"],
    "properties": {
        **SWEEP_RESULT["properties"],
        "suggestions": {"type": "array", "items": SUGGESTION_SCHEMA},
        "fixes": {"type": "array", "items": SUGGESTION_SCHEMA},
        "samples": {"type": "object", "additionalProperties": {"type": "object"}},
        "stopped": {"type": ["object", "null"], "required": ["samples", "of"],
                    "properties": {"samples": {"type": "integer", "minimum": 1}, "of": {"type": "integer"}}},
        "model_sha256": {"type": ["string", "null"]},
        "same_model_as": {"type": "string"},
        "by_sample": {"type": "object", "additionalProperties": {"type": "number"}}},
}


@dataclass
class Below(Stop):
    """The ``stop`` of a lever's trial (:meth:`~ivq_debug.tune.verify.Tuner.trial`, told the trial's model bytes and
    HTP cycles through :meth:`observe`): True once the worst SQNR so far of the watched tensors (``bound``: a worst
    SQNR only falls as samples are added, so the lever's final score is at most that) is below ``base`` (the
    baseline's: the lever lowers a watched tensor, refused whatever the other samples give), or below ``floor``
    (what the lever must reach to be chosen, be the combination step's start or grow its set: :func:`search`) while
    one of ``rivals`` — eligible levers measured in full, ``(score, model bytes, cycles)`` — scored above it at no
    greater cost (HTP cycles when both have them, else model bytes): the lever can then be neither chosen nor on
    the frontier. ``frontier=False`` (a search that measures in full only what may be chosen): below ``floor`` is
    enough, whatever the cost — the lever may still be on the frontier, which the search then does not settle."""

    watch: tuple[str, ...]
    base: float
    floor: float
    rivals: tuple[tuple[float, int | None, float | None], ...] = ()
    model_bytes: int | None = None
    cycles: float | None = None
    frontier: bool = True

    def observe(self, model_bytes: int | None = None, cycles: float | None = None) -> None:
        """The running trial's model bytes (once quantized) and HTP cycles (after its first sample)."""
        self.model_bytes = self.model_bytes if model_bytes is None else model_bytes
        self.cycles = self.cycles if cycles is None else cycles

    def key(self) -> list[Any]:
        """What decides the stop (a job's key)."""
        return [repr(self.base), repr(self.floor), [[repr(x) for x in r] for r in self.rivals]] + (
            [] if self.frontier else ["choice"])

    def cheaper(self, model_bytes: int | None, cycles: float | None) -> bool:
        """A rival of these figures costs no more than the running trial."""
        if cycles is not None and self.cycles is not None:
            return cycles <= self.cycles
        return model_bytes is not None and self.model_bytes is not None and model_bytes <= self.model_bytes

    def __call__(self, worst: Any) -> bool:
        vals = [worst.get(w) for w in self.watch]
        if not vals or None in vals:
            return False
        bound = min(vals)
        return bound < self.base or (bound < self.floor and any(
            score > bound and (not self.frontier or self.cheaper(b, c)) for score, b, c in self.rivals))


def lever_job(tuner: Tuner, label: str, suggestions: list[dict[str, Any]], stop: Below | None = None,
              same: dict[str, dict[str, Any]] | None = None, watch: Sequence[str] = ()) -> dict[str, Any]:
    """One lever (in a worker): its trial in ``tuner.workdir`` (a partial capture; ``stop``: ended at the sample
    that makes it irrelevant, :class:`Below`), what the choice reads and its model's SHA-256 (the delivery of the
    chosen lever checks it, :func:`_deliver`), then its files removed (kept, with the trial's dump, when
    ``tuner.keep_dumps``: ``--keep-dumps``). ``same``: the figures of models measured in full, by SHA-256
    (:func:`same_model`): a lever quantized to one of them takes its figures instead of running. ``watch``: the
    search's watched tensors, whose per-sample scores (``by_sample``, :func:`sample_scores`; a trial run on every
    sample) order the samples of the levers built on this one (:func:`hardest_first`)."""
    sug = [Suggestion(**x) for x in suggestions]
    out = same_model(tuner, label, sug, same) if same and not tuner.keep_dumps else None
    if out is None:
        tr = tuner.trial(label, sug, stop=stop)  # a dump only with keep_dumps
        out = {"label": tr.label, "error": tr.error, "sqnr": {} if tr.error else dict(tr.sqnr_table),
               "task": dict(tr.task), "model_bytes": tr.model_bytes, "cycles": tr.cycles,
               "seconds": round(tr.seconds, 3), "suggestions": [x.to_dict() for x in tr.suggestions],
               "fixes": list(tr.fixes), "samples": dict(tr.samples), "stopped": tr.stopped,
               "model_sha256": None if tr.error or not tr.qdq_model.is_file() else sha256_file(tr.qdq_model),
               "by_sample": {} if tr.error or tr.stopped else {
                   str(i): v for i, v in sample_scores(tr.comparison, watch or tuner.watch).items()}}
    if not tuner.keep_dumps:
        shutil.rmtree(tuner.workdir, ignore_errors=True)
    return json_safe(out)


def same_model(tuner: Tuner, label: str, suggestions: list[Suggestion], same: dict[str, dict[str, Any]]
               ) -> dict[str, Any] | None:
    """A lever's job result without running it, when its quantized model has the bytes of a model measured in
    full on the same samples (``same``: ``{SHA-256: job result + "lever"}``): the same bytes on the same samples
    give the same figures (the argument :func:`_deliver` rests on). At 16-bit activations entropy calibration is
    MinMax (:mod:`ivq_debug.qnn.entropy`), so on an a16w8 or a16w16 baseline the ``calibration entropy`` lever is
    the baseline's model (before entropy had its bins, the a8w8 one was too: 12 emulated HTP lines of the
    PP-OCRv4 recognizer for the baseline's figures). None (the trial runs) when the quantization fails or is refused, the bytes are new, or
    the figures held do not cover the tensors this lever measures (:meth:`~ivq_debug.tune.verify.Tuner.measured`).
    The HTP cycles are the measured model's (the same bytes: its emulated profile)."""
    t0 = time.perf_counter()
    if forbidden(suggestions, tuner.source(), tuner.preset, tuner.target):
        return None
    wd = Path(tuner.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    qdq = wd / f"{label}.qdq.onnx"
    try:
        _, applied, fixes, _ = tuner._quantize(label, suggestions, qdq)  # the model cache serves the trial's
    except Exception:  # the trial raises it again and records it as its result
        return None
    if violations(qdq, tuner.target):
        return None
    sha = sha256_file(qdq)
    src = same.get(sha)
    if src is None or not tuner.measured(applied, tuner.outputs()) <= set(src["sqnr"]):
        return None
    return {"label": label, "error": None, "sqnr": dict(src["sqnr"]), "task": dict(src["task"]),
            "model_bytes": model_file_bytes(qdq), "cycles": src["cycles"],
            "seconds": round(time.perf_counter() - t0, 3), "suggestions": [x.to_dict() for x in applied],
            "fixes": [f.to_dict() for f in fixes], "samples": dict(src["samples"]), "stopped": None,
            "model_sha256": sha, "same_model_as": src["lever"]}


def shard_trial(result: dict[str, Any], folder: Path) -> Trial:
    """A lever's trial as its shard holds it (figures only: its files were removed with its job folder)."""
    label = result["label"]
    return Trial(label, [Suggestion(**x) for x in result["suggestions"]], folder / f"{label}.qdq.onnx",
                 folder / f"{label}.h5", None, dict(result.get("task") or {}), int(result.get("model_bytes") or 0),
                 result.get("cycles"), float(result.get("seconds") or 0.0), result.get("error"),
                 sqnr_table={k: v for k, v in (result.get("sqnr") or {}).items() if v is not None},
                 fixes=list(result.get("fixes") or []), samples=dict(result.get("samples") or {}),
                 stopped=result.get("stopped"))
