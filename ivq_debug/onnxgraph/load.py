"""The one ONNX loader: a ``ModelProto`` from a path, bytes or a proto, weights left on disk when they can stay.

Every module that needs an ONNX graph calls :func:`load_model`. External data stays external (never loaded);
files of :data:`IN_PLACE_MIN_BYTES` or more are opened with :func:`load_in_place`, which references each large
embedded weight at its byte range in the original file instead of copying it into Python. Small initializers
and anything a shape-computing input reads (``Reshape`` shapes, ``Expand`` / ``Slice`` / ``Tile`` arguments,
...) stay inline: ONNX Runtime's load-time shape inference cannot read external data, so a 3-element int64
shape tensor turned external made ``Reshape`` fail to load (measured on an 86 MB single-file ViT).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from ivq_debug.errors import InputError
from ivq_debug.util import regular_file

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
            return load_in_place(p)
        return onnx.load(str(p), load_external_data=False)
    except InputError:
        raise
    except Exception as e:  # onnx raises DecodeError / google.protobuf errors / OSError
        raise InputError(f"not a readable ONNX model ({type(e).__name__})", where) from None


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
