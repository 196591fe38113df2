"""The replay's batches as jobs on an executor (:mod:`ivq_debug.executor`): one job per batch, its shard the batch's
accumulators as JSON, merged in batch order; a rerun skips the batches whose shard is there. Every number is the
in-process replay's to the bit: a unit's values do not depend on the other units of its batch, and its sums are
made in one job, in the same order.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ivq_debug.diagnose.batch import Acc, BatchContext, BatchResult, RunnerFactory, replay_batch
from ivq_debug.diagnose.refs import RefIndex, pairs_for
from ivq_debug.diagnose.units import Unit, lineage_aliases, model_units
from ivq_debug.dump import open_dump
from ivq_debug.errors import InputError, UsageError, one_line
from ivq_debug.executor import Executor, Job, job_key, merge_check, versions
from ivq_debug.inputfiles import sha256_file
from ivq_debug.jsonio import json_safe
from ivq_debug.onnxgraph.load import Model, load

#: the shard fields that must agree across a run's batches (``executor.merge_check``)
SHARD_FIELDS = ("model_sha256", "reference_sha256", "test_sha256", "backend", "records", "versions")
_N = {"type": "integer", "minimum": 0}
_F = {"type": "number", "x-finite": True}
_F0 = {"type": "number", "minimum": 0, "x-finite": True}
_METRIC_STATE = {
    "type": "object",
    "required": ["n", "sum_abs", "sum_sq_err", "sum_r2", "sum_t2", "sum_tr", "max_abs", "nonfinite_ref",
                 "nonfinite_test"],
    "additionalProperties": False,
    "properties": {"n": _N, "sum_abs": _F0, "sum_sq_err": _F0, "sum_r2": _F0, "sum_t2": _F0, "sum_tr": _F,
                   "max_abs": _F0, "nonfinite_ref": _N, "nonfinite_test": _N, "logits": {"type": "boolean"},
                   "rows": _N, "top1_agree": _N, "kl_sum": _F},
    "x-ordered": [["top1_agree", "rows"]],
}
_SHARE = {"type": ["number", "null"], "minimum": 0, "maximum": 1, "x-finite": True}
#: a replay shard's ``result`` (:meth:`Acc.state` per unit): counts non-negative integers, sums finite and
#: squares non-negative, never NaN (shards are untrusted: checked before the merge reads them)
SHARD_RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "replay shard result",
    "required": ["units", "backend", "info", "sessions"],
    "properties": {
        "units": {"type": "object", "additionalProperties": {
            "type": "object",
            "required": [*Acc.SUMS, "selfcheck", "selfcheck_share", "replayed_on", "ref_match"],
            "properties": {**dict.fromkeys(Acc.SUMS, _METRIC_STATE),
                           "selfcheck": {"type": ["number", "null"], "minimum": 0},  # NaN where the test held one
                           "selfcheck_share": _SHARE, "replayed_on": {"type": "string"},
                           "ref_match": {"type": "string"}},
        }},
        "backend": {"type": "string"}, "info": {"type": "object"}, "sessions": _N,
    },
}
#: per worker process: the opened inputs of the last replay (jobs of one run share them)
_WORKER_CACHE: dict[tuple[Any, ...], tuple[Model, dict[str, Unit], dict[str, RefIndex]]] = {}


def describe_factory(factory: RunnerFactory | None) -> str:
    """A stable description of a runner factory for a job key: ``cpu``, or the module-level function's name with
    a ``functools.partial``'s arguments. A lambda or a closure cannot be sent to a worker: :class:`UsageError`."""
    if factory is None:
        return "cpu"
    fn, args, kw = factory, (), {}
    if isinstance(factory, functools.partial):
        fn, args, kw = factory.func, factory.args, factory.keywords
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    if "<" in name:
        raise UsageError(f"an executor needs a runner factory that is a module-level function or a functools.partial "
                         f"of one, not {name}")
    return f"{name}{args!r}{sorted(kw.items())!r}"


