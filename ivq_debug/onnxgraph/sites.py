"""Facts about an ONNX graph's tensors: which ones a capture can expose, their module scope, their QDQ encodings.

Float models expose node outputs. QDQ models expose the outputs of their activation ``QuantizeLinear`` nodes
(raw integers), dequantized with the model's own scale / zero point and keyed by the *float* tensor name, so
float, CPU-QDQ and QNN HTP dumps of one model align by name. Everything here reads a ``ModelProto``; nothing
runs a model.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivq_debug.errors import UsageError
from ivq_debug.onnxgraph.fold import constant_nodes

QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
#: suffix the ORT quantizer gives a graph output's float tensor when it inserts Q/DQ after it
Q_INPUT_SUFFIX = "_QuantizeLinear_Input"
#: suffix the ORT quantizer gives a quantized initializer
QUANTIZED_SUFFIX = "_quantized"


@dataclass(frozen=True)
class TensorSite:
    """One capturable tensor of an ONNX graph."""

    name: str  # key in the dump (float name for QDQ-exposed tensors)
    output: str  # graph value to expose
    op_type: str  # producer op type (for QDQ: the op that produced the float tensor)
    node: str  # producer node name
    order: int  # topological position of the producer
    scope: str | None  # module path from exporter scopes / metadata
    encoding: dict[str, Any] | None = None  # for QDQ-exposed tensors: how to dequantize


def scope_of(node: Any) -> str | None:
    """Module path of an ONNX node, from dynamo ``pkg.torch.onnx.name_scopes`` or legacy scope names.

    Legacy node names look like ``/vision_tower/encoder/layer.0/attention/q_proj/MatMul``: the module
    path is the components between the first and the last ``/`` joined by ``.``. Dynamo nodes carry the
    full module path as the second-to-last entry of the ``name_scopes`` metadata.
    """
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                break
            if isinstance(scopes, list) and len(scopes) >= 2:
                return str(scopes[-2]) or None
    name = node.name
    if name.startswith("/") and name.count("/") >= 2:
        parts = name.split("/")[1:-1]
        return ".".join(parts) or None
    return None


def is_qdq(node: Any) -> bool:
    """True for a QuantizeLinear / DequantizeLinear node of a QDQ domain."""
    return node.op_type in QDQ_OPS and node.domain in QDQ_DOMAINS


def is_qdq_model(model: Any) -> bool:
    """True when the graph holds QuantizeLinear nodes."""
    return any(n.op_type == "QuantizeLinear" and n.domain in QDQ_DOMAINS for n in model.graph.node)


def float_name(tensor: str) -> str:
    """The float model's name of a tensor the quantizer renamed (``X_QuantizeLinear_Input`` -> ``X``)."""
    return tensor[: -len(Q_INPUT_SUFFIX)] if tensor.endswith(Q_INPUT_SUFFIX) else tensor


# ------------------------------------------------------------------------------ QDQ parameters
def constant_arrays(model: Any, names: set[str] | None = None, base_dir: str = "") -> dict[str, np.ndarray]:
    """Values of initializers and ``Constant`` nodes (only ``names`` when given; external data read from
    ``base_dir``, the model's folder)."""
    from onnx import numpy_helper

    out: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        if names is None or init.name in names:
            out[init.name] = numpy_helper.to_array(init, base_dir)
    for node in model.graph.node:  # Constant nodes can also hold scales / zero points
        if node.op_type == "Constant" and node.output and (names is None or node.output[0] in names):
            for a in node.attribute:
                if a.name == "value":
                    out[node.output[0]] = numpy_helper.to_array(a.t)
    return out


@dataclass(frozen=True)
class QuantParams:
    """The parameters of one QuantizeLinear / DequantizeLinear node."""

    scale: np.ndarray
    zero_point: np.ndarray | None
    dtype: np.dtype  # storage type (the zero point's; uint8 when absent)
    bitwidth: int  # the storage width, or the node's ``precision`` attribute when set
    axis: int | None  # per-channel axis (None for per-tensor)

    @property
    def is_integer(self) -> bool:
        """Integer storage (float8 and other types have no QNN encoding)."""
        return self.dtype.kind in "iu"

    def encoding(self) -> dict[str, Any]:
        """The dump's encoding dict (``docs/dump-format.md``): what :func:`ivq_debug.dump.quant.dequantize` reads."""
        zp = self.zero_point
        return {
            "bitwidth": self.dtype.itemsize * 8,
            "dtype": self.dtype.name,
            "scale": self.scale.tolist(),
            "zero_point": zp.tolist() if zp is not None else 0,
            "axis": self.axis,
            "qmin": int(np.iinfo(self.dtype).min),
            "qmax": int(np.iinfo(self.dtype).max),
        }


