"""A mixed-precision sweep as jobs: layer group × precision, each candidate one re-quantize + capture + compare
(``ivq tune --sweep``, issue 15).

**Groups.** By default the quantized activation tensors of the baseline (the activation ``QuantizeLinear`` inputs
of its QDQ model), in the topological order of the float model, cut into ``n`` consecutive blocks of near-equal
size (:func:`block_groups`): any model has them. Or the pattern groups of the suggestions
(:func:`suggestion_groups`: the introduced-error replay's groups, one group per ungrouped entry), or groups the
caller builds (:class:`Group`).

**Precisions.** ``a16``: 16-bit activations on every tensor of the group, on the range calibration gave (the
baseline's encoding; a tensor produced by a view op shares its producer's type and is left to it). ``fp16``: the
group's producing nodes left unquantized (float on HTP). Both go through the delivered overrides format
(:meth:`~ivq_debug.tune.verify.Tuner.trial`).

**Jobs.** Each candidate is one :class:`~ivq_debug.executor.Job` whose key hashes the preprocessed float model,
the reference dump's content (:func:`~ivq_debug.tune.verify.dump_digest`), the evaluation inputs, the calibration data, the candidate's overrides, the watched tensors,
the settings (preset, format, backend, quantizer knobs, base overrides, runner and task metric) and
:func:`~ivq_debug.executor.versions`. A job runs one trial in its own folder and writes a small JSON shard: the
watched tensors' SQNR, the task metrics, the model bytes, the HTP cycles (QNN) and its wall time; its model and
dump are then removed. A rerun skips the candidates whose shard exists, so an interrupted sweep (Ctrl-C, a killed
worker) resumes without redoing them.

**Selection** (:func:`select`, a pure function of the baseline and the merged shards: a sequential, a pool and a
Ray run pick the same set). Per candidate: ``gain`` = worst watched SQNR minus the baseline's; ``cost`` = the
relative increase of the HTP cycles (when every trial has a profile) or of the model bytes, floored at
:data:`COST_FLOOR`; ``efficiency`` = gain / cost. A candidate that failed, gains less than ``min_gain_db`` or lowers
a task metric is not eligible. Each group keeps its most efficient eligible precision; the groups are ranked by
efficiency (then gain, then group order) and taken in that order while the *predicted* SQNR of the set is below
the budget (all eligible groups without a budget). The prediction adds the noise each group removes (noise
powers of independent errors add): ``N = N0 − Σ (N0 − N_g)`` per watched tensor. One final trial verifies the
set; when it makes a watched tensor or a task metric worse than the baseline, the top-ranked group alone is
tried instead.
"""

from __future__ import annotations

import fnmatch
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ivq_debug import defaults
from ivq_debug.diagnose.replay import describe_factory
from ivq_debug.dump.contract import input_digest
from ivq_debug.errors import InputError, RunError, UsageError, one_line
from ivq_debug.executor import (
    Executor,
    Job,
    JobFailure,
    JobsFailedError,
    LocalExecutor,
    job_key,
    merge_check,
    versions,
)
from ivq_debug.inputfiles import sha256_file
from ivq_debug.jsonio import json_safe
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.qnn.encodings import encodings_from_qdq_model
from ivq_debug.tune.suggest import Suggestion
from ivq_debug.tune.verify import (
    Trial,
    Tuner,
    TuneReport,
    _default_watch,
    _jsonable_overrides,
    _suggestion_key,
    calibration_digest,
    confirm_on_target,
    judge,
    load_task_metric,
)

#: the precisions a group can be given
PRECISIONS = ("a16", "fp16")
#: default number of consecutive blocks of activation tensors (``--groups``)
DEFAULT_GROUPS = 8
#: a candidate's relative cost below this counts as this (a free candidate ranks by its gain alone)
COST_FLOOR = 0.01
#: the least gain (dB, worst watched SQNR) that makes a candidate eligible (the greedy mode's threshold)
MIN_GAIN_DB = 0.5
#: the shard fields that must agree across a sweep (``executor.merge_check``)
SWEEP_FIELDS = ("model_sha256", "reference_sha256", "inputs_sha256", "calibration_sha256", "settings", "versions")
KIND = "tune-sweep/1"
_NUM = {"type": ["number", "null"]}
_COST = {"type": ["number", "null"], "minimum": 0, "x-finite": True}
#: a sweep shard's ``result`` (shards are untrusted: checked before the selection reads them)
RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "sweep shard result",
    "required": ["label", "error", "sqnr", "task", "model_bytes", "cycles"],
    "properties": {
        "label": {"type": "string"}, "error": {"type": ["string", "null"]},
        "sqnr": {"type": "object", "additionalProperties": _NUM},
        "task": {"type": "object", "additionalProperties": _NUM},
        "model_bytes": {"type": ["integer", "null"], "minimum": 0}, "cycles": _COST, "seconds": _COST},
}


