"""Derived graphs the replay diagnostics build from a QDQ model: value names, typed inputs, node copies (the
constant subgraph is :attr:`ivq_debug.onnxgraph.load.Model.constants`).
Derived models go to their runner in memory (:meth:`ivq_debug.onnxgraph.load.Model.derive`), never a file."""

from __future__ import annotations

from typing import Any

import numpy as np

from ivq_debug.onnxgraph.sites import QDQ_DOMAINS, float_name


def unit_value(pre: str, name: str) -> str:
    """A derived graph's name for the model tensor (or node) ``name`` inside the copy whose names start with
    ``pre`` (a replay unit ``u3::``, a lift variant ``v1::``): in its own ``v:`` namespace, so a model tensor
    called ``out``, ``fq`` or ``out::logits`` cannot collide with the copy's result names (``{pre}out``,
    ``{pre}out::logits``, ...)."""
    return f"{pre}v:{name}"


def typed_inputs(m: Any, feeds: dict[str, np.ndarray]) -> None:
    """Give every graph input of ``m`` the dtype and static shape of its feed (any numpy dtype ONNX has, e.g.
    the uint8 / int8 tensors of a dynamic INT8 reference)."""
    from onnx import helper

    for vi in m.graph.input:
        a = feeds[vi.name]
        vi.CopyFrom(helper.make_tensor_value_info(vi.name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)))


def copy_node(n: Any, name: str, inputs: list[str], outputs: list[str]) -> Any:
    """A copy of node ``n`` with a new name, inputs and outputs (attributes and domain kept)."""
    import onnx

    c = onnx.NodeProto()
    c.CopyFrom(n)
    c.name = name
    c.ClearField("input")
    c.ClearField("output")
    c.input.extend(inputs)
    c.output.extend(outputs)
    return c


def mergeable(model: Any) -> bool:
    """Whether the lift variants of ``model`` can share one graph (:func:`lifted_variants`): its nodes in
    topological order and none with a subgraph (whose outer-scope reads the copy could not follow)."""
    from onnx import AttributeProto

    known = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer} | {""}
    for n in model.graph.node:
        if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in n.attribute):
            return False
        if any(x not in known for x in n.input):
            return False
        known.update(n.output)
    return True


def lifted_variants(model: Any, plans: list[tuple[dict[int, Any], dict[str, np.ndarray]]]
                    ) -> tuple[Any, list[dict[str, str]]]:
    """One model that computes ``model`` and each lift variant of ``plans`` (each a lift plan of :mod:`ivq_debug.diagnose.effect`) side by side:
    variant ``v`` copies only the nodes its replacements change and everything downstream of them (names in its
    own ``v{v}::`` namespace, :func:`unit_value`) and reads every other value from the
    unchanged model's, so the shared part runs once; each node's copy follows its original, so a value is freed
    as early as in the model alone. Returns the model and, per variant, ``{graph output: the output holding the
    variant's value}`` for the outputs the variant changes (an output it does not change is the model's own).
    The model must be :func:`mergeable`; every node computes what it computes in its own variant's model."""
    import onnx
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    added: set[str] = set()
    for _, inits in plans:
        for k, v in inits.items():
            if k not in added:
                g.initializer.append(numpy_helper.from_array(v, k))
                added.add(k)
    renamed: list[dict[str, str]] = [{} for _ in plans]
    nodes = []
    for i, n in enumerate(model.graph.node):
        nodes.append(n)
        for v, (plan, _) in enumerate(plans):
            ren = renamed[v]
            src = plan.get(i)
            if src is None and not any(x in ren for x in n.input):
                continue
            src = n if src is None else src
            pre = f"v{v}::"
            outs = [unit_value(pre, o) if o else "" for o in src.output]
            nodes.append(copy_node(src, unit_value(pre, src.name or f"#{i}"), [ren.get(x, x) for x in src.input],
                                   outs))
            ren.update({o: r for o, r in zip(src.output, outs, strict=True) if o})
    outs: list[dict[str, str]] = []
    for ren in renamed:
        mine = {}
        for o in model.graph.output:
            if o.name in ren:
                vi = g.output.add()
                vi.CopyFrom(o)
                vi.name = mine[o.name] = ren[o.name]
        outs.append(mine)
    # the model's own outputs only where a variant reads one it does not change (the unchanged model's, e.g. the
    # empty lift), and only the nodes those outputs need: without such a variant the unchanged model runs only
    # up to what the copies read
    need = {mine.get(o.name, o.name) for mine in outs for o in model.graph.output}
    kept = [o for o in g.output if o.name in need]
    del g.output[:]
    g.output.extend(kept)
    del g.node[:]
    g.node.extend(live_nodes(nodes, need))
    return m, outs


