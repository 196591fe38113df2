"""QNN graph descriptions: ``<model>_net.json``, ORT's ``dump_json_qnn_graph`` and context-binary JSON.

Three JSON shapes describe a QNN graph's tensors (dims, data type, quantization, layout):

* the converter's ``<model>_net.json`` and ONNX Runtime's ``dump_json_qnn_graph`` output
  (``{"graph": {"tensors": {name: {...}}, "nodes": {name: {...}}}}``, see ``docs/qnn-formats.md``);
* ``qnn-context-binary-utility --json_file`` output (``info.graphs[].info.graphInputs[].info``, or the
  same without the ``info`` wrappers), which lists graph inputs and outputs only.

Quantization follows QNN: ``float = (q + offset) * scale`` with ``offset = -zero_point``.

ORT's dump writes only the ``scale_offset`` member of the quantize-params union, so a per-channel
(``AXIS_SCALE_OFFSET``) tensor shows the union's other member reinterpreted: ``scale`` holds the bits
of the int32 axis and ``offset`` the channel count. :func:`read_net_json` decodes that and marks the
per-channel scales as unavailable (``QnnQuant.per_channel_missing``).

The files are untrusted: each tensor and node object is checked against :data:`TENSOR_SCHEMA` /
:data:`NODE_SCHEMA` (JSON Schema, ``docs/input-formats.md``) before use — dims non-negative integers
below 2^32, offsets 32-bit integers, scales numbers — then quantization parameters are checked for
meaning: finite scales, positive for a defined fixed-point encoding, a per-channel axis inside the
tensor's rank with one scale per channel. Any failure is a one-line ``InputError`` naming the file, the
tensor and the field.
"""

from __future__ import annotations

import heapq
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError
from ivq_debug.jsonio import load_json
from ivq_debug.schema import check_schema

# ----------------------------------------------------------------------------- enums
#: Qnn_DataType_t code → (name, numpy dtype name or None, bitwidth)
DATA_TYPES: dict[int, tuple[str, str | None, int]] = {
    0x0008: ("INT_8", "int8", 8),
    0x0016: ("INT_16", "int16", 16),
    0x0032: ("INT_32", "int32", 32),
    0x0064: ("INT_64", "int64", 64),
    0x0108: ("UINT_8", "uint8", 8),
    0x0116: ("UINT_16", "uint16", 16),
    0x0132: ("UINT_32", "uint32", 32),
    0x0164: ("UINT_64", "uint64", 64),
    0x0216: ("FLOAT_16", "float16", 16),
    0x0232: ("FLOAT_32", "float32", 32),
    0x0264: ("FLOAT_64", "float64", 64),
    0x0304: ("SFIXED_POINT_4", "int8", 4),
    0x0308: ("SFIXED_POINT_8", "int8", 8),
    0x0316: ("SFIXED_POINT_16", "int16", 16),
    0x0332: ("SFIXED_POINT_32", "int32", 32),
    0x0404: ("UFIXED_POINT_4", "uint8", 4),
    0x0408: ("UFIXED_POINT_8", "uint8", 8),
    0x0416: ("UFIXED_POINT_16", "uint16", 16),
    0x0432: ("UFIXED_POINT_32", "uint32", 32),
    0x0508: ("BOOL_8", "bool", 8),
    0x0608: ("STRING", None, 8),
}
_DT_BY_NAME = {v[0]: k for k, v in DATA_TYPES.items()}

#: Qnn_TensorType_t
TENSOR_TYPES = {0: "APP_WRITE", 1: "APP_READ", 2: "APP_READWRITE", 3: "NATIVE", 4: "STATIC", 5: "NULL"}
_TT_BY_NAME = {v: k for k, v in TENSOR_TYPES.items()}

#: Qnn_QuantizationEncoding_t
QUANT_ENCODINGS = {
    0: "SCALE_OFFSET",
    1: "AXIS_SCALE_OFFSET",
    2: "BW_SCALE_OFFSET",
    3: "BW_AXIS_SCALE_OFFSET",
    4: "BLOCK",
    5: "BLOCKWISE_EXPANSION",
    6: "VECTOR",
    0x7FFFFFFF: "UNDEFINED",
}
_QE_BY_NAME = {v: k for k, v in QUANT_ENCODINGS.items()}

#: Qnn_Definition_t
DEFINITIONS = {0: "IMPL_GENERATED", 1: "DEFINED", 0x7FFFFFFF: "UNDEFINED"}
_DEF_BY_NAME = {v: k for k, v in DEFINITIONS.items()}