@dataclass(frozen=True)
class Group:
    """A layer group: activation tensors with their producing node (None: a graph input) and its op type."""

    name: str
    tensors: tuple[str, ...]
    nodes: tuple[str | None, ...]
    op_types: tuple[str | None, ...]

    @property
    def span(self) -> str:
        """First and last tensor."""
        return self.tensors[0] if len(self.tensors) == 1 else f"{self.tensors[0]} … {self.tensors[-1]}"


@dataclass
class TaskMetric:
    """A ``--task-metric MODULE:FUNCTION`` that travels to worker processes by its spec (a function loaded from a
    ``.py`` file cannot be pickled) and is loaded there on first use; its key includes the file's hash."""

    spec: str
    _fn: Callable[..., Any] | None = field(default=None, repr=False, compare=False)

    def __call__(self, outputs: list[dict[str, Any]]) -> Any:
        if self._fn is None:
            self._fn = load_task_metric(self.spec)
        return self._fn(outputs)

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "_fn": None}

    def key(self) -> str:
        """The spec, and the file's SHA-256 when it names a ``.py`` file."""
        mod = self.spec.rpartition(":")[0]
        return f"{self.spec}@{sha256_file(mod)}" if mod.endswith(".py") else self.spec


# ---------------------------------------------------------------------------------------------- groups
def quantized_activations(tuner: Tuner, before: Trial) -> list[tuple[str, str | None, str | None]]:
    """``(tensor, producing node, op type)`` of every activation the baseline quantizes, graph inputs first, then
    in the topological order of the model the trials quantize."""
    encs = encodings_from_qdq_model(before.qdq_model).activations
    src = load_model(tuner.source())
    order: dict[str, tuple[int, str | None, str | None]] = {i.name: (-1, None, None) for i in src.graph.input}
    for i, n in enumerate(src.graph.node):
        for o in n.output:
            order[o] = (i, n.name or None, n.op_type)
    named = [(order[t][0], t) for t in encs if t in order]
    return [(t, order[t][1], order[t][2]) for _, t in sorted(named)]


def block_groups(tensors: Sequence[tuple[str, str | None, str | None]], n: int) -> list[Group]:
    """``n`` consecutive blocks of near-equal size (the first ones one tensor longer), named ``g01``…"""
    if n < 1:
        raise UsageError(f"--groups must be at least 1, got {n}")
    n = min(n, len(tensors))
    out, start = [], 0
    for i in range(n):
        size = len(tensors) // n + (1 if i < len(tensors) % n else 0)
        block = tensors[start:start + size]
        start += size
        out.append(Group(f"g{i + 1:02d}", *(tuple(x) for x in zip(*block, strict=True))))
    return out


def suggestion_groups(suggestions: Sequence[Suggestion],
                      tensors: Sequence[tuple[str, str | None, str | None]]) -> list[Group]:
    """The suggestions' pattern groups (activation entries only; an ungrouped entry is its own group), in order
    of their first tensor."""
    info = {t: (n, op) for t, n, op in tensors}
    by: dict[str, list[str]] = {}
    for s in suggestions:
        if not s.is_weight and s.tensor in info:
            by.setdefault(s.group or s.tensor, []).append(s.tensor)
    pos = {t: i for i, (t, _, _) in enumerate(tensors)}
    keys = sorted(by, key=lambda k: min(pos[t] for t in by[k]))
    out = []
    for i, k in enumerate(keys):
        ts = tuple(sorted(set(by[k]), key=pos.__getitem__))
        out.append(Group(f"g{i + 1:02d}", ts, tuple(info[t][0] for t in ts), tuple(info[t][1] for t in ts)))
    return out


def candidate(group: Group, precision: str, encodings: Mapping[str, Any]) -> list[Suggestion]:
    """The overrides of one candidate (module docstring); empty when the precision changes nothing there."""
    out = []
    for t, node, op in zip(group.tensors, group.nodes, group.op_types, strict=True):
        if precision == "fp16":
            if node:
                out.append(Suggestion(t, "fp16", f"sweep {group.name}: the node left unquantized", node=node,
                                      group=group.name))
            continue
        enc = encodings.get(t)
        if op in defaults.VIEW_OPS or enc is None or enc.bitwidth >= 16 or not enc.scale:
            continue
        (lo,), (hi,) = enc.grid_range()
        out.append(Suggestion(t, "a16", f"sweep {group.name}: 16-bit on the calibrated range", lo, hi, node=node,
                              group=group.name))
    return out


