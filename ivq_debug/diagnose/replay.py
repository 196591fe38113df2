"""Introduced error: replay each QDQ node unit alone, and charge each encoding to the unit that produces it.

For every compute node N of a QDQ model, its *unit* is N plus the Q/DQ nodes around it: activation inputs
enter as their float tensor X through X's QuantizeLinear → DequantizeLinear, weights through their
DequantizeLinear, and N's output leaves through its QuantizeLinear → DequantizeLinear. Each unit is run alone on
the test backend, fed reference values, and compared with a reference. Two attributions (``docs/findings.md``):

``iso`` (shadow error)
    fed the reference X (re-quantized by the unit's input encodings), compared with the reference output. It
    counts the unit's input encodings too, so an encoding that is bad shows in *every consumer* of the tensor
    (the variance ``ReduceMean`` that reads a coarse ``x²``), and data-movement units repeat their producer's
    encoding error.
``local`` (producer-charged, the default ranking)
    fed the *quantized* inputs Xq = DQ(Q(X)), compared with the float op on the same quantized inputs (float
    weights): only the unit's weights, arithmetic and output encoding count. An encoding is charged to the unit
    that produces it; data-movement units are exactly lossless.

With ``R`` the reference output, ``T`` the backend's unit output, and, computed on the CPU in float,
``Fw = N(X, Wq)`` (float activations, quantized weights) and ``Fq = N(Xq, Wq)`` (quantized inputs, no output
encoding), the local reference is ``R_local = R + Fq − Fw`` (= N(Xq, W) exactly for ops without quantized
weights, and to second order — the product of the input and weight errors — for the others). The errors split
into a *weight* part ``Fw − R`` (the "float activations" rerun; the same under both attributions) and an
*activation* part ``T_iso − Fw`` (iso: input and output encodings) or ``T_local − Fq`` (local: the output
encoding and the backend's arithmetic), so ``weight_share = P_w / (P_w + P_a)`` with ``P = Σ (t − r)²``.

Cost: the units of a batch (bounded by ``defaults.REPLAY_BATCH_BYTES`` of reference inputs) are laid side by side
in one CPU *shadow* model (each unit, its ``Fw`` and ``Fq`` copies; weights shared) and, for a non-CPU backend,
one backend model; each is one session, run once per record (the backend: fed X, fed Xq and, for the self-check,
fed the test dump's own upstream values). On QNN HTP, data-movement units (``defaults.VIEW_OPS``) whose inputs
and output share one encoding move integers, exactly on every backend, and are taken from the CPU replay; the *self-check* runs each unit alone on the
backend's own upstream values from the free-running test dump and flags units whose isolated output differs from
the full-graph output by more than ``defaults.REPLAY_SELFCHECK_STEPS`` quantization steps ("fused in the full
graph: isolated attribution approximate").

Reference values are found by name, else through the alignment of the given comparison (e.g. the
``reshape`` strategy for tensors the quantizer's preprocessing created), else by the QDQ model's own lineage (a
tensor that is a Reshape / Flatten / Squeeze / Unsqueeze of a referenced one, confirmed on the test dump); every
unit records how (``ref_match``), and every skipped unit its reason.

The modules: :mod:`~ivq_debug.diagnose.units` (which nodes form a unit, the model of a batch),
:mod:`~ivq_debug.diagnose.refs` (reference values per record), :mod:`~ivq_debug.diagnose.batch` (one batch: its
sessions and sums), :mod:`~ivq_debug.diagnose.jobs` (batches as executor jobs) and this one (the orchestration,
the table, :class:`ReplayResult`). The QDQ model is read once (a :class:`~ivq_debug.onnxgraph.load.Model`); every
derived model goes to its runner in memory.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ivq_debug import defaults
from ivq_debug.console import track
from ivq_debug.diagnose.accumulation import Accumulation, explain_accumulation
from ivq_debug.diagnose.batch import Acc, BatchContext, BatchResult, RunnerFactory, replay_batch
from ivq_debug.diagnose.effect import measure_effects
from ivq_debug.diagnose.effect_targets import EffectPlan, effect_plan, replay_effects
from ivq_debug.diagnose.findings import Finding
from ivq_debug.diagnose.hazards import resolution_collapse, saturation
from ivq_debug.diagnose.jobs import describe_factory, replay_jobs
from ivq_debug.diagnose.patterns import replay_findings
from ivq_debug.diagnose.refs import RefIndex, model_records, pairs_for, record_ids
from ivq_debug.diagnose.remedy import Remedy, UnitEvidence, over_budget, remedies_for
from ivq_debug.diagnose.units import (
    Unit,
    find_dynamic_units,
    find_units,
    intro_budget,
    lineage_aliases,
    model_units,
    replay_units,
)
from ivq_debug.diagnose.weight_spread import spread_by_weight
from ivq_debug.dump import open_dump
from ivq_debug.errors import InputError, UsageError
from ivq_debug.executor import Executor, size_runs
from ivq_debug.jsonio import json_safe
from ivq_debug.metrics import MetricAccumulator
from ivq_debug.onnxgraph.load import Model, load

#: public names of the replay's modules that callers import from here
__all__ = ["ATTRIBUTIONS", "SCHEMA", "ReplayResult", "Unit", "describe_factory", "find_dynamic_units", "find_units",
           "intro_budget", "replay", "replay_records", "replay_units"]

#: the ``ivq-replay/2`` document (:meth:`ReplayResult.to_json`, ``ivq diagnose --json``)
SCHEMA = "ivq-replay/2"
#: the two attributions (``docs/findings.md``); the first is the default ranking
ATTRIBUTIONS = ("local", "iso")

COLUMNS = ["node", "op_type", "tensor", "order", "intro_sqnr_db", "intro_max_abs", "intro_rel_l2", "intro_status",
           "intro_noise", "local_sqnr_db", "local_noise", "iso_sqnr_db", "iso_noise", "weight_sqnr_db",
           "weight_noise", "act_noise", "weight_share", "weights", "input_ops", "cum_sqnr_db", "cum_max_abs", "inherited_share",
           "replayed_on", "ref_match", "selfcheck_steps", "selfcheck_share", "approximate", "signal"]
FLOAT_COLUMNS = ("intro_sqnr_db", "intro_max_abs", "intro_rel_l2", "local_sqnr_db", "iso_sqnr_db", "weight_sqnr_db",
                 "weight_share", "cum_sqnr_db", "cum_max_abs", "inherited_share", "selfcheck_steps",
                 "selfcheck_share")


def _nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _cum_rows(cumulative: Any, ref: Any, rid: str) -> dict[str, Any]:
    """Comparison rows of one ref record, keyed by the test tensor name."""
    if cumulative is None:
        return {}
    t = cumulative.table
    if t.empty:
        return {}
    rr = ref.records.set_index("rid").loc[rid]
    sel = t[(t["sample"] == rr["sample"]) & (t["part"] == rr["part"]) & (t["step"] == int(rr["step"]))]
    if sel.empty and len(ref.records) == 1:
        sel = t
    return {r["test_name"]: r for r in sel.to_dict("records")}



@dataclass
class ReplayResult:
    """Per-unit introduced error (``table``, in execution order), both attributions, and the findings."""

    table: Any
    budget_sqnr_db: float
    skipped: list[str]
    backend: str | None
    info: dict[str, Any]
    record: dict[str, Any]
    batches: int
    attribution: str = "local"
    skipped_reasons: dict[str, str] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    sessions: int = 0
    seconds: float = 0.0
    model_path: str | None = None
    lift: dict[str, Any] = field(default_factory=dict)  # pattern key -> its effect (effect.measure_effects)
    #: the unit evidence the remedies read (units over budget, :func:`~ivq_debug.diagnose.remedy.unit_evidence`)
    evidence: dict[str, UnitEvidence] = field(default_factory=dict)
    #: the counterfactual runs (:func:`~ivq_debug.diagnose.effect.measure_effects`): base, targets, runs, seconds
    effects: dict[str, Any] = field(default_factory=dict)
    #: the model whose weights :attr:`spread` measures (the float model when given, else the QDQ model)
    spread_model: Model | None = field(default=None, repr=False)
    #: with an executor: its name, jobs in all, resumed from shards, retried keys, the kept shard folder
    jobs: dict[str, Any] = field(default_factory=dict)
    #: how the reference was chosen when it was not the given dump (``ivq_debug.api.diagnose``), for the reader
    note: str | None = None
    #: when no unit breaks the budget but the part's output does: where the error accumulates
    #: (:func:`~ivq_debug.diagnose.accumulation.explain_accumulation`; needs ``cumulative``)
    accumulation: Accumulation | None = None

    @functools.cached_property
    def spread(self) -> dict[str, float]:
        """``{weight: per-channel range spread}`` of the per-tensor weights of :attr:`spread_model`
        (:func:`~ivq_debug.diagnose.weight_spread.spread_by_weight`), computed when first read: no document, finding or
        remedy of the replay reads it (0.1-0.3 s of every ``ivq diagnose`` on bench_loop's 12-block ViT before)."""
        return spread_by_weight(self.spread_model) if self.spread_model is not None else {}

    def column(self, attribution: str | None = None) -> str:
        """The SQNR column of an attribution (default: the ranking one)."""
        a = attribution or self.attribution
        if a not in ATTRIBUTIONS:
            raise UsageError(f"unknown attribution {a!r} ({', '.join(ATTRIBUTIONS)})")
        return f"{a}_sqnr_db"

    @property
    def breaking(self):
        """Units whose introduced SQNR (ranking attribution) is below the budget (execution order)."""
        t = self.table
        return t[(t["intro_sqnr_db"] < self.budget_sqnr_db) | (t["intro_status"] == "non_finite")]

    @property
    def first_breaking(self) -> dict[str, Any] | None:
        """The first unit in execution order whose introduced error breaks the budget."""
        b = self.breaking
        return None if b.empty else b.iloc[0].to_dict()

    def worst(self, n: int = 10, attribution: str | None = None):
        """Units with the most introduced error (lowest SQNR of ``attribution``, default the ranking one)."""
        return self.table.sort_values(self.column(attribution), kind="stable").head(n)

    @property
    def approximate(self) -> list[str]:
        """Units the self-check flags: the backend computes them differently in the full graph."""
        t = self.table
        return list(t.loc[t["approximate"].astype(bool), "tensor"]) if len(t) else []

    def remedies(self, node: str) -> list[Remedy]:
        """The fixes by cause of one unit (:func:`~ivq_debug.diagnose.remedy.remedies_for`): a unit over budget, or
        one within it whose measured effect on the output makes it a finding (``effects["groups"]``); empty for
        any other unit."""
        ev = self.evidence.get(node)
        if ev is None:
            return []
        fix_units = {n for ns in (self.effects.get("groups") or {}).values() for n in ns}
        if not (over_budget(ev) or node in fix_units):
            return []
        return remedies_for(ev)

    def findings(self) -> list[Finding]:
        """The headline (worst introducer's pattern) first, then other patterns and the self-check
        (:mod:`ivq_debug.diagnose.patterns`)."""
        out = replay_findings(self)
        return ([self.accumulation.finding()] if self.accumulation is not None else []) + out

    def to_json(self) -> dict[str, Any]:
        """The ``ivq-replay/2`` document: record(s), backend, budget, attribution, every unit, skipped units with
        their reasons, findings."""
        return json_safe({
            "schema": SCHEMA, "record": self.record, "records": self.records, "backend": self.backend,
            "budget_sqnr_db": self.budget_sqnr_db, "attribution": self.attribution,
            "units": self.table.to_dict(orient="records"), "skipped": self.skipped_reasons,
            "approximate": self.approximate, "sessions": self.sessions, "seconds": self.seconds,
            "accumulation": self.accumulation.to_dict() if self.accumulation is not None else None,
            "findings": [f.to_dict() for f in self.findings()],
            "effects": self.effects,
            "remedies": {n: [r.to_dict() for r in self.remedies(n)] for n in self.evidence},
        })


def _noise_power(acc: MetricAccumulator) -> float:
    return acc.sum_sq_err


def _record_keys(ref: Any, rids: list[str]) -> list[dict[str, Any]]:
    """The (sample, part, step) of each replayed record, in replay order."""
    by_rid = ref.records.set_index("rid")
    return [{"sample": int(by_rid.loc[rid]["sample"]), "part": by_rid.loc[rid]["part"],
             "step": int(by_rid.loc[rid]["step"])} for rid in rids]


def replay(
    qdq_model: str | os.PathLike | Model,
    reference: Any,
    *,
    record: Any = None,
    nodes: Iterable[str] | None = None,
    runner_factory: RunnerFactory | None = None,
    cumulative: Any = None,
    budget_sqnr_db: float | None = None,
    attribution: str = "local",
    selfcheck: bool | None = None,
    float_model: str | os.PathLike | Model | None = None,
    lift: bool = True,
    batch_bytes: int = defaults.REPLAY_BATCH_BYTES,
    progress: bool = True,
    executor: Executor | None = None,
    shards: str | os.PathLike | None = None,
) -> ReplayResult:
    """Introduced error of each QDQ node unit, under both attributions (module docstring).

    Args:
        qdq_model: the QDQ ONNX model (the one the test backend ran): a path or a loaded
            :class:`~ivq_debug.onnxgraph.load.Model` (read once; its units are cached on it).
        reference: golden float dump (path or :class:`~ivq_debug.dump.Dump`) with the float tensors.
        record: which record(s) of the reference to replay: a key / rid, a list of them, or ``"all"``
            (default: the first record). Errors accumulate over the records (sessions are reused).
        nodes: only these compute nodes (names) or output tensors; default all units whose inputs are in
            the reference.
        runner_factory: ``f(model) -> runner`` on the test backend, given each derived model in memory (a
            :class:`~ivq_debug.onnxgraph.load.Model`; default: ORT CPU-QDQ, optimizations disabled). Pass e.g.
            ``functools.partial(make_runner, "qnn")`` to replay on QNN HTP.
        cumulative: a :class:`~ivq_debug.comparator.Comparison` (reference vs free-running test): the
            cumulative error, the alignment used for tensors the reference names differently, and the test
            dump the self-check feeds from.
        budget_sqnr_db: the introduced SQNR below which a unit breaks the budget (default: by the model's
            activation bitwidth, ``defaults.INTRO_BUDGET_DB``).
        attribution: ``"local"`` (default) or ``"iso"``: which one the ``intro_*`` columns, the ranking and
            the findings use (both are always in the table).
        selfcheck: run the self-check (default: on a non-CPU backend with a test dump in ``cumulative``).
        float_model: the float model the QDQ model was made from (a path or a loaded model): its float weights
            are lifted when measuring a weight pattern's output share, and its per-channel weight spreads choose
            the weight fix.
        lift: measure the effect on the output of the worst groups and units over budget: counterfactual runs of
            the whole model with each put back to float, on the replay's backend over the replayed records
            (:mod:`~ivq_debug.diagnose.effect`; jobs on ``executor``, kept in ``shards``); the headline is
            ranked by it.
        batch_bytes: maximum reference-input bytes per replay batch.
        executor: run the batches as jobs (:mod:`ivq_debug.diagnose.jobs`: a :class:`~ivq_debug.executor.
            LocalExecutor` process pool, a :class:`~ivq_debug.executor.RayExecutor`); default: in this process.
            The batches are then cut into at least ``defaults.REPLAY_MIN_JOBS`` jobs (``batches`` and
            ``sessions`` count them); every number is the same to the bit. ``runner_factory`` must then be
            picklable (``None``, a module-level function or a ``functools.partial`` of one).
        shards: the folder of the jobs' shards (with ``executor``): a rerun skips the batches whose shard is
            there; default a temporary folder, removed after the run.

    Returns:
        A :class:`ReplayResult` (``.table`` DataFrame; ``.worst()``; ``.findings()``).
    """
    if attribution not in ATTRIBUTIONS:
        raise UsageError(f"unknown attribution {attribution!r} ({', '.join(ATTRIBUTIONS)})")
    t_start = time.perf_counter()
    ref = reference if hasattr(reference, "entries") else open_dump(reference)
    model = load(qdq_model)
    if not model.proto.graph.node:  # "0 units replayed", exit 0, was the answer
        raise InputError("the model has no nodes: nothing to replay (an empty or zero-node ONNX model)",
                         model.origin)
    fmodel = load(float_model) if float_model is not None else None
    index = _indexer(ref, model, cumulative)
    rids = model_records(ref, record, record_ids(ref, record), model, index)
    budget = float(intro_budget(model) if budget_sqnr_db is None else budget_sqnr_db)
    runnable, skipped = _runnable(model, nodes, ref, rids, index, prefetch=executor is None)
    batches = _batches(runnable, index(rids[0]), batch_bytes, executor is not None)
    do_check = (runner_factory is not None) if selfcheck is None else bool(selfcheck)
    indexes = {rid: index(rid) for rid in rids}
    if executor is None:  # in this process, as one loop; on the exact CPU path the last sums beside the effect runs
        ctx = BatchContext(model, rids, indexes, runner_factory, do_check, attribution)
        it = track(batches, "replaying", total=len(batches)) if progress else batches
        defer = lift and runner_factory is None  # the last batch's last sums: _start_effects
        done, jobs = [replay_batch(ctx, b, defer=defer and i == len(batches) - 1) for i, b in enumerate(it)], {}
    else:
        done, jobs = replay_jobs(executor, shards, model, ref, cumulative, rids, batches, runner_factory, do_check,
                                 progress)
    accs, backend, info, sessions = _merged(done)
    # the remedies' evidence and the effects (effect_targets.py) read the replay's own columns only: the comparison's
    # table is waited for after them (api.diagnose computes it in a thread meanwhile)
    idx0 = index(rids[0])
    with ThreadPoolExecutor(1, thread_name_prefix="ivq-effect") as pool:
        table, plan, started = _start_effects(pool, model, ref, rids, runnable, accs, attribution, budget, fmodel,
                                              executor, shards, progress, [d.rest for d in done if d.rest is not None])
        evidence, effects, lifted = replay_effects(
            model, ref, rids, table, budget, read=lambda t: idx0.read(t) if idx0.source(t) is not None else None,
            float_model=fmodel, runner_factory=runner_factory, executor=executor, shards=shards, measure=lift,
            progress=progress, plan=plan, started=started)
    _add_cumulative(table, runnable, accs, attribution, *_cumulative(cumulative, ref, rids, runnable))
    recs = _record_keys(ref, rids)
    accumulation = _accumulation(model, table, budget, recs[0], attribution, cumulative, ref, rids, runnable)
    return ReplayResult(table, budget, list(skipped), backend, info, recs[0], len(batches),
                        attribution=attribution, skipped_reasons=skipped, records=recs, sessions=sessions,
                        seconds=round(time.perf_counter() - t_start, 3), model_path=str(model.origin), lift=lifted,
                        spread_model=fmodel if fmodel is not None else model, jobs=jobs, evidence=evidence, effects=effects, accumulation=accumulation)


def replay_records(qdq_model: str | os.PathLike | Model, reference: Any, record: Any = None
                   ) -> list[tuple[int, str, int]]:
    """The keys ``(sample, part, step)`` of the records :func:`replay` replays for ``record`` (default: the first
    record holding the model's inputs, e.g. the vision record for a session dump's vision part; ``"all"``: every
    such record), so a caller can restrict the cumulative comparison to them before replaying."""
    ref = reference if hasattr(reference, "entries") else open_dump(reference)
    model = load(qdq_model)
    key_of = {rid: key for key, rid in ref.record_keys().items()}
    return [key_of[r] for r in model_records(ref, record, record_ids(ref, record), model, _indexer(ref, model, None))]


def _start_effects(pool: ThreadPoolExecutor, model: Model, ref: Any, rids: list[str], runnable: list[Unit],
                   accs: dict[str, Acc], attribution: str, budget: float, fmodel: Model | None,
                   executor: Executor | None, shards: Any, progress: bool, rest: list[Any]
                   ) -> tuple[Any, EffectPlan | None, Any]:
    """The replay table; with sums deferred (``rest``, :func:`~ivq_debug.diagnose.batch.replay_batch`), first the
    effect runs of the targets the ranking attribution's sums choose (:func:`~ivq_debug.diagnose.effect_targets.
    effect_plan`) started on ``pool`` (ONNX Runtime releases the GIL), then the other sums added here while they run
    (``docs/scale.md``, seventh pass). Returns the table, the plan and ``(its targets, the call that waits for their
    effects)`` for ``replay_effects``."""
    if not rest:
        return _table(runnable, accs, attribution), None, None
    plan = effect_plan(model, _table(runnable, accs, attribution), budget)
    started = None
    if plan is not None:
        fut = pool.submit(measure_effects, model, ref, rids, plan.targets, float_model=fmodel, executor=executor,
                          shards=shards, progress=progress)
        started = (plan.targets, fut.result)
    for add in rest:
        add()
    return _table(runnable, accs, attribution), plan, started


def _accumulation(model: Model, table: Any, budget: float, record: dict[str, Any], attribution: str,
                  cumulative: Any, ref: Any, rids: list[str], runnable: list[Unit]) -> Accumulation | None:
    """When nothing is over budget but the output: where the error accumulates (needs ``cumulative``). The
    comparison's encoding findings are read only then (a comparison made without the encoding fit gets it here,
    :meth:`~ivq_debug.comparator.comparison.Comparison.fit_encodings`)."""
    if cumulative is None:
        return None
    g = model.proto.graph
    inits = {i.name for i in g.initializer}
    facts = dict(attribution=attribution, cumulative=_cum_rows(cumulative, ref, rids[0]),
                 model_inputs=[i.name for i in g.input if i.name not in inits], model_outputs=[o.name for o in g.output],
                 unit_inputs={u.output: u.inputs for u in runnable})
    if explain_accumulation(table, budget, record, findings=[], **facts) is None:  # the findings change no None
        return None
    fit = getattr(cumulative, "fit_encodings", None)
    if fit is not None:
        fit()
    return explain_accumulation(table, budget, record, findings=resolution_collapse(cumulative) + saturation(cumulative),
                                **facts)


def _merged(done: list[BatchResult]) -> tuple[dict[str, Acc], str | None, dict[str, Any], int]:
    """The batches' accumulators, the backend that ran units (the last batch that ran any) and the sessions."""
    accs: dict[str, Acc] = {}
    backend, info, sessions = None, {}, 0
    for got in done:
        accs.update(got.accs)
        if got.backend is not None:
            backend, info = got.backend, got.info
        sessions += got.sessions
    return accs, backend, info, sessions


def _indexer(ref: Any, model: Model, cumulative: Any) -> Any:
    """``index(rid) -> RefIndex``, each record's reference index built once, linked to the comparison's alignment
    when it first needs it (a tensor the reference does not name, the test dump)."""
    aliases = lineage_aliases(model)
    indexes: dict[str, RefIndex] = {}

    def index(rid: str) -> RefIndex:
        if rid not in indexes:
            indexes[rid] = RefIndex(ref, rid, {}, aliases, shapes=model.value_shapes,
                                    link=lambda: pairs_for(cumulative, rid))
        return indexes[rid]

    return index


def _runnable(model: Model, nodes: Iterable[str] | None, ref: Any, rids: list[str], index: Any,
              prefetch: bool = False) -> tuple[list[Unit], dict[str, str]]:
    """The units to replay (those of ``nodes``, default all) whose tensors every record references, and the
    skipped ones with their reason. ``prefetch``: first read the first record's values of the tensors the reference
    names (the replay in this process reads them next, and the index keeps what it read), while the comparison
    that ``ivq diagnose`` aligns in a thread is not yet needed: a tensor the reference does not name waits for that
    alignment (``docs/scale.md``, fifth pass)."""
    units = model_units(model)
    if nodes is not None:
        wanted = set(nodes)
        units = [u for u in units if u.node in wanted or u.output in wanted]
        if not units:
            raise UsageError(f"none of the requested nodes {sorted(wanted)[:5]} is a QDQ node unit")
    idx0 = index(rids[0])
    if prefetch:
        for x in dict.fromkeys(x for u in units for x in [*u.inputs, u.output] if x in idx0.by_name):
            idx0.read(x)
    runnable: list[Unit] = []
    skipped: dict[str, str] = {}
    for u in units:
        missing = [x for x in [*u.inputs, u.output] if idx0.source(x) is None]
        if missing:
            why = idx0.rejected.get(missing[0])
            skipped[u.node] = (f"no reference value for {'output' if missing[0] == u.output else 'input'} "
                               f"{missing[0]!r}" + (f" ({why})" if why else " (not in the reference, not aligned)"))
        else:
            runnable.append(u)
    for rid in rids[1:]:  # every further record must hold what the first one gave the runnable units
        idx = index(rid)
        gap = next((x for u in runnable for x in [*u.inputs, u.output] if idx.source(x) is None), None)
        if gap is not None:
            raise UsageError(f"record {rid!r} lacks {gap!r}, which record {rids[0]!r} holds: replay the records "
                             "one at a time (--record)", getattr(ref, "path", None))
    return runnable, skipped


def _batches(runnable: list[Unit], idx0: RefIndex, batch_bytes: int, as_jobs: bool) -> list[list[Unit]]:
    """Batches bounded by reference-input bytes; as jobs, cut into at least ``defaults.REPLAY_MIN_JOBS``."""
    batches = size_runs(runnable, lambda u: sum(idx0.source(x).entry.nbytes for x in u.inputs), batch_bytes)
    if as_jobs and runnable:  # jobs for the workers to share (defaults.REPLAY_MIN_JOBS)
        per = math.ceil(len(runnable) / defaults.REPLAY_MIN_JOBS)
        batches = [b[i:i + per] for b in batches for i in range(0, len(b), per)]
    return batches


def _cumulative(cumulative: Any, ref: Any, rids: list[str], runnable: list[Unit]
                ) -> tuple[dict[str, Any], dict[str, float]]:
    """Per unit: the comparison row of its worst record (lowest cumulative SQNR) and its cumulative noise power
    summed over the records."""
    cum_noise: dict[str, float] = {}
    cum_rows: dict[str, Any] = {}
    for rid in rids:
        c_pairs = _cum_rows(cumulative, ref, rid)
        for u in runnable:
            c = c_pairs.get(u.output)
            if c is not None:
                rm = c.get("rmse")
                p_cum = (rm ** 2) * c["numel"] if rm is not None and not _nan(rm) else None
                if p_cum is not None:
                    cum_noise[u.node] = cum_noise.get(u.node, 0.0) + p_cum
                prev = cum_rows.get(u.node)
                if prev is None or (c.get("sqnr_db") is not None and not _nan(c["sqnr_db"])
                                    and (prev.get("sqnr_db") is None or c["sqnr_db"] < prev["sqnr_db"])):
                    cum_rows[u.node] = c
    return cum_rows, cum_noise


def _table(runnable: list[Unit], accs: dict[str, Acc], attribution: str) -> Any:
    """The replay table (:data:`COLUMNS`), one row per unit in execution order; the cumulative columns
    (``cum_sqnr_db``, ``cum_max_abs``, ``inherited_share``) NaN until :func:`_add_cumulative` fills them."""
    import pandas as pd

    rows = []
    for u in runnable:
        a = accs[u.node]
        iso, loc, w = a.iso.result(), a.local.result(), a.weight.result()
        chosen = loc if attribution == "local" else iso
        p_act = _noise_power(a.act_local if attribution == "local" else a.act_iso)
        p_w = _noise_power(a.weight)
        row = {
            "node": u.node, "op_type": u.op_type, "tensor": u.output,
            "order": u.order,
            "intro_sqnr_db": chosen["sqnr_db"], "intro_max_abs": chosen["max_abs"],
            "intro_rel_l2": chosen["rel_l2"], "intro_status": chosen["status"],
            "intro_noise": _noise_power(a.local if attribution == "local" else a.iso),
            "local_sqnr_db": loc["sqnr_db"], "local_noise": _noise_power(a.local),
            "iso_sqnr_db": iso["sqnr_db"], "iso_noise": _noise_power(a.iso),
            "weight_sqnr_db": w["sqnr_db"] if u.weights else None, "weight_noise": p_w,
            "act_noise": p_act,
            # a dynamic INT8 unit (no compute node of its own) has no weight / activation split: None
            "weight_share": (p_w / (p_w + p_act)) if u.weights and (p_w + p_act) > 0 else (
                None if u.weights or u.compute is None else 0.0),
            "weights": ",".join(u.weights), "input_ops": ",".join(dict.fromkeys(u.input_ops)),
            "replayed_on": a.replayed_on, "ref_match": a.ref_match,
            "selfcheck_steps": a.selfcheck, "selfcheck_share": a.selfcheck_share,
            "approximate": bool(a.selfcheck is not None and a.selfcheck > defaults.REPLAY_SELFCHECK_STEPS),
            "signal": a.local.sum_r2,
        }
        rows.append(row)
    table = pd.DataFrame(rows, columns=COLUMNS).sort_values("order", kind="stable").reset_index(drop=True)
    for c in FLOAT_COLUMNS:
        table[c] = pd.to_numeric(table[c], errors="coerce").astype("float64")
    return table


def _add_cumulative(table: Any, runnable: list[Unit], accs: dict[str, Acc], attribution: str,
                    cum_rows: dict[str, Any], cum_noise: dict[str, float]) -> None:
    """Fill the replay table's cumulative columns in place (each unit's comparison row of its worst record, and
    the share of its cumulative noise it inherited), with the values and arithmetic of one row at a time."""
    import pandas as pd

    cum: dict[str, dict[str, Any]] = {}
    for u in runnable:
        c = cum_rows.get(u.node)
        if c is None:
            continue
        a = accs[u.node]
        intro = _noise_power(a.local if attribution == "local" else a.iso)
        p_cum = cum_noise.get(u.node)
        cum[u.node] = {"cum_sqnr_db": c["sqnr_db"], "cum_max_abs": c["max_abs"],
                       "inherited_share": (max(0.0, 1.0 - intro / p_cum) if p_cum else (0.0 if p_cum == 0 else None))}
    nodes = table["node"].tolist()
    for col in ("cum_sqnr_db", "cum_max_abs", "inherited_share"):
        vals = [cum[n][col] if n in cum else None for n in nodes]
        table[col] = pd.to_numeric(pd.Series(vals, index=table.index, dtype=object), errors="coerce").astype("float64")
