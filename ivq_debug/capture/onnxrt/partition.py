"""Partitioned capture: a model cut into consecutive subgraphs, each exposing one group of tensors.

Capturing in output subsets (``max_outputs_per_run``) bounds the memory of the exposed tensors, but running
the whole model once per subset costs one forward per subset. A :class:`PartitionPlan` cuts the node list
(topological order) right after the producer of each subset's last tensor; the runner then runs the pieces in
sequence, feeding each the boundary tensors of the earlier ones, so the whole capture costs one forward and
memory holds one piece's weights, its exposed tensors and the live boundary tensors.

What keeps a cut exact (bit-identical to the whole model on ONNX Runtime's CPU EP at
``optimization="disable"``, where every node runs the same kernel on the same inputs):

- *Constant subgraphs never cross a cut.* ``Constant`` nodes and nodes computed from initializers only (weight
  ``DequantizeLinear``, ``Transpose`` of a weight, shape constants) are copied into every piece that reads them:
  ORT turns ``Constant`` nodes into initializers and prepacks them for MatMul/Gemm, which it would not do for
  a graph input, and a piece must not hold another piece's weights.
- *Only values numpy carries losslessly cross a cut.* ORT hands bfloat16, float8 and 4-bit tensors to Python
  as other types (or not at all), sequences and maps as lists and dicts; a cut that such a value would cross
  moves forward to the next position none crosses. Types come from ONNX shape inference. Where it cannot type
  a value (after a ``com.microsoft`` op, say), the value counts as a plain tensor unless a sequence/map op made
  it or the model mentions a type numpy cannot carry anywhere (initializers, declared values, ``Cast``
  targets, ``output_dtype`` attributes, constant tensors): then the value is treated as unsafe.

With optimizations on, fusions across a cut would differ, and on an execution provider that compiles the graph
(QNN HTP) the cut would change the compiled partition, so runners use plans only on the CPU EP at
``optimization="disable"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug.onnxgraph.fold import constant_nodes

#: ONNX tensor element types numpy holds bit for bit (what may cross a cut)
SAFE_ELEM_TYPES = frozenset({1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13})  # float … uint64, bool, fp16, double
#: element types numpy cannot carry faithfully: string, bfloat16, float8 ×4, uint4, int4, float4
EXOTIC_ELEM_TYPES = frozenset({8, 16, 17, 18, 19, 20, 21, 22, 23})
#: ops whose outputs are sequences, maps or optionals (never tensors numpy can carry)
NON_TENSOR_OPS = frozenset({"SplitToSequence", "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceErase",
                            "SequenceMap", "Optional", "ZipMap", "CastMap"})


@dataclass
class Piece:
    """One subgraph of a :class:`PartitionPlan`."""

    start: int  # first node index of its range (inclusive)
    stop: int  # last node index of its range + 1
    sites: list[Any]  # TensorSite objects whose exposed value this piece produces
    nodes: list[int] = field(default_factory=list)  # node indices it runs: its range + the constant nodes it reads
    inputs: list[str] = field(default_factory=list)  # graph inputs and earlier pieces' values it reads
    initializers: list[str] = field(default_factory=list)  # initializers its nodes read
    outputs: list[str] = field(default_factory=list)  # exposed values, model outputs, boundary values


@dataclass
class PartitionPlan:
    """Consecutive subgraphs covering every non-constant node of a model once, in topological order."""

    pieces: list[Piece]
    #: value name -> index of the last piece that reads it (boundary values are dropped after it ran)
    last_use: dict[str, int]
    #: value name -> ONNX element type, for the values that cross a cut
    elem_types: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.pieces)


def _has_subgraphs(node: Any) -> bool:
    return any(a.HasField("g") or len(a.graphs) for a in node.attribute)


def _value_types(model: Any) -> dict[str, int] | None:
    """Element type of every value shape inference can type (-1: a sequence, map or optional), or ``None``."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        return None
    g = inferred.graph
    out: dict[str, int] = {t.name: t.data_type for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type
        kind = t.WhichOneof("value")
        if kind == "tensor_type":
            if t.tensor_type.elem_type:
                out[vi.name] = t.tensor_type.elem_type
        elif kind is not None:
            out[vi.name] = -1
    return out


def _mentions_exotic_types(model: Any) -> bool:
    """True when a type numpy cannot carry appears anywhere the graph states a type."""
    g = model.graph
    if any(t.data_type in EXOTIC_ELEM_TYPES for t in g.initializer):
        return True
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.elem_type in EXOTIC_ELEM_TYPES:
            return True
    for n in g.node:
        for a in n.attribute:
            if a.name in ("to", "dtype", "output_dtype") and a.i in EXOTIC_ELEM_TYPES:
                return True
            if a.HasField("t") and a.t.data_type in EXOTIC_ELEM_TYPES:
                return True
    return False


def plan_partitions(model: Any, sites: list[Any], max_outputs: int) -> PartitionPlan | None:
    """Cut ``model`` so that each piece exposes about ``max_outputs`` of ``sites`` (more where a cut had to move).

    Returns ``None`` when the graph cannot be cut safely: control-flow nodes (their bodies may read outer
    values), sparse initializers, nodes out of topological order, model outputs no node produces, or a graph
    shape inference cannot process.
    """
    g = model.graph
    nodes = list(g.node)
    if not nodes or g.sparse_initializer or any(_has_subgraphs(n) for n in nodes):
        return None
    graph_inputs = {i.name for i in g.input}
    inits = {t.name for t in g.initializer} - graph_inputs  # an input with a default is fed, not folded
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            if x and x not in producer and x not in inits and x not in graph_inputs:
                return None  # not topologically sorted (or reads an undefined value)
        for o in n.output:
            if o:
                producer[o] = i
    outputs = [o.name for o in g.output]
    if any(o not in producer for o in outputs) or any(s.output not in producer for s in sites):
        return None
    types = _value_types(model)
    if types is None:
        return None
    const_nodes, _ = constant_nodes(nodes, inits)  # copied into the pieces that read them, never cut

    # cut positions a value numpy cannot carry would cross: (producer, last consumer]
    last_reader: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if i not in const_nodes:
            for x in n.input:
                if x and x in producer and producer[x] not in const_nodes:
                    last_reader[x] = i
    exotic = _mentions_exotic_types(model)

    def unsafe(v: str) -> bool:
        if v in types:
            return types[v] not in SAFE_ELEM_TYPES
        return exotic or nodes[producer[v]].op_type in NON_TENSOR_OPS

    blocked = np.zeros(len(nodes) + 2, np.int64)
    for v, last in last_reader.items():
        if unsafe(v):
            blocked[producer[v] + 1] += 1
            blocked[last + 1] -= 1
    blocked = np.cumsum(blocked) > 0

    ordered = sorted(sites, key=lambda s: producer[s.output])
    n_out = max(1, max_outputs)
    stops: list[int] = []
    for k in range(n_out, len(ordered), n_out):  # cut after the producer of each chunk's last tensor
        stop = producer[ordered[k - 1].output] + 1
        while stop < len(nodes) and blocked[stop]:
            stop += 1
        if stop < len(nodes) and (not stops or stop > stops[-1]):  # tensors of one node never straddle a cut
            stops.append(stop)
    stops.append(len(nodes))

    pieces: list[Piece] = []
    start = 0
    for stop in stops:
        pieces.append(Piece(start, stop, [s for s in ordered if start <= producer[s.output] < stop]))
        start = stop
    for p in pieces:
        _fill_piece(p, nodes, const_nodes, producer, inits, set(outputs))
    needed = set(outputs)
    for p in reversed(pieces):  # outputs: sites, model outputs, and values later pieces read
        wanted = [s.output for s in p.sites]
        wanted += [v for v in outputs if p.start <= producer[v] < p.stop]
        wanted += sorted(v for v in needed if v in producer and p.start <= producer[v] < p.stop
                         and producer[v] not in const_nodes)
        p.outputs = list(dict.fromkeys(wanted))
        needed.update(p.inputs)
    pieces = [p for p in pieces if p.outputs]  # a tail of dead nodes produces nothing anybody reads
    last_use: dict[str, int] = {}
    for k, p in enumerate(pieces):
        for x in p.inputs:
            last_use[x] = k
    crossing = {x for p in pieces for x in p.inputs if x not in graph_inputs}
    return PartitionPlan(pieces, last_use, {v: types[v] for v in crossing if v in types})


def _fill_piece(p: Piece, nodes: list[Any], const_nodes: set[int], producer: dict[str, int],
                inits: set[str], outputs: set[str]) -> None:
    """The nodes a piece runs (its non-constant range plus the constant nodes they read, transitively, in
    topological order), the initializers they read and the values they need from outside."""
    own = [i for i in range(p.start, p.stop) if i not in const_nodes]
    # plus a constant that is a model output, in the piece whose range holds it
    seeds = own + [i for i in range(p.start, p.stop) if i in const_nodes and any(o in outputs for o in nodes[i].output)]
    pulled = {i for i in seeds if i in const_nodes}
    todo = [x for i in seeds for x in nodes[i].input if x]
    while todo:  # the constant nodes they read, transitively
        j = producer.get(todo.pop())
        if j is not None and j in const_nodes and j not in pulled:
            pulled.add(j)
            todo.extend(y for y in nodes[j].input if y)
    p.nodes = sorted(set(own) | pulled)
    produced: set[str] = set()
    seen: set[str] = set()
    for i in p.nodes:
        for x in nodes[i].input:
            if not x or x in produced or x in seen:
                continue
            seen.add(x)
            (p.initializers if x in inits else p.inputs).append(x)
        produced.update(o for o in nodes[i].output if o)


def piece_model(model: Any, piece: Piece, feeds: dict[str, np.ndarray], elem_types: dict[str, int] | None = None,
                name: str = "") -> Any:
    """The ModelProto of ``piece``: its nodes, the initializers they read (external references stay
    references), its inputs typed from ``elem_types`` (else from ``feeds``; graph inputs keep their declared
    type) with the shapes of ``feeds``, and its outputs."""
    import onnx
    from onnx import helper

    g = model.graph
    declared = {i.name: i for i in g.input}
    init_by_name = {t.name: t for t in g.initializer}
    elem_types = elem_types or {}
    m = onnx.ModelProto()
    m.ir_version = model.ir_version
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    m.producer_name = "ivq-debug partition"
    sub = m.graph
    sub.name = name or f"{g.name}_part"
    sub.node.extend(g.node[i] for i in piece.nodes)
    sub.initializer.extend(init_by_name[x] for x in piece.initializers)
    for x in piece.inputs:
        if x in declared:
            sub.input.append(declared[x])
        else:
            a = feeds[x]
            et = elem_types.get(x) or helper.np_dtype_to_tensor_dtype(a.dtype)
            sub.input.append(helper.make_tensor_value_info(x, et, a.shape))
    sub.output.extend(onnx.ValueInfoProto(name=o) for o in piece.outputs)
    return m