# ---------------------------------------------------------------------------------------------- jobs
def sweep_job(tuner: Tuner, label: str, suggestions: list[dict[str, Any]], watch: list[str]) -> dict[str, Any]:
    """One candidate (in a worker): its trial in ``tuner.workdir``, measured, then its files removed (kept, with
    the trial's dump, when ``tuner.keep_dumps``: ``--keep-dumps``)."""
    tr = tuner.trial(label, [Suggestion(**s) for s in suggestions])  # a dump only with keep_dumps
    out = measure(tr, watch)
    if not tuner.keep_dumps:
        shutil.rmtree(tuner.workdir, ignore_errors=True)
    return out


def measure(tr: Trial, watch: Sequence[str]) -> dict[str, Any]:
    """What a sweep keeps of a trial."""
    return {"label": tr.label, "error": tr.error, "sqnr": {w: tr.sqnr(w) for w in watch} if not tr.error else {},
            "task": dict(tr.task), "model_bytes": tr.model_bytes, "cycles": tr.cycles,
            "seconds": round(tr.seconds, 3)}


def _describe(fn: Any) -> str | None:
    if fn is None:
        return None
    return fn.key() if isinstance(fn, TaskMetric) else describe_factory(fn)


def job_meta(tuner: Tuner) -> dict[str, Any]:
    """What every job of a tune shares (the shard ``meta`` a merge checks, :data:`SWEEP_FIELDS`): the model's,
    reference's, inputs' and calibration's hashes, the settings, the versions."""
    settings = {"preset": tuner.preset, "fmt": tuner.fmt, "backend": tuner.backend, "part": tuner.part,
                "quantize_kw": {k: str(v) for k, v in sorted(tuner.quantize_kw.items())},
                "base_overrides": _jsonable_overrides(tuner.base_overrides),
                "runner": _describe(tuner.runner_factory), "task": _describe(tuner.task),
                "output_metric": _describe(tuner.output_metric), "target": tuner.target,
                "qnn": tuner.qnn_options() if tuner.backend == "qnn" else None}
    return {"model_sha256": sha256_file(tuner.source()), "reference_sha256": tuner.reference_digest(),
            "inputs_sha256": job_key(feeds=[{k: input_digest(v) for k, v in sorted(f.items())}
                                            for f in tuner.feeds]),
            "calibration_sha256": calibration_digest(tuner.calibration), "settings": settings,
            "versions": versions()}


# ---------------------------------------------------------------------------------------------- selection
def _score(sqnr: Mapping[str, Any], watch: Sequence[str]) -> float | None:
    vals = [sqnr.get(w) for w in watch]
    if not vals or any(v is None for v in vals):
        return None
    return min(float(v) for v in vals)


def _noise(db: float) -> float:
    return 0.0 if math.isinf(db) and db > 0 else 10.0 ** (-db / 10.0)


def _db(noise: float) -> float:
    return math.inf if noise <= 0 else -10.0 * math.log10(noise)


