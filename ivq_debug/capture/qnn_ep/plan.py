"""How a QNN HTP capture exposes tensors: the channels-last plan, and the tensors it must not ask QNN for.

Facts measured on the x86 HTP emulator (``docs/qnn-compile.md``, ``bench/bench_qnn_compile.py``):

* **Channels-last tensors.** The QNN EP runs convolutions, pools, ... channels-last (ORT's layout transformer
  rewrites them to NHWC and moves the layout through element-wise, Q/DQ, concat and reduction ops). An exposed
  NCHW activation must be handed back NCHW, so QNN adds one Transpose per exposed rank-4 tensor; each is a
  full-size copy kept alive to the end of the graph and QNN's "Graph Sequencing for Target" grows faster than
  linearly with them (PP-OCRv4 a16w8, all 369 tensors exposed: 27.6 s session vs 4.7 s plain). Exposing such a
  tensor through an explicit ``Transpose(perm=[0, 2, 3, 1])`` lets ORT's transpose optimizer cancel it against
  QNN's own, so the tensor leaves the graph with no copy (7.1 s, 369/369 tensors bit-identical); the capture
  transposes it back in numpy. A wrong guess only costs one transpose: the stored values are exact either way.
* **Dead tensors.** A tensor nothing reads on the way to a model output (an LSTM's ``Y_h`` / ``Y_c`` the
  quantizer quantized but no node consumes) is not computed by the deployed graph; exposing it changes what QNN
  compiles, and on the crnn bench model it moved the model output by one 8-bit step. Such tensors are listed as
  unexposable instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ivq_debug.capture.onnxrt.runner import ExposedAs
from ivq_debug.onnxgraph.fold import constant_nodes
from ivq_debug.onnxgraph.sites import TensorSite

#: ops ORT's layout transformer runs channels-last for the QNN EP (their rank-4 outputs live in NHWC on HTP)
LAYOUT_SENSITIVE = frozenset({
    "Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool",
    "BatchNormalization", "InstanceNormalization", "Resize", "DepthToSpace", "SpaceToDepth", "LRN", "GridSample"})
#: ops the transpose optimizer moves a channels-last layout through (element-wise, Q/DQ, concat, reductions)
LAYOUT_FOLLOWING = frozenset({
    "QuantizeLinear", "DequantizeLinear", "Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
    "LeakyRelu", "PRelu", "Elu", "Add", "Mul", "Sub", "Div", "Pow", "Sqrt", "Concat", "Identity", "Erf", "Gelu",
    "Neg", "Abs", "Max", "Min", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"})
#: the permutation that takes an NCHW tensor to the layout HTP holds it in, and the one that takes it back
TO_NHWC, TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)
#: suffix of the extra graph output that carries a channels-last tensor
NHWC_SUFFIX = "__ivq_nhwc"
#: the reason recorded for a dead tensor
DEAD_REASON = ("nothing reads it on the way to a model output, so the deployed graph does not compute it; "
               "exposing it changes what QNN compiles (an LSTM's unused Y_h / Y_c moved the model output by one "
               "step)")


def _ranks(model: Any) -> dict[str, int]:
    """Tensor ranks from the graph's value_info, inputs, outputs and initializers, propagated through the ops
    whose output rank is their input's (layout-sensitive and layout-following ops)."""
    g = model.graph
    rank: dict[str, int] = {i.name: len(i.dims) for i in g.initializer}
    for v in [*g.value_info, *g.input, *g.output]:
        t = v.type.tensor_type if v.type.HasField("tensor_type") else None
        if t is not None and t.HasField("shape"):
            rank[v.name] = len(t.shape.dim)
    for n in g.node:
        if not n.output or not n.output[0] or n.output[0] in rank:
            continue
        ins = [rank[i] for i in n.input[:1 if n.op_type in ("QuantizeLinear", "DequantizeLinear") else None]
               if i in rank]
        keepdims = next((a.i for a in n.attribute if a.name == "keepdims"), 1)
        if ins and (n.op_type in LAYOUT_SENSITIVE or (n.op_type in LAYOUT_FOLLOWING and
                                                      (not n.op_type.startswith("Reduce") or keepdims))):
            rank[n.output[0]] = max(ins)
    return rank


def channels_last(model: Any, sites: list[TensorSite]) -> set[str]:
    """Site outputs HTP holds channels-last: rank 4 and produced by a layout-sensitive op, or by layout-following
    ops whose activation inputs are all channels-last (a data-flow rule over the graph; no run)."""
    inits = {i.name for i in model.graph.initializer}
    _, const = constant_nodes(list(model.graph.node), inits)
    rank = _ranks(model)
    nhwc: set[str] = set()
    for n in model.graph.node:
        acts = [i for i in n.input if i and i not in inits and i not in const]
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            acts = acts[:1]
        if n.op_type in LAYOUT_SENSITIVE or (n.op_type in LAYOUT_FOLLOWING and acts and all(i in nhwc for i in acts)):
            nhwc.update(o for o in n.output if o)
    return {s.output for s in sites if s.output in nhwc and rank.get(s.output) == 4}


def _to_nchw(value: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(value.transpose(TO_NCHW))


def nhwc_exposure(output: str) -> ExposedAs:
    """Expose ``output`` through ``Transpose(perm=[0, 2, 3, 1])`` and transpose the fetched value back."""
    from onnx import helper

    fetch = f"{output}{NHWC_SUFFIX}"
    node = helper.make_node("Transpose", [output], [fetch], perm=list(TO_NHWC), name=fetch)
    return ExposedAs(fetch=fetch, nodes=(node,), restore=_to_nchw)


def dead_sites(model: Any, sites: list[TensorSite]) -> list[TensorSite]:
    """Sites from which no model output can be reached (see the module docstring)."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output if o}
    live: set[str] = set()
    stack = [o.name for o in g.output]
    while stack:
        t = stack.pop()
        if t in live:
            continue
        live.add(t)
        n = producer.get(t)
        if n is not None:
            stack.extend(i for i in n.input if i and i not in live)
    return [s for s in sites if s.output not in live]


def consumers_of(model: Any) -> dict[str, list[str]]:
    """Tensor -> names of the nodes that read it, looking through DequantizeLinear (a QDQ site's users)."""
    users: dict[str, list[str]] = {}
    for n in model.graph.node:
        for i in n.input:
            if i:
                users.setdefault(i, []).append(n.name)
    dq = {n.name: [o for o in n.output if o] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    out: dict[str, list[str]] = {}
    for t, names in users.items():
        seen: list[str] = []
        for name in names:
            seen.append(name)
            for o in dq.get(name, []):
                seen.extend(users.get(o, []))
        out[t] = seen
    return out
