"""Effect on the output: the whole quantized model run with a unit or a group put back to float (issue 28).

Introduced error says *where* the error starts; it does not say what fixing it buys: a unit's error can be absorbed
downstream (a gate multiplied into a residual it cannot move) or be most of the output's. A *counterfactual* run
measures it: the QDQ model with a *target* put back to float, run on the replay's backend over the replayed
records, against the reference's final outputs.

A target puts back to float

- the output encodings of its units **and every encoding shared with them** (:func:`shared_encodings`: a Reshape /
  Transpose / other data-movement copy re-quantized with the same scale and zero point carries the same clipping
  or coarseness; lifting only the unit's own Q/DQ leaves the copy's in place and measures nothing);
- the weights its units read: the float model's initializer of the same name (``--float-model``), else the QDQ
  model's own float initializer when it keeps one (a weight quantized in the graph: QuantizeLinear of a float
  initializer); a weight with neither is listed in ``unreached`` and stays quantized.

Figures per target (``noise`` = ``Σ (out − ref)²`` over every final output and record):

- ``share = 1 − noise_lifted / noise_base``: the share of the output error that disappears (negative when lifting
  makes the output worse: errors that cancelled; reported as 0 with ``why``);
- ``gain_db = sqnr_lifted − sqnr_base``: the final outputs' SQNR gained (dB);
- ``why``: when the share is ≈ 0 (< :data:`ABSORBED_SHARE`), the reason: the lift could not reach a weight (no
  float values) or an encoding (``unreached_tensors``: no Q → DQ on the tensor), or the error is absorbed
  downstream, or lifting made the output worse (errors that cancelled).

Cost: one run of the whole model per distinct target plus the unchanged model. On the CPU they run as one graph
(:func:`~ivq_debug.diagnose.graphs.lifted_variants`: the unchanged model once, each target's copy of only the nodes its lift changes and
what lies downstream of them), one session, one run per record, with every figure what the target's own model
gives, to the bit; on another backend each target is its own model and session (a backend may refuse one lifted
model and place another). The runs are jobs on the executor (:mod:`ivq_debug.executor`; a group of targets per
worker on the CPU; without an executor and kept shards, a group per thread of this process,
``defaults.EFFECT_THREADS``) keyed by content (the model's, the reference's and the float model's SHA-256, the records,
the lifted tensors and weights, the backend and the versions), so ``--shards`` keeps them and a rerun skips
them. The targets are bounded: the :data:`EFFECT_GROUPS` worst groups over budget and the
:data:`EFFECT_UNITS` worst units (``replay`` picks them; identical targets share one run).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.batch import cpu_runner
from ivq_debug.diagnose.graphs import (
    dequantized,
    lift_starts,
    lifted_variants,
    mergeable,
    split_by_start,
    typed_inputs,
)
from ivq_debug.diagnose.jobs import describe_factory
from ivq_debug.dump import open_dump
from ivq_debug.errors import InputError, IvqError, UsageError, one_line
from ivq_debug.executor import Executor, Job, JobFailure, JobsFailedError, LocalExecutor, job_key, versions
from ivq_debug.inputfiles import file_version, sha256_file
from ivq_debug.metrics import dot
from ivq_debug.onnxgraph.intake import load_float_model
from ivq_debug.onnxgraph.load import Model, load
from ivq_debug.onnxgraph.sites import QDQ_DOMAINS, constant_arrays, float_name, floors_at_zero, quant_params

#: the worst groups over budget whose effect is measured (by their worst unit's introduced SQNR)
EFFECT_GROUPS = 6
#: the worst units over budget whose effect is measured on their own
EFFECT_UNITS = 5
#: an effect below this share of the output error counts as none: ``why`` says why
ABSORBED_SHARE = 0.02
#: a unit within the budget whose effect removes at least this share of the output error is a finding too
EFFECT_MATTERS = 0.25


@dataclass
class Target:
    """What one counterfactual run puts back to float."""

    key: str
    tensors: list[str]  # activation tensors whose encodings are bypassed (with their copies)
    weights: list[str]  # weights replaced by their float values


def _is(node: Any, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in QDQ_DOMAINS


def shared_encodings(model: Any) -> dict[str, list[str]]:
    """``{float tensor: every float tensor sharing its encoding}`` of a QDQ model (a path, proto or
    :class:`~ivq_debug.onnxgraph.load.Model`): tensors joined by a data-movement op (``defaults.VIEW_OPS``) whose
    input and output are quantized with the same scale and zero point (values), in graph order. Tensors with no
    copy are left out."""
    m = load(model)
    nodes = list(m.proto.graph.node)
    producer = {o: n for n in nodes for o in n.output if o}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for x in n.input:
            consumers.setdefault(x, []).append(n)
    qs = [n for n in nodes if _is(n, "QuantizeLinear")]
    arrays = m.arrays({x for q in qs for x in q.input[1:3] if x})

    def sig(q: Any) -> tuple[Any, ...] | None:
        qp = quant_params(q, arrays)
        if qp is None:
            return None
        zp = qp.zero_point if qp.zero_point is not None else np.zeros((), np.uint8)
        return (qp.scale.tobytes(), np.asarray(zp).tobytes(), str(zp.dtype))

    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    order: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.op_type not in defaults.VIEW_OPS or n.domain not in ("", "ai.onnx") or not n.input or not n.output:
            continue
        dq = producer.get(n.input[0])
        q_in = producer.get(dq.input[0]) if _is(dq, "DequantizeLinear") else None
        q_out = next((c for c in consumers.get(n.output[0], []) if _is(c, "QuantizeLinear")), None)
        if not _is(q_in, "QuantizeLinear") or q_out is None:
            continue
        s_in, s_out = sig(q_in), sig(q_out)
        if s_in is None or s_in != s_out:
            continue
        a, b = float_name(q_in.input[0]), float_name(n.output[0])
        order.setdefault(a, i)
        order.setdefault(b, i + 0.5)
        parent[find(b)] = find(a)
    fams: dict[str, list[str]] = {}
    for t in order:
        fams.setdefault(find(t), []).append(t)
    out: dict[str, list[str]] = {}
    for members in fams.values():
        members.sort(key=lambda t: order[t])
        for t in members:
            out[t] = members
    return out


def float_weights(qdq: Model, fmodel: Model | None, names: set[str]) -> dict[str, np.ndarray]:
    """Float values of the weights ``names``: the float model's initializers (or ``Constant`` nodes), else the
    QDQ model's own float initializers of the same name (a weight the graph quantizes itself)."""
    out: dict[str, np.ndarray] = {}
    if fmodel is not None:
        out.update(constant_arrays(load_float_model(fmodel), set(names), fmodel.base_dir))
    rest = {n for n in names if n not in out}
    if rest:
        out.update({k: v for k, v in qdq.arrays(rest).items() if v.dtype.kind == "f"})
    return out


