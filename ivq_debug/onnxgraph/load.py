"""The one ONNX loader: a ``ModelProto`` from a path, bytes or a proto, weights left on disk when they can stay, and
the :class:`Model` object that carries a loaded proto with its folder and the facts derived from it.

Every module that needs an ONNX graph calls :func:`load_model` (a proto) or :func:`load` (a :class:`Model`: a
command that reads one model file for several stages parses it once and hands the object on; runners take it in
place of a path, :func:`ivq_debug.capture.base.make_runner`). External data stays external (never loaded);
files of :data:`IN_PLACE_MIN_BYTES` or more are opened with :func:`load_in_place`, which references each large
embedded weight at its byte range in the original file instead of copying it into Python. Small initializers
and anything a shape-computing input reads (``Reshape`` shapes, ``Expand`` / ``Slice`` / ``Tile`` arguments,
...) stay inline: ONNX Runtime's load-time shape inference cannot read external data, so a 3-element int64
shape tensor turned external made ``Reshape`` fail to load (measured on an 86 MB single-file ViT).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError
from ivq_debug.inputfiles import regular_file, sha256_file_once
from ivq_debug.onnxgraph.fold import constant_nodes
from ivq_debug.onnxgraph.sites import activation_quantizers, constant_arrays, float_name

#: models larger than this are opened with their weights referenced in place (see :func:`load_in_place`)
IN_PLACE_MIN_BYTES = 64 << 20
#: initializers up to this size stay inline when a model is loaded in place (shape tensors, scales, biases)
INLINE_MAX_BYTES = 4 << 10
#: ``op_type -> input indices`` that ONNX shape inference reads as values: such initializers stay inline
SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Slice": (1, 2, 3, 4),
    "Pad": (1, 2, 3), "Resize": (1, 2, 3), "Upsample": (1,), "Squeeze": (1,), "Unsqueeze": (1,),
    "Split": (1,), "TopK": (1,), "Range": (0, 1, 2), "OneHot": (1,), "ReduceSum": (1,), "ReduceMean": (1,),
    "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,), "ReduceL2": (1,), "CenterCropPad": (1,),
    "Trilu": (1,), "CumSum": (1,),
}


def has_external_data(model: Any) -> bool:
    """True when any initializer of ``model`` is stored as external data (weights referenced in place count)."""
    from onnx.external_data_helper import uses_external_data

    return any(uses_external_data(t) for t in model.graph.initializer)


def external_files(proto: Any, base: str | os.PathLike) -> list[Path]:
    """The external-data files an ONNX graph references (resolved against ``base``, its folder), sorted."""
    locs = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    return sorted(Path(base) / loc for loc in locs)


def model_digest(model: bytes | str | os.PathLike, proto: Any = None) -> dict[str, Any]:
    """What identifies the graph handed to ORT: the SHA-256 of its bytes and of its external-data files."""
    if isinstance(model, bytes | bytearray | memoryview):
        return {"sha256": hashlib.sha256(model).hexdigest(), "bytes": len(model), "external": {}}
    p = Path(model)
    ext = {f.name: sha256_file_once(f) for f in external_files(proto, p.parent)} if proto is not None else {}
    return {"sha256": sha256_file_once(p), "bytes": p.stat().st_size, "external": ext}


def model_file_bytes(path: str | os.PathLike) -> int:
    """Bytes on disk of the model at ``path``: the file and every external data file it names (each once)."""
    from onnx.external_data_helper import uses_external_data

    path = Path(path)
    files = {path.resolve()}
    for t in load_model(path).graph.initializer:
        if uses_external_data(t):
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc:
                files.add((path.parent / loc).resolve())
    return sum(f.stat().st_size for f in files if f.is_file())


def load_model(
    model: Any,
    *,
    in_place: bool | None = None,
    path_for_errors: str | os.PathLike | None = None,
) -> Any:
    """An ``onnx.ModelProto`` from a path, serialized bytes or a proto (returned as is).

    External data is never loaded; tensor values are read with ``numpy_helper.to_array(t, <model folder>)``.
    With ``in_place`` (default: files of :data:`IN_PLACE_MIN_BYTES` or more), large embedded weights are
    referenced in place (:func:`load_in_place`) instead of parsed into memory.

    Raises:
        InputError: the file is missing, is not a regular file (a FIFO, socket or device is refused with
            ``stat`` before protobuf reads it, so it never blocks), or is not a readable ONNX model (exit 3).
    """
    if isinstance(model, Model):
        return model.proto
    if hasattr(model, "graph"):
        return model
    import onnx

    if isinstance(model, bytes | bytearray | memoryview):
        try:
            return onnx.load_from_string(bytes(model))
        except Exception as e:
            raise InputError(f"not a readable ONNX model ({type(e).__name__})", path_for_errors) from None
    p = Path(model)
    where = path_for_errors or p
    try:
        regular_file(p, "ONNX model")
    except InputError as e:
        raise InputError(e.message, where) from None
    try:
        if in_place or (in_place is None and p.stat().st_size >= IN_PLACE_MIN_BYTES):
            proto = load_in_place(p)
        else:
            proto = onnx.load(str(p), load_external_data=False)
        if not proto.HasField("graph"):  # an empty file parses as an empty ModelProto
            raise InputError("not an ONNX model (no graph: an empty or foreign file)", where)
        return proto
    except InputError:
        raise
    except Exception as e:  # onnx raises DecodeError / google.protobuf errors / OSError
        raise InputError(f"not a readable ONNX model ({type(e).__name__})", where) from None


# --------------------------------------------------------------------------------- the model object
class Model:
    """An ONNX model in memory: the ``ModelProto``, the folder its external data is read from, the file it was
    read from, and facts derived from it on first use (cached: a model read once serves every stage).

    Attributes:
        proto: the ``onnx.ModelProto`` (external data not loaded; see :func:`load_model`).
        path: the file ``proto`` was read from; ``None`` for a model built in memory (:meth:`derive`).
        folder: where its external data lives (the file's folder; a derived model keeps its source's): ONNX
            Runtime reads external data only from inside that folder.
        origin: the file to name in messages about this model (its own file, or its source's).

    Derived facts: :attr:`constants`, :attr:`quantizers`, :attr:`value_shapes`, :meth:`arrays`; a stage caches its
    own with :meth:`fact` (e.g. the replay's units). The facts assume the proto is not changed after loading;
    change a copy (:meth:`derive`).
    """

    def __init__(self, proto: Any, *, path: str | os.PathLike | None = None, folder: str | os.PathLike | None = None,
                 origin: str | os.PathLike | None = None) -> None:
        self.proto = proto
        self.path = Path(path) if path is not None else None
        self.folder = Path(folder) if folder is not None else self.path.parent if self.path is not None else None
        self.origin = Path(origin) if origin is not None else self.path
        self._facts: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Model({str(self.path or self.origin or '<in memory>')!r}, {len(self.proto.graph.node)} nodes)"

    @property
    def base_dir(self) -> str:
        """The external-data folder as ``numpy_helper.to_array`` takes it (``""``: the working directory)."""
        return str(self.folder) if self.folder is not None else ""

    def fact(self, key: str, compute: Callable[[Model], Any]) -> Any:
        """A derived fact, computed by ``compute(self)`` on first use and cached under ``key``."""
        if key not in self._facts:
            self._facts[key] = compute(self)
        return self._facts[key]

    @property
    def constants(self) -> tuple[set[str], list[Any]]:
        """Values computed from initializers only (weights, their DequantizeLinear, shape constants), and the
        nodes that compute them, in graph order (:func:`~ivq_debug.onnxgraph.fold.constant_nodes`)."""
        def compute(m: Model) -> tuple[set[str], list[Any]]:
            nodes = list(m.proto.graph.node)
            idx, const = constant_nodes(nodes, {i.name for i in m.proto.graph.initializer})
            return const, [nodes[i] for i in sorted(idx)]

        return self.fact("constants", compute)

    @property
    def quantizers(self) -> list[tuple[str, Any]]:
        """``(float name, QuantizeLinear node)`` of every activation quantizer
        (:func:`~ivq_debug.onnxgraph.sites.activation_quantizers`)."""
        return self.fact("quantizers", lambda m: list(activation_quantizers(m.proto, m.constants[0])))

    @property
    def value_shapes(self) -> dict[str, tuple[int, ...]]:
        """Static shapes the model's ``value_info`` / inputs / outputs record, by float name."""
        def compute(m: Model) -> dict[str, tuple[int, ...]]:
            out: dict[str, tuple[int, ...]] = {}
            g = m.proto.graph
            for vi in [*g.input, *g.value_info, *g.output]:
                t = vi.type.tensor_type
                if t.HasField("shape"):
                    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
                    if dims and all(d > 0 for d in dims):
                        out.setdefault(float_name(vi.name), tuple(dims))
            return out

        return self.fact("value_shapes", compute)

    def arrays(self, names: set[str] | None = None) -> dict[str, np.ndarray]:
        """Values of initializers and ``Constant`` nodes (:func:`~ivq_debug.onnxgraph.sites.constant_arrays`),
        external data read from :attr:`folder`."""
        return constant_arrays(self.proto, names, self.base_dir)

    def derive(self, proto: Any) -> Model:
        """A model built from this one (a replay batch, a lifted variant): in memory, same folder and origin."""
        return Model(proto, folder=self.folder, origin=self.origin)


def load(model: Any, *, in_place: bool | None = None) -> Model:
    """A :class:`Model` from a path, serialized bytes, a proto or a :class:`Model` (returned as is); the file is
    parsed once (:func:`load_model`, whose errors it raises)."""
    if isinstance(model, Model):
        return model
    if hasattr(model, "graph"):
        return Model(model)
    if isinstance(model, bytes | bytearray | memoryview):
        return Model(load_model(model))
    return Model(load_model(model, in_place=in_place), path=model)


# --------------------------------------------------------------------------------- weights in place
def _varint(buf: Any, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: Any, start: int, end: int):
    """Protobuf wire-format fields of ``buf[start:end]``: (field, start, end, value start, value end)."""
    pos = start
    while pos < end:
        fstart = pos
        tag, pos = _varint(buf, pos)
        f, wt = tag >> 3, tag & 7
        vs = ve = pos
        if wt == 0:
            _, pos = _varint(buf, pos)
        elif wt == 1:
            pos += 8
        elif wt == 5:
            pos += 4
        elif wt == 2:
            ln, vs = _varint(buf, pos)
            ve = pos = vs + ln
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        if pos > end:
            raise ValueError("truncated protobuf field")
        yield f, fstart, pos, vs, ve


def shape_input_names(graph: Any) -> set[str]:
    """Names read as *values* by shape inference (the :data:`SHAPE_INPUTS` of every node)."""
    out: set[str] = set()
    for n in graph.node:
        for i in SHAPE_INPUTS.get(n.op_type, ()):
            if i < len(n.input) and n.input[i]:
                out.add(n.input[i])
    return out


def load_in_place(path: str | os.PathLike, inline_max_bytes: int = INLINE_MAX_BYTES) -> Any:
    """An ONNX ModelProto whose large initializer payloads stay in ``path``: each initializer with ``raw_data``
    over ``inline_max_bytes`` (and not read by shape inference, :func:`shape_input_names`) is turned into
    external data pointing at its byte range in the original file.

    The file is walked in protobuf wire format (ModelProto.graph = 7, GraphProto.initializer = 5,
    TensorProto.raw_data = 9); only the graph structure is parsed, so weights are never copied into Python,
    and a model derived from it (extra graph outputs) saved *in the same folder* lets ONNX Runtime read the
    weights from the original file. Initializer values are read with ``numpy_helper.to_array(t, base_dir)``.
    """
    import onnx

    p = Path(path)
    with open(p, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        top, graph = [], (0, 0)
        for f, s, e, vs, ve in _fields(buf, 0, len(buf)):
            if f == 7:
                graph = (vs, ve)
            else:
                top.append(buf[s:e])
        gparts, init_ranges = [], []
        for f, s, e, vs, ve in _fields(buf, *graph):
            if f == 5:
                init_ranges.append((vs, ve))
            else:
                gparts.append(buf[s:e])
        m = onnx.ModelProto()
        m.ParseFromString(b"".join(top))
        m.graph.ParseFromString(b"".join(gparts))
        keep_inline = shape_input_names(m.graph)
        inits = []
        for vs, ve in init_ranges:
            parts, raw = [], None
            for tf, ts, te, tvs, tve in _fields(buf, vs, ve):
                if tf == 9:
                    raw = (tvs, tve)
                else:
                    parts.append(buf[ts:te])
            t = onnx.TensorProto()
            if raw is None or raw[1] - raw[0] <= inline_max_bytes:
                t.ParseFromString(buf[vs:ve])
            else:
                t.ParseFromString(b"".join(parts))
                if t.name in keep_inline:
                    t.raw_data = buf[raw[0]:raw[1]]
                else:
                    t.data_location = onnx.TensorProto.EXTERNAL
                    for k, v in (("location", p.name), ("offset", str(raw[0])), ("length", str(raw[1] - raw[0]))):
                        entry = t.external_data.add()
                        entry.key, entry.value = k, v
            inits.append(t)
        m.graph.initializer.extend(inits)
        return m
    finally:
        buf.close()
