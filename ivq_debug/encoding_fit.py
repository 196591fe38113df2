"""How well a quantization encoding fits the reference values it has to represent.

Computed on the reference tensor, streaming, in the same pass as the metrics (no extra reads):

- ``clipped_fraction``: share of reference values outside the encoding's range
  ``[(qmin − zp)·scale − scale/2, (qmax − zp)·scale + scale/2]`` (they saturate). For a projector this is the
  *calibration coverage* miss: the calibration set did not see the real input range.
- ``clip_snr_db``: 10·log10(Σ r² / Σ (r − clip(r))²), how much of the signal the clipping throws away (+inf
  when nothing clips): two values of a 32-element decode tensor just past the range are harmless, a range
  that misses half the values is not.
- ``grid_snr_db``: 10·log10(var(r) / mean((fq(r) − r)²)) over the in-range reference values above the encoding's
  lowest bin, where ``fq`` fake-quantizes with the test encoding (clipped values are left to ``clipped_fraction``). It measures whether the encoding's step can
  represent the values that carry information at all. Values in the lowest bin (masked attention scores,
  rectified zeros) are left out, and the variance (not the mean square) is the signal, so a large constant
  offset such as an additive −1e4 mask cannot hide a collapse. ~40 dB is typical for a healthy 8-bit tensor;
  below 10 dB the step is larger than the spread (resolution collapse).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np


def _sum_sq(x: np.ndarray) -> float:
    """``Σ x²`` of a flat float64 array: numpy's ``einsum`` loop, in the calling thread (no BLAS pool), the fit's
    pinned summation since it was written (``docs/metrics.md``)."""
    return float(np.einsum("i,i->", x, x))


def encoding_range(enc: dict[str, Any]) -> tuple[float, float, float] | None:
    """``(min, max, step)`` representable by a per-tensor encoding (None for per-channel)."""
    scale = np.asarray(enc.get("scale"), dtype=np.float64)
    if scale.size != 1:
        return None
    zp = float(np.asarray(enc.get("zero_point", 0), dtype=np.float64).reshape(-1)[0])
    bits = int(enc.get("bitwidth", 8))
    qmin = enc.get("qmin", 0)
    qmax = enc.get("qmax", 2**bits - 1)
    s = float(scale.reshape(-1)[0])
    return (qmin - zp) * s, (qmax - zp) * s, s


@dataclass
class EncodingAccumulator:
    """Streams reference blocks against one per-tensor encoding."""

    lo: float
    hi: float
    step: float
    zp: float
    qmin: int
    qmax: int
    n: int = 0
    clipped: int = 0
    clip_sq: float = 0.0  # Σ (x − clip(x))²: the signal power saturation throws away
    sig_sq: float = 0.0  # Σ x²
    n_inf: int = 0
    s1: float = 0.0
    s2: float = 0.0
    noise: float = 0.0

    @classmethod
    def for_encoding(cls, enc: dict[str, Any] | None) -> EncodingAccumulator | None:
        """An accumulator for a per-tensor encoding (None when there is none or it is per-channel)."""
        if not enc or enc.get("scale") is None:
            return None
        rng = encoding_range(enc)
        if rng is None or rng[2] <= 0:
            return None
        bits = int(enc.get("bitwidth", 8))
        zp = float(np.asarray(enc.get("zero_point", 0), dtype=np.float64).reshape(-1)[0])
        return cls(rng[0], rng[1], rng[2], zp, int(enc.get("qmin", 0)), int(enc.get("qmax", 2**bits - 1)))

    def update(self, r: np.ndarray) -> None:
        """Add a block of reference values (a float64 block is used in place, without a copy).

        The same elements in the same order as the plain formulation (filter non-finite values, then
        the in-range ones, then those above the lowest bin, each by a copy), so the same sums to the last
        bit, with fewer passes: the finiteness filter runs only when ``Σ x²`` is not finite; the range
        mask only when the block's extremes leave the range; the bins are computed for the whole block
        in one reused buffer, and the two masks combine into one selection (the order of the elements is
        kept, so selecting once equals selecting twice); no selection at all when every value is kept, and then
        ``Σ x²`` of the kept values is the one already summed (the same ``einsum`` over the same array).
        """
        x = np.asarray(r, dtype=np.float64).reshape(-1)
        sig = _sum_sq(x)
        if not math.isfinite(sig):  # a non-finite value, or one whose square overflows: filter
            x = x[np.isfinite(x)]
            sig = _sum_sq(x)
        n = x.size
        if not n:
            return
        self.n += n
        half = self.step / 2
        inside = None  # None: every value is in range
        if not (x.min() >= self.lo - half and x.max() <= self.hi + half):
            inside = (x >= self.lo - half) & (x <= self.hi + half)
            self.clipped += int(n - np.count_nonzero(inside))
        self.sig_sq += sig
        if self.clipped:
            c = x - np.clip(x, self.lo, self.hi)
            self.clip_sq += _sum_sq(c)
        # resolution is judged on the in-range values (clipping is the saturation check's business)
        q = _scratch(n)
        np.divide(x, self.step, out=q)
        np.add(q, self.zp, out=q)
        np.rint(q, out=q)
        np.clip(q, self.qmin, self.qmax, out=q)
        keep = q > self.qmin  # above the lowest bin: the values that carry information
        if inside is not None:
            keep &= inside
        kept = int(np.count_nonzero(keep))
        if not kept:
            return
        if kept == n:  # every value kept: Σ x² of the kept values is the block's, summed above
            inf, fq, s2 = x, q, sig
        else:
            inf, fq = x[keep], q[keep]
            s2 = _sum_sq(inf)
        np.subtract(fq, self.zp, out=fq)
        np.multiply(fq, self.step, out=fq)
        d = np.subtract(fq, inf, out=fq)
        self.n_inf += kept
        self.s1 += float(inf.sum())
        self.s2 += s2
        self.noise += _sum_sq(d)

    #: the sums and counts :meth:`merge` adds (the encoding fields must agree)
    _SUMS = ("n", "clipped", "clip_sq", "sig_sq", "n_inf", "s1", "s2", "noise")
    _ENCODING = ("lo", "hi", "step", "zp", "qmin", "qmax")

    def merge(self, other: EncodingAccumulator) -> EncodingAccumulator:
        """Add the values another accumulator saw against the same encoding (else ``ValueError``): counts
        exactly, the float64 sums up to the order of their additions (shards of a calibration set)."""
        if any(getattr(self, f) != getattr(other, f) for f in self._ENCODING):
            raise ValueError("cannot merge encoding fits of different encodings")
        for f in self._SUMS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        return self

    def state(self) -> dict[str, Any]:
        """Plain JSON values (a shard's); floats round-trip exactly through ``json``."""
        return {f: getattr(self, f) for f in self._ENCODING + self._SUMS}

    @classmethod
    def from_state(cls, doc: dict[str, Any]) -> EncodingAccumulator:
        """The accumulator of :meth:`state` (``KeyError`` / ``TypeError`` / ``ValueError`` on a bad document)."""
        ints = ("qmin", "qmax", "n", "clipped", "n_inf")
        return cls(**{f: (int(doc[f]) if f in ints else float(doc[f])) for f in cls._ENCODING + cls._SUMS})

    def result(self) -> dict[str, Any]:
        """``clipped_fraction``, ``grid_snr_db``, ``step`` and the encoding range."""
        out: dict[str, Any] = {"clipped_fraction": None, "clip_snr_db": None, "grid_snr_db": None,
                               "enc_step": self.step, "enc_min": self.lo, "enc_max": self.hi}
        if self.n == 0:
            return out
        out["clipped_fraction"] = self.clipped / self.n
        if self.clip_sq > 0:
            out["clip_snr_db"] = 10 * math.log10(self.sig_sq / self.clip_sq) if self.sig_sq > 0 else -math.inf
        else:
            out["clip_snr_db"] = math.inf
        if self.n_inf > 1:
            mean = self.s1 / self.n_inf
            var = max(self.s2 / self.n_inf - mean * mean, 0.0)
            mse = self.noise / self.n_inf
            if mse == 0:
                out["grid_snr_db"] = math.inf
            elif var > 0:
                out["grid_snr_db"] = 10 * math.log10(var / mse)
            # a constant reference (var 0) has no spread to resolve: undefined
        return out


_local = threading.local()


def _scratch(n: int) -> np.ndarray:
    """A float64 work array of ``n`` elements, reused by the calling thread (the bins of one block)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(max(n, 1024), dtype=np.float64)
    return buf[:n]