def _lift_plan(model: Any, tensors: set[str], floats: dict[str, np.ndarray], base_dir: str = "",
               reached: set[str] | None = None) -> tuple[dict[int, Any], dict[str, np.ndarray]]:
    """What lifting ``tensors`` and the weights in ``floats`` changes in ``model``: ``(replacements, initializers)``,
    the nodes that replace a DequantizeLinear by index in ``model.graph.node`` (an Identity of the float tensor, or
    a Relu when the encoding holds a folded ReLU; an Identity of the weight's float values) and the float weights'
    new initializers (``ivq_float::W``), in graph order; ``reached`` collects the tensors whose encoding was found."""
    import onnx

    producer = {o: n for n in model.graph.node for o in n.output if o}
    inits = {i.name for i in model.graph.initializer}
    out: dict[int, Any] = {}
    added: dict[str, np.ndarray] = {}
    for i, n in enumerate(model.graph.node):
        w, q = dequantized(n, producer, inits)
        if w is not None and w in floats:
            name = f"ivq_float::{w}"
            if name not in added:
                added[name] = np.asarray(floats[w], np.float32)
            out[i] = onnx.helper.make_node("Identity", [name], [n.output[0]], name=f"{n.name}::float")
        elif w is None and q is not None and float_name(q.input[0]) in tensors:
            op = "Relu" if floors_at_zero(q, model, base_dir) else "Identity"
            if reached is not None:
                reached.add(float_name(q.input[0]))
            out[i] = onnx.helper.make_node(op, [q.input[0]], [n.output[0]], name=f"{n.name}::float")
    return out, added


