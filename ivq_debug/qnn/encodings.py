"""Quantization overrides and encodings: QNN legacy, QNN/AIMET ``1.0.0``, AIMET 2.x and ORT overrides.

One dataclass, :class:`Encoding`, holds an encoding in the **ONNX convention** (``zero_point``, with
the storage signedness in ``signed``); QNN offsets are derived (``offset = -zero_point`` for unsigned
storage). The formats (see ``docs/qnn-formats.md``):

``legacy`` (AIMET 0.6.x, what ``--quantization_overrides`` reads when there is no ``"version": "1.0.0"``)
    ``{"activation_encodings": {name: [entry, …]}, "param_encodings": {…}}``; an entry is
    ``{bitwidth, dtype: "int"|"float", is_symmetric: "True"|"False" (a string), min, max, scale,
    offset (≤ 0)}``; several entries = per-channel.
``1.0.0``
    lists of ``{name, enc_type: PER_TENSOR|PER_CHANNEL, dtype: INT|FLOAT, bw, is_sym, scale: [],
    offset: []}``.
``aimet2`` (read only)
    lists of ``{name, output_dtype, y_scale, y_zero_point, axis}`` (ONNX sign convention).
``ort``
    ONNX Runtime's ``TensorQuantOverrides`` (``init_overrides`` of ``get_qnn_qdq_config``):
    ``{name: [{"quant_type", "scale", "zero_point", "axis", "symmetric", "rmin", "rmax", …}, …]}``.

Every document is first checked against the JSON Schema of its format (:data:`SCHEMAS`, Draft 2020-12,
validated with ``jsonschema``; documented in ``docs/input-formats.md``): types, required keys, ranges.
Then the QNN rules (one-line :class:`~ivq_debug.errors.InputError` naming the file and the field):
bitwidths (int 4/8/16/32, float 16/32), symmetric offsets (``-2^(bw-1)`` or ``-2^(bw-1)+1``; ``0`` is
rewritten to ``-2^(bw-1)`` as the converter does), per-channel entries must be symmetric, offsets within
``[-(2^bw-1), 0]``, positive finite scales, ``min <= max``, and with an ONNX model: tensor names present
in it, per-channel counts matching a dimension of the initializer.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError, UsageError
from ivq_debug.jsonio import load_json
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.onnxgraph.sites import constant_arrays
from ivq_debug.outputs import atomic_write_text
from ivq_debug.qnn.names import NameMap
from ivq_debug.schema import check_schema as _check_schema

INT_BITWIDTHS = (4, 8, 16, 32)
FLOAT_BITWIDTHS = (16, 32)
FORMATS = ("legacy", "1.0.0", "aimet2", "ort")

#: ORT QuantType name → (bitwidth, signed)
ORT_QUANT_TYPES = {
    "QUInt4": (4, False),
    "QInt4": (4, True),
    "QUInt8": (8, False),
    "QInt8": (8, True),
    "QUInt16": (16, False),
    "QInt16": (16, True),
}
_ORT_BY_BITS = {v: k for k, v in ORT_QUANT_TYPES.items()}
_ORT_KEYS = {"quant_type", "scale", "zero_point", "symmetric", "reduce_range", "rmin", "rmax", "axis", "convert"}


# ============================================================================ schemas
#: a bitwidth: any integer a file may hold is range-checked later; the bound keeps ``1 << (bw - 1)`` cheap
_BITS = {"type": "integer", "minimum": 1, "maximum": 64}
_NUM = {"type": "number"}
_INT = {"type": "integer"}
#: QNN writes ``"True"`` / ``"False"`` strings; JSON booleans and 0 / 1 are read too
_BOOLISH = {"anyOf": [{"type": "boolean"}, {"enum": [0, 1]},
                      {"type": "string", "pattern": "^\\s*([Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee])\\s*$"}],
            "x-message": "must be 'True' or 'False'"}
_NAME = {"type": "string"}

_LEGACY_ENTRY = {
    "type": "object",
    "required": ["bitwidth"],
    "properties": {
        "bitwidth": _BITS,
        "dtype": {"type": "string", "pattern": "^(?i:int|float)$", "x-message": "must be 'int' or 'float'"},
        "is_symmetric": _BOOLISH,
        "scale": _NUM, "offset": _INT, "min": _NUM, "max": _NUM,
    },
}
_LEGACY_SECTION = {"type": "object", "additionalProperties": {
    "type": "array", "minItems": 1, "items": _LEGACY_ENTRY, "x-message": "must be a non-empty list of encodings"}}
_V1_ENTRY = {
    "type": "object",
    "required": ["name", "bw", "enc_type", "is_sym", "dtype"],
    "properties": {
        "name": _NAME, "bw": _BITS, "enc_type": {"type": "string"},
        "dtype": {"type": "string", "pattern": "^(?i:int|float)$", "x-message": "must be 'INT' or 'FLOAT'"},
        "is_sym": _BOOLISH,
        "scale": {"type": "array", "items": _NUM}, "offset": {"type": "array", "items": _INT},
        "axis": {"type": ["integer", "null"]}, "block_size": {"type": ["integer", "null"]},
    },
}
_AIMET2_ENTRY = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _NAME, "output_dtype": {"type": "string"}, "dtype": {"type": "string"},
        "y_scale": {"anyOf": [_NUM, {"type": "array", "minItems": 1, "items": _NUM}]},
        "y_zero_point": {"anyOf": [_INT, {"type": "array", "minItems": 1, "items": _INT}]},
        "axis": {"type": ["integer", "null"]},
    },
}
_ORT_ENTRY = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "quant_type": {"type": "string"}, "scale": _NUM, "zero_point": _INT, "symmetric": {"type": "boolean"},
        "reduce_range": {"type": "boolean"}, "rmin": _NUM, "rmax": _NUM, "axis": _INT,
        "convert": {"type": "object", "required": ["quant_type"],
                    "properties": {"quant_type": {"type": "string"}, "scale": _NUM, "zero_point": _INT,
                                   "recv_nodes": {"type": "array", "items": {"type": "string"}}}},
    },
}

def _entry_lists(entry: dict[str, Any], **properties: Any) -> dict[str, Any]:
    """Schema of a format whose activation and parameter encodings are lists of ``entry`` objects."""
    return {"type": "object", "properties": {**properties, "activation_encodings": {"type": "array", "items": entry},
                                             "param_encodings": {"type": "array", "items": entry}}}


#: JSON Schema (Draft 2020-12) of each overrides / encodings format (``docs/input-formats.md``)
SCHEMAS: dict[str, dict[str, Any]] = {
    "legacy": {
        "type": "object",
        "properties": {"activation_encodings": _LEGACY_SECTION, "param_encodings": _LEGACY_SECTION,
                       "quantizer_args": {"type": "object"}},
    },
    "1.0.0": _entry_lists(_V1_ENTRY, version={"const": "1.0.0"}, quantizer_args={"type": "object"},
                          excluded_layers={"type": "array"}),
    "aimet2": _entry_lists(_AIMET2_ENTRY, version={"type": "string"}),
    "ort": {
        "type": "object",
        "additionalProperties": {"anyOf": [_ORT_ENTRY, {"type": "array", "minItems": 1, "items": _ORT_ENTRY}]},
    },
}


def check_schema(doc: Any, fmt: str, source: str | os.PathLike | None = None) -> None:
    """Validate a loaded document against :data:`SCHEMAS` ``[fmt]``.

    Raises:
        InputError: the first (most relevant) violation, naming the file and the field, e.g.
            ``ov.json: activation_encodings['x'][0].scale: must be a number, got 'abc' (legacy format)``.
    """
    try:
        _check_schema(doc, SCHEMAS[fmt], os.fspath(source) if source is not None else None)
    except InputError as e:
        raise InputError(f"{e.message} ({fmt} format)", e.path) from None


# ============================================================================ the encoding
@dataclass(frozen=True)
class Encoding:
    """One tensor's quantization encoding (per tensor or per channel), ONNX convention.

    Attributes:
        bitwidth: bits per value (int: 4/8/16/32; float: 16/32).
        dtype: ``"int"`` (fixed point) or ``"float"`` (a float precision request, no scale).
        symmetric: symmetric encoding (QNN: offset ``-2^(bw-1)``; ONNX signed: zero point 0).
        scale: one value per tensor or per channel; empty when only a range is known.
        zero_point: ONNX zero points in the storage given by ``signed``; same length as ``scale``.
        signed: integer storage is signed (int8…) rather than unsigned (uint8…). QNN files carry no
            signedness; encodings read from them are unsigned.
        min, max: the float range when the file gives one (or when only a range is known).
        axis: per-channel axis (ONNX layout), ``None`` for per-tensor or when unknown.
    """

    bitwidth: int
    dtype: str = "int"
    symmetric: bool = False
    scale: tuple[float, ...] = ()
    zero_point: tuple[int, ...] = ()
    signed: bool = False
    min: tuple[float, ...] = ()
    max: tuple[float, ...] = ()
    axis: int | None = None

    # ------------------------------------------------------------------ derived values
    @property
    def is_float(self) -> bool:
        """True for float precision requests."""
        return self.dtype == "float"

    @property
    def channels(self) -> int:
        """Number of scale (or range) entries."""
        return max(len(self.scale), len(self.min), 1)

    @property
    def per_channel(self) -> bool:
        """True with several channels or an explicit axis."""
        return self.channels > 1 or self.axis is not None

    @property
    def qmin(self) -> int:
        """Smallest stored integer."""
        return -(1 << (self.bitwidth - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        """Largest stored integer."""
        return (1 << (self.bitwidth - 1)) - 1 if self.signed else (1 << self.bitwidth) - 1

    @property
    def offsets(self) -> tuple[int, ...]:
        """QNN offsets (``float = (q_unsigned + offset) * scale``): ``-zero_point`` in unsigned storage."""
        shift = (1 << (self.bitwidth - 1)) if self.signed else 0
        return tuple(-(int(z) + shift) for z in self.zero_point)

    def as_unsigned(self) -> Encoding:
        """The same grid in unsigned storage (QNN's view)."""
        if not self.signed:
            return self
        shift = 1 << (self.bitwidth - 1)
        return replace(self, zero_point=tuple(int(z) + shift for z in self.zero_point), signed=False)

    def as_signed(self) -> Encoding:
        """The same grid in signed storage."""
        if self.signed:
            return self
        shift = 1 << (self.bitwidth - 1)
        return replace(self, zero_point=tuple(int(z) - shift for z in self.zero_point), signed=True)

    def grid_range(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(min, max) of the representable values: ``(qmin - zp) * scale``, ``(qmax - zp) * scale``."""
        lo = tuple((self.qmin - z) * s for s, z in zip(self.scale, self.zero_point, strict=True))
        hi = tuple((self.qmax - z) * s for s, z in zip(self.scale, self.zero_point, strict=True))
        return lo, hi

    def key(self) -> tuple[Any, ...]:
        """What two equivalent encodings share: bitwidth, dtype, symmetric, scales, QNN offsets, axis.

        Storage signedness does not count (int8 zp 0 and uint8 zp 128 are the same grid); ranges do
        not count when a scale is given (they follow from it).
        """
        if self.is_float:
            return ("float", self.bitwidth)
        rng = () if self.scale else (self.min, self.max)
        return ("int", self.bitwidth, self.symmetric, self.scale, self.offsets, self.axis, rng)

    def equivalent(self, other: Encoding, check_axis: bool = True) -> bool:
        """Same quantization grid (see :meth:`key`)."""
        a, b = self.key(), other.key()
        if not check_axis and a[0] == "int" and b[0] == "int":
            a, b = a[:5] + a[6:], b[:5] + b[6:]
        return a == b

    def to_dump(self) -> dict[str, Any]:
        """The dict the golden dump stores for a tensor's encoding."""
        if self.is_float:
            return {"dtype": f"float{self.bitwidth}", "bitwidth": self.bitwidth}
        dt = f"{'int' if self.signed else 'uint'}{max(self.bitwidth, 8)}"
        one = len(self.scale) == 1 and self.axis is None
        return {
            "bitwidth": self.bitwidth,
            "dtype": dt,
            "scale": self.scale[0] if one else list(self.scale),
            "zero_point": self.zero_point[0] if one else list(self.zero_point),
            "axis": self.axis,
            "symmetric": self.symmetric,
            "qmin": self.qmin,
            "qmax": self.qmax,
        }


@dataclass
class EncodingSet:
    """Activation and parameter encodings read from (or to be written to) one file.

    Attributes:
        activations, params: tensor name → :class:`Encoding`.
        format: the format the set was read from (``legacy``, ``1.0.0``, ``aimet2``, ``ort``).
        source: the file, when read from one.
        quantizer_args, excluded_layers: passed through for the ``1.0.0`` format.
        dropped: ``(name, reason)`` for entries that could not be represented (block encodings,
            ORT ``convert`` requests, …); never silently lost.
    """

    activations: dict[str, Encoding] = field(default_factory=dict)
    params: dict[str, Encoding] = field(default_factory=dict)
    format: str = "legacy"
    source: str | None = None
    quantizer_args: dict[str, Any] | None = None
    excluded_layers: list[Any] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.activations) + len(self.params)

    def __iter__(self) -> Iterator[str]:
        yield from self.activations
        yield from self.params

    def items(self) -> Iterator[tuple[str, Encoding]]:
        """(name, encoding) for activations then params."""
        yield from self.activations.items()
        yield from self.params.items()

    def get(self, name: str) -> Encoding | None:
        """The encoding of a tensor (activation or param)."""
        return self.activations.get(name) or self.params.get(name)

    def equivalent(self, other: EncodingSet, check_axis: bool = True) -> bool:
        """Same names in the same sections with equivalent encodings."""
        if set(self.activations) != set(other.activations) or set(self.params) != set(other.params):
            return False
        return all(e.equivalent(other.get(n), check_axis) for n, e in self.items())  # type: ignore[arg-type]

    def validate(self, model: Any = None, allow_sanitized: bool = False) -> None:
        """Check QNN rules and, with a model, that every name is one of its tensors.

        Raises:
            InputError: the first problem, one line, naming :attr:`source`.
        """
        for name, enc in self.items():
            _check(name, enc, self.source)
        if model is not None:
            unknown = self.unknown_names(model, allow_sanitized)
            if unknown:
                more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
                raise InputError(
                    f"{len(unknown)} tensor name(s) not in the model: {', '.join(map(repr, unknown[:3]))}{more}",
                    self.source,
                )
            self._check_channels(model)

    def _check_channels(self, model: Any) -> None:
        """Per-channel parameter encodings must have one entry per channel of their initializer."""
        shapes = {i.name: tuple(i.dims) for i in load_model(model).graph.initializer}
        for name, enc in self.params.items():
            shp = shapes.get(name)
            if shp is None or enc.is_float or enc.channels <= 1:
                continue
            if enc.axis is not None and not (-len(shp) <= enc.axis < len(shp)):
                raise InputError(f"{name!r}: axis {enc.axis} is outside the initializer's rank {len(shp)}",
                                 self.source)
            if (shp[enc.axis] if enc.axis is not None else None) != enc.channels and enc.channels not in shp:
                raise InputError(f"{name!r}: {enc.channels} per-channel encodings, but the initializer has shape "
                                 f"{list(shp)}", self.source)

    def unknown_names(self, model: Any, allow_sanitized: bool = False) -> list[str]:
        """Names that are not tensors of ``model`` (a path or ``ModelProto``)."""

        nm = NameMap.from_onnx(model)
        known = set(nm.tensors)
        out = []
        for n in self:
            if n in known or (allow_sanitized and nm.lookup(n) is not None):
                continue
            out.append(n)
        return out

    def infer_axes(self, model: Any) -> EncodingSet:
        """Fill the per-channel ``axis`` of parameter encodings that lack it, from the model's initializers.

        The axis is the unique dimension whose size equals the channel count; when several match,
        ``0`` for Conv weights, ``1`` for ConvTranspose, the last axis for MatMul / Gemm weights.
        """

        m = load_model(model)
        shapes = {i.name: tuple(i.dims) for i in m.graph.initializer}
        consumers: dict[str, Any] = {}
        for n in m.graph.node:
            for i in n.input:
                consumers.setdefault(i, n)

        def real_op(name: str) -> str:
            n = consumers.get(name)
            if n is not None and n.op_type == "DequantizeLinear" and n.output:
                n = consumers.get(n.output[0])
            return n.op_type if n is not None else ""

        out = {}
        for name, enc in self.params.items():
            if enc.channels > 1 and enc.axis is None and name in shapes:
                shp = shapes[name]
                cands = [a for a, d in enumerate(shp) if d == enc.channels]
                axis = None
                if len(cands) == 1:
                    axis = cands[0]
                elif cands:
                    op = real_op(name)
                    pref = {"Conv": 0, "ConvTranspose": 1}.get(op, len(shp) - 1 if op in ("MatMul", "Gemm") else None)
                    axis = pref if pref in cands else None
                enc = replace(enc, axis=axis)
            out[name] = enc
        return replace(self, params=out)


# ============================================================================ checks
def _bits_ok(enc: Encoding) -> bool:
    return enc.bitwidth in (FLOAT_BITWIDTHS if enc.is_float else INT_BITWIDTHS)


def _check(name: str, enc: Encoding, source: str | None) -> None:
    if enc.dtype not in ("int", "float"):
        raise InputError(f"{name!r}: dtype {enc.dtype!r} is neither 'int' nor 'float'", source)
    if not _bits_ok(enc):
        allowed = FLOAT_BITWIDTHS if enc.is_float else INT_BITWIDTHS
        raise InputError(f"{name!r}: impossible bitwidth {enc.bitwidth} for dtype {enc.dtype} (allowed {allowed})", source)
    if enc.is_float:
        return
    if len(enc.scale) != len(enc.zero_point):
        raise InputError(f"{name!r}: {len(enc.scale)} scale(s) but {len(enc.zero_point)} offset(s)", source)
    if not enc.scale and not enc.min:
        return  # a type-only request (ORT quant_type without range)
    for s in enc.scale:
        if not (math.isfinite(s) and s > 0):
            raise InputError(f"{name!r}: scale {s!r} is not a positive finite number", source)
    for z in enc.zero_point:
        if not enc.qmin <= z <= enc.qmax:
            raise InputError(
                f"{name!r}: zero point {z} outside [{enc.qmin}, {enc.qmax}] for {enc.bitwidth}-bit "
                f"{'signed' if enc.signed else 'unsigned'} storage", source)
    for lo, hi in zip(enc.min, enc.max, strict=False):
        if not lo <= hi:
            raise InputError(f"{name!r}: min {lo} > max {hi}", source)
    if enc.per_channel and not enc.symmetric:
        raise InputError(f"{name!r}: per-channel encoding is not symmetric (QNN requires symmetric per-channel)", source)
    if enc.symmetric and enc.scale:
        half = 1 << (enc.bitwidth - 1)
        bad = [o for o in enc.offsets if o not in (-half, -half + 1)]
        if bad:
            raise InputError(
                f"{name!r}: symmetric encoding with QNN offset {bad[0]} (allowed {-half} or {-half + 1})", source)


# ============================================================================ parsing
def _as_bool(v: Any, name: str, key: str, source: str | None) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    raise InputError(f"{name!r}: {key} must be 'True' or 'False', got {v!r}", source)


def _num(v: Any, name: str, key: str, source: str | None, kind: type = float) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{name!r}: {key} must be a number, got {v!r}", source)
    if kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise InputError(f"{name!r}: {key} must be an integer, got {v!r}", source)
        return int(v)
    return float(v)


def _from_qnn(
    name: str,
    bw: int,
    dtype: str,
    sym: bool,
    scales: list[float],
    offsets: list[int],
    mins: list[float],
    maxs: list[float],
    source: str | None,
) -> Encoding:
    """Build an Encoding from QNN-convention values, applying the converter's offset rules."""
    if dtype == "float":
        return Encoding(bitwidth=bw, dtype="float")
    if bw not in INT_BITWIDTHS:
        raise InputError(f"{name!r}: impossible bitwidth {bw} for dtype int (allowed {INT_BITWIDTHS})", source)
    half = 1 << (bw - 1)
    fixed = []
    for o in offsets:
        o = -abs(int(o))  # the converter forces offsets negative
        if sym and o == 0:
            o = -half  # the converter rewrites symmetric offset 0 to -2^(bw-1)
        if o < -((1 << bw) - 1):
            raise InputError(f"{name!r}: offset {o} below -(2^{bw}-1)", source)
        fixed.append(o)
    return Encoding(
        bitwidth=bw, dtype="int", symmetric=sym, scale=tuple(float(s) for s in scales),
        zero_point=tuple(-o for o in fixed), signed=False,
        min=tuple(float(x) for x in mins), max=tuple(float(x) for x in maxs),
    )


def _parse_legacy_entries(name: str, entries: Any, source: str | None) -> Encoding:
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{name!r}: expected a non-empty list of encodings, got {type(entries).__name__}", source)
    bws, dts, syms, scales, offsets, mins, maxs = set(), set(), set(), [], [], [], []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise InputError(f"{name!r}[{i}]: encoding is not an object", source)
        if "bitwidth" not in e:
            raise InputError(f"{name!r}[{i}]: missing 'bitwidth'", source)
        bws.add(_num(e["bitwidth"], name, "bitwidth", source, int))
        dt = str(e.get("dtype", "int")).lower()
        if dt not in ("int", "float"):
            raise InputError(f"{name!r}[{i}]: dtype {e.get('dtype')!r} is neither 'int' nor 'float'", source)
        dts.add(dt)
        syms.add(_as_bool(e.get("is_symmetric", "False"), name, "is_symmetric", source))
        if dt == "float":
            continue
        has_so = "scale" in e and "offset" in e
        has_mm = "min" in e and "max" in e
        if not (has_so or has_mm):
            raise InputError(f"{name!r}[{i}]: needs 'scale'+'offset' or 'min'+'max'", source)
        if has_so:
            scales.append(_num(e["scale"], name, "scale", source))
            offsets.append(_num(e["offset"], name, "offset", source, int))
        if has_mm:
            mins.append(_num(e["min"], name, "min", source))
            maxs.append(_num(e["max"], name, "max", source))
    if len(bws) != 1 or len(dts) != 1 or len(syms) != 1:
        raise InputError(f"{name!r}: per-channel entries disagree on bitwidth, dtype or is_symmetric", source)
    if scales and len(scales) != len(entries):
        raise InputError(f"{name!r}: some channels have scale/offset and some do not", source)
    return _from_qnn(name, bws.pop(), dts.pop(), syms.pop(), scales, offsets, mins, maxs, source)


def _parse_legacy(d: dict[str, Any], source: str | None) -> EncodingSet:
    out = EncodingSet(format="legacy", source=source, quantizer_args=d.get("quantizer_args"))
    for section, target in (("activation_encodings", out.activations), ("param_encodings", out.params)):
        sec = d.get(section, {})
        if not isinstance(sec, dict):
            raise InputError(f"{section} must be an object keyed by tensor name (legacy format)", source)
        for name, entries in sec.items():
            target[name] = _parse_legacy_entries(name, entries, source)
    return out


def _parse_v1_entry(e: Any, i: int, section: str, source: str | None, out: EncodingSet) -> tuple[str, Encoding] | None:
    if not isinstance(e, dict) or "name" not in e:
        raise InputError(f"{section}[{i}]: expected an object with a 'name'", source)
    name = str(e["name"])
    for k in ("bw", "enc_type", "is_sym", "dtype"):
        if k not in e:
            raise InputError(f"{name!r}: missing {k!r} (1.0.0 format)", source)
    bw = _num(e["bw"], name, "bw", source, int)
    dtype = str(e["dtype"]).lower()
    if dtype not in ("int", "float"):
        raise InputError(f"{name!r}: dtype {e['dtype']!r} is neither INT nor FLOAT", source)
    sym = _as_bool(e["is_sym"], name, "is_sym", source)
    enc_type = str(e["enc_type"]).upper()
    if dtype == "float":
        if bw not in FLOAT_BITWIDTHS:
            raise InputError(f"{name!r}: impossible bitwidth {bw} for dtype float (allowed {FLOAT_BITWIDTHS})", source)
        return name, Encoding(bitwidth=bw, dtype="float")
    if enc_type not in ("PER_TENSOR", "PER_CHANNEL"):
        if enc_type in ("PER_BLOCK", "LPBQ", "VECTOR"):
            out.dropped.append((name, f"{enc_type} encodings are not supported"))
            return None
        raise InputError(f"{name!r}: unknown enc_type {e['enc_type']!r}", source)
    scales, offsets = e.get("scale"), e.get("offset")
    if not isinstance(scales, list) or not isinstance(offsets, list) or len(scales) != len(offsets) or not scales:
        raise InputError(f"{name!r}: 'scale' and 'offset' must be non-empty lists of equal length", source)
    if enc_type == "PER_TENSOR" and len(scales) != 1:
        raise InputError(f"{name!r}: PER_TENSOR with {len(scales)} scales", source)
    if enc_type == "PER_CHANNEL":
        if not sym:
            raise InputError(f"{name!r}: PER_CHANNEL encoding is not symmetric (QNN requires is_sym true)", source)
        half = 1 << (bw - 1)
        bad = [o for o in offsets if o not in (0, -half)]
        if bad:
            raise InputError(f"{name!r}: PER_CHANNEL offset {bad[0]} (allowed 0 or {-half})", source)
    enc = _from_qnn(
        name, bw, "int", sym,
        [_num(s, name, "scale", source) for s in scales],
        [_num(o, name, "offset", source, int) for o in offsets], [], [], source,
    )
    if enc_type == "PER_CHANNEL" and len(scales) == 1:
        enc = replace(enc, axis=_axis_or_none(e.get("axis")))
    return name, enc


def _axis_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _parse_v1(d: dict[str, Any], source: str | None) -> EncodingSet:
    out = EncodingSet(format="1.0.0", source=source, quantizer_args=d.get("quantizer_args"),
                      excluded_layers=list(d.get("excluded_layers") or []))
    for section, target in (("activation_encodings", out.activations), ("param_encodings", out.params)):
        sec = d.get(section, [])
        if not isinstance(sec, list):
            raise InputError(f"{section} must be a list (1.0.0 format)", source)
        for i, e in enumerate(sec):
            r = _parse_v1_entry(e, i, section, source, out)
            if r:
                target[r[0]] = r[1]
    return out


_AIMET2_DTYPES = {
    "int4": (4, True), "uint4": (4, False), "int8": (8, True), "uint8": (8, False),
    "int16": (16, True), "uint16": (16, False), "int32": (32, True), "uint32": (32, False),
}


def _parse_aimet2(d: dict[str, Any], source: str | None) -> EncodingSet:
    out = EncodingSet(format="aimet2", source=source)
    for section, target in (("activation_encodings", out.activations), ("param_encodings", out.params)):
        sec = d.get(section, [])
        if not isinstance(sec, list):
            raise InputError(f"{section} must be a list (AIMET 2.x format)", source)
        for i, e in enumerate(sec):
            if not isinstance(e, dict) or "name" not in e:
                raise InputError(f"{section}[{i}]: expected an object with a 'name'", source)
            name = str(e["name"])
            odt = str(e.get("output_dtype", e.get("dtype", ""))).lower()
            if odt.startswith(("float", "fp")) or odt in ("bfloat16",):
                bits = 16 if "16" in odt else 32
                target[name] = Encoding(bitwidth=bits, dtype="float")
                continue
            if odt not in _AIMET2_DTYPES:
                raise InputError(f"{name!r}: unknown output_dtype {e.get('output_dtype')!r}", source)
            if e.get("block_size") is not None or "per_block_int_scale" in e:
                out.dropped.append((name, "block encodings are not supported"))
                continue
            bw, signed = _AIMET2_DTYPES[odt]
            if "y_scale" not in e:
                raise InputError(f"{name!r}: missing 'y_scale'", source)
            sc = e["y_scale"] if isinstance(e["y_scale"], list) else [e["y_scale"]]
            zp = e.get("y_zero_point", 0)
            zp = zp if isinstance(zp, list) else [zp] * len(sc)
            if len(zp) != len(sc):
                raise InputError(f"{name!r}: {len(sc)} y_scale(s) but {len(zp)} y_zero_point(s)", source)
            zps = tuple(_num(z, name, "y_zero_point", source, int) for z in zp)
            mid = 0 if signed else (1 << (bw - 1))
            target[name] = Encoding(
                bitwidth=bw, dtype="int", symmetric=all(z == mid for z in zps),
                scale=tuple(_num(s, name, "y_scale", source) for s in sc), zero_point=zps, signed=signed,
                axis=_axis_or_none(e.get("axis")) if len(sc) > 1 or e.get("axis") is not None else None,
            )
    return out


def _looks_like_ort(d: dict[str, Any]) -> bool:
    if not d or any(k in d for k in ("activation_encodings", "param_encodings", "version")):
        return False
    def entry(x: Any) -> bool:
        return isinstance(x, dict) and set(x) <= _ORT_KEYS

    return all(entry(v) or (isinstance(v, list) and all(entry(x) for x in v)) for v in d.values())


def detect_format(d: Any) -> str | None:
    """The overrides / encodings format of a loaded document (``legacy``, ``1.0.0``, ``aimet2``, ``ort``),
    or None when it is none of them."""
    if not isinstance(d, dict):
        return None
    version = str(d.get("version", ""))
    if version == "1.0.0":
        return "1.0.0"
    if version.startswith("2."):
        return "aimet2"
    if "activation_encodings" in d or "param_encodings" in d:
        sec = d.get("activation_encodings", d.get("param_encodings"))
        if isinstance(sec, list):
            # lists without a version: 1.0.0-shaped if entries use bw/enc_type, else AIMET 2.x
            sample = (d.get("activation_encodings") or d.get("param_encodings") or [{}])[0]
            return "1.0.0" if isinstance(sample, dict) and "bw" in sample else "aimet2"
        return "legacy"
    if _looks_like_ort(d):
        return "ort"
    return None


def parse_encodings(d: Any, source: str | os.PathLike | None = None) -> EncodingSet:
    """Parse an already-loaded encodings document (any supported format, detected, schema-checked)."""
    src = os.fspath(source) if source is not None else None
    if not isinstance(d, dict):
        raise InputError(f"encodings must be a JSON object, got {type(d).__name__}", src)
    fmt = detect_format(d)
    if fmt is None:
        raise InputError("not an encodings file (no activation_encodings / param_encodings)", src)
    check_schema(d, fmt, src)
    if fmt == "1.0.0":
        return _parse_v1(d, src)
    if fmt == "aimet2":
        return _parse_aimet2(d, src)
    if fmt == "legacy":
        return _parse_legacy(d, src)
    return from_ort_overrides(d, source=src)


def read_encodings(path: str | os.PathLike, model: Any = None, allow_sanitized: bool = False) -> EncodingSet:
    """Read an overrides / encodings JSON file of any supported format and validate it.

    Args:
        path: the file.
        model: an ONNX model (path or proto); when given, unknown tensor names are an error and missing
            per-channel axes are inferred from the initializers.
        allow_sanitized: accept QNN-sanitized names that resolve uniquely to model tensors.
    """
    p = Path(path)
    encs = parse_encodings(load_json(p, "encodings file"), p)
    if model is not None:
        encs = encs.infer_axes(model)
    encs.validate(model, allow_sanitized)
    return encs


# ============================================================================ QNN writers
def _f(x: float) -> float:
    return float(x)


def _legacy_entries(name: str, enc: Encoding) -> list[dict[str, Any]]:
    if enc.is_float:
        return [{"bitwidth": enc.bitwidth, "dtype": "float"}]
    sym = "True" if enc.symmetric else "False"
    if not enc.scale:
        if not enc.min:
            raise UsageError(f"{name!r}: an int encoding needs a scale or a range to be written for QNN")
        return [{"bitwidth": enc.bitwidth, "dtype": "int", "is_symmetric": sym, "max": _f(hi), "min": _f(lo)}
                for lo, hi in zip(enc.min, enc.max, strict=True)]
    u = enc.as_unsigned()
    lo_g, hi_g = u.grid_range()
    mins = enc.min if len(enc.min) == len(enc.scale) else lo_g
    maxs = enc.max if len(enc.max) == len(enc.scale) else hi_g
    return [
        {"bitwidth": enc.bitwidth, "dtype": "int", "is_symmetric": sym, "max": _f(hi), "min": _f(lo),
         "offset": int(o), "scale": _f(s)}
        for s, o, lo, hi in zip(enc.scale, u.offsets, mins, maxs, strict=True)
    ]


def to_legacy(encs: EncodingSet) -> dict[str, Any]:
    """The legacy (AIMET 0.6.1-style) overrides document; names stay as given (use ONNX names)."""
    for n, e in encs.items():
        _check(n, e, encs.source)
    d: dict[str, Any] = {
        "activation_encodings": {n: _legacy_entries(n, e) for n, e in encs.activations.items()},
        "param_encodings": {n: _legacy_entries(n, e) for n, e in encs.params.items()},
    }
    if encs.quantizer_args:
        d["quantizer_args"] = encs.quantizer_args
    return d


def _scale_from_range(enc: Encoding) -> Encoding:
    """A per-tensor range-only encoding with the scale / zero point QNN computes from its min / max (the range
    widened to hold 0; symmetric: ``max|x| / (2^(bw-1) - 1)``, zero point ``2^(bw-1)``)."""
    lo, hi = min(enc.min[0], 0.0), max(enc.max[0], 0.0)
    if enc.symmetric:
        s = max(abs(lo), abs(hi)) / ((1 << (enc.bitwidth - 1)) - 1) or 1e-12
        return replace(enc, scale=(s,), zero_point=(1 << (enc.bitwidth - 1),), signed=False)
    s = (hi - lo) / ((1 << enc.bitwidth) - 1) or 1e-12
    return replace(enc, scale=(s,), zero_point=(round(-lo / s),), signed=False)


def _v1_entry(name: str, enc: Encoding) -> dict[str, Any]:
    if enc.is_float:
        return {"name": name, "enc_type": "PER_TENSOR", "dtype": "FLOAT", "bw": enc.bitwidth, "is_sym": True}
    if not enc.scale and enc.min and len(enc.min) == 1:
        enc = _scale_from_range(enc)  # the grid QNN derives from min/max (range widened to hold 0)
    if not enc.scale:
        raise UsageError(f"{name!r}: the 1.0.0 format needs scale/offset (this encoding only has a range)")
    u = enc.as_unsigned()
    return {
        "name": name,
        "enc_type": "PER_CHANNEL" if enc.per_channel else "PER_TENSOR",
        "dtype": "INT",
        "bw": enc.bitwidth,
        "is_sym": enc.symmetric,
        "scale": [_f(s) for s in enc.scale],
        "offset": [int(o) for o in u.offsets],
    }


def to_v1(encs: EncodingSet) -> dict[str, Any]:
    """The ``"version": "1.0.0"`` document."""
    for n, e in encs.items():
        _check(n, e, encs.source)
    return {
        "version": "1.0.0",
        "activation_encodings": [_v1_entry(n, e) for n, e in encs.activations.items()],
        "param_encodings": [_v1_entry(n, e) for n, e in encs.params.items()],
        "quantizer_args": encs.quantizer_args or {},
        "excluded_layers": list(encs.excluded_layers),
    }


# ============================================================================ ORT overrides
def _error(message: str, encs: Any) -> UsageError | InputError:
    """An :class:`InputError` naming the file the encodings came from, else a :class:`UsageError`."""
    src = getattr(encs, "source", None)
    return InputError(message, src) if src else UsageError(message)


def validate_ort_overrides(doc: Any, source: str | os.PathLike | None = None,
                           known_quant_type: Any = None) -> None:
    """Check an ORT ``TensorQuantOverrides`` document as read from JSON (before ORT sees it).

    Schema (:data:`SCHEMAS` ``["ort"]``: a dict or a non-empty list of dicts per tensor, known keys only,
    typed values), then per entry: ``quant_type`` known (``known_quant_type(name) -> bool``, default the
    ORT integer types), finite positive ``scale``, ``zero_point`` within its type's range, finite
    ``rmin <= rmax``; per-channel lists give ``scale`` / ``zero_point`` on every channel or none.

    Raises:
        InputError: the first problem, naming the file, the tensor and the field.
    """
    src = os.fspath(source) if source is not None else None
    check_schema(doc, "ort", src)
    known = known_quant_type or (lambda q: q in ORT_QUANT_TYPES)
    for name, entries in doc.items():
        items = entries if isinstance(entries, list) else [entries]
        n_scales = sum("scale" in d for d in items)
        if n_scales not in (0, len(items)):
            raise InputError(f"{name!r}: per-channel overrides that give scale/zero_point must do so for every "
                             "channel", src)
        for i, d in enumerate(items):
            where = f"{name!r}" + (f"[{i}]" if isinstance(entries, list) else "")
            for key, qt in (("quant_type", d.get("quant_type")), ("convert.quant_type",
                                                                    (d.get("convert") or {}).get("quant_type"))):
                if qt is not None and not known(qt):
                    raise InputError(f"{where}: unknown {key} {qt!r}", src)
            if ("scale" in d) != ("zero_point" in d):
                raise InputError(f"{where}: 'scale' and 'zero_point' must be given together", src)
            if "scale" in d and not (math.isfinite(d["scale"]) and d["scale"] > 0):
                raise InputError(f"{where}: scale {d['scale']!r} is not a positive finite number", src)
            bits = ORT_QUANT_TYPES.get(str(d.get("quant_type", "")))
            if "zero_point" in d and not -(1 << 31) <= d["zero_point"] < (1 << 32):
                raise InputError(f"{where}: zero_point {d['zero_point']} is not a 32-bit integer", src)
            if "zero_point" in d and bits is not None:
                lo, hi = (-(1 << (bits[0] - 1)), (1 << (bits[0] - 1)) - 1) if bits[1] else (0, (1 << bits[0]) - 1)
                if not lo <= d["zero_point"] <= hi:
                    raise InputError(f"{where}: zero_point {d['zero_point']} outside [{lo}, {hi}] for "
                                     f"{d['quant_type']}", src)
            for k in ("rmin", "rmax"):
                if k in d and not math.isfinite(d[k]):
                    raise InputError(f"{where}: {k} {d[k]!r} is not finite", src)
            if "rmin" in d and "rmax" in d and d["rmin"] > d["rmax"]:
                raise InputError(f"{where}: rmin {d['rmin']} > rmax {d['rmax']}", src)


def _quant_type_name(v: Any) -> str:
    name = getattr(v, "name", v)
    if not isinstance(name, str) or name not in ORT_QUANT_TYPES:
        raise ValueError(f"unsupported quant_type {v!r}")
    return name


def to_ort_overrides(
    encs: EncodingSet | Mapping[str, Encoding],
    json_safe: bool = False,
    signed_symmetric: bool = True,
    skip_unsupported: bool = False,
    skipped: list[tuple[str, str]] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """ONNX Runtime ``TensorQuantOverrides`` (``init_overrides`` of ``get_qnn_qdq_config``).

    Args:
        encs: the encodings.
        json_safe: plain Python values and ``quant_type`` as a name (``"QUInt8"``), for a JSON file;
            otherwise ``QuantType`` members and numpy scalars, ready for ORT's quantizer (which wants
            float32 scales: a float64 scale is rounded to float32 here, as ORT would).
        signed_symmetric: write symmetric encodings in signed storage with zero point 0 (ORT and the
            QNN EP's convention), keeping the grid.
        skip_unsupported: leave out what ORT overrides cannot express instead of raising: float precision
            requests and 32-bit integer encodings (biases: ORT derives their scale from the input and
            weight scales, so a valid QNN overrides file holding them still applies).
        skipped: with ``skip_unsupported``, receives ``(name, reason)`` for each encoding left out.

    Raises:
        UsageError: an encoding ORT overrides cannot express (float precision requests, a 32-bit
            integer encoding, a per-channel encoding without an axis); :class:`InputError` naming the
            file instead when the encodings were read from one.
    """
    items = encs.items()
    qt_enum = None
    if not json_safe:
        from onnxruntime.quantization import QuantType as qt_enum
    out: dict[str, list[dict[str, Any]]] = {}
    for name, enc in items:
        if enc.is_float or enc.bitwidth not in (4, 8, 16):
            what = "a float precision request" if enc.is_float else f"a {enc.bitwidth}-bit integer encoding"
            if skip_unsupported:
                if skipped is not None:
                    skipped.append((name, f"ORT TensorQuantOverrides cannot express {what}"
                                          + ("" if enc.is_float else " (ORT derives bias quantization)")))
                continue
            raise _error(f"{name!r}: ORT TensorQuantOverrides cannot express {what}", encs)
        e = enc.as_signed() if (signed_symmetric and enc.symmetric and enc.scale) else enc
        qname = _ORT_BY_BITS[(e.bitwidth, e.signed)]
        qtype = qname if json_safe else getattr(qt_enum, qname)
        zdt = np.dtype(f"{'int' if e.signed else 'uint'}{max(e.bitwidth, 8)}")
        if e.bitwidth == 4 and not json_safe:
            zdt = np.dtype("int8" if e.signed else "uint8")
        if e.per_channel and e.axis is None:
            raise _error(f"{name!r}: per-channel encoding without an axis; read it with model= to infer one", encs)
        entries: list[dict[str, Any]] = []
        n = e.channels
        for c in range(n):
            d: dict[str, Any] = {"quant_type": qtype}
            if e.per_channel:
                d["axis"] = e.axis
            if e.scale:
                s, z = e.scale[c], e.zero_point[c]
                d["scale"] = float(s) if json_safe else np.array(s, dtype=np.float32)
                d["zero_point"] = int(z) if json_safe else np.array(z, dtype=zdt)
            else:
                d["symmetric"] = e.symmetric
                if e.min:
                    lo, hi = e.min[c], e.max[c]
                    d["rmin"] = float(lo) if json_safe else np.array(lo, dtype=np.float32)
                    d["rmax"] = float(hi) if json_safe else np.array(hi, dtype=np.float32)
            entries.append(d)
        out[name] = entries
    return out


def from_ort_overrides(
    overrides: Mapping[str, Any],
    model: Any = None,
    default_quant_type: str = "QUInt8",
    source: str | os.PathLike | None = None,
) -> EncodingSet:
    """Encodings from an ORT ``TensorQuantOverrides`` dict (QuantType members, names or JSON values).

    With a model, initializers go to ``params`` and everything else to ``activations``; without one,
    per-channel entries are taken as params. ``convert`` requests are kept in ``dropped``.
    """
    src = os.fspath(source) if source is not None else None
    inits: set[str] | None = None
    if model is not None:
        inits = {i.name for i in load_model(model).graph.initializer}
    out = EncodingSet(format="ort", source=src)
    for name, lst in overrides.items():
        if isinstance(lst, Mapping):
            lst = [lst]
        if not isinstance(lst, list) or not lst or not all(isinstance(x, Mapping) for x in lst):
            raise InputError(f"{name!r}: ORT overrides must be a non-empty list of dicts", src)
        first = lst[0]
        unknown = set(first) - _ORT_KEYS
        if unknown:
            raise InputError(f"{name!r}: unknown ORT override key(s) {sorted(unknown)}", src)
        if "convert" in first:
            out.dropped.append((name, "ORT 'convert' (mixed-precision type conversion) has no QNN overrides form"))
        try:
            qname = _quant_type_name(first.get("quant_type", default_quant_type))
        except ValueError as e:
            raise InputError(f"{name!r}: {e}", src) from None
        bw, signed = ORT_QUANT_TYPES[qname]
        axis = first.get("axis")
        per_channel = len(lst) > 1 or axis is not None
        scales, zps, mins, maxs = [], [], [], []
        for i, d in enumerate(lst):
            if ("scale" in d) != ("zero_point" in d):
                raise InputError(f"{name!r}[{i}]: 'scale' and 'zero_point' must be given together", src)
            if "scale" in d:
                scales.append(float(np.asarray(d["scale"]).reshape(())))
                zps.append(int(np.asarray(d["zero_point"]).reshape(())))
            if "rmin" in d and "rmax" in d:
                mins.append(float(np.asarray(d["rmin"]).reshape(())))
                maxs.append(float(np.asarray(d["rmax"]).reshape(())))
        if scales and len(scales) != len(lst):
            raise InputError(f"{name!r}: per-channel overrides that give scale/zero_point must do so for every channel", src)
        if scales:
            mid = 0 if signed else (1 << (bw - 1))
            sym = all(z == mid for z in zps)
        else:
            sym = bool(first.get("symmetric", False))
        enc = Encoding(
            bitwidth=bw, dtype="int", symmetric=sym, scale=tuple(scales), zero_point=tuple(zps), signed=signed,
            min=tuple(mins), max=tuple(maxs), axis=int(axis) if per_channel and axis is not None else None,
        )
        is_param = (name in inits) if inits is not None else per_channel
        (out.params if is_param else out.activations)[name] = enc
    return out


# ============================================================================ files
def write_encodings(
    encs: EncodingSet,
    path: str | os.PathLike,
    format: str = "legacy",
    overwrite: bool = False,
) -> Path:
    """Write encodings atomically (temp file + rename).

    Args:
        encs: the encodings.
        path: destination.
        format: ``"legacy"`` (widest converter support), ``"1.0.0"`` or ``"ort"`` (JSON-safe
            ``TensorQuantOverrides``).
        overwrite: replace an existing file.

    Raises:
        UsageError: the file exists and ``overwrite`` is false; unknown format; an encoding the
            format cannot express.
    """
    if format == "legacy":
        doc: Any = to_legacy(encs)
    elif format == "1.0.0":
        doc = to_v1(encs)
    elif format == "ort":
        doc = to_ort_overrides(encs, json_safe=True)
    else:
        raise UsageError(f"unknown encodings format {format!r} (legacy, 1.0.0, ort)")
    return atomic_write_text(path, json.dumps(doc, indent=2) + "\n", overwrite=overwrite)


def encodings_from_qdq_model(model: Any, base_dir: str | os.PathLike = "") -> EncodingSet:
    """The encodings a QDQ model uses, keyed by the *float* model's tensor names.

    Activations: each activation ``QuantizeLinear`` (name = its input without ``_QuantizeLinear_Input``).
    Parameters: each ``DequantizeLinear`` of an initializer (name = the initializer without
    ``_quantized``); per-channel ones keep their ``axis``. Symmetry is read from the zero points (0 for
    signed storage, ``2^(bw-1)`` for unsigned). This is what overrides for the float model must hold to
    reproduce the quantization (see :func:`to_ort_overrides`). ``model``: a path (external data read from its
    folder) or a loaded model (external data read from ``base_dir``); only the scales and zero points are read.
    """
    if not hasattr(model, "graph") and not base_dir:
        base_dir = Path(model).parent
    m = load_model(model)
    names = {x for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear") for x in n.input[1:3] if x}
    arrs = constant_arrays(m, names, str(base_dir))
    consts = {i.name for i in m.graph.initializer} | {n.output[0] for n in m.graph.node
                                                      if n.op_type == "Constant" and n.output}
    out = EncodingSet(format="qdq")

    def enc_of(n: Any) -> Encoding | None:
        scale = arrs.get(n.input[1])
        zp = arrs.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        if scale is None:
            return None
        zdt = zp.dtype if zp is not None else np.dtype(np.uint8)
        if zdt.kind not in "iu":
            return None  # float8 and other non-integer types have no QNN overrides form
        bw = zdt.itemsize * 8
        for a in n.attribute:
            if a.name == "precision" and a.i:
                bw = int(a.i)
        signed = zdt.kind == "i"
        sc = tuple(float(x) for x in np.atleast_1d(scale).astype(np.float64))
        zps = tuple(int(x) for x in np.atleast_1d(zp)) if zp is not None else (0,) * len(sc)
        mid = 0 if signed else 1 << (bw - 1)
        axis = None
        if np.ndim(scale) > 0 and np.size(scale) > 1:
            axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
        return Encoding(bitwidth=bw, dtype="int", symmetric=all(z == mid for z in zps), scale=sc, zero_point=zps,
                        signed=signed, axis=axis)

    for n in m.graph.node:
        if not n.input:
            continue
        # activations: their QuantizeLinear's input; weights: their DequantizeLinear's constant input
        if n.op_type == "QuantizeLinear" and n.input[0] not in consts:
            table, suffix = out.activations, "_QuantizeLinear_Input"
        elif n.op_type == "DequantizeLinear" and n.input[0] in consts:
            table, suffix = out.params, "_quantized"
        else:
            continue
        e = enc_of(n)
        if e is not None:
            table.setdefault(n.input[0].removesuffix(suffix), e)
    return out


def from_encodings_dict(encodings: Iterable[tuple[str, Encoding]], params: Iterable[str] = ()) -> EncodingSet:
    """An :class:`EncodingSet` from ``(name, Encoding)`` pairs; names in ``params`` go to ``params``."""
    ps = set(params)
    out = EncodingSet()
    for n, e in encodings:
        (out.params if n in ps else out.activations)[n] = e
    return out
