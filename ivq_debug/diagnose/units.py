"""The replay's units: which nodes of a QDQ (or dynamically quantized) model replay together, the model that lays
a batch of them side by side, and the model facts the replay reads (lineage aliases, activation bits, budget).

For every compute node N of a QDQ model, its *unit* is N plus the Q/DQ nodes around it (:func:`find_units`); a
dynamic-quantization op with its scale arithmetic is one unit too (:func:`find_dynamic_units`). The units of a model
are a fact of its :class:`~ivq_debug.onnxgraph.load.Model` (:func:`model_units`, computed once per loaded model).
:func:`build_replay_model` builds the derived graph a batch runs: a new :class:`Model` in memory, never a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.graphs import copy_node, unit_value
from ivq_debug.onnxgraph.load import Model, load
from ivq_debug.onnxgraph.sites import QDQ_DOMAINS, float_name, floors_at_zero, is_qdq, quant_params

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
    """The QDQ node units of a model (a path, proto or :class:`Model`), in topological order (compute nodes with
    float outputs only)."""
    model = load(model)
    nodes = list(model.proto.graph.node)
    producer: dict[str, Any] = {o: n for n in nodes for o in n.output if o}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    const, _ = model.constants
    inits = {i.name for i in model.proto.graph.initializer}
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
    model = load(model)
    nodes = list(model.proto.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            consumers.setdefault(x, []).append(i)
    const, _ = model.constants
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
    model = load(model)
    dynamic = find_dynamic_units(model)
    covered = {o for u in dynamic for n in u.nodes for o in n.output if o}
    units = [u for u in find_units(model) if not (set(u.nodes[0].output) & covered)] + dynamic
    return sorted(units, key=lambda u: u.order)


def model_units(model: Model) -> list[Unit]:
    """:func:`replay_units` of a loaded model, computed once per :class:`Model` (a fact it caches)."""
    return model.fact("replay_units", replay_units)


def build_replay_model(model: Model, units: list[Unit], prefix: str = "u", *, shadow: bool = False,
                       keys: list[int] | None = None, xq: bool = True
                       ) -> tuple[Model, dict[str, tuple[int, str]], dict[str, str]]:
    """One model holding the given units side by side.

    Returns the model (in memory, :meth:`Model.derive`: same folder, the weights it reads shared), a map ``graph
    input name -> (unit key, reference tensor name)`` and a map ``result name -> graph output name``: unit
    ``k``'s output is the result ``{prefix}{k}::out``. With ``shadow``, each unit also yields ``::fq`` (its
    compute node on the quantized inputs, no output encoding), ``::xq{j}`` (the quantized value of its j-th
    quantized input) and, for a unit with quantized weights, ``::fw`` (on the float inputs: quantized weights, no
    activation encoding); ``xq=False`` leaves out ``::xq{j}`` (a CPU replay needs no quantized feeds). ``keys``
    name the units (default ``0..n-1``).

    The backend model's results are graph outputs of their own name (an ``Identity`` of the value: the graph a
    backend compiles is the one it always was). The shadow model (ONNX Runtime's CPU EP) returns the values
    themselves as graph outputs, a result name mapped to the value that holds it: no ``Identity`` copy of each
    of its ~2 results per unit (1,033 copies, 408 MB, on bench_loop's 12-block ViT; the values are the same
    arrays).
    """
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model.proto)
    g = m.graph
    const, const_nodes = model.constants
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
    results: dict[str, str] = {}
    exposed: set[str] = set()
    # the output encodings' scales and zero points, read once for every unit (floors_at_zero)
    qarr = model.arrays({x for u in units if u.out_q is not None for x in u.out_q.input[1:3] if x}) if shadow else {}
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
            relu = u.out_q is not None and floors_at_zero(u.out_q, model.proto, model.base_dir, qarr)

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
            if shadow and value.startswith(pre) and value not in feeds:  # a node output of this unit's copy
                if value not in exposed:
                    exposed.add(value)
                    g.output.append(onnx.ValueInfoProto(name=value))
                results[out_name] = value
                continue
            g.node.append(onnx.NodeProto(op_type="Identity", name=out_name, input=[value], output=[out_name]))
            g.output.append(onnx.ValueInfoProto(name=out_name))
            results[out_name] = out_name
    # drop initializers no unit uses (the replay of a few units should not carry the whole model)
    used = {x for n in g.node for x in n.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    # the ValueInfo of graph inputs needs a type: set from the reference arrays at run time
    return model.derive(m), feeds, results



def lineage_aliases(model: Any) -> dict[str, list[str]]:
    """Float tensors of a QDQ model that hold the same values as others, in another shape: for each
    Reshape / Flatten / Squeeze / Unsqueeze (its Q/DQ skipped), its output and its input name each other."""
    graph = load(model).proto.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    out: dict[str, list[str]] = {}
    for n in graph.node:
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
    """Static shapes the model's ``value_info`` / inputs / outputs record, by float name
    (:attr:`Model.value_shapes`)."""
    return load(model).value_shapes


def activation_bits(model: Any) -> int:
    """The most common activation bitwidth of a QDQ model (a path, proto or :class:`Model`; 8 when it has
    none)."""
    model = load(model)
    quantizers = [n for _, n in model.quantizers]
    arrays = model.arrays({x for n in quantizers for x in n.input[1:3] if x})
    bits: dict[int, int] = {}
    for n in quantizers:
        qp = quant_params(n, arrays)
        b = qp.bitwidth if qp is not None else 8
        bits[b] = bits.get(b, 0) + 1
    return max(bits, key=lambda b: (bits[b], -b)) if bits else 8


def intro_budget(model: Any) -> float:
    """The default introduced-SQNR budget for a QDQ model: by its activation bitwidth
    (``defaults.INTRO_BUDGET_DB``)."""
    return defaults.INTRO_BUDGET_DB.get(activation_bits(model), defaults.DIVERGENCE_SQNR_DB)

