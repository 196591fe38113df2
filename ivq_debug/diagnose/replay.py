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
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.capture.base import make_runner
from ivq_debug.console import track
from ivq_debug.diagnose.findings import Finding
from ivq_debug.diagnose.graphs import constant_values, copy_node, typed_inputs, unit_value
from ivq_debug.diagnose.patterns import groups, measure_lift, replay_findings, sortable
from ivq_debug.diagnose.weight_spread import spread_by_weight
from ivq_debug.dump import open_dump
from ivq_debug.errors import InputError, UsageError, one_line
from ivq_debug.executor import Executor, Job, job_key, merge_check, versions
from ivq_debug.metrics import MetricAccumulator, dot, one_blas_thread
from ivq_debug.onnxgraph.load import has_external_data, load_model
from ivq_debug.onnxgraph.sites import (
    QDQ_DOMAINS,
    activation_quantizers,
    constant_arrays,
    float_name,
    floors_at_zero,
    is_qdq,
    quant_params,
)
from ivq_debug.util import json_safe, sha256_file

#: the ``ivq-replay/2`` document (:meth:`ReplayResult.to_json`, ``ivq diagnose --json``)
SCHEMA = "ivq-replay/2"
#: the two attributions (``docs/findings.md``); the first is the default ranking
ATTRIBUTIONS = ("local", "iso")
#: ops whose output is a rearrangement of an input (a reference value of one is the other, reshaped)
RESHAPE_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


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
    compute: Any = field(repr=False, default=None)  # the compute NodeProto
    qin: dict[str, str] = field(default_factory=dict)  # fed float input -> the DQ output N reads
    out_q: Any = field(repr=False, default=None)  # the output QuantizeLinear (None: float output)
    weights: list[str] = field(default_factory=list)  # quantized initializers N reads (float names)
    input_ops: list[str] = field(default_factory=list)  # op types producing the fed inputs (Q/DQ skipped)
    in_q: list[Any] = field(repr=False, default_factory=list)  # the input QuantizeLinear nodes

    @property
    def is_view(self) -> bool:
        """A data-movement op (``defaults.VIEW_OPS``)."""
        return self.op_type in defaults.VIEW_OPS

    def moves_integers(self, arrays: dict[str, np.ndarray]) -> bool:
        """A data-movement unit whose inputs and output share one encoding: it moves integers, exactly on every
        backend (no requantization)."""
        if not self.is_view or self.out_q is None or not self.in_q:
            return False
        out = quant_params(self.out_q, arrays)
        if out is None:
            return False
        for q in self.in_q:
            qp = quant_params(q, arrays)
            if qp is None or not (np.array_equal(qp.scale, out.scale) and np.array_equal(
                    qp.zero_point if qp.zero_point is not None else 0, out.zero_point if out.zero_point is not None
                    else 0)):
                return False
        return True