def select(baseline: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]], watch: Sequence[str], *,
           budget_sqnr_db: float | None = None, min_gain_db: float = MIN_GAIN_DB) -> tuple[Any, dict[str, Any]]:
    """The best set from the baseline's and the candidates' measurements (module docstring: the rule).

    ``candidates`` hold ``group``, ``group_index``, ``precision``, ``precision_index``, ``label`` and a shard's
    result (``error``, ``sqnr``, ``task``, ``model_bytes``, ``cycles``). Returns the table (one row per
    candidate, in group then precision order) and ``{"chosen": labels in rank order, "predicted_db": {watched
    tensor: predicted SQNR}, "cost_basis": "cycles" | "model_bytes"}``. A pure function: the same inputs in any
    order give the same outputs.
    """
    import pandas as pd

    cands = sorted(candidates, key=lambda c: (c["group_index"], c["precision_index"]))
    ok = [c for c in cands if not c.get("error")]
    basis = ("cycles" if baseline.get("cycles") and ok and all(c.get("cycles") is not None for c in ok)
             else "model_bytes")
    s0, c0 = _score(baseline["sqnr"], watch), float(baseline.get(basis) or 0)
    if s0 is None:
        raise InputError("the baseline has no SQNR for a watched tensor")
    rows = []
    for c in cands:
        row = {"group": c["group"], "precision": c["precision"], "label": c["label"], "tensors": c.get("tensors"),
               "span": c.get("span"), "sqnr_db": None, "gain_db": None, "cost": None, "efficiency": None,
               "model_bytes": c.get("model_bytes"), "cycles": c.get("cycles"), "eligible": False,
               "status": "", "rank": None, "picked": False}
        rows.append(row)
        if c.get("error"):
            row["status"] = f"failed: {one_line(c['error'], 160)}"
            continue
        sc = _score(c.get("sqnr") or {}, watch)
        if sc is None:
            row["status"] = "a watched tensor is missing from the trial's capture"
            continue
        gain = sc - s0
        rel = (float(c.get(basis) or 0) - c0) / c0 if c0 else 0.0
        cost = max(rel, 0.0) + COST_FLOOR
        row |= {"sqnr_db": sc, "gain_db": gain, "cost": rel, "efficiency": gain / cost}
        drop = next((k for k, b in (baseline.get("task") or {}).items()
                     if isinstance(b, (int, float)) and isinstance((c.get("task") or {}).get(k), (int, float))
                     and c["task"][k] < b), None)
        if drop is not None:
            row["status"] = f"lowers {drop}"
        elif gain < min_gain_db:
            row["status"] = f"gain below {min_gain_db:g} dB"
        else:
            row["eligible"] = True
            row["status"] = "eligible"
    best: dict[str, tuple[int, dict]] = {}
    for i, (c, row) in enumerate(zip(cands, rows, strict=True)):
        if not row["eligible"]:
            continue
        cur = best.get(c["group"])
        k = (row["efficiency"], row["gain_db"], -c["precision_index"])
        if cur is None or k > (rows[cur[0]]["efficiency"], rows[cur[0]]["gain_db"], -cands[cur[0]]["precision_index"]):
            best[c["group"]] = (i, c)
    ranked = sorted(best.values(), key=lambda ic: (-rows[ic[0]]["efficiency"], -rows[ic[0]]["gain_db"],
                                                   ic[1]["group_index"]))
    n0 = {w: _noise(float(baseline["sqnr"][w])) for w in watch}
    noise = dict(n0)
    chosen: list[str] = []
    for rank, (i, c) in enumerate(ranked, 1):
        rows[i]["rank"] = rank
        rows[i]["status"] = "best of its group"
        if budget_sqnr_db is not None and min(_db(v) for v in noise.values()) >= budget_sqnr_db:
            continue
        for w in watch:
            noise[w] = max(noise[w] - (n0[w] - _noise(float(c["sqnr"][w]))), 0.0)
        rows[i]["picked"] = True
        rows[i]["status"] = "picked"
        chosen.append(c["label"])
    return pd.DataFrame(rows), {"chosen": chosen, "predicted_db": {w: _db(v) for w, v in noise.items()},
                                "cost_basis": basis}


# ---------------------------------------------------------------------------------------------- the sweep
@dataclass
class SweepResult:
    """A sweep's candidates, the chosen set and its verification (``report``), and what the jobs did."""

    table: Any
    chosen: list[str]
    predicted_db: dict[str, float]
    report: TuneReport
    groups: list[Group]
    precisions: list[str]
    jobs: dict[str, Any]
    cost_basis: str = "model_bytes"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the report's document with a ``sweep`` section."""
        doc = self.report.to_dict()
        doc["sweep"] = json_safe({
            "groups": [{"name": g.name, "tensors": list(g.tensors)} for g in self.groups],
            "precisions": self.precisions, "chosen": self.chosen, "predicted_db": self.predicted_db,
            "cost_basis": self.cost_basis,
            "table": self.table.to_dict(orient="records"), "jobs": self.jobs})
        return doc


