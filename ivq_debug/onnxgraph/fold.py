"""ONNX graph preparation for static-shape backends (QNN): exact constant folding that keeps names.

Exporters leave shape arithmetic in static graphs (``Shape → ConstantOfShape → Where → Expand`` for a
``cls_token.expand(B, -1, -1)``); QNN HTP rejects ``Shape`` / ``ConstantOfShape`` nodes, and ORT's own
optimizer would also rewrite MatMul/Add into Gemm and rename tensors, breaking the alignment with PyTorch.
:func:`fold_constants` evaluates only the nodes whose inputs are all constant (initializers, ``Constant``
nodes, or ``Shape`` of a statically shaped tensor) with the ONNX reference implementation and replaces them
by initializers; every other node, and every non-constant tensor name, is unchanged.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

#: do not materialize folded tensors larger than this (bytes)
FOLD_MAX_BYTES = 64 << 20
#: ops whose result changes from one evaluation to the next: never constant, even on constant inputs
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli"})


def constant_nodes(nodes: Any, constants: set[str]) -> tuple[set[int], set[str]]:
    """The nodes of a topologically sorted node list computed from ``constants`` (initializers) alone.

    ``Constant`` nodes, weight ``Identity`` / ``Transpose`` / ``DequantizeLinear``, shape arithmetic: every
    non-random node whose inputs are all constant. Returns their indices and every constant value name
    (``constants`` included). Capture does not expose these values (they are not activations) and partitioned
    capture copies these nodes into each piece that reads them.
    """
    values = set(constants)
    idx: set[int] = set()
    for i, n in enumerate(nodes):
        if n.op_type not in RANDOM_OPS and all((not x) or x in values for x in n.input):
            idx.add(i)
            values.update(o for o in n.output if o)
    return idx, values


def static_shapes(model: Any) -> dict[str, list[int]]:
    """``{value name: dims}`` of every value ONNX shape inference (with data propagation) gives a static shape;
    empty when inference fails."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # e.g. com.microsoft ops: no folding of Shape nodes then
        return {}
    out: dict[str, list[int]] = {}
    g = inferred.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if all(d is not None for d in dims):
            out[vi.name] = dims  # type: ignore[assignment]
    return out


def _eval_node(node: Any, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray]:
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    ins = [helper.make_tensor_value_info(n or "", helper.np_dtype_to_tensor_dtype(a.dtype) if a is not None else 1, None)
           for n, a in zip(node.input, inputs, strict=True) if n]
    outs = [helper.make_tensor_value_info(o, 0, None) for o in node.output if o]
    g = helper.make_graph([node], "fold", ins, outs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: a for n, a in zip(node.input, inputs, strict=True) if n}
    return ReferenceEvaluator(m).run(None, feeds)


#: folding passes at most (each pass re-infers the shapes the previous one made static)
FOLD_MAX_PASSES = 8
#: ops whose output depends on their input's shape only: constant once that shape is static
SHAPE_OPS = frozenset({"Shape", "Size"})


def fold_constants(model: Any, max_bytes: int = FOLD_MAX_BYTES) -> tuple[Any, int]:
    """Fold constant subgraphs of ``model`` (a ModelProto, changed in place and returned) → ``(model, n)``.

    Repeats until a pass folds nothing: shape inference runs once per pass, and a ``Shape`` whose input's shape
    only becomes static once an earlier pass turned its ``Slice`` bounds into initializers folds in the next one
    (qwen3vl-tiny's interleaved M-RoPE left 16 such nodes after one pass, and a ``Shape → Concat`` piece QNN HTP
    rejects: "Having zero graph inputs is not supported").
    """
    total = 0
    for _ in range(FOLD_MAX_PASSES):
        model, done = _fold_pass(model, max_bytes)
        total += len(done)
        if not done:
            break
    return model, total


def fold_shape_chains(model: Any, max_bytes: int = FOLD_MAX_BYTES) -> tuple[Any, list[tuple[str, str]]]:
    """Fold the shape arithmetic of ``model`` (a ModelProto, changed in place) → ``(model, [(node, op_type)])``.

    What QNN HTP refuses at ORT optimization level "disable": a ``Shape`` (or ``Size``) of a tensor whose shape
    is static and everything computed from it and constants alone (``Gather`` / ``Slice`` / ``Cast`` /
    ``Concat`` / ``Unsqueeze`` on the shape, ``ConstantOfShape``, ``Range``, ``Expand`` of a constant, …), the
    ``Shape → Gather → Concat → Reshape`` chains paddle2onnx and torch's exporters write for dynamic reshapes.
    Each becomes an initializer holding its exact value (the ONNX reference implementation); constant nodes
    that only fed them go, every other node, initializer and tensor name stays (weights are not touched: the
    quantizer still sees the graph it was given, minus its shape arithmetic). Same passes as
    :func:`fold_constants`; a model whose shapes are not static folds nothing.
    """
    derived: set[str] = set()
    folded: list[tuple[str, str]] = []
    for _ in range(FOLD_MAX_PASSES):
        if not any(n.op_type in SHAPE_OPS for n in model.graph.node):  # nothing left to start a chain: no inference
            break
        model, done = _fold_pass(model, max_bytes, derived)
        folded += done
        if not done:
            break
    return model, folded