def _is(node: Any, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in QDQ_DOMAINS


def find_units(model: Any) -> list[Unit]:
    """The QDQ node units of a model, in topological order (compute nodes with float outputs only)."""
    nodes = list(model.graph.node)
    producer: dict[str, Any] = {o: n for n in nodes for o in n.output if o}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    const, _ = constant_values(model)
    inits = {i.name for i in model.graph.initializer}
    units: list[Unit] = []
    for idx, n in enumerate(nodes):
        if is_qdq(n) or n.op_type == "Constant" or all(o in const for o in n.output if o):
            continue
        members = [n]
        feeds: list[str] = []
        qin: dict[str, str] = {}
        weights: list[str] = []
        input_ops: list[str] = []
        in_q: list[Any] = []
        ok = True
        for x in n.input:
            if not x:
                continue
            p = producer.get(x)
            if x in const:
                if _is(p, "DequantizeLinear") and p.input and p.input[0] in inits:
                    weights.append(float_name(p.input[0]).removesuffix("_quantized"))
                continue
            if _is(p, "DequantizeLinear"):
                q = producer.get(p.input[0])
                if _is(q, "QuantizeLinear"):
                    members += [q, p]
                    feeds.append(q.input[0])
                    qin.setdefault(q.input[0], x)
                    src = producer.get(q.input[0])
                    input_ops.append(src.op_type if src is not None else "input")
                    in_q.append(q)
                    continue
                ok = False
                break
            feeds.append(x)  # float activation without QDQ (or a graph input)
            input_ops.append(p.op_type if p is not None else "input")
        if not ok or not n.output or not n.output[0]:
            continue
        out = n.output[0]
        out_value = out
        out_q = None
        qs = [c for c in consumers.get(out, []) if _is(c, "QuantizeLinear")]
        if qs:
            q = qs[0]
            dqs = [c for c in consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"]
            if dqs:
                members += [q, dqs[0]]
                out_value = dqs[0].output[0]
                out_q = q
        name = float_name(out)
        # an input used twice (Mul(x, x)) brings its Q/DQ twice: keep each node once
        members = list({id(m): m for m in members}.values())
        feeds = list(dict.fromkeys(feeds))
        units.append(Unit(n.name, n.op_type, idx, feeds, name, members, out_value, n, qin, out_q, weights,
                          input_ops, in_q))
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


def build_replay_model(model: Any, units: list[Unit], prefix: str = "u", *, shadow: bool = False,
                       keys: list[int] | None = None, xq: bool = True, base_dir: str = ""
                       ) -> tuple[Any, dict[str, tuple[int, str]]]:
    """One model holding the given units side by side.

    Returns the model and a map ``graph input name -> (unit key, reference tensor name)``; unit ``k``'s
    output is the graph output ``{prefix}{k}::out``. With ``shadow``, each unit also yields ``::fq`` (its
    compute node on the quantized inputs, no output encoding), ``::xq{j}`` (the quantized value of its j-th
    quantized input) and, for a unit with quantized weights, ``::fw`` (on the float inputs: quantized weights, no
    activation encoding); ``xq=False`` leaves out ``::xq{j}`` (a CPU replay needs no quantized feeds). ``keys``
    name the units (default ``0..n-1``).
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
    del g.node[:]
    del g.input[:]
    del g.output[:]
    del g.value_info[:]
    g.node.extend(const_nodes)
    feeds: dict[str, tuple[int, str]] = {}
    for k, u in zip(keys if keys is not None else range(len(units)), units, strict=True):
        pre = f"{prefix}{k}::"

        def ren(name: str, pre: str = pre) -> str:
            if not name or name in const:
                return name
            return unit_value(pre, name)

        for x in u.inputs:
            gi = ren(x)
            if gi not in feeds:
                feeds[gi] = (k, x)
                g.input.append(onnx.ValueInfoProto(name=gi))
        for n in u.nodes:
            g.node.append(copy_node(n, unit_value(pre, n.name), [ren(i) for i in n.input], [ren(o) for o in n.output]))
        outs = [(pre + "out", ren(u.out_value))]
        if shadow and u.compute is not None:  # a dynamic INT8 unit quantizes its float inputs itself: fq = ref
            raw = {dq: x for x, dq in u.qin.items()}  # DQ output N reads -> its float input
            c = u.compute
            # the compute node's own output, before its encoding (with the ReLU the quantizer folded into it)
            relu = u.out_q is not None and floors_at_zero(u.out_q, model, base_dir)

            def floored(value: str, name: str, relu: bool = relu) -> str:
                if not relu:
                    return value
                g.node.append(onnx.NodeProto(op_type="Relu", name=f"{name}::relu", input=[value],
                                             output=[f"{name}::relu"]))
                return f"{name}::relu"

            outs.append((f"{pre}fq", floored(ren(c.output[0]), f"{pre}fq")))
            if u.weights:  # without quantized weights the float op on the float inputs is the reference itself
                o = [f"{pre}fw::{j}" if x else "" for j, x in enumerate(c.output)]
                g.node.append(copy_node(c, f"{pre}fw::{c.name}", [ren(raw.get(i, i)) for i in c.input], o))
                outs.append((f"{pre}fw", floored(o[0], f"{pre}fw")))
            if xq:
                outs += [(f"{pre}xq{j}", ren(dq)) for j, dq in enumerate(u.qin.values())]
        for out_name, value in outs:
            g.node.append(onnx.NodeProto(op_type="Identity", name=out_name, input=[value], output=[out_name]))
            g.output.append(onnx.ValueInfoProto(name=out_name))
    # drop initializers no unit uses (the replay of a few units should not carry the whole model)
    used = {x for n in g.node for x in n.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    # the ValueInfo of graph inputs needs a type: set from the reference arrays at run time
    return m, feeds


def _noise_power(acc: MetricAccumulator) -> float:
    return acc.sum_sq_err


# ------------------------------------------------------------------------------------------ reference values
@dataclass
class _Source:
    """Where a unit tensor's reference value comes from: a ref entry, reshaped to ``shape`` when needed."""

    entry: Any
    how: str


def lineage_aliases(model: Any) -> dict[str, list[str]]:
    """Float tensors of a QDQ model that hold the same values as others, in another shape: for each
    Reshape / Flatten / Squeeze / Unsqueeze (its Q/DQ skipped), its output and its input name each other."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    out: dict[str, list[str]] = {}
    for n in model.graph.node:
        if n.op_type not in RESHAPE_OPS or not n.input or not n.output:
            continue
        src = n.input[0]
        p = producer.get(src)
        if _is(p, "DequantizeLinear"):
            q = producer.get(p.input[0])
            src = q.input[0] if _is(q, "QuantizeLinear") else p.input[0]
        a, b = float_name(src), float_name(n.output[0])
        out.setdefault(b, []).append(a)
        out.setdefault(a, []).append(b)
    return out


def value_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Static shapes the model's ``value_info`` / inputs / outputs record, by float name."""
    out: dict[str, tuple[int, ...]] = {}
    g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
            if dims and all(d > 0 for d in dims):
                out.setdefault(float_name(vi.name), tuple(dims))
    return out


class _RefIndex:
    """Reference values of one record by QDQ float name (name, alignment pair, or lineage)."""

    def __init__(self, ref: Any, rid: str, pairs: dict[str, Any], aliases: dict[str, list[str]],
                 test: Any = None, test_rid: str | None = None, shapes: dict[str, tuple[int, ...]] | None = None
                 ) -> None:
        self.ref = ref
        self.by_name = {e.name: e for e in ref.tensors(rid)} | {e.name: e for e in ref.tensors(rid, kind="input")}
        self.pairs = pairs  # test name -> (ref entry, strategy)
        self.aliases = aliases
        self.test = test
        self.test_by_name = {e.name: e for e in test.tensors(test_rid)} if test is not None and test_rid else {}
        self.shapes = dict(shapes or {}) | {n: e.shape for n, e in self.test_by_name.items()}
        self.cache: dict[str, _Source | None] = {}
        self.rejected: dict[str, str] = {}
        self.values: dict[str, np.ndarray] = {}

    def source(self, name: str) -> _Source | None:
        if name in self.cache:
            return self.cache[name]
        src: _Source | None = None
        if name in self.by_name:
            src = _Source(self.by_name[name], "name")
        elif name in self.pairs:
            e, how = self.pairs[name]
            src = _Source(e, f"alignment:{how}")
        else:
            for other in self.aliases.get(name, []):
                e = self.by_name.get(other)
                if e is not None and self._confirm(name, other):
                    src = _Source(e, f"lineage:reshape of {other}")
                    break
        if src is not None and src.how != "name":
            shape = self.shapes.get(name)
            if shape is None or math.prod(shape) != src.entry.size:
                self.rejected[name] = (f"matched to {src.entry.name!r} ({src.how}) but its shape in this model is "
                                       "unknown" if shape is None else f"matched to {src.entry.name!r} with "
                                       f"{src.entry.size} elements, not {math.prod(shape)}")
                src = None
        self.cache[name] = src
        return src

    def _confirm(self, name: str, other: str) -> bool:
        """A lineage alias holds the same values: checked on the test dump (same elements, within one step of
        the tensor's encoding, or 1e-6 relative without one) when it holds both; assumed otherwise."""
        a, b = self.test_by_name.get(name), self.test_by_name.get(other)
        if a is None or b is None:
            return True
        if a.size != b.size:
            self.rejected[name] = f"lineage alias {other!r} has {b.size} elements, not {a.size}"
            return False
        va, vb = self.test.read(a).astype(np.float64).reshape(-1), self.test.read(b).astype(np.float64).reshape(-1)
        scale = np.max(np.asarray((a.encoding or {}).get("scale", [0.0]), dtype=np.float64)) if a.encoding else 0.0
        tol = scale * 1.0001 if scale > 0 else 1e-6 * max(float(np.max(np.abs(vb))), 1e-30)
        if float(np.max(np.abs(va - vb))) > tol:
            self.rejected[name] = f"lineage alias {other!r} differs by values on the test dump (> {tol:.3g})"
            return False
        return True

    def read(self, name: str) -> np.ndarray:
        v = self.values.get(name)
        if v is None:
            src = self.cache.get(name) or self.source(name)
            assert src is not None
            v = self.ref.read(src.entry)
            if src.how != "name":
                v = v.reshape(self.shapes[name])
            self.values[name] = v
        return v


def _pairs_for(cumulative: Any, ref_rid: str) -> tuple[dict[str, Any], Any, str | None]:
    """From a comparison: test name -> (ref entry, strategy) for one ref record, the test dump and its rid."""
    if cumulative is None:
        return {}, None, None
    out: dict[str, Any] = {}
    test_rid = None
    for p in cumulative.alignment.pairs:
        if p.ref.rid == ref_rid:
            test_rid = p.test.rid
            if p.test.name != p.ref.name:
                out.setdefault(p.test.name, (p.ref, p.match))
    if test_rid is None:  # no pair: the record with the same key
        keys = cumulative.test.record_keys()
        ref_key = next((k for k, v in cumulative.ref.record_keys().items() if v == ref_rid), None)
        test_rid = keys.get(ref_key) if ref_key is not None else None
        if test_rid is None and len(keys) == 1:
            test_rid = next(iter(keys.values()))
    return out, cumulative.test, test_rid


# ------------------------------------------------------------------------------------------ the replay
def _records(ref: Any, record: Any) -> list[str]:
    keys = ref.record_keys()
    if record is None or record == "all":
        if not keys:
            raise UsageError("the reference dump holds no records", getattr(ref, "path", None))
        return [keys[k] for k in sorted(keys, key=lambda k: (k[0], k[2], k[1]))]
    if isinstance(record, list):
        return [ref._rid(r) for r in record]
    return [ref._rid(record)]


def _model_records(ref: Any, record: Any, rids: list[str], model: Any, index: Callable[[str], _RefIndex]
                   ) -> list[str]:
    """The records of ``rids`` that hold the model's graph inputs (a session dump has vision, prefill and decode
    records; a part's model replays on its own): the first of them by default, every one with ``"all"``. A
    record named explicitly must hold them (``UsageError`` naming the first missing input)."""
    inits = {i.name for i in model.graph.initializer}
    dims = {i.name: [d.dim_value if d.HasField("dim_value") else 0 for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input if i.name not in inits}
    inputs = list(dims)

    def fits(shape: tuple[int, ...], want: list[int]) -> bool:  # static dims agree (0: dynamic)
        if len(shape) != len(want):
            return all(want) and math.prod(shape) == math.prod(want)
        return all(w in (0, d) for d, w in zip(shape, want, strict=True))

    def missing(rid: str) -> str | None:
        idx = index(rid)
        for x in inputs:
            src = idx.source(x)
            if src is None:
                return x
            if not fits(tuple(src.entry.shape), dims[x]):
                return f"{x} of shape {list(dims[x])} (it holds {list(src.entry.shape)})"
        return None

    if record is None or record == "all":
        fit = [r for r in rids if missing(r) is None]
        if not fit:
            where = {v: k for k, v in ref.record_keys().items()}
            raise UsageError(f"no record holds the model's inputs ({', '.join(inputs[:4])}): checked "
                             f"{len(rids)} record(s), e.g. {where.get(rids[0], rids[0])} lacks "
                             f"{missing(rids[0])}", getattr(ref, "path", None))
        return fit if record == "all" else fit[:1]
    for r in rids:
        if (m := missing(r)) is not None:
            raise UsageError(f"record {r!r} does not hold the model's input {m} (is it a record of another "
                             "part?)", getattr(ref, "path", None))
    return rids


def _sq(a: np.ndarray, b: np.ndarray | float) -> float:
    """``Σ (a − b)²`` of flat float64 arrays, without BLAS threads (``metrics.dot``)."""
    d = a - b if not (isinstance(b, float) and b == 0.0) else a
    return dot(d, d)


def _steps(got: np.ndarray, want: np.ndarray, scale: float | None) -> float | None:
    if scale is None or scale <= 0 or got.size != want.size:
        return None
    return float(np.max(np.abs(got.astype(np.float64).reshape(-1) - want.astype(np.float64).reshape(-1)))) / scale


class _Sessions:
    """Replay sessions of one batch, one per (model kind, feed signature), reused across records; each model is
    saved to TMPDIR, or next to the QDQ model when its weights are references into the QDQ model's own file
    (external data, which ONNX Runtime reads only from inside the model's folder); hidden, removed on close."""

    def __init__(self, folder: Path, source: str | os.PathLike | None = None) -> None:
        self.folder = folder
        self.source = source
        self.runners: dict[tuple[Any, ...], Any] = {}
        self.paths: list[str] = []

    def get(self, kind: str, m: Any, feeds: dict[str, np.ndarray], factory: Callable[[str], Any]) -> Any:
        """The runner of model ``m`` (``kind``) for feeds of these shapes and dtypes."""
        import onnx

        sig = (kind, tuple((k, v.shape, v.dtype.str) for k, v in sorted(feeds.items())))
        r = self.runners.get(sig)
        if r is None:
            typed_inputs(m, feeds)
            fd, path = tempfile.mkstemp(prefix=f".ivq-replay-{os.getpid()}-", suffix=".onnx",
                                        dir=self.folder if has_external_data(m) else None)
            os.close(fd)
            self.paths.append(path)
            onnx.save(m, path)
            try:
                r = self.runners[sig] = factory(path)
            except InputError as e:  # ONNX Runtime refused the model's own graph or weights: name the user's file
                raise InputError(e.message, self.source or path) from None
        return r

    def close(self) -> None:
        """Close the runners and remove the model files."""
        for r in self.runners.values():
            close = getattr(r, "close", None)
            if close is not None:
                close()
        for p in self.paths:
            try:
                os.unlink(p)
            except OSError:
                pass


class _Acc:
    """Per-unit accumulators over records (:meth:`state` / :meth:`from_state`: a shard's JSON, exact)."""

    SUMS = ("iso", "local", "weight", "act_iso", "act_local")

    def __init__(self) -> None:
        self.iso, self.local, self.weight = MetricAccumulator(), MetricAccumulator(), MetricAccumulator()
        self.act_iso, self.act_local = MetricAccumulator(), MetricAccumulator()
        self.selfcheck: float | None = None
        self.selfcheck_share: float | None = None
        self.replayed_on = ""
        self.ref_match = ""

    def state(self) -> dict[str, Any]:
        """The accumulators as plain JSON values."""
        out: dict[str, Any] = {k: getattr(self, k).state() for k in self.SUMS}
        out.update(selfcheck=self.selfcheck, selfcheck_share=self.selfcheck_share, replayed_on=self.replayed_on,
                   ref_match=self.ref_match)
        return out

    @classmethod
    def from_state(cls, doc: dict[str, Any]) -> _Acc:
        """The accumulators of :meth:`state`."""
        a = cls()
        for k in cls.SUMS:
            setattr(a, k, MetricAccumulator.from_state(doc[k]))
        a.selfcheck, a.selfcheck_share = doc["selfcheck"], doc["selfcheck_share"]
        a.replayed_on, a.ref_match = str(doc["replayed_on"]), str(doc["ref_match"])
        return a


def replay(
    qdq_model: str | os.PathLike,
    reference: Any,
    *,
    record: Any = None,
    nodes: Iterable[str] | None = None,
    runner_factory: Callable[[str], Any] | None = None,
    cumulative: Any = None,
    budget_sqnr_db: float | None = None,
    attribution: str = "local",
    selfcheck: bool | None = None,
    float_model: str | os.PathLike | None = None,
    lift: bool = True,
    batch_bytes: int = defaults.REPLAY_BATCH_BYTES,
    progress: bool = True,
    executor: Executor | None = None,
    shards: str | os.PathLike | None = None,
) -> ReplayResult:
    """Introduced error of each QDQ node unit, under both attributions (module docstring).

    Args:
        qdq_model: the QDQ ONNX model (the one the test backend ran).
        reference: golden float dump (path or :class:`~ivq_debug.dump.Dump`) with the float tensors.
        record: which record(s) of the reference to replay: a key / rid, a list of them, or ``"all"``
            (default: the first record). Errors accumulate over the records (sessions are reused).
        nodes: only these compute nodes (names) or output tensors; default all units whose inputs are in
            the reference.
        runner_factory: ``f(model_path) -> runner`` on the test backend (default: ORT CPU-QDQ,
            optimizations disabled). Pass e.g. ``lambda p: make_runner("qnn", p)`` to replay on QNN HTP.
        cumulative: a :class:`~ivq_debug.comparator.Comparison` (reference vs free-running test): the
            cumulative error, the alignment used for tensors the reference names differently, and the test
            dump the self-check feeds from.
        budget_sqnr_db: the introduced SQNR below which a unit breaks the budget (default: by the model's
            activation bitwidth, ``defaults.INTRO_BUDGET_DB``).
        attribution: ``"local"`` (default) or ``"iso"``: which one the ``intro_*`` columns, the ranking and
            the findings use (both are always in the table).
        selfcheck: run the self-check (default: on a non-CPU backend with a test dump in ``cumulative``).
        float_model: the float model the QDQ model was made from: its float weights are lifted when measuring
            a weight pattern's output share, and its per-channel weight spreads choose the weight fix.
        lift: measure the output-error share of the groups over budget (:func:`~ivq_debug.diagnose.patterns.
            measure_lift`, one CPU run on the first record).
        batch_bytes: maximum reference-input bytes per replay batch.
        executor: run the batches as jobs (:mod:`ivq_debug.executor`: a :class:`~ivq_debug.executor.
            LocalExecutor` process pool, a :class:`~ivq_debug.executor.RayExecutor`); default: in this process.
            The batches are then cut into at least ``defaults.REPLAY_MIN_JOBS`` jobs (``batches`` and
            ``sessions`` count them); every number is the same to the bit: a unit's values do not depend on the
            other units of its batch, and its sums are made in one job, in the same order.
            ``runner_factory`` must then be picklable (``None``, a module-level function or a
            ``functools.partial`` of one).
        shards: the folder of the jobs' shards (with ``executor``): a rerun skips the batches whose shard is
            there; default a temporary folder, removed after the run.

    Returns:
        A :class:`ReplayResult` (``.table`` DataFrame; ``.worst()``; ``.findings()``).
    """
    import pandas as pd

    if attribution not in ATTRIBUTIONS:
        raise UsageError(f"unknown attribution {attribution!r} ({', '.join(ATTRIBUTIONS)})")
    t_start = time.perf_counter()
    ref = reference if hasattr(reference, "entries") else open_dump(reference)
    model = load_model(qdq_model)
    aliases = lineage_aliases(model)
    shapes = value_shapes(model)
    indexes: dict[str, _RefIndex] = {}

    def index(rid: str) -> _RefIndex:
        if rid not in indexes:
            p, t, trid = _pairs_for(cumulative, rid)
            indexes[rid] = _RefIndex(ref, rid, p, aliases, t, trid, shapes)
        return indexes[rid]

    rids = _model_records(ref, record, _records(ref, record), model, index)
    units = replay_units(model)
    if budget_sqnr_db is None:
        budget_sqnr_db = intro_budget(model, str(Path(qdq_model).parent))
    if nodes is not None:
        wanted = set(nodes)
        units = [u for u in units if u.node in wanted or u.output in wanted]
        if not units:
            raise UsageError(f"none of the requested nodes {sorted(wanted)[:5]} is a QDQ node unit")
    idx0 = index(rids[0])
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
    # batches bounded by reference-input bytes
    batches: list[list[Unit]] = []
    cur: list[Unit] = []
    size = 0
    for u in runnable:
        b = sum(idx0.source(x).entry.nbytes for x in u.inputs)
        if cur and size + b > batch_bytes:
            batches.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += b
    if cur:
        batches.append(cur)
    if executor is not None and runnable:  # jobs for the workers to share (defaults.REPLAY_MIN_JOBS)
        per = math.ceil(len(runnable) / defaults.REPLAY_MIN_JOBS)
        batches = [b[i:i + per] for b in batches for i in range(0, len(b), per)]

    on_cpu = runner_factory is None
    do_check = (not on_cpu) if selfcheck is None else bool(selfcheck)
    indexes = {rid: index(rid) for rid in rids}
    accs: dict[str, _Acc] = {}
    jobs: dict[str, Any] = {}
    backend = None
    info: dict[str, Any] = {}
    sessions = 0
    if executor is None:  # in this process, as one loop
        ctx = _Context(model, Path(qdq_model), rids, indexes, runner_factory, do_check)
        it = track(batches, "replaying", total=len(batches)) if progress else batches
        for batch in it:
            got = _replay_batch(ctx, batch)
            accs.update(got.accs)
            if got.backend is not None:
                backend, info = got.backend, got.info
            sessions += got.sessions
    else:
        done, jobs = _replay_jobs(executor, shards, Path(qdq_model), ref, cumulative, rids, batches, runner_factory,
                                  do_check, progress)
        for got in done:
            accs.update(got.accs)
            if got.backend is not None:
                backend, info = got.backend, got.info
            sessions += got.sessions
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
            "weights": ",".join(u.weights), "input_ops": ",".join(dict.fromkeys(u.input_ops)), "replayed_on": a.replayed_on, "ref_match": a.ref_match,
            "selfcheck_steps": a.selfcheck, "selfcheck_share": a.selfcheck_share,
            "approximate": bool(a.selfcheck is not None and a.selfcheck > defaults.REPLAY_SELFCHECK_STEPS),
            "signal": a.local.sum_r2,
        }
        c = cum_rows.get(u.node)
        if c is not None:
            row["cum_sqnr_db"] = c["sqnr_db"]
            row["cum_max_abs"] = c["max_abs"]
            p_cum = cum_noise.get(u.node)
            row["inherited_share"] = (max(0.0, 1.0 - row["intro_noise"] / p_cum) if p_cum
                                      else (0.0 if p_cum == 0 else None))
        rows.append(row)
    table = pd.DataFrame(rows, columns=COLUMNS).sort_values("order", kind="stable").reset_index(drop=True)
    for c in FLOAT_COLUMNS:
        table[c] = pd.to_numeric(table[c], errors="coerce").astype("float64")
    lifted: dict[str, Any] = {}
    if lift and len(table):
        budget = float(budget_sqnr_db)
        over = [g for g in groups(table) if any(sortable(r.get("intro_sqnr_db")) < budget for r in g.rows)]
        if over:
            lifted = measure_lift(qdq_model, ref, rids[0], over, float_model=float_model)
    spread = (spread_by_weight(float_model) if float_model is not None
              else spread_by_weight(model, str(Path(qdq_model).parent)))
    recs = []
    for rid in rids:
        rr = ref.records.set_index("rid").loc[rid]
        recs.append({"sample": int(rr["sample"]), "part": rr["part"], "step": int(rr["step"])})
    return ReplayResult(table, float(budget_sqnr_db), list(skipped), backend, info, recs[0], len(batches),
                        attribution=attribution, skipped_reasons=skipped, records=recs, sessions=sessions,
                        seconds=round(time.perf_counter() - t_start, 3), model_path=str(qdq_model), lift=lifted,
                        spread=spread, jobs=jobs)



@dataclass
class _Context:
    """What the replay of one batch reads: the QDQ model, the records and their reference indexes, the backend."""

    model: Any
    path: Path
    rids: list[str]
    indexes: dict[str, Any]
    runner_factory: Callable[[str], Any] | None
    do_check: bool


@dataclass
class _BatchResult:
    """The accumulators of one batch's units, the backend that ran them (None: none ran on it) and its sessions."""

    accs: dict[str, _Acc]
    backend: str | None
    info: dict[str, Any]
    sessions: int


def _cpu_factory(path: str) -> Any:
    return make_runner("onnx", path, optimization="disable")


@one_blas_thread
def _replay_batch(ctx: _Context, batch: list[Unit]) -> _BatchResult:
    """Replay one batch of units over every record (the shadow model and the backend model: one session each per
    feed signature, reused across records)."""
    model, rids, indexes, do_check = ctx.model, ctx.rids, ctx.indexes, ctx.do_check
    on_cpu = ctx.runner_factory is None
    factory = ctx.runner_factory or _cpu_factory
    cpu_factory = _cpu_factory
    arrays = constant_arrays(model, {x for u in batch for q in [u.out_q, *u.in_q] if q is not None
                                     for x in q.input[1:]}, str(ctx.path.parent))
    out_scale: dict[str, float | None] = {}
    for u in batch:
        qp = quant_params(u.out_q, arrays) if u.out_q is not None else None
        out_scale[u.node] = float(np.max(qp.scale)) if qp is not None and qp.is_integer else None
    accs = {u.node: _Acc() for u in batch}
    backend = None
    info: dict[str, Any] = {}
    # replay models with external-data weights go next to the QDQ model, the others to TMPDIR (_Sessions)
    folder = ctx.path.resolve().parent
    qdq_model = ctx.path
    sessions = 0
    keys = list(range(len(batch)))
    on_backend = [] if on_cpu else [k for k, u in zip(keys, batch, strict=True) if not u.moves_integers(arrays)]
    shadow, s_map = build_replay_model(model, batch, shadow=True, xq=not on_cpu, base_dir=str(ctx.path.parent))
    bmodel, b_map = (build_replay_model(model, [batch[k] for k in on_backend], keys=on_backend,
                                        base_dir=str(ctx.path.parent))
                     if on_backend else (None, {}))
    pool = _Sessions(folder, qdq_model)
    try:
        for rid in rids:
            idx = indexes[rid]
            feeds = {gi: idx.read(x) for gi, (_, x) in s_map.items()}
            s_runner = pool.get("shadow", shadow, feeds, cpu_factory)
            s_out = s_runner.run(feeds)
            if on_cpu:
                backend, info = s_runner.backend, s_runner.info
            b_iso: dict[str, np.ndarray] = {}
            b_loc: dict[str, np.ndarray] = {}
            b_chk: dict[str, np.ndarray] = {}
            chk_ok: set[int] = set()
            if bmodel is not None:
                bf = {gi: feeds[gi] for gi in b_map}
                br = pool.get("backend", bmodel, bf, factory)
                backend, info = br.backend, br.info
                b_iso = br.run(bf)
                lf = dict(bf)
                for gi, (k, x) in b_map.items():
                    u = batch[k]
                    if x in u.qin:
                        lf[gi] = s_out[f"u{k}::xq{list(u.qin).index(x)}"].astype(bf[gi].dtype, copy=False)
                b_loc = br.run(lf)
                if do_check and idx.test is not None:
                    cf = dict(bf)
                    for k in on_backend:
                        u = batch[k]
                        ents = [idx.test_by_name.get(x) for x in [*u.inputs, u.output]]
                        if all(e is not None and e.size == idx.read(x).size
                               for e, x in zip(ents, [*u.inputs, u.output], strict=True)):
                            chk_ok.add(k)
                            for x in u.inputs:
                                gi = unit_value(f"u{k}::", x)
                                cf[gi] = idx.test.read(idx.test_by_name[x]).reshape(bf[gi].shape).astype(
                                    bf[gi].dtype, copy=False)
                    if chk_ok:
                        b_chk = br.run(cf)
            for k, u in zip(keys, batch, strict=True):
                a = accs[u.node]
                r = idx.read(u.output).astype(np.float64).reshape(-1)
                fq = s_out[f"u{k}::fq"].astype(np.float64).reshape(-1) if u.compute is not None else r
                fw = s_out[f"u{k}::fw"].astype(np.float64).reshape(-1) if u.weights else r
                if f"u{k}::out" in b_iso:
                    t_iso, t_loc = b_iso[f"u{k}::out"], b_loc[f"u{k}::out"]
                    a.replayed_on = backend or ""
                else:
                    t_iso = t_loc = s_out[f"u{k}::out"]
                    a.replayed_on = s_runner.backend + (" (data movement: exact on every backend)"
                                                        if not on_cpu else "")
                t_iso = t_iso.astype(np.float64).reshape(-1)
                t_loc = t_iso if t_loc is t_iso else t_loc.astype(np.float64).reshape(-1)
                a.ref_match = idx.source(u.output).how
                if not (r.size == fw.size == fq.size == t_iso.size == t_loc.size):
                    continue  # element counts differ: the unit's metrics stay empty
                r_loc = (r + fq - fw) if u.weights else fq
                a.iso.update(r, t_iso)
                a.local.update(r_loc, t_loc)
                if u.weights:
                    a.weight.sum_sq_err += _sq(fw, r)
                    a.weight.sum_r2 += _sq(r, 0.0)
                    a.weight.n += r.size
                a.act_iso.sum_sq_err += _sq(t_iso, fw)
                a.act_local.sum_sq_err += _sq(t_loc, fq)
                if k in chk_ok:
                    want = idx.test.read(idx.test_by_name[u.output])
                    st = _steps(b_chk[f"u{k}::out"], want, out_scale[u.node])
                    if st is not None:
                        a.selfcheck = st if a.selfcheck is None else max(a.selfcheck, st)
                        d = np.abs(b_chk[f"u{k}::out"].astype(np.float64).reshape(-1)
                                   - want.astype(np.float64).reshape(-1))
                        share = float(np.mean(d > 0.5 * out_scale[u.node]))
                        a.selfcheck_share = share if a.selfcheck_share is None else max(a.selfcheck_share, share)
            del feeds, s_out, b_iso, b_loc, b_chk
    finally:
        sessions += len(pool.runners)
        pool.close()
    return _BatchResult(accs, backend, info, sessions)



# ------------------------------------------------------------------------------------------ batches as jobs
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
#: a replay shard's ``result`` (:meth:`_Acc.state` per unit): counts non-negative integers, sums finite and
#: squares non-negative, never NaN (shards are untrusted: checked before the merge reads them)
SHARD_RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "replay shard result",
    "required": ["units", "backend", "info", "sessions"],
    "properties": {
        "units": {"type": "object", "additionalProperties": {
            "type": "object",
            "required": [*_Acc.SUMS, "selfcheck", "selfcheck_share", "replayed_on", "ref_match"],
            "properties": {**dict.fromkeys(_Acc.SUMS, _METRIC_STATE),
                           "selfcheck": {"type": ["number", "null"], "minimum": 0},  # NaN where the test held one
                           "selfcheck_share": _SHARE, "replayed_on": {"type": "string"},
                           "ref_match": {"type": "string"}},
        }},
        "backend": {"type": "string"}, "info": {"type": "object"}, "sessions": _N,
    },
}
#: per worker process: the opened inputs of the last replay (jobs of one run share them)
_WORKER_CACHE: dict[tuple[Any, ...], tuple[Any, dict[str, Unit], dict[str, Any]]] = {}


def describe_factory(factory: Callable[[str], Any] | None) -> str:
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
               runner_factory: Callable[[str], Any] | None, do_check: bool) -> dict[str, Any]:
    """One job: the replay of one batch of units (``nodes``) over the records, as a shard's JSON."""
    ck = (model_path, ref_path, test_path, tuple(rids))
    hit = _WORKER_CACHE.get(ck)
    if hit is None:
        _WORKER_CACHE.clear()
        model = load_model(model_path)
        ref = open_dump(ref_path)
        test = open_dump(test_path) if test_path else None
        aliases, shapes = lineage_aliases(model), value_shapes(model)
        indexes = {rid: _RefIndex(ref, rid, pairs[rid][0], aliases, test if pairs[rid][1] else None, pairs[rid][1],
                                  shapes) for rid in rids}
        hit = _WORKER_CACHE[ck] = (model, {u.node: u for u in replay_units(model)}, indexes)
    model, by_node, indexes = hit
    ctx = _Context(model, Path(model_path), rids, indexes, runner_factory, do_check)
    got = _replay_batch(ctx, [by_node[n] for n in nodes])
    return {"units": {n: a.state() for n, a in got.accs.items()}, "backend": got.backend,
            "info": json_safe(got.info), "sessions": got.sessions}