def _batch_job(model_path: str, ref_path: str, test_path: str | None, rids: list[str],
               pairs: dict[str, tuple[dict[str, Any], str | None]], nodes: list[str],
               runner_factory: RunnerFactory | None, do_check: bool) -> dict[str, Any]:
    """One job: the replay of one batch of units (``nodes``) over the records, as a shard's JSON."""
    ck = (model_path, ref_path, test_path, tuple(rids))
    hit = _WORKER_CACHE.get(ck)
    if hit is None:
        _WORKER_CACHE.clear()
        model = load(model_path)
        ref = open_dump(ref_path)
        test = open_dump(test_path) if test_path else None
        aliases = lineage_aliases(model)
        indexes = {rid: RefIndex(ref, rid, pairs[rid][0], aliases, test if pairs[rid][1] else None, pairs[rid][1],
                                 model.value_shapes) for rid in rids}
        hit = _WORKER_CACHE[ck] = (model, {u.node: u for u in model_units(model)}, indexes)
    model, by_node, indexes = hit
    ctx = BatchContext(model, rids, indexes, runner_factory, do_check)
    got = replay_batch(ctx, [by_node[n] for n in nodes])
    return {"units": {n: a.state() for n, a in got.accs.items()}, "backend": got.backend,
            "info": json_safe(got.info), "sessions": got.sessions}


def replay_jobs(executor: Executor, shards: str | os.PathLike | None, model: Model, ref: Any, cumulative: Any,
                rids: list[str], batches: list[list[Unit]], runner_factory: RunnerFactory | None,
                do_check: bool, progress: bool) -> tuple[list[BatchResult], dict[str, Any]]:
    """The batches as jobs on ``executor``, their shards merged in batch order
    (:func:`~ivq_debug.diagnose.replay.replay`), and what the run did (``ReplayResult.jobs``). A worker reads the
    model from its file: a model built in memory cannot be sent (:class:`UsageError`)."""
    if model.path is None:
        raise UsageError("an executor replays a model file (each worker reads it): save the model first")
    model_path = model.path
    backend = describe_factory(runner_factory)
    ref_path = str(Path(ref.path).resolve())
    test = cumulative.test if cumulative is not None else None
    test_path = str(Path(test.path).resolve()) if test is not None else None
    pairs: dict[str, tuple[dict[str, Any], str | None]] = {}
    for rid in rids:
        p, t, trid = pairs_for(cumulative, rid)
        pairs[rid] = (p, trid if t is not None else None)
    meta = {"model_sha256": sha256_file(model_path), "reference_sha256": ref.content_digest(),
            "test_sha256": test.content_digest() if test is not None else None, "backend": backend, "records": rids,
            "versions": versions(), "selfcheck": do_check}
    # the alignment pairs change which reference a unit reads: a part of the key
    align = job_key(pairs={rid: {k: [e.name, e.rid, how] for k, (e, how) in p.items()} for rid, (p, _) in pairs.items()},
                    test_rids={rid: trid for rid, (_, trid) in pairs.items()})
    jobs = []
    for batch in batches:
        nodes = [u.node for u in batch]
        key = job_key(kind="replay-batch/1", nodes=nodes, align=align, **meta)
        jobs.append(Job(key, _batch_job, {"model_path": str(model_path.resolve()), "ref_path": ref_path,
                                          "test_path": test_path, "rids": rids, "pairs": pairs, "nodes": nodes,
                                          "runner_factory": runner_factory, "do_check": do_check}, meta))
    tmp = None
    if shards is None:
        tmp = shards = tempfile.mkdtemp(prefix=".ivq-replay-shards-")
    try:
        report = executor.run(jobs, shards, "replaying", progress=progress)
        report.raise_failures()
        docs = [report.load(j.key, SHARD_RESULT_SCHEMA) for j in jobs]
        merge_check(docs, SHARD_FIELDS)
        out = []
        for doc, batch in zip(docs, batches, strict=True):
            r = doc["result"]
            try:
                if sorted(r["units"]) != sorted(u.node for u in batch):
                    raise ValueError("it does not hold its batch's units")
                out.append(BatchResult({n: Acc.from_state(v) for n, v in r["units"].items()}, r["backend"],
                                       dict(r["info"]), int(r["sessions"])))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise InputError(f"not a replay shard ({one_line(e, 200)})", report.shards[doc["key"]]) from None
        return out, {"executor": type(executor).__name__, "total": len(jobs), "resumed": len(report.skipped),
                     "retried": sorted(set(report.retried)), "shards": None if tmp is not None else str(shards)}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