def sweep(tuner: Tuner, *, groups: int | Sequence[Group] = DEFAULT_GROUPS,
          precisions: Sequence[str] = PRECISIONS, watch: Sequence[str] = (), budget_sqnr_db: float | None = None,
          min_gain_db: float = MIN_GAIN_DB, executor: Executor | None = None,
          shards: str | os.PathLike | None = None, before: Trial | None = None,
          tensors: Sequence[str] | None = None, progress: bool = True) -> SweepResult:
    """Layer group × precision as jobs on ``executor`` (default: in this process), the best set selected from
    the merged shards and verified by one final trial (module docstring).

    Args:
        tuner: what every trial shares; its runner factory and task callables must be module-level functions
            (they go to worker processes and into the job keys).
        groups: the number of consecutive blocks of quantized activations, or the groups themselves.
        precisions: of :data:`PRECISIONS`.
        watch: the end-to-end tensors (default: the last output).
        budget_sqnr_db: stop adding groups once the predicted worst watched SQNR reaches it.
        min_gain_db: the least gain of an eligible candidate.
        executor: a :class:`~ivq_debug.executor.LocalExecutor` or a :class:`~ivq_debug.executor.RayExecutor`
            (a notebook's own cluster).
        shards: the shard folder (default ``<workdir>/sweep/shards``); a rerun skips the shards there.
        before: the baseline trial, when already run.
        tensors: only the activations matching one of these globs go into the blocks (``--tensors``).

    Raises:
        UsageError: an unknown precision, or no candidate to try.
        JobsFailedError: jobs failed twice (exit 1; each listed with its label and key; the shards stay).
    """
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise UsageError(f"unknown precision(s) {bad} (choose from {', '.join(PRECISIONS)})")
    precisions = list(dict.fromkeys(precisions))
    before = before or tuner.trial("before", [])
    if before.error:
        raise RunError(f"the baseline trial failed: {before.error}")
    watch = list(watch) or _default_watch(before)
    tuner = tuner.watching(watch)
    acts = [a for a in quantized_activations(tuner, before)
            if not tensors or any(fnmatch.fnmatchcase(a[0], g) for g in tensors)]
    gs = block_groups(acts, groups) if isinstance(groups, int) else list(groups)
    encs = encodings_from_qdq_model(before.qdq_model).activations
    root = Path(tuner.workdir).resolve() / "sweep"
    shards = Path(shards) if shards is not None else root / "shards"
    meta = job_meta(tuner)
    # what a worker needs, by absolute paths (a Ray worker runs in another folder)
    worker = tuner.worker(tuner.workdir)
    jobs, cands = [], []
    for gi, g in enumerate(gs):
        for pi, p in enumerate(precisions):
            sug = candidate(g, p, encs)
            if not sug:
                continue
            label = f"{g.name}-{p}"
            key = job_key(kind=KIND, overrides=[_suggestion_key(s) for s in sug], watch=watch, **meta)
            jobs.append(Job(key, sweep_job, {"tuner": replace(worker, workdir=root / "jobs" / label), "label": label,
                                             "suggestions": [s.to_dict() for s in sug], "watch": watch}, meta))
            cands.append({"group": g.name, "group_index": gi, "precision": p, "precision_index": pi,
                          "label": label, "tensors": len(sug), "span": g.span, "key": key, "suggestions": sug})
    if not jobs:
        raise UsageError("no sweep candidate: no group has a tensor the precisions change")
    executor = executor or LocalExecutor(1)
    report = executor.run(jobs, shards, "sweep", progress=progress)
    if report.failures:
        by_key = {c["key"]: c["label"] for c in cands}
        raise JobsFailedError([JobFailure(f"{by_key.get(f.key, '?')} ({f.key})", f.error) for f in report.failures],
                              shards)
    docs = [report.load(j.key, RESULT_SCHEMA) for j in jobs]
    merge_check(docs, SWEEP_FIELDS)
    for c, doc in zip(cands, docs, strict=True):
        c |= {k: doc["result"].get(k) for k in ("error", "sqnr", "task", "model_bytes", "cycles", "seconds")}
    base = measure(before, watch)
    table, picked = select(base, cands, watch, budget_sqnr_db=budget_sqnr_db, min_gain_db=min_gain_db)
    chosen = picked["chosen"]
    by_label = {c["label"]: c for c in cands}
    steps: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    after, ok = before, False
    check: dict[str, Any] = {}
    tries = [("sweep", chosen)] + ([("sweep-top", chosen[:1])] if len(chosen) > 1 else [])
    for label, labels in tries if chosen else []:
        sug = [s for lb in labels for s in by_label[lb]["suggestions"]]
        tr = tuner.trial(label, sug)
        why = judge(before, tr, watch)
        if why is None:
            why, check = confirm_on_target(tuner, before, tr, watch)
        steps.append({"candidate": "+".join(labels), "label": label, "kept": why is None})
        if why is None:
            after, ok = tr, True
            break
        refused.append({"candidate": "+".join(labels), "label": label, "overrides": [s.tensor for s in sug],
                        "reason": why})
    rep = TuneReport(before, after if ok else replace(before, suggestions=[]), watch, steps, refused,
                     recommended=ok, backend=tuner.backend, format=tuner.fmt, target_check=check)
    jobs_info = {"executor": type(executor).__name__, "total": len(jobs), "run": len(jobs) - len(report.skipped),
                 "resumed": len(report.skipped), "retried": sorted(set(report.retried)), "shards": str(shards)}
    return SweepResult(table, chosen, picked["predicted_db"], rep, gs, precisions, jobs_info, picked["cost_basis"])