def _replay_jobs(executor: Executor, shards: str | os.PathLike | None, model_path: Path, ref: Any, cumulative: Any,
                 rids: list[str], batches: list[list[Unit]], runner_factory: Callable[[str], Any] | None,
                 do_check: bool, progress: bool) -> tuple[list[_BatchResult], dict[str, Any]]:
    """The batches as jobs on ``executor``, their shards merged in batch order (:func:`replay`), and what the run
    did (``ReplayResult.jobs``)."""
    backend = describe_factory(runner_factory)
    ref_path = str(Path(ref.path).resolve())
    test = cumulative.test if cumulative is not None else None
    test_path = str(Path(test.path).resolve()) if test is not None else None
    pairs: dict[str, tuple[dict[str, Any], str | None]] = {}
    for rid in rids:
        p, t, trid = _pairs_for(cumulative, rid)
        pairs[rid] = (p, trid if t is not None else None)
    meta = {"model_sha256": sha256_file(model_path), "reference_sha256": sha256_file(ref_path),
            "test_sha256": sha256_file(test_path) if test_path else None, "backend": backend, "records": rids,
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
                out.append(_BatchResult({n: _Acc.from_state(v) for n, v in r["units"].items()}, r["backend"],
                                        dict(r["info"]), int(r["sessions"])))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise InputError(f"not a replay shard ({one_line(e, 200)})", report.shards[doc["key"]]) from None
        return out, {"executor": type(executor).__name__, "total": len(jobs), "resumed": len(report.skipped),
                     "retried": sorted(set(report.retried)), "shards": None if tmp is not None else str(shards)}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

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


def activation_bits(model: Any, base_dir: str = "") -> int:
    """The most common activation bitwidth of a QDQ model (8 when it has none; external data read from
    ``base_dir``, the model's folder)."""
    quantizers = [n for _, n in activation_quantizers(model)]
    arrays = constant_arrays(model, {x for n in quantizers for x in n.input[1:3] if x}, base_dir)
    bits: dict[int, int] = {}
    for n in quantizers:
        qp = quant_params(n, arrays)
        b = qp.bitwidth if qp is not None else 8
        bits[b] = bits.get(b, 0) + 1
    return max(bits, key=lambda b: (bits[b], -b)) if bits else 8


def intro_budget(model: Any, base_dir: str = "") -> float:
    """The default introduced-SQNR budget for a QDQ model: by its activation bitwidth
    (``defaults.INTRO_BUDGET_DB``; external data read from ``base_dir``)."""
    return defaults.INTRO_BUDGET_DB.get(activation_bits(model, base_dir), defaults.DIVERGENCE_SQNR_DB)


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
    lift: dict[str, Any] = field(default_factory=dict)  # pattern key -> output share (patterns.measure_lift)
    spread: dict[str, float] = field(default_factory=dict)  # weight -> per-channel range spread
    #: with an executor: its name, jobs in all, resumed from shards, retried keys, the kept shard folder
    jobs: dict[str, Any] = field(default_factory=dict)

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

    def findings(self) -> list[Finding]:
        """The headline (worst introducer's pattern) first, then other patterns and the self-check
        (:mod:`ivq_debug.diagnose.patterns`)."""
        return replay_findings(self, self.spread)

    def to_json(self) -> dict[str, Any]:
        """The ``ivq-replay/2`` document: record(s), backend, budget, attribution, every unit, skipped units with
        their reasons, findings."""
        return json_safe({
            "schema": SCHEMA, "record": self.record, "records": self.records, "backend": self.backend,
            "budget_sqnr_db": self.budget_sqnr_db, "attribution": self.attribution,
            "units": self.table.to_dict(orient="records"), "skipped": self.skipped_reasons,
            "approximate": self.approximate, "sessions": self.sessions, "seconds": self.seconds,
            "findings": [f.to_dict() for f in self.findings()],
        })