def _subgraph_reads(nodes: Any) -> set[str]:
    """Every value name read by the nodes of the subgraphs (``If`` branches, ``Loop`` bodies) under ``nodes``:
    outer-scope values a subgraph reads must stay."""
    from onnx import AttributeProto

    out: set[str] = set()
    for n in nodes:
        for a in n.attribute:
            graphs = [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs) if a.type == AttributeProto.GRAPHS \
                else []
            for sg in graphs:
                out.update(x for sn in sg.node for x in sn.input if x)
                out |= _subgraph_reads(sg.node)
    return out


def _fold_pass(model: Any, max_bytes: int, derived: set[str] | None = None) -> tuple[Any, list[tuple[str, str]]]:
    """One folding pass (see :func:`fold_constants`) → ``(model, [(node, op_type) folded])``.

    ``derived`` (updated): fold only the shape chains (:func:`fold_shape_chains`): the values computed from a
    ``Shape`` / ``Size`` of a static tensor; the other constant nodes are evaluated (their values feed the
    chains) but kept, unless nothing reads them any more.
    """
    from onnx import numpy_helper

    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    graph_inputs = {i.name for i in g.input}
    const: dict[str, np.ndarray] = {}
    for init in g.initializer:
        if init.name not in graph_inputs:
            try:
                const[init.name] = numpy_helper.to_array(init)
            except Exception:
                pass
    shapes = static_shapes(model)
    keep = []
    kept_constant: set[int] = set()  # ids of kept nodes computed from constants alone (removable when unread)
    folded: dict[str, np.ndarray] = {}
    done: list[tuple[str, str]] = []
    for node in g.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in RANDOM_OPS:
            keep.append(node)
            continue
        values = None
        if node.op_type == "Constant":
            try:
                values = _eval_node(node, [], opset)
            except Exception:
                values = None
        elif node.op_type in SHAPE_OPS and node.input[0] in shapes:
            shp = np.asarray(shapes[node.input[0]], dtype=np.int64)
            if node.op_type == "Size":
                values = [np.asarray(np.prod(shp), dtype=np.int64)]
            else:
                start = next((a.i for a in node.attribute if a.name == "start"), 0)
                end = next((a.i for a in node.attribute if a.name == "end"), None)
                values = [shp[start:end]]
        elif node.input and all((not x) or x in const for x in node.input):
            try:
                values = _eval_node(node, [const.get(x) if x else None for x in node.input], opset)
            except Exception:
                values = None
        if values is None or sum(np.asarray(v).nbytes for v in values) > max_bytes:
            keep.append(node)
            continue
        outs = [o for o in node.output if o]
        for o, v in zip(outs, values, strict=True):
            const[o] = np.asarray(v)
        if derived is not None and not (node.op_type in SHAPE_OPS or any(x in derived for x in node.input)):
            keep.append(node)  # a constant, not shape arithmetic: stays (its value feeds the chains)
            kept_constant.add(id(node))
            continue
        for o in outs:
            folded[o] = const[o]
        if derived is not None:
            derived.update(outs)
        done.append((node.name or outs[0], node.op_type))
    if not done:
        return model, []
    reads = Counter(x for n in keep for x in n.input if x)
    reads.update({o.name for o in g.output} | _subgraph_reads(keep))
    if kept_constant:  # constants that only fed folded chains are unread now (consumers come first in reverse)
        gone: set[int] = set()
        for n in reversed(keep):
            if id(n) in kept_constant and not any(reads[o] for o in n.output if o):
                gone.add(id(n))
                reads.subtract(x for x in n.input if x)
        keep = [n for n in keep if id(n) not in gone]
    used = {x for x, k in reads.items() if k > 0}
    del g.node[:]
    g.node.extend(keep)
    existing = {i.name for i in g.initializer}
    for name, arr in folded.items():
        if name in used and name not in existing:
            g.initializer.append(numpy_helper.from_array(arr, name))
    # drop initializers nothing reads any more
    live = [i for i in g.initializer if i.name in used or i.name in graph_inputs]
    del g.initializer[:]
    g.initializer.extend(live)
    return model, done