def quant_params(node: Any, arrays: dict[str, np.ndarray]) -> QuantParams | None:
    """The :class:`QuantParams` of a Q/DQ node whose scale (and zero point) are in ``arrays``."""
    scale = arrays.get(node.input[1]) if len(node.input) > 1 else None
    if scale is None:
        return None
    zp = arrays.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    dtype = zp.dtype if zp is not None else np.dtype(np.uint8)
    bits = dtype.itemsize * 8
    for a in node.attribute:
        if a.name == "precision" and a.i:
            bits = int(a.i)
    axis = None
    if np.ndim(scale) > 0 and np.size(scale) > 1:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    return QuantParams(np.asarray(scale), None if zp is None else np.asarray(zp), np.dtype(dtype), bits, axis)


def floors_at_zero(q_node: Any, model: Any, base_dir: str = "", arrays: dict[str, np.ndarray] | None = None) -> bool:
    """True when the per-tensor encoding of the Q/DQ node ``q_node`` (in ``model``) has exactly 0 as its lower
    bound (integer zero point = the storage minimum). ORT's quantizer folds a ReLU (or a Clip at 0) that follows
    an op into such an encoding and removes the node: the graph's value *before* this encoding then lacks the
    ReLU, and a float stand-in for the encoding (the replay's float-weight / pre-encoding outputs, a lifted
    encoding) must apply ``max(x, 0)`` to mean what the float model computes. External data is read from
    ``base_dir``, the model's folder; ``arrays``: the model's constants already read (:func:`constant_arrays`
    of at least the node's scale and zero point: a caller asking for many nodes reads the model once)."""
    if arrays is None:
        arrays = constant_arrays(model, set(q_node.input[1:3]), base_dir)
    qp = quant_params(q_node, arrays)
    if qp is None or qp.axis is not None or qp.zero_point is None or not qp.is_integer:
        return False
    return int(np.asarray(qp.zero_point).reshape(-1)[0]) == int(np.iinfo(qp.dtype).min)


def activation_quantizers(model: Any, const: set[str] | None = None) -> Iterator[tuple[str, Any]]:
    """``(float name, QuantizeLinear node)`` of every activation quantizer, first per float name, in graph order.

    Activation = the Q node's input is not computed from initializers alone (``const``, default from
    :func:`~ivq_debug.onnxgraph.fold.constant_nodes`).
    """
    nodes = list(model.graph.node)
    if const is None:
        _, const = constant_nodes(nodes, {i.name for i in model.graph.initializer})
    seen: set[str] = set()
    for n in nodes:
        if n.op_type != "QuantizeLinear" or n.domain not in QDQ_DOMAINS or not n.input:
            continue
        if n.input[0] in const:
            continue
        name = float_name(n.input[0])
        if name not in seen:
            seen.add(name)
            yield name, n


def parameter_dequantizers(model: Any, arrays: dict[str, np.ndarray]) -> Iterator[tuple[str, Any]]:
    """``(float parameter name, DequantizeLinear node)`` of every DQ reading a stored value in ``arrays``."""
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.input and n.input[0] in arrays:
            name = n.input[0]
            yield (name[: -len(QUANTIZED_SUFFIX)] if name.endswith(QUANTIZED_SUFFIX) else name), n


# ------------------------------------------------------------------------------ capture sites
def list_sites(model: Any, mode: str = "auto", base_dir: str = "") -> list[TensorSite]:
    """All capturable tensors of a model, in topological order.

    ``mode``: ``"float"`` exposes every node output; ``"qdq"`` exposes activation QuantizeLinear outputs
    keyed by their float names; ``"auto"`` picks ``"qdq"`` when the model has Q nodes.
    """
    if mode == "auto":
        mode = "qdq" if is_qdq_model(model) else "float"
    if mode not in ("float", "qdq"):
        raise UsageError(f"unknown exposure mode {mode!r} (float, qdq, auto)")
    nodes = list(model.graph.node)
    # values computed from initializers only (weight Identity copies, shape constants): not activations
    _, const = constant_nodes(nodes, {i.name for i in model.graph.initializer})
    sites: list[TensorSite] = []
    if mode == "float":
        for i, n in enumerate(nodes):
            if n.output and all((not o) or o in const for o in n.output):
                continue
            for o in n.output:
                if o:
                    sites.append(TensorSite(o, o, n.op_type, n.name, i, scope_of(n)))
        return sites
    producer = {o: (i, n) for i, n in enumerate(nodes) for o in n.output if o}
    graph_inputs = {i.name for i in model.graph.input}
    qnodes = list(activation_quantizers(model, const))
    params = constant_arrays(model, {x for _, n in qnodes for x in n.input[1:3] if x}, base_dir)
    for name, n in qnodes:
        qp = quant_params(n, params)
        if qp is None:
            continue
        src = n.input[0]
        if src in producer:
            pi, pn = producer[src]
            op_type, node_name, order, scope = pn.op_type, pn.name, pi, scope_of(pn)
        elif src in graph_inputs:
            op_type, node_name, order, scope = "GraphInput", "", -1, None
        else:
            continue
        sites.append(TensorSite(name, n.output[0], op_type, node_name, order, scope, qp.encoding()))
    sites.sort(key=lambda s: s.order)
    return sites