def _enum(value: Any, by_name: dict[str, int], prefix: str) -> int | None:
    """An enum code from an int, a decimal / hex string or a ``QNN_…`` name."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        s = value.strip()
        try:
            return int(s, 0)
        except ValueError:
            pass
        key = s.upper()
        for p in (prefix, "QNN_"):
            if key.startswith(p):
                key = key[len(p):]
        return by_name.get(key)
    return None


def data_type_code(value: Any) -> int | None:
    """Qnn_DataType_t code from an int (562), a string (``"0x0232"``, ``"QNN_DATATYPE_FLOAT_32"``)."""
    return _enum(value, _DT_BY_NAME, "QNN_DATATYPE_")


def numpy_dtype(code: int) -> np.dtype:
    """The numpy dtype QNN stores a tensor of this data type in (4-bit types: one value per byte;
    ``STRING``: ``object``, which no raw file can be read as)."""
    info = DATA_TYPES.get(code)
    if info is None:
        raise ValueError(f"QNN data type {code:#06x} has no numpy dtype")
    return np.dtype(info[1] or object)


def is_fixed_point(code: int) -> bool:
    """True for SFIXED_POINT_* / UFIXED_POINT_* data types."""
    return (code >> 8) in (3, 4)


# ----------------------------------------------------------------------------- dataclasses
@dataclass(frozen=True)
class QnnQuant:
    """A QNN tensor's quantization, in QNN's convention (``float = (q + offset) * scale``).

    Attributes:
        encoding: ``SCALE_OFFSET``, ``AXIS_SCALE_OFFSET``, ``BW_SCALE_OFFSET``, … (see
            :data:`QUANT_ENCODINGS`).
        scale: float64 array, one value per tensor or per channel (empty when unavailable).
        offset: int64 array, same length (QNN offsets are usually ≤ 0).
        axis: per-channel axis (in the tensor's QNN layout), or ``None``.
        bitwidth: explicit bitwidth (BW_* encodings), else ``None`` (use the data type's).
        num_channels: number of per-channel entries announced by the file.
        per_channel_missing: the file announces per-channel parameters but does not hold them
            (ORT's dump); such a tensor cannot be dequantized from this file.
    """

    encoding: str
    scale: np.ndarray
    offset: np.ndarray
    axis: int | None = None
    bitwidth: int | None = None
    num_channels: int | None = None
    per_channel_missing: bool = False

    @property
    def zero_point(self) -> np.ndarray:
        """ONNX zero point(s): ``-offset``."""
        return -self.offset

    @property
    def per_channel(self) -> bool:
        """True for axis encodings."""
        return self.axis is not None

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """float32 values as qnn-net-run writes them: ``float32((q + offset) * scale)`` per element.

        ``q`` must be in the tensor's QNN layout (the per-channel axis refers to it).
        """
        if self.per_channel_missing or self.scale.size == 0:
            raise ValueError("quantization parameters are not available")
        scale = self.scale.astype(np.float32).astype(np.float64)  # QNN scales are float32
        offset = self.offset.astype(np.float64)
        if self.axis is not None and scale.size > 1:
            shape = [1] * q.ndim
            shape[self.axis] = scale.size
            scale, offset = scale.reshape(shape), offset.reshape(shape)
        else:
            scale, offset = scale.reshape(()), offset.reshape(())
        return ((q.astype(np.float64) + offset) * scale).astype(np.float32)


@dataclass(frozen=True)
class QnnTensor:
    """One tensor of a QNN graph.

    Attributes:
        name: QNN name (sanitized for converter graphs; ORT graphs keep ONNX names).
        graph: the graph it belongs to.
        type: ``APP_WRITE`` (graph input), ``APP_READ`` (graph output), ``NATIVE``, ``STATIC``, …
        data_type: Qnn_DataType_t code (e.g. 1032 = UFIXED_POINT_8).
        dims: dims in QNN layout (what raw files hold).
        quant: quantization, or ``None`` for non-quantized tensors.
        permute_order_to_src: ``np.transpose`` order from the QNN layout back to the source layout.
        axis_format, src_axis_format: layout names when the file gives them (``NHWC``, ``NCHW``, …).
        id: the tensor id, when given.
    """

    name: str
    graph: str
    type: str
    data_type: int
    dims: tuple[int, ...]
    quant: QnnQuant | None = None
    permute_order_to_src: tuple[int, ...] | None = None
    axis_format: str | None = None
    src_axis_format: str | None = None
    id: int | None = None

    @property
    def dtype(self) -> np.dtype:
        """numpy dtype of the native data."""
        return numpy_dtype(self.data_type)

    @property
    def data_type_name(self) -> str:
        """``UFIXED_POINT_8``, ``FLOAT_32``, …"""
        return DATA_TYPES.get(self.data_type, (f"{self.data_type:#06x}", None, 0))[0]

    @property
    def bitwidth(self) -> int:
        """Bits per value (the quant's explicit bitwidth for BW_* encodings)."""
        if self.quant is not None and self.quant.bitwidth:
            return self.quant.bitwidth
        return DATA_TYPES.get(self.data_type, ("", None, 0))[2]

    @property
    def is_quantized(self) -> bool:
        """True for fixed-point tensors with a defined encoding."""
        return self.quant is not None and is_fixed_point(self.data_type)

    @property
    def is_float(self) -> bool:
        """True for FLOAT_16/32/64 tensors."""
        return (self.data_type >> 8) == 2

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1

    @property
    def src_shape(self) -> tuple[int, ...]:
        """Shape in the source framework's layout (after ``permute_order_to_src``)."""
        if self.permute_order_to_src:
            return tuple(self.dims[i] for i in self.permute_order_to_src)
        return self.dims

    @property
    def src_layout(self) -> str | None:
        """Source layout name when known (e.g. ``NCHW``)."""
        fmt = self.src_axis_format
        return None if not fmt or fmt == "NOT_YET_DEFINED" else fmt

    def to_source(self, arr: np.ndarray) -> np.ndarray:
        """Reshape flat data to ``dims`` and transpose it back to the source layout."""
        a = np.asarray(arr).reshape(self.dims)
        if self.permute_order_to_src:
            a = np.ascontiguousarray(np.transpose(a, self.permute_order_to_src))
        return a

    def from_source(self, arr: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`to_source`: transpose source-layout data into the QNN layout."""
        a = np.asarray(arr)
        if self.permute_order_to_src:
            a = np.transpose(a, np.argsort(self.permute_order_to_src))
        if tuple(a.shape) != self.dims:
            raise ValueError(f"shape {tuple(a.shape)} does not match QNN dims {list(self.dims)}")
        return np.ascontiguousarray(a)


@dataclass(frozen=True)
class QnnNode:
    """One op of a QNN graph (net JSON only)."""

    name: str
    type: str
    package: str | None
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


@dataclass
class QnnGraph:
    """A QNN graph's tensors (and ops, for net JSON) read from one file."""

    name: str
    tensors: dict[str, QnnTensor]
    nodes: dict[str, QnnNode] = field(default_factory=dict)
    source: str | None = None
    kind: str = "net_json"  # or "context_json"
    op_types: tuple[str, ...] = ()

    @property
    def inputs(self) -> list[QnnTensor]:
        """Graph inputs (APP_WRITE / APP_READWRITE), in file order."""
        return [t for t in self.tensors.values() if t.type in ("APP_WRITE", "APP_READWRITE")]

    @property
    def outputs(self) -> list[QnnTensor]:
        """Graph outputs (APP_READ), in file order."""
        return [t for t in self.tensors.values() if t.type == "APP_READ"]

    def producers(self) -> dict[str, QnnNode]:
        """tensor name → the op that writes it."""
        return {o: n for n in self.nodes.values() for o in n.output_names}

    def topo_nodes(self) -> list[QnnNode]:
        """Ops in a topological order (file order breaks ties; ORT's dump sorts ops by name)."""
        nodes = list(self.nodes.values())
        prod = {o: i for i, n in enumerate(nodes) for o in n.output_names}
        deps = [{prod[x] for x in n.input_names if x in prod and prod[x] != i} for i, n in enumerate(nodes)]
        users: dict[int, list[int]] = {}
        for i, d in enumerate(deps):
            for j in d:
                users.setdefault(j, []).append(i)
        remaining = [len(d) for d in deps]
        ready = [i for i, r in enumerate(remaining) if r == 0]
        heapq.heapify(ready)
        out: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            out.append(i)
            for u in users.get(i, ()):
                remaining[u] -= 1
                if remaining[u] == 0:
                    heapq.heappush(ready, u)
        done = set(out)
        out += [i for i in range(len(nodes)) if i not in done]  # cycles: keep file order
        return [nodes[i] for i in out]

    def order(self) -> dict[str, int]:
        """tensor name → topological position of its producer (graph inputs: -1)."""
        out = {t.name: -1 for t in self.inputs}
        for i, n in enumerate(self.topo_nodes()):
            for o in n.output_names:
                out.setdefault(o, i)
        return out

    def __iter__(self) -> Iterator[QnnTensor]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)


# ----------------------------------------------------------------------------- schemas
_ENUM = {"type": ["integer", "string"]}
_DIMS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 0xFFFFFFFF}}
_OFFSET = {"type": "integer", "minimum": -(1 << 31), "maximum": (1 << 31) - 1}
_BW = {"type": ["integer", "null"], "minimum": 0, "maximum": 64}
_SCALE_OFFSET = {"type": "object", "properties": {"scale": {"type": "number"}, "offset": _OFFSET,
                                                  "bitwidth": _BW, "bitWidth": _BW}}
_AXIS_SCALE_OFFSET = {
    "type": "object",
    "properties": {
        "axis": {"type": "integer"}, "num_scale_offsets": {"type": "integer", "minimum": 0},
        "scale_offsets": {"type": "array", "items": _SCALE_OFFSET},
        "scaleOffset": {"type": "array", "items": _SCALE_OFFSET},
        "scaleOffsets": {"type": "array", "items": _SCALE_OFFSET},
        "scales": {"type": "array", "items": {"type": "number"}}, "offsets": {"type": "array", "items": _OFFSET},
        "bitwidth": _BW, "bitWidth": _BW,
    },
}
_QUANT = {
    "type": ["object", "null"],
    "properties": {
        **{k: _ENUM for k in ("definition", "encodingDefinition", "encoding", "quantizationEncoding",
                              "encodingType")},
        **{k: _SCALE_OFFSET for k in ("scale_offset", "scaleOffset", "scaleOffsetEncoding", "bw_scale_offset",
                                      "bwScaleOffsetEncoding")},
        **{k: _AXIS_SCALE_OFFSET for k in ("axis_scale_offset", "axisScaleOffset", "axisScaleOffsetEncoding",
                                           "bw_axis_scale_offset", "bwAxisScaleOffsetEncoding")},
    },
}
#: JSON Schema of one tensor object (converter net JSON, ORT dump, context-binary JSON; both spellings)
TENSOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "id": {"type": ["integer", "null"]}, "type": _ENUM,
        "data_type": _ENUM, "dataType": _ENUM,
        "dims": _DIMS, "dimensions": _DIMS, "current_dims": _DIMS, "currentDimensions": _DIMS,
        "permute_order_to_src": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
        "axis_format": {"type": ["string", "null"]}, "src_axis_format": {"type": ["string", "null"]},
        "quant_params": _QUANT, "quantizeParams": _QUANT,
    },
}
#: JSON Schema of one op object of a converter net JSON / ORT dump
NODE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string"}, "package": {"type": ["string", "null"]},
        "input_names": {"type": "array", "items": {"type": "string"}},
        "output_names": {"type": "array", "items": {"type": "string"}},
    },
}


