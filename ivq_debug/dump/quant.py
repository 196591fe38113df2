"""The one definition of a quantized tensor's values from its integers: ``float32((q − zero_point) · scale)``.

Every capture that has a tensor's raw integers computes its values with :func:`dequantize` (the ORT runner, QDQ on
the CPU EP and QNN HTP alike), and every reader of a format-version-2 dump reconstructs the values of a tensor
stored as its integers only with it (``docs/dump-format.md``, "Integers only"): the whole tensor, a flat run of it
(the readers' blocks) or any flat selection (a summary sample). ONNX ``DequantizeLinear``: per tensor, or per
channel along ``axis`` (``scale`` / ``zero_point`` lists of ``shape[axis]`` values; a one-value zero point with a
list of scales applies to every channel); ORT computes it the same way for the integer dtypes a dump stores
(:data:`INTEGER_DTYPES`).

For integers of up to 16 bits (and zero points below 2**24) the subtraction is done in float32, in place: the
integers and their difference are exact in float32, so the values equal those of the int64 subtraction, with one
array instead of an int64 and a float32 copy (the 2,080 uint8 tensors of ``bench/bench_many.py``'s a8w8 capture:
0.39 -> 0.13 s CPU). Wider integers (int32) subtract in int64 and round once to float32, as ORT does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: integer dtypes of the raw integers a dump may store in place of a tensor's values (ONNX's 8 / 16 / 32-bit
#: ``DequantizeLinear`` inputs)
INTEGER_DTYPES = ("uint8", "int8", "uint16", "int16", "int32")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def encoding_problem(enc: Any, shape: tuple[int, ...]) -> str | None:
    """Why :func:`dequantize` cannot rebuild a tensor of ``shape`` from ``enc`` (None: it can).

    ``scale`` a finite number or a non-empty list of them; ``zero_point`` an integer or a list of integers (one,
    or one per scale); a list of more than one scale needs an integer ``axis`` of ``shape`` whose length is the
    number of scales. What the writer requires before it leaves a tensor's values out, and what the reader
    checks of an untrusted dump before it computes with the encoding.
    """
    if not isinstance(enc, dict):
        return "the encoding is not an object"
    scale, zp, axis = enc.get("scale"), enc.get("zero_point"), enc.get("axis")
    scales = scale if isinstance(scale, list) else [scale]
    zps = zp if isinstance(zp, list) else [zp]
    if not scales or not all(_number(s) and math.isfinite(s) for s in scales):
        return f"its scale is {str(scale)[:60]!r}, not a finite number or a list of them"
    if not zps or not all(isinstance(z, int) and not isinstance(z, bool) for z in zps):
        return f"its zero point is {str(zp)[:60]!r}, not an integer or a list of them"
    if any(abs(z) >= 1 << 62 for z in zps):
        return "its zero point is out of range"
    if len(zps) not in (1, len(scales)):
        return f"{len(zps)} zero points for {len(scales)} scales"
    if len(scales) > 1:
        if not isinstance(axis, int) or isinstance(axis, bool) or not -len(shape) <= axis < len(shape):
            return f"per-channel scales with axis {axis!r} for a tensor of {len(shape)} dimensions"
        if shape[axis] != len(scales):
            return f"{len(scales)} scales along axis {axis} of length {shape[axis]}"
    return None


def dequantize(q: np.ndarray, enc: dict[str, Any], shape: tuple[int, ...] | None = None,
               at: int | np.ndarray = 0, out: np.ndarray | None = None) -> np.ndarray:
    """``float32((q − zero_point) · scale)``, as ONNX ``DequantizeLinear`` computes it (see the module docstring).

    ``q`` is the whole tensor, or, with ``shape`` (the tensor's) given, flat elements of it: a contiguous run
    starting at flat index ``at`` (an int), or the elements at the flat indices ``at`` (an array, e.g. a strided
    sample). Each element gets its own channel's scale and zero point, computed with the same float32 operations
    as the whole tensor's, so the values are bit-identical whichever way they are read. ``out``: a float32 array
    of ``q``'s shape to write into (the readers' reused block buffer).
    """
    q = np.asarray(q)
    scale = np.asarray(enc["scale"], dtype=np.float32)
    zp = np.asarray(enc.get("zero_point", 0), dtype=np.int64)
    axis = enc.get("axis")
    if scale.ndim == 1 and scale.size > 1 and axis is not None:  # per channel
        if zp.size == 1:
            zp = zp.reshape(())
        full = tuple(q.shape) if shape is None else tuple(shape)
        axis = int(axis) % len(full)
        if shape is None or tuple(q.shape) == full:
            bshape = [1] * q.ndim
            bshape[axis] = scale.size
            scale = scale.reshape(bshape)
            zp = zp.reshape(bshape) if zp.ndim else zp
        else:  # flat elements of the tensor: each one's channel
            inner = math.prod(full[axis + 1:])
            idx = np.arange(at, at + q.size) if np.ndim(at) == 0 else np.asarray(at).reshape(-1)
            ch = (idx // inner) % scale.size
            scale = scale[ch].reshape(q.shape)
            zp = zp[ch].reshape(q.shape) if zp.ndim else zp
    exact = q.dtype.kind in "iu" and q.dtype.itemsize <= 2 and (not zp.size or int(np.abs(zp).max()) < 1 << 24)
    if exact and np.broadcast_shapes(q.shape, zp.shape, scale.shape) == q.shape:
        if out is None:
            out = q.astype(np.float32)
        else:
            out[...] = q
        out -= zp.astype(np.float32)
        out *= scale
        return out
    d = (q.astype(np.int64) - zp).astype(np.float32)
    if out is None:
        return d * scale
    return np.multiply(d, scale, out=out)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float32 arrays of one shape hold the same bits (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
