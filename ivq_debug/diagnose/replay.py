"""Introduced (isolated) error: replay each QDQ node unit with the *reference* inputs.

For every compute node N of a QDQ model, its *unit* is N plus the Q/DQ nodes around it: activation inputs
enter as their float tensor X through X's QuantizeLinear → DequantizeLinear, weights through their
DequantizeLinear, and N's output leaves through its QuantizeLinear → DequantizeLinear. The unit is fed the
reference value of X (from the golden float dump) and its output is compared with the reference value of N's
output. That error is what the unit itself *introduces* (its input quantization, weight quantization, compute
precision and output quantization); the rest of the free-running (cumulative) error at that tensor is
*inherited* from upstream. Noise powers roughly add, so ``inherited_share = 1 − P_introduced / P_cumulative``
with P = Σ(t − r)².

All requested units are laid side by side in one replay model (renamed apart, weights shared), batched so that
one batch's reference inputs stay under ``defaults.REPLAY_BATCH_BYTES``; each batch is one session and one run
on the test backend (CPU-QDQ, or QNN HTP through a runner factory).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.capture.base import make_runner
from ivq_debug.console import track
from ivq_debug.diagnose.findings import Finding
from ivq_debug.dump import open_dump
from ivq_debug.errors import UsageError
from ivq_debug.metrics import MetricAccumulator
from ivq_debug.onnxgraph.fold import constant_nodes
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.onnxgraph.sites import QDQ_DOMAINS, float_name, is_qdq
from ivq_debug.util import json_safe

#: the ``ivq-replay/1`` document (:meth:`ReplayResult.to_json`, ``ivq diagnose --json``)
SCHEMA = "ivq-replay/1"


@dataclass
class Unit:
    """One QDQ node unit of a model."""

    node: str  # name of the compute node
    op_type: str
    order: int  # topological index of the compute node
    inputs: list[str]  # float tensors fed from the reference dump (pre-Q names)
    output: str  # float name of the unit's (first) output, as keyed in dumps
    nodes: list[Any] = field(repr=False, default_factory=list)  # NodeProtos of the unit
    out_value: str = ""  # graph value holding the unit output (a DQ output or N's output)


def constant_values(model: Any) -> tuple[set[str], list[Any]]:
    """Values computed from initializers only (weights, their DequantizeLinear, shape constants), and the
    nodes that compute them, in graph order (:func:`~ivq_debug.onnxgraph.fold.constant_nodes`)."""
    nodes = list(model.graph.node)
    idx, const = constant_nodes(nodes, {i.name for i in model.graph.initializer})
    return const, [nodes[i] for i in sorted(idx)]


def find_units(model: Any) -> list[Unit]:
    """The QDQ node units of a model, in topological order (compute nodes with float outputs only)."""
    nodes = list(model.graph.node)
    producer: dict[str, Any] = {o: n for n in nodes for o in n.output if o}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    const, _ = constant_values(model)
    units: list[Unit] = []
    for idx, n in enumerate(nodes):
        if is_qdq(n) or n.op_type == "Constant" or all(o in const for o in n.output if o):
            continue
        members = [n]
        feeds: list[str] = []
        ok = True
        for x in n.input:
            if not x or x in const:
                continue
            p = producer.get(x)
            if p is not None and p.op_type == "DequantizeLinear" and p.domain in QDQ_DOMAINS:
                src = p.input[0]
                q = producer.get(src)
                if q is not None and q.op_type == "QuantizeLinear" and q.domain in QDQ_DOMAINS:
                    members += [q, p]
                    feeds.append(q.input[0])
                    continue
                ok = False
                break
            feeds.append(x)  # float activation without QDQ (or a graph input)
        if not ok or not n.output or not n.output[0]:
            continue
        out = n.output[0]
        out_value = out
        qs = [c for c in consumers.get(out, []) if c.op_type == "QuantizeLinear" and c.domain in QDQ_DOMAINS]
        if qs:
            q = qs[0]
            dqs = [c for c in consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"]
            if dqs:
                members += [q, dqs[0]]
                out_value = dqs[0].output[0]
        name = float_name(out)
        # an input used twice (Mul(x, x)) brings its Q/DQ twice: keep each node once
        members = list({id(m): m for m in members}.values())
        feeds = list(dict.fromkeys(feeds))
        units.append(Unit(n.name, n.op_type, idx, feeds, name, members, out_value))
    return units


#: the integer ops a dynamic-quantization unit is built around (quantize_dynamic's, and ONNX Runtime's fusions)
DYNAMIC_OPS = ("MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")


def find_dynamic_units(model: Any) -> list[Unit]:
    """The dynamic-quantization units of a model (``quantize_dynamic``), in topological order.

    A unit is an integer op of :data:`DYNAMIC_OPS` with the ``DynamicQuantizeLinear`` nodes that quantize its
    float inputs, the ``Mul`` nodes that multiply their scales with the weight scales, (for an integer output)
    the ``Cast`` and the ``Mul`` that turn it back into float, and the bias ``Add`` after it: float in, float out
    under the float layer's name, so it replays on reference inputs like a QDQ unit. A fused
    ``DynamicQuantizeMatMul`` (float input) or ``MatMulIntegerToFloat`` (ONNX Runtime's graphs at
    ``ORT_ENABLE_ALL``, saved optimized models) is its own output stage; with its bias it covers the same tensor.
    """
    nodes = list(model.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            consumers.setdefault(x, []).append(i)
    const, _ = constant_values(model)
    units: list[Unit] = []
    for idx, n in enumerate(nodes):
        if n.op_type not in DYNAMIC_OPS or n.domain not in ("", "ai.onnx", "com.microsoft"):
            continue
        members, feeds, inner = {idx}, [], set(n.output)
        for x in n.input:
            if not x or x in const:
                continue
            p = producer.get(x)
            if p is not None and nodes[p].op_type == "DynamicQuantizeLinear":
                members.add(p)
                feeds.append(nodes[p].input[0])
                inner.update(nodes[p].output)
            elif n.op_type == "DynamicQuantizeMatMul" and x == n.input[0]:
                feeds.append(x)  # the fused op quantizes its float input itself
            else:
                feeds = []
                break
        if not feeds:
            continue
        out = n.output[0]
        if n.op_type in ("MatMulInteger", "ConvInteger"):  # int32 → Cast → Mul(scale product) → float
            casts = [i for i in consumers.get(out, []) if nodes[i].op_type == "Cast"]
            scaled = [i for i in consumers.get(nodes[casts[0]].output[0], []) if nodes[i].op_type == "Mul"] if casts else []
            if not scaled:
                continue
            mul = nodes[scaled[0]]
            for y in mul.input:  # the scale product: Mul(x_scale, w_scale) of the unit's own quantizer
                q = producer.get(y)
                if y and y not in const and y != nodes[casts[0]].output[0]:
                    if q is None or nodes[q].op_type != "Mul" or not all(
                            (not z) or z in const or z in inner for z in nodes[q].input):
                        break
                    members.add(q)
            else:
                members.update((casts[0], scaled[0]))
                out = mul.output[0]
            if out == n.output[0]:
                continue
        after = consumers.get(out, [])  # the layer's bias (ConvInteger's float name is the Add's), as fused at all
        if len(after) == 1 and nodes[after[0]].op_type == "Add" and all(
                (not z) or z in const or z == out for z in nodes[after[0]].input):
            members.add(after[0])
            out = nodes[after[0]].output[0]
        unit_nodes = [nodes[i] for i in sorted(members)]
        units.append(Unit(n.name, n.op_type, idx, list(dict.fromkeys(feeds)), float_name(out), unit_nodes, out))
    return units


def replay_units(model: Any) -> list[Unit]:
    """Every replayable unit of a model: its QDQ units (:func:`find_units`) and its dynamic-quantization units
    (:func:`find_dynamic_units`), which replace the per-node units of their members, in topological order."""
    dynamic = find_dynamic_units(model)
    covered = {o for u in dynamic for n in u.nodes for o in n.output if o}
    units = [u for u in find_units(model) if not (set(u.nodes[0].output) & covered)] + dynamic
    return sorted(units, key=lambda u: u.order)


def build_replay_model(model: Any, units: list[Unit], prefix: str = "u") -> tuple[Any, dict[str, tuple[int, str]]]:
    """One model holding the given units side by side.

    Returns the model and a map ``graph input name -> (unit index, reference tensor name)``; unit ``k``'s
    output is the graph output ``{prefix}{k}::out``.
    """
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    const, const_nodes = constant_values(model)
    needed = {x for u in units for n in u.nodes for x in n.input} | {u.out_value for u in units}
    # keep only the constant subgraph that feeds the units
    keep, frontier = set(), {x for x in needed if x in const}
    by_out = {o: n for n in const_nodes for o in n.output}
    while frontier:
        v = frontier.pop()
        n = by_out.get(v)
        if n is not None and id(n) not in keep:
            keep.add(id(n))
            frontier.update(x for x in n.input if x in const)
    const_nodes = [n for n in const_nodes if id(n) in keep]
    const_outs = {o for n in const_nodes for o in n.output}
    del g.node[:]
    del g.input[:]
    del g.output[:]
    del g.value_info[:]
    g.node.extend(const_nodes)
    feeds: dict[str, tuple[int, str]] = {}
    for k, u in enumerate(units):
        pre = f"{prefix}{k}::"

        def ren(name: str, pre: str = pre) -> str:
            if not name or name in const:
                return name
            return pre + name

        for x in u.inputs:
            gi = ren(x)
            if gi not in feeds:
                feeds[gi] = (k, x)
                g.input.append(onnx.ValueInfoProto(name=gi))
        for n in u.nodes:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.name = pre + n.name
            c.ClearField("input")
            c.ClearField("output")
            c.input.extend(ren(i) for i in n.input)
            outs = [ren(o) for o in n.output]
            c.output.extend(outs)
            g.node.append(c)
        out = onnx.NodeProto(op_type="Identity", name=pre + "out", input=[ren(u.out_value)], output=[pre + "out"])
        g.node.append(out)
        g.output.append(onnx.ValueInfoProto(name=pre + "out"))
    del const_outs
    # drop initializers no unit uses (the replay of a few units should not carry the whole model)
    used = {x for n in g.node for x in n.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    # the ValueInfo of graph inputs needs a type: set from the reference arrays at run time
    return m, feeds


def _typed_inputs(m: Any, feeds: dict[str, np.ndarray]) -> None:
    from onnx import helper

    for vi in m.graph.input:  # any numpy dtype ONNX has (uint8 / int8 tensors of a dynamic INT8 reference)
        a = feeds[vi.name]
        vi.CopyFrom(helper.make_tensor_value_info(vi.name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)))


def _noise_power(acc: MetricAccumulator) -> float:
    return acc.sum_sq_err


def replay(
    qdq_model: str | os.PathLike,
    reference: Any,
    *,
    record: Any = None,
    nodes: Iterable[str] | None = None,
    runner_factory: Callable[[str], Any] | None = None,
    cumulative: Any = None,
    budget_sqnr_db: float = defaults.DIVERGENCE_SQNR_DB,
    batch_bytes: int = defaults.REPLAY_BATCH_BYTES,
    progress: bool = True,
):
    """Introduced error of each QDQ node unit, fed with reference inputs.

    Args:
        qdq_model: the QDQ ONNX model (the one the test backend ran).
        reference: golden float dump (path or :class:`~ivq_debug.dump.Dump`) with the float tensors.
        record: which record of the reference to replay (default: the only / first record).
        nodes: only these compute nodes (names) or output tensors; default all units whose inputs are in
            the reference.
        runner_factory: ``f(model_path) -> runner`` on the test backend (default: ORT CPU-QDQ,
            optimizations disabled). Pass e.g. ``lambda p: make_runner("qnn", p)`` to replay on QNN HTP.
        cumulative: a :class:`~ivq_debug.comparator.Comparison` (reference vs free-running test) to take the
            cumulative error from.
        budget_sqnr_db: the introduced SQNR below which a unit breaks the budget.
        batch_bytes: maximum reference-input bytes per replay batch.

    Returns:
        A :class:`ReplayResult` (``.table`` DataFrame; ``.first_breaking``).
    """
    import onnx
    import pandas as pd

    ref = reference if hasattr(reference, "entries") else open_dump(reference)
    keys = ref.record_keys()
    if record is None:
        record = min(keys, key=lambda k: (k[0], k[2], k[1])) if keys else None
    rid = ref._rid(record)
    avail = {e.name: e for e in ref.tensors(rid)} | {e.name: e for e in ref.tensors(rid, kind="input")}
    model = load_model(qdq_model)
    units = replay_units(model)
    if nodes is not None:
        wanted = set(nodes)
        units = [u for u in units if u.node in wanted or u.output in wanted]
        if not units:
            raise UsageError(f"none of the requested nodes {sorted(wanted)[:5]} is a QDQ node unit")
    runnable = [u for u in units if all(x in avail for x in u.inputs) and u.output in avail]
    skipped = [u for u in units if u not in runnable]
    # batches bounded by reference-input bytes
    batches: list[list[Unit]] = []
    cur: list[Unit] = []
    size = 0
    for u in runnable:
        b = sum(avail[x].nbytes for x in u.inputs)
        if cur and size + b > batch_bytes:
            batches.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += b
    if cur:
        batches.append(cur)
    if runner_factory is None:
        def runner_factory(path: str) -> Any:
            return make_runner("onnx", path, optimization="disable")

    cum = {}
    if cumulative is not None:
        t = cumulative.table
        sel = t[(t["sample"] == ref.records.set_index("rid").loc[rid, "sample"])]
        for _, r in sel.iterrows():
            cum[(r["part"], r["step"], r["ref_name"])] = r
    rec = ref.records.set_index("rid").loc[rid]
    rows = []
    backend = None
    info: dict[str, Any] = {}
    # replay models go next to the QDQ model (hidden, removed after use): their weights are references
    # into the QDQ model's own file, which ONNX Runtime reads only from inside the model's folder
    folder = Path(qdq_model).resolve().parent
    it = track(batches, "replaying", total=len(batches)) if progress else batches
    for batch in it:
        m, feed_map = build_replay_model(model, batch)
        feeds = {gi: ref.read(avail[x]) for gi, (_, x) in feed_map.items()}
        _typed_inputs(m, feeds)
        fd, path = tempfile.mkstemp(prefix=f".ivq-replay-{os.getpid()}-", suffix=".onnx", dir=folder)
        os.close(fd)
        try:
            onnx.save(m, path)
            runner = runner_factory(path)
            backend, info = runner.backend, runner.info
            outs = runner.run(feeds)
        finally:
            os.unlink(path)
        del feeds
        for k, u in enumerate(batch):
            got = outs[f"u{k}::out"]
            want = ref.read(avail[u.output])
            acc = MetricAccumulator()
            if got.size == want.size:
                acc.update(want.reshape(-1), got.reshape(-1))
            intro = acc.result()
            row = {
                "node": u.node, "op_type": u.op_type, "tensor": u.output, "order": avail[u.output].order,
                "intro_sqnr_db": intro["sqnr_db"], "intro_max_abs": intro["max_abs"],
                "intro_rel_l2": intro["rel_l2"], "intro_status": intro["status"],
                "intro_noise": _noise_power(acc),
            }
            c = cum.get((rec["part"], int(rec["step"]), u.output))
            if c is not None:
                row["cum_sqnr_db"] = c["sqnr_db"]
                row["cum_max_abs"] = c["max_abs"]
                p_cum = (c["rmse"] ** 2) * c["numel"] if c["rmse"] is not None and not math.isnan(c["rmse"]) else None
                row["inherited_share"] = (
                    max(0.0, 1.0 - row["intro_noise"] / p_cum) if p_cum else (0.0 if p_cum == 0 else None)
                )
            rows.append(row)
        del outs
    cols = ["node", "op_type", "tensor", "order", "intro_sqnr_db", "intro_max_abs", "intro_rel_l2", "intro_status",
            "intro_noise", "cum_sqnr_db", "cum_max_abs", "inherited_share"]
    table = pd.DataFrame(rows, columns=cols).sort_values("order", kind="stable").reset_index(drop=True)
    for c in ("intro_sqnr_db", "intro_max_abs", "intro_rel_l2", "cum_sqnr_db", "cum_max_abs", "inherited_share"):
        table[c] = pd.to_numeric(table[c], errors="coerce").astype("float64")
    return ReplayResult(table, budget_sqnr_db, [u.node for u in skipped], backend, info,
                        {"sample": int(rec["sample"]), "part": rec["part"], "step": int(rec["step"])}, len(batches))


@dataclass
class ReplayResult:
    """Per-unit introduced error (``table``, in execution order) and the first unit breaking the budget."""

    table: Any
    budget_sqnr_db: float
    skipped: list[str]
    backend: str | None
    info: dict[str, Any]
    record: dict[str, Any]
    batches: int

    @property
    def breaking(self):
        """Units whose introduced SQNR is below the budget (execution order)."""
        t = self.table
        return t[(t["intro_sqnr_db"] < self.budget_sqnr_db) | (t["intro_status"] == "non_finite")]

    @property
    def first_breaking(self) -> dict[str, Any] | None:
        """The first unit in execution order whose introduced error breaks the budget."""
        b = self.breaking
        return None if b.empty else b.iloc[0].to_dict()

    def worst(self, n: int = 10):
        """Units with the most introduced error (lowest introduced SQNR)."""
        return self.table.sort_values("intro_sqnr_db", kind="stable").head(n)

    def findings(self) -> list[Finding]:
        """An ``introduced_error`` finding for the first unit breaking the budget."""
        fb = self.first_breaking
        if fb is None:
            return []
        inh = fb.get("inherited_share")
        return [
            Finding(
                "introduced_error", "error",
                f"{fb['tensor']} ({fb['op_type']}) introduces {fb['intro_sqnr_db']:.1f} dB SQNR on its own "
                f"(budget {self.budget_sqnr_db:g} dB), the first unit to break it",
                where={"record": self.record, "tensor": fb["tensor"], "node": fb["node"]},
                evidence={k: fb.get(k) for k in ("intro_sqnr_db", "intro_max_abs", "cum_sqnr_db", "cum_max_abs")}
                | {"inherited_share": inh, "backend": self.backend},
                suggestion="raise this tensor's precision (16-bit activation) or widen its encoding; "
                           "see `ivq tune`",
            )
        ]

    def to_json(self) -> dict[str, Any]:
        """The ``ivq-replay/1`` document: record, backend, budget, every unit, skipped units, findings."""
        return json_safe({
            "schema": SCHEMA, "record": self.record, "backend": self.backend, "budget_sqnr_db": self.budget_sqnr_db,
            "units": self.table.to_dict(orient="records"), "skipped": self.skipped,
            "findings": [f.to_dict() for f in self.findings()],
        })
