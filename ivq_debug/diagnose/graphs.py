"""Derived graphs the replay diagnostics build from a QDQ model: value names, typed inputs, node copies (the
constant subgraph is :attr:`ivq_debug.onnxgraph.load.Model.constants`).
Derived models go to their runner in memory (:meth:`ivq_debug.onnxgraph.load.Model.derive`), never a file."""

from __future__ import annotations

from typing import Any

import numpy as np


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
    del g.node[:]
    g.node.extend(nodes)
    outs: list[dict[str, str]] = []
    for ren in renamed:
        mine = {}
        for o in model.graph.output:
            if o.name in ren:
                vi = g.output.add()
                vi.CopyFrom(o)
                vi.name = mine[o.name] = ren[o.name]
        outs.append(mine)
    return m, outs