# ----------------------------------------------------------------------------- reading helpers
def _load_json(path: str | os.PathLike) -> Any:
    return load_json(path, "graph JSON")


def _f32_bits_to_int(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def _first(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def _quant(qp: Any, data_type: int, where: str, path: Path) -> QnnQuant | None:
    """Parse a ``quant_params`` / ``quantizeParams`` object (both spellings) and check its values."""
    q = _parse_quant(qp, data_type, where, path)
    if q is None or q.per_channel_missing:
        return q
    if not np.all(np.isfinite(q.scale)):
        raise InputError(f"tensor {where!r}: quantization scale {q.scale[~np.isfinite(q.scale)][0]} is not finite",
                         path)
    if is_fixed_point(data_type) and np.any(q.scale <= 0):
        raise InputError(f"tensor {where!r}: quantization scale {q.scale[q.scale <= 0][0]} is not positive", path)
    return q


def _parse_quant(qp: Any, data_type: int, where: str, path: Path) -> QnnQuant | None:
    if not isinstance(qp, dict):
        return None
    definition = _enum(_first(qp, "definition", "encodingDefinition"), _DEF_BY_NAME, "QNN_DEFINITION_")
    enc_code = _enum(
        _first(qp, "encoding", "quantizationEncoding", "encodingType"), _QE_BY_NAME, "QNN_QUANTIZATION_ENCODING_"
    )
    if definition == 0x7FFFFFFF or enc_code == 0x7FFFFFFF:
        return None
    if not is_fixed_point(data_type) and enc_code is None and definition is None:
        return None
    so = _first(qp, "scale_offset", "scaleOffset", "scaleOffsetEncoding", "bw_scale_offset", "bwScaleOffsetEncoding")
    aso = _first(qp, "axis_scale_offset", "axisScaleOffset", "axisScaleOffsetEncoding",
                 "bw_axis_scale_offset", "bwAxisScaleOffsetEncoding")
    if enc_code is None:
        enc_code = 1 if aso is not None else 0
    enc = QUANT_ENCODINGS.get(enc_code, str(enc_code))
    try:
        if enc in ("AXIS_SCALE_OFFSET", "BW_AXIS_SCALE_OFFSET"):
            if isinstance(aso, dict):
                entries = _first(aso, "scale_offsets", "scaleOffset", "scaleOffsets", "scales") or []
                axis = int(_first(aso, "axis") or 0)
                bw = _first(aso, "bitwidth", "bitWidth")
                if entries and isinstance(entries[0], dict):
                    scale = np.array([float(e["scale"]) for e in entries], dtype=np.float64)
                    offset = np.array([int(e.get("offset", 0)) for e in entries], dtype=np.int64)
                else:  # BW_AXIS: parallel arrays
                    scale = np.asarray(entries, dtype=np.float64)
                    offs = _first(aso, "offsets") or [0] * len(scale)
                    offset = np.asarray(offs, dtype=np.int64)
                return QnnQuant(enc, scale, offset, axis, int(bw) if bw else None, len(scale))
            if isinstance(so, dict):  # ORT's dump: the union read as scale_offset
                axis = _f32_bits_to_int(so.get("scale", 0.0))
                n = int(so.get("offset", 0))
                return QnnQuant(enc, np.zeros(0), np.zeros(0, dtype=np.int64), axis, None, n, True)
            return QnnQuant(enc, np.zeros(0), np.zeros(0, dtype=np.int64), None, None, None, True)
        if isinstance(so, dict):
            scale = np.array([float(so.get("scale", 0.0))], dtype=np.float64)
            offset = np.array([int(so.get("offset", 0))], dtype=np.int64)
            bw = _first(so, "bitwidth", "bitWidth")
            return QnnQuant(enc, scale, offset, None, int(bw) if bw else None)
    except (TypeError, ValueError, KeyError) as e:
        raise InputError(f"tensor {where!r}: bad quantization parameters ({e})", path) from None
    if is_fixed_point(data_type):
        return QnnQuant(enc, np.zeros(0), np.zeros(0, dtype=np.int64), None, None, None, True)
    return None


def _tensor(name: str, t: Any, graph: str, path: Path, default_type: str | None = None) -> QnnTensor:
    if not isinstance(t, dict):
        raise InputError(f"tensor {name!r} is not an object", path)
    check_schema(t, TENSOR_SCHEMA, path, f"tensor {name!r}")
    code = data_type_code(_first(t, "data_type", "dataType"))
    if code is None or code not in DATA_TYPES:
        raise InputError(f"tensor {name!r}: missing or unknown data_type {t.get('data_type', t.get('dataType'))!r}", path)
    dims = _first(t, "dims", "dimensions", "current_dims", "currentDimensions")
    if dims is None or not isinstance(dims, list) or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise InputError(f"tensor {name!r}: missing or bad dims {dims!r}", path)
    tt = _enum(t.get("type"), _TT_BY_NAME, "QNN_TENSOR_TYPE_")
    ttype = TENSOR_TYPES.get(tt, default_type or "NATIVE") if tt is not None else (default_type or "NATIVE")
    perm = t.get("permute_order_to_src")
    if perm is not None:
        if not (isinstance(perm, list) and sorted(perm) == list(range(len(dims)))):
            raise InputError(f"tensor {name!r}: permute_order_to_src {perm!r} is not a permutation of its rank", path)
        perm = tuple(int(p) for p in perm)
        if perm == tuple(range(len(dims))):
            perm = None
    q = _quant(_first(t, "quant_params", "quantizeParams"), code, name, path)
    if q is not None and q.axis is not None and not q.per_channel_missing:
        if not 0 <= q.axis < len(dims):
            raise InputError(f"tensor {name!r}: per-channel axis {q.axis} outside its rank {len(dims)}", path)
        if q.scale.size not in (1, dims[q.axis]):
            raise InputError(f"tensor {name!r}: {q.scale.size} per-channel scales for an axis of size "
                             f"{dims[q.axis]}", path)
    tid = t.get("id")
    return QnnTensor(
        name=name,
        graph=graph,
        type=ttype,
        data_type=code,
        dims=tuple(int(d) for d in dims),
        quant=q,
        permute_order_to_src=perm,
        axis_format=t.get("axis_format"),
        src_axis_format=t.get("src_axis_format"),
        id=int(tid) if isinstance(tid, int) else None,
    )


# ----------------------------------------------------------------------------- public readers
def read_net_json(path: str | os.PathLike, graph_name: str | None = None) -> QnnGraph:
    """Read a converter ``<model>_net.json`` or an ORT ``dump_json_qnn_graph`` file.

    Args:
        path: the JSON file.
        graph_name: name to give the graph (default: the file stem without ``_net``).

    Raises:
        InputError: missing file, bad JSON, no ``graph.tensors`` object, malformed tensors.
    """
    p = Path(path)
    d = _load_json(p)
    g = d.get("graph") if isinstance(d, dict) else None
    if not isinstance(g, dict) or not isinstance(g.get("tensors"), dict):
        raise InputError("not a QNN net JSON (no graph.tensors object)", p)
    name = graph_name or (p.stem[: -len("_net")] if p.stem.endswith("_net") else p.stem)
    tensors = {n: _tensor(n, t, name, p) for n, t in g["tensors"].items()}
    nodes: dict[str, QnnNode] = {}
    raw_nodes = g.get("nodes") or {}
    if not isinstance(raw_nodes, dict):
        raise InputError(f"graph.nodes must be an object keyed by op name, got {type(raw_nodes).__name__}", p)
    for n, nd in raw_nodes.items():
        if not isinstance(nd, dict):
            raise InputError(f"node {n!r} is not an object", p)
        check_schema(nd, NODE_SCHEMA, p, f"node {n!r}")
        nodes[n] = QnnNode(
            name=n,
            type=str(nd.get("type", "")),
            package=nd.get("package"),
            input_names=tuple(nd.get("input_names") or ()),
            output_names=tuple(nd.get("output_names") or ()),
        )
    ops = d.get("op_types") or ()
    return QnnGraph(name, tensors, nodes, str(p), "net_json", tuple(ops) if isinstance(ops, list) else ())


def read_context_json(path: str | os.PathLike) -> list[QnnGraph]:
    """Read ``qnn-context-binary-utility`` JSON (``info``-wrapped or plain): one graph per context graph.

    Only graph inputs (APP_WRITE) and outputs (APP_READ) are described by this file.
    """
    p = Path(path)
    d = _load_json(p)
    root = d.get("info", d) if isinstance(d, dict) else None
    graphs = root.get("graphs") if isinstance(root, dict) else None
    if not isinstance(graphs, list) or not graphs:
        raise InputError("not a QNN context-binary JSON (no graphs list)", p)
    out: list[QnnGraph] = []
    for gi, g in enumerate(graphs):
        g = g.get("info", g) if isinstance(g, dict) else None
        if not isinstance(g, dict):
            raise InputError(f"graph #{gi} is not an object", p)
        gname = str(_first(g, "graphName", "graph_name", "name") or f"Graph_{gi}")
        tensors: dict[str, QnnTensor] = {}
        for key, ttype in (("graphInputs", "APP_WRITE"), ("graphOutputs", "APP_READ")):
            for ti, t in enumerate(g.get(key) or []):
                t = t.get("info", t) if isinstance(t, dict) else t
                if not isinstance(t, dict):
                    raise InputError(f"graph {gname!r}: {key}[{ti}] is not an object", p)
                tname = str(t.get("name") or f"Output_{ti}")
                tensors[tname] = _tensor(tname, t, gname, p, default_type=ttype)
        out.append(QnnGraph(gname, tensors, {}, str(p), "context_json"))
    return out


def read_qnn_json(path: str | os.PathLike) -> list[QnnGraph]:
    """Read any of the supported graph JSON files (net JSON, ORT dump, context JSON)."""
    p = Path(path)
    d = _load_json(p)
    if isinstance(d, dict) and isinstance(d.get("graph"), dict):
        return [read_net_json(p)]
    return read_context_json(p)