def live_nodes(nodes: list[Any], outputs: set[str]) -> list[Any]:
    """The nodes (in topological order) that ``outputs`` depend on, in their order."""
    live = set(outputs)
    kept = []
    for n in reversed(nodes):
        if any(o in live for o in n.output if o):
            kept.append(n)
            live.update(x for x in n.input if x)
    return kept[::-1]


def dequantized(n: Any, producer: dict[str, Any], inits: set[str]) -> tuple[str | None, Any]:
    """What a DequantizeLinear node ``n`` gives back (``producer``: node by output, ``inits``: initializer names):
    ``(weight, None)`` for a weight (a quantized initializer, or a float one the graph quantizes), ``(None, q)`` for
    an activation encoding (``q``, its QuantizeLinear), ``(None, None)`` for anything else."""
    if not (n.op_type == "DequantizeLinear" and n.domain in QDQ_DOMAINS and n.input):
        return None, None
    src = n.input[0]
    q = producer.get(src)
    if src in inits:  # a quantized initializer
        return float_name(src).removesuffix("_quantized"), None
    if q is None or q.op_type != "QuantizeLinear" or q.domain not in QDQ_DOMAINS:
        return None, None
    return (q.input[0], None) if q.input[0] in inits else (None, q)  # a float initializer the graph quantizes


def lift_starts(model: Any, specs: list[tuple[list[str], list[str]]]) -> list[int]:
    """For each ``(tensors, weights)`` of ``specs``, the position in ``model.graph.node`` of the first node that
    reads a value its lift changes (a DequantizeLinear output of one of its weights or encodings), or the number of
    nodes for none: a lift variant copies from there on (:func:`lifted_variants`)."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output if o}
    inits = {i.name for i in model.graph.initializer}
    lifted: dict[str, str] = {}  # DequantizeLinear output -> the weight or float tensor it gives back
    first: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            if x in lifted:
                first.setdefault(lifted[x], i)
        w, q = dequantized(n, producer, inits)
        if w is not None or q is not None:
            lifted[n.output[0]] = w if w is not None else float_name(q.input[0])
    return [min((first.get(x, len(nodes)) for x in [*t, *w]), default=len(nodes)) for t, w in specs]


def split_by_start(starts: list[int], n_nodes: int, groups: int) -> list[list[int]]:
    """The indexes of ``starts`` (lift variants by where their copy starts, of a model of ``n_nodes`` nodes) in at
    most ``groups`` groups, each a run of the variants ordered by start, so that the largest group's graph is
    smallest. A group's graph has each variant's copy (``n_nodes - start``) and the unchanged model up to its latest
    start (all of it with the empty lift, which starts at ``n_nodes``); on bench_loop's 12-block ViT, 7 targets in
    2 groups, 5,130 + 4,122 nodes in order became 3,492 + 4,517 (``docs/scale.md``, sixth pass)."""
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    groups = max(1, min(groups, len(order)))

    def cost(run: list[int]) -> int:
        return sum(n_nodes - starts[i] for i in run) + max(starts[i] for i in run)

    best: dict[tuple[int, int], tuple[int, list[list[int]]]] = {}

    def split(lo: int, k: int) -> tuple[int, list[list[int]]]:  # order[lo:] in k runs
        if k == 1:
            return cost(order[lo:]), [order[lo:]]
        if (lo, k) not in best:
            best[lo, k] = min(((max(cost(order[lo:hi]), rest[0]), [order[lo:hi], *rest[1]])
                               for hi in range(lo + 1, len(order) - k + 2) for rest in [split(hi, k - 1)]),
                              key=lambda c: c[0])
        return best[lo, k]

    return split(0, groups)[1] if order else []