def lifted_model(model: Any, tensors: set[str], floats: dict[str, np.ndarray], base_dir: str = "",
                 reached: set[str] | None = None) -> Any:
    """A copy of the QDQ model with the activation encodings of ``tensors`` bypassed (their DequantizeLinear
    becomes an Identity, or a Relu when the encoding holds a folded ReLU) and the weights in ``floats`` replaced
    by their float values; ``reached`` (when given) collects the tensors whose encoding was found and bypassed."""
    import onnx
    from onnx import numpy_helper

    plan, added = _lift_plan(model, tensors, floats, base_dir, reached)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in added.items())
    new_nodes = [plan.get(i, n) for i, n in enumerate(g.node)]
    del g.node[:]
    g.node.extend(new_nodes)
    return m


Spec = tuple[list[str], list[str]]  # a target's (tensors, weights), sorted


def _record_feeds(ref: Any, rid: str, g_in: list[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One record's model inputs and its reference entries by name (outputs and inputs)."""
    ins = {e.name: e for e in ref.tensors(rid, kind="input")}
    return {n: ref.read(ins[n]) for n in g_in}, {e.name: e for e in ref.tensors(rid)} | ins


def _add_noise(acc: dict[str, Any], got: dict[str, np.ndarray], refs: dict[str, np.ndarray | None]) -> None:
    """Add one record's output noise and signal powers (``refs``: the reference of each graph output, float64
    flat, None when the reference lacks it) into ``acc``."""
    for o, r in refs.items():
        if r is None or o not in got:
            continue
        t = np.asarray(got[o], np.float64).reshape(-1)
        if r.size != t.size:
            continue
        d = t - r
        acc["noise"] += dot(d, d)
        acc["signal"] += dot(r, r)
        if o not in acc["outputs"]:
            acc["outputs"].append(o)


def _out_refs(ref: Any, outs: dict[str, Any], g_out: list[str]) -> dict[str, np.ndarray | None]:
    return {o: ref.read(outs[o]).astype(np.float64).reshape(-1) if o in outs else None for o in g_out}


def _measure(qdq: Model, m: Any, names: list[dict[str, str]], ref: Any, rids: list[str],
             runner_factory: Callable[[Any], Any] | None) -> tuple[list[dict[str, Any]], str]:
    """Run ``m`` (derived from ``qdq``, in memory) over the records, one session: per variant (``names``: its
    ``{graph output: the output holding its value}``, ``{}`` for the model's own outputs) the output noise and
    signal powers and the outputs measured; and the runner's backend."""
    model = qdq.proto
    inits = {i.name for i in model.graph.initializer}
    g_in = [i.name for i in model.graph.input if i.name not in inits]
    g_out = [o.name for o in model.graph.output]
    accs: list[dict[str, Any]] = [{"noise": 0.0, "signal": 0.0, "outputs": []} for _ in names]
    backend = ""
    runner = None
    try:
        for rid in rids:
            feeds, outs = _record_feeds(ref, rid, g_in)
            if runner is None:
                typed_inputs(m, feeds)
                runner = (runner_factory or cpu_runner)(qdq.derive(m))
                backend = getattr(runner, "backend", "")
            got = runner.run(feeds)
            refs = _out_refs(ref, outs, g_out)
            for acc, mine in zip(accs, names, strict=True):
                _add_noise(acc, {o: got[mine.get(o, o)] for o in g_out if mine.get(o, o) in got}, refs)
            del got
    finally:
        if runner is not None and hasattr(runner, "close"):
            runner.close()
    return accs, backend


def effect_run(qdq: Model, ref: Any, rids: list[str], tensors: list[str], weights: list[str],
               fmodel: Model | None, runner_factory: Callable[[Any], Any] | None) -> dict[str, Any]:
    """One counterfactual run over the records: the output noise and signal powers (the derived model goes to
    its runner in memory)."""
    return effect_runs(qdq, ref, rids, [(tensors, weights)], fmodel, runner_factory, merge=False)[0]


def effect_runs(qdq: Model, ref: Any, rids: list[str], specs: list[Spec], fmodel: Model | None,
                runner_factory: Callable[[Any], Any] | None, merge: bool = True) -> list[dict[str, Any]]:
    """The counterfactual runs of ``specs`` (each a target's ``(tensors, weights)``): with ``merge`` as one graph
    (:func:`~ivq_debug.diagnose.graphs.lifted_variants`: the unchanged model and each target's changed part), one session, one run per
    record, each target's figures what its own model gives (:func:`lifted_model`, one session each: ``merge``
    False, or a model that is not :func:`~ivq_debug.diagnose.graphs.mergeable`), to the bit: every node computes what it computes in the
    target's own model. ``seconds``: the whole group's."""
    t0 = time.perf_counter()
    model = qdq.proto
    every = {w for _, ws in specs for w in ws}
    found = float_weights(qdq, fmodel, every) if every else {}
    floats = [{w: found[w] for w in ws if w in found} for _, ws in specs]
    reached: list[set[str]] = [set() for _ in specs]
    if merge and len(specs) > 1 and mergeable(model):
        plans = [_lift_plan(model, set(t), fl, qdq.base_dir, rc)
                 for (t, _), fl, rc in zip(specs, floats, reached, strict=True)]
        m, names = lifted_variants(model, plans)
        accs, backend = _measure(qdq, m, names, ref, rids, runner_factory)
    else:
        accs, backend = [], ""
        for (t, _), fl, rc in zip(specs, floats, reached, strict=True):
            got, backend = _measure(qdq, lifted_model(model, set(t), fl, qdq.base_dir, rc), [{}], ref, rids,
                                    runner_factory)
            accs += got
    sec = round(time.perf_counter() - t0, 3)
    return [{**acc, "weights_lifted": sorted(fl), "unreached": sorted(set(ws) - set(fl)),
             "unreached_tensors": sorted(set(ts) - rc), "backend": backend, "seconds": sec}
            for acc, (ts, ws), fl, rc in zip(accs, specs, floats, reached, strict=True)]


#: the models of the current run by (file, size, mtime): a job in this process (or in a forked worker) reads no
#: model file again; a worker started otherwise reads each once
_LOADED: dict[tuple[str, int, int], Model] = {}


def _once(memo: dict[tuple[str, int, int], Any], path: str, read: Callable[[str], Any]) -> Any:
    """``read(path)`` once per process and file version (``memo``: :data:`_LOADED` or :data:`_OPENED`)."""
    key = file_version(path)
    if key not in memo:
        memo[key] = read(path)
    return memo[key]


def _loaded(path: str) -> Model:
    """The model of ``path``, parsed once per process and file version."""
    return _once(_LOADED, path, load)


#: the reference dumps of the current run by (file, size, mtime), open: a job in this process reads the manifest
#: of the dump its caller opened instead of opening it again (0.2-0.3 s each on the ViT-S reference of
#: bench/bench_loop.py, 2,140 entries, once per counterfactual run); a worker opens each once
_OPENED: dict[tuple[str, int, int], Any] = {}


def _opened(path: str) -> Any:
    """The reference dump at ``path``, opened once per process and file version."""
    return _once(_OPENED, path, open_dump)


_F0 = {"type": "number", "minimum": 0, "x-finite": True}
_NAMES = {"type": "array", "items": {"type": "string"}}
#: one counterfactual run's figures (:func:`effect_run`'s, or a backend's refusal ``{"error": ...}``): noise and
#: signal powers finite and non-negative, never NaN (shards are untrusted: checked before the merge reads them)
RUN_RESULT_SCHEMA: dict[str, Any] = {
    "title": "effect run",
    "anyOf": [
        {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
        {"type": "object", "required": ["noise", "signal", "outputs"],
         "properties": {"noise": _F0, "signal": _F0, "outputs": _NAMES, "weights_lifted": _NAMES,
                        "unreached": _NAMES, "unreached_tensors": _NAMES, "backend": {"type": "string"},
                        "seconds": _F0}},
    ],
    "x-message": "must be an effect run (noise and signal: finite numbers >= 0, outputs: names) or {\"error\": text}",
}
#: an effect shard's ``result``: its targets' runs, in the job's order
SHARD_RESULT_SCHEMA: dict[str, Any] = {
    "title": "effect shard result", "type": "object", "required": ["results"],
    "properties": {"results": {"type": "array", "items": RUN_RESULT_SCHEMA}},
}


def _run_batch(qdq: Model, ref: Any, rids: list[str], specs: list[Spec], fmodel: Model | None,
               runner_factory: Callable[[Any], Any] | None) -> list[dict[str, Any]]:
    """The runs of ``specs``, in order: as one graph (:func:`effect_runs`), or one by one when the backend refuses
    that graph, so each refusal is its own target's. A backend that refuses a lifted model gives a result
    (``{"error": ...}``), not a failure to retry: the refusal is deterministic."""
    if len(specs) > 1:
        try:
            return effect_runs(qdq, ref, rids, specs, fmodel, runner_factory)
        except IvqError:
            pass
    out = []
    for tensors, weights in specs:
        try:
            out.append(effect_run(qdq, ref, rids, tensors, weights, fmodel, runner_factory))
        except IvqError as e:
            out.append({"error": e.message})
    return out


def _effect_job(model_path: str, ref_path: str, rids: list[str], specs: list[Spec], float_model: str | None,
                runner_factory: Callable[[Any], Any] | None) -> dict[str, Any]:
    """The counterfactual runs of ``specs`` as a job (the models as this process loaded them, :func:`_loaded`):
    ``{"results": [...]}`` (:func:`_run_batch`)."""
    return {"results": _run_batch(_loaded(model_path), _opened(ref_path), rids, [(list(t), list(w)) for t, w in specs],
                                  _loaded(float_model) if float_model else None, runner_factory)}


def _sqnr(signal: float, noise: float) -> float:
    import math

    if noise <= 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _grouped(model: Any, spec: dict[str, Spec], runner_factory: Callable[[Any], Any] | None,
             executor: Executor | None) -> list[list[Spec]]:
    """The distinct targets of ``spec`` in groups that each run as one graph: on the CPU (``runner_factory``
    None) as many groups as the executor has workers (one in this process), the targets by where their lift starts
    in ``model`` (:func:`~ivq_debug.diagnose.graphs.split_by_start`: a group without the unchanged model runs it only
    up to its latest start); on another backend one target per group (a backend may refuse one lifted model and
    place another: each keeps its own answer)."""
    distinct = list({(tuple(t), tuple(w)): (t, w) for t, w in spec.values()}.values())
    if runner_factory is not None:
        return [[s] for s in distinct]
    n = min(len(distinct), getattr(executor, "workers", len(distinct)) if executor is not None else 1)
    return [[distinct[i] for i in g] for g in split_by_start(lift_starts(model, distinct), len(model.graph.node), n)]


def _as_jobs(qdq: Model, fmodel: Model | None, ref: Any, rids: list[str], spec: dict[str, Spec],
             runner_factory: Callable[[Any], Any] | None, executor: Executor | None, shards: str | os.PathLike | None,
             progress: bool) -> tuple[dict[str, Any], dict[str, str], int, int]:
    """The targets' runs as jobs (models read from files), a job per group (:func:`_grouped`):
    ``(docs, refused, runs, resumed)`` by target key (runs and resumed count targets)."""

    try:
        backend = describe_factory(runner_factory)
    except UsageError:  # a closure cannot go to a worker: it runs in this process, keyed by its name
        backend = repr(runner_factory)
    executor = executor or _in_process(runner_factory, kept=shards is not None)
    _LOADED.clear()  # this run's models, already parsed
    _LOADED.update({file_version(m.path): m for m in (qdq, fmodel) if m is not None})
    ref_path = str(Path(ref.path).resolve())
    _OPENED.clear()  # this run's reference, already open (not closed here: its caller owns it)
    _OPENED[file_version(ref_path)] = ref
    meta = {"model_sha256": sha256_file(qdq.path), "reference_sha256": ref.content_digest(),
            "float_sha256": sha256_file(fmodel.path) if fmodel is not None else None, "records": list(rids),
            "backend": backend, "versions": versions()}
    kw = {"model_path": str(qdq.path.resolve()), "ref_path": ref_path, "rids": list(rids),
          "float_model": str(fmodel.path.resolve()) if fmodel is not None else None,
          "runner_factory": runner_factory}
    jobs: dict[str, Job] = {}
    members: dict[str, list[Spec]] = {}
    for group in _grouped(qdq.proto, spec, runner_factory, executor):
        k = job_key(kind="effect/2", specs=group, **meta)
        members[k] = group
        jobs[k] = Job(k, _effect_job, kw | {"specs": group}, meta)
    tmp = None
    if shards is None:
        tmp = shards = tempfile.mkdtemp(prefix=".ivq-effect-shards-")
    by_spec: dict[tuple[Any, ...], dict[str, Any]] = {}
    try:
        report = executor.run(list(jobs.values()), shards, "effect on the output", progress=progress)
        failed = {f.key: f.error for f in report.failures}
        for k, group in members.items():
            if k in failed:
                got = [{"error": failed[k]}] * len(group)
            else:
                got = report.load(k, SHARD_RESULT_SCHEMA)["result"]["results"]
                if len(got) != len(group):
                    raise InputError(f"the shard of job {k} holds {len(got)} effect runs for {len(group)} targets",
                                     report.shards.get(k))
            by_spec.update({(tuple(t), tuple(w)): d for (t, w), d in zip(group, got, strict=True)})
    finally:
        _OPENED.clear()  # the caller's dump is not kept open by this module after the run
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    docs, refused = _split(spec, by_spec)
    resumed = sum(len(members[k]) for k in report.skipped if k in members)
    return docs, refused, len(by_spec), resumed


def _in_process(runner_factory: Callable[[Any], Any] | None, kept: bool) -> Executor:
    """The executor of the runs without one: on the CPU, when no shard is kept, ``defaults.EFFECT_THREADS`` threads
    (at most one per core), a group of targets each (:func:`_grouped`); else one job at a time in this process (kept
    shards are keyed by their group: a rerun with or without ``LocalExecutor(1)`` resumes them)."""
    if runner_factory is None and not kept:
        return LocalExecutor(max(1, min(defaults.EFFECT_THREADS, os.cpu_count() or 1)), threads=True)
    return LocalExecutor(1)


def _split(spec: dict[str, Spec], by_spec: dict[tuple[Any, ...], dict[str, Any]]
           ) -> tuple[dict[str, Any], dict[str, str]]:
    """Each target's run, and the refused ones' reasons, by target key."""
    docs, refused = {}, {}
    for key, (t, w) in spec.items():
        d = by_spec[(tuple(t), tuple(w))]
        if "error" in d:
            refused[key] = str(d["error"])
        else:
            docs[key] = d
    return docs, refused


def _here(qdq: Model, fmodel: Model | None, ref: Any, rids: list[str], spec: dict[str, Spec],
          runner_factory: Callable[[Any], Any] | None) -> tuple[dict[str, Any], dict[str, str], int]:
    """The targets' runs in this process (a model built in memory), the same target measured once, a group
    (:func:`_grouped`) at a time: ``(docs, refused, runs)``."""
    by_spec: dict[tuple[Any, ...], dict[str, Any]] = {}
    for group in _grouped(qdq.proto, spec, runner_factory, None):
        got = _run_batch(qdq, ref, list(rids), group, fmodel, runner_factory)
        by_spec.update({(tuple(t), tuple(w)): d for (t, w), d in zip(group, got, strict=True)})
    docs, refused = _split(spec, by_spec)
    return docs, refused, len(by_spec)


def _on_cpu(qdq: Model, fmodel: Model | None, ref: Any, rids: list[str], spec: dict[str, tuple[list[str], list[str]]],
            docs: dict[str, Any], refused: dict[str, str]) -> int:
    """The backend refused a lifted model (e.g. a float op HTP cannot place without CPU fallback): that target and
    the unchanged model are measured on CPU-QDQ instead, and say so (every target, when the unchanged model itself
    is refused). Fills ``docs``; returns the runs it made."""
    cpu_base = effect_run(qdq, ref, list(rids), [], [], fmodel, None)
    redo = list(spec) if "base" in refused else list(refused)
    why = refused.get("base") or next(iter(refused.values()))
    for key in redo:
        if key == "base":
            docs["base"] = cpu_base
            continue
        got = effect_run(qdq, ref, list(rids), *spec[key], fmodel, None)
        got["refused"] = one_line(refused.get(key, why), 300)
        docs[key] = got
    docs["cpu_base"] = cpu_base
    return 1 + len([k for k in redo if k != "base"])


def measure_effects(qdq_model: Any, ref: Any, rids: list[str], targets: list[Target], *,
                    float_model: Any = None, runner_factory: Callable[[Any], Any] | None = None,
                    executor: Executor | None = None, shards: str | os.PathLike | None = None,
                    progress: bool = False) -> dict[str, Any]:
    """The effect of each target (module docstring): ``{"base": {...}, "targets": {key: {...}}, "runs": n,
    "resumed": n, "seconds": s}``; empty when the reference lacks the model's inputs or outputs for the records.

    ``qdq_model`` / ``float_model``: paths or :class:`~ivq_debug.onnxgraph.load.Model` objects. Models read from
    files run as jobs on ``executor`` (default: in this process) with their shards in ``shards``; a model built
    in memory, or a reference that is not a file (``ivq tune``'s in-memory float reference), runs in this process,
    unkept.
    """
    t0 = time.perf_counter()
    qdq = load(qdq_model)
    fmodel = load(float_model) if float_model is not None else None
    model = qdq.proto
    inits = {i.name for i in model.graph.initializer}
    g_in = [i.name for i in model.graph.input if i.name not in inits]
    g_out = [o.name for o in model.graph.output]
    for rid in rids:
        names = {e.name for e in ref.tensors(rid, kind="input")}
        outs = {e.name for e in ref.tensors(rid)} | names
        if any(n not in names for n in g_in) or not any(n in outs for n in g_out):
            return {}
    spec = {t.key: (sorted(set(t.tensors)), sorted(set(t.weights))) for t in [Target("base", [], []), *targets]}
    resumed = 0
    if qdq.path is not None and (fmodel is None or fmodel.path is not None) and os.path.isfile(str(ref.path)):
        docs, refused, runs, resumed = _as_jobs(qdq, fmodel, ref, rids, spec, runner_factory, executor, shards,
                                                progress)
    else:
        docs, refused, runs = _here(qdq, fmodel, ref, rids, spec, runner_factory)
    if refused and runner_factory is not None:
        runs += _on_cpu(qdq, fmodel, ref, rids, spec, docs, refused)
    elif refused:
        raise JobsFailedError([JobFailure(k, v) for k, v in refused.items()], shards or "")
    base = docs["base"]
    pb, sig = float(base["noise"]), float(base["signal"])
    out: dict[str, Any] = {"base": {"noise": pb, "signal": sig, "sqnr_db": _sqnr(sig, pb), "outputs": base["outputs"],
                                    "backend": base["backend"]},
                           "targets": {}, "runs": runs, "resumed": resumed,
                           "seconds": round(time.perf_counter() - t0, 3)}
    for t in targets:
        d = docs[t.key]
        pl = float(d["noise"])
        b = docs["cpu_base"] if d.get("refused") and "cpu_base" in docs else base
        pb, sig = float(b["noise"]), float(b["signal"])
        share = (1.0 - pl / pb) if pb > 0 else 0.0
        out["targets"][t.key] = {
            "tensors": spec[t.key][0], "weights_lifted": d["weights_lifted"], "unreached": d["unreached"],
            "unreached_tensors": d.get("unreached_tensors", []),
            "noise": pl, "sqnr_db": _sqnr(sig, pl), "gain_db": _sqnr(sig, pl) - _sqnr(sig, pb), "change": share,
            "share": max(share, 0.0), "backend": d["backend"]}
        if d.get("refused"):
            out["targets"][t.key]["refused"] = d["refused"]
    return out


def why_small(effect: dict[str, Any], weight_share: float | None) -> str | None:
    """Why a measured effect is ≈ 0 (< :data:`ABSORBED_SHARE`), or None when it is not: the lift could not reach
    the weights (no float values) when the weights dominate, else the error is absorbed downstream; a negative
    change says so (errors that cancelled)."""
    if effect.get("change") is None or effect["change"] >= ABSORBED_SHARE:
        return None
    if effect.get("unreached_tensors") and (weight_share or 0.0) < 0.5:
        return (f"the lift could not reach the encodings of {', '.join(effect['unreached_tensors'][:3])} (no "
                "QuantizeLinear → DequantizeLinear on them in the model)")
    if effect.get("unreached") and (weight_share or 0.0) >= 0.5:
        return (f"the lift could not reach the weights {', '.join(effect['unreached'][:3])} (no float values: give "
                "--float-model)")
    if effect["change"] < 0:
        return (f"putting it back to float makes the output worse ({effect['gain_db']:+.2f} dB): its error cancels "
                "another one downstream")
    return (f"absorbed downstream: putting it back to float changes the final outputs' SQNR by "
            f"{effect['gain_db']:+.2f} dB")
