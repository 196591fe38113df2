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
from dataclasses import dataclass
from typing import Any

import numpy as np


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
        """Add a block of reference values."""
        x = np.asarray(r, dtype=np.float64).reshape(-1)
        x = x[np.isfinite(x)]
        if not x.size:
            return
        self.n += x.size
        half = self.step / 2
        inside = (x >= self.lo - half) & (x <= self.hi + half)
        self.clipped += int(x.size - np.count_nonzero(inside))
        self.sig_sq += float(np.einsum("i,i->", x, x))
        if self.clipped:
            c = x - np.clip(x, self.lo, self.hi)
            self.clip_sq += float(np.einsum("i,i->", c, c))
        # resolution is judged on the in-range values (clipping is the saturation check's business)
        x = x[inside]
        q = np.clip(np.round(x / self.step + self.zp), self.qmin, self.qmax)
        keep = q > self.qmin  # above the lowest bin: the values that carry information
        inf = x[keep]
        if not inf.size:
            return
        fq = (q[keep] - self.zp) * self.step
        d = fq - inf
        self.n_inf += inf.size
        self.s1 += float(inf.sum())
        self.s2 += float(np.einsum("i,i->", inf, inf))
        self.noise += float(np.einsum("i,i->", d, d))

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
