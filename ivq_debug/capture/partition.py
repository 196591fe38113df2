"""Partitioned capture: a model cut into consecutive subgraphs, each exposing one group of tensors.

Capturing in output subsets (``max_outputs_per_run``) bounds the memory of the exposed tensors, but running
the whole model once per subset costs one forward per subset. A :class:`PartitionPlan` cuts the node list
(topological order) right after the producer of each subset's last tensor; the runner then runs the pieces in
sequence, feeding each the boundary tensors of the earlier ones, so the whole capture costs one forward and
memory holds one piece's weights, its exposed tensors and the live boundary tensors.

With ONNX Runtime's graph optimizations disabled every node runs the same kernel on the same inputs whether
the graph is whole or cut, so a partitioned capture is bit-identical to a whole-model one (tested). With
optimizations on, fusions across a cut would differ, and on an execution provider that compiles the graph
(QNN HTP) the cut would change the compiled partition, so runners use plans only on the CPU EP at
``optimization="disable"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Piece:
    """One subgraph of a :class:`PartitionPlan`."""

    start: int  # first node index (inclusive)
    stop: int  # last node index + 1
    sites: list[Any]  # TensorSite objects whose exposed value this piece produces
    inputs: list[str] = field(default_factory=list)  # graph inputs and earlier pieces' values it reads
    initializers: list[str] = field(default_factory=list)  # initializers its nodes read
    outputs: list[str] = field(default_factory=list)  # exposed values, model outputs, boundary values


@dataclass
class PartitionPlan:
    """Consecutive subgraphs covering every node of a model once, in topological order."""

    pieces: list[Piece]
    #: value name -> index of the last piece that reads it (boundary values are dropped after it ran)
    last_use: dict[str, int]

    def __len__(self) -> int:
        return len(self.pieces)


def _has_subgraphs(node: Any) -> bool:
    return any(a.HasField("g") or len(a.graphs) for a in node.attribute)


def plan_partitions(model: Any, sites: list[Any], max_outputs: int) -> PartitionPlan | None:
    """Cut ``model`` so that each piece exposes at most ``max_outputs`` of ``sites``.

    Returns ``None`` when the graph cannot be cut safely: control-flow nodes (their bodies may read outer
    values), sparse initializers, nodes out of topological order, or model outputs no node produces.
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
    ordered = sorted(sites, key=lambda s: producer[s.output])
    n = max(1, max_outputs)
    stops: list[int] = []
    for k in range(n, len(ordered), n):  # cut after the producer of each chunk's last tensor
        stop = producer[ordered[k - 1].output] + 1
        if not stops or stop > stops[-1]:  # (tensors of one node never straddle a cut)
            stops.append(stop)
    if not stops or stops[-1] < len(nodes):
        stops.append(len(nodes))
    pieces: list[Piece] = []
    start = 0
    for stop in stops:
        pieces.append(Piece(start, stop, [s for s in ordered if start <= producer[s.output] < stop]))
        start = stop
    last_use: dict[str, int] = {}
    for k, p in enumerate(pieces):
        produced: set[str] = set()
        seen: set[str] = set()
        for n_ in nodes[p.start : p.stop]:
            for x in n_.input:
                if not x or x in produced or x in seen:
                    continue
                seen.add(x)
                if x in inits:
                    p.initializers.append(x)
                else:
                    p.inputs.append(x)
                    last_use[x] = k
            produced.update(o for o in n_.output if o)
    for k, p in enumerate(pieces):
        wanted = [s.output for s in p.sites]
        wanted += [o for o in outputs if p.start <= producer[o] < p.stop]
        wanted += [v for v, j in last_use.items() if j > k and v in producer and p.start <= producer[v] < p.stop]
        p.outputs = list(dict.fromkeys(wanted))
    return PartitionPlan(pieces, last_use)


def piece_model(model: Any, piece: Piece, feeds: dict[str, np.ndarray], name: str = "") -> Any:
    """The ModelProto of ``piece``: its nodes, the initializers they read (external references stay
    references), its inputs typed from ``feeds`` (graph inputs keep their declared type) and its outputs."""
    import onnx
    from onnx import helper

    g = model.graph
    declared = {i.name: i for i in g.input}
    init_by_name = {t.name: t for t in g.initializer}
    m = onnx.ModelProto()
    m.ir_version = model.ir_version
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    m.producer_name = "ivq-debug partition"
    sub = m.graph
    sub.name = name or f"{g.name}_part"
    sub.node.extend(g.node[piece.start : piece.stop])
    sub.initializer.extend(init_by_name[x] for x in piece.initializers)
    for x in piece.inputs:
        if x in declared:
            sub.input.append(declared[x])
        else:
            a = feeds[x]
            sub.input.append(helper.make_tensor_value_info(x, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape))
    sub.output.extend(onnx.ValueInfoProto(name=o) for o in piece.outputs)
    return m
