"""The encoding fit's streaming statistics equal the plain formulation to the last bit."""

from __future__ import annotations

import math
from dataclasses import astuple

import numpy as np
import pytest

from ivq_debug.encoding_fit import EncodingAccumulator


def _plain_update(acc: EncodingAccumulator, r: np.ndarray) -> None:
    """The formulation the statistics are defined by: filter non-finite values, then the in-range ones,
    then those above the lowest bin, each by a copy (the code before issue 22)."""
    x = np.asarray(r, dtype=np.float64).reshape(-1)
    x = x[np.isfinite(x)]
    if not x.size:
        return
    acc.n += x.size
    half = acc.step / 2
    inside = (x >= acc.lo - half) & (x <= acc.hi + half)
    acc.clipped += int(x.size - np.count_nonzero(inside))
    acc.sig_sq += float(np.einsum("i,i->", x, x))
    if acc.clipped:
        c = x - np.clip(x, acc.lo, acc.hi)
        acc.clip_sq += float(np.einsum("i,i->", c, c))
    x = x[inside]
    q = np.clip(np.round(x / acc.step + acc.zp), acc.qmin, acc.qmax)
    keep = q > acc.qmin
    inf = x[keep]
    if not inf.size:
        return
    fq = (q[keep] - acc.zp) * acc.step
    d = fq - inf
    acc.n_inf += inf.size
    acc.s1 += float(inf.sum())
    acc.s2 += float(np.einsum("i,i->", inf, inf))
    acc.noise += float(np.einsum("i,i->", d, d))


def _exact(values: object) -> list[str]:
    return [repr(v) if v is None or not math.isfinite(v) else float(v).hex() for v in values]  # type: ignore[attr-defined]


ENC = {"scale": 0.05, "zero_point": 128, "bitwidth": 8}  # range [-6.4, 6.35]


def _blocks(kind: str, rng: np.random.Generator) -> list[np.ndarray]:
    """Streams of float32 blocks that take each path of the update."""
    g = rng.standard_normal
    if kind == "in-range":  # nothing filtered: no selection at all
        return [np.clip(g(5000), -6, 6).astype(np.float32) + 0.0 for _ in range(3)]
    if kind == "lowest-bin":  # rectified: many values in the lowest bin
        return [np.clip(g(4096) * 2, -6.4, 6).astype(np.float32) for _ in range(2)]
    if kind == "clipped":  # values beyond the range, and just inside the half-step margin
        b = (g(6000) * 4).astype(np.float32)
        b[:4] = [6.35 + 0.024, 6.35 + 0.026, -6.4 - 0.024, -6.4 - 0.026]
        return [np.clip(g(3000), -1, 1).astype(np.float32), b, (g(100) * 0.1).astype(np.float32)]
    if kind == "non-finite":
        b = g(3000).astype(np.float32)
        b[[3, 70, 2999]] = [np.nan, np.inf, -np.inf]
        return [b, np.full(8, np.nan, np.float32), g(50).astype(np.float32)]
    if kind == "overflowing-square":  # finite values whose squares overflow float64
        return [np.array([1e200, -1e200, 0.1, 2.0]), g(10)]
    if kind == "constant":
        return [np.full(1000, -6.4, np.float32), np.zeros(0, np.float32)]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["in-range", "lowest-bin", "clipped", "non-finite", "overflowing-square", "constant"])
def test_streamed_statistics_equal_the_plain_formulation_bit_for_bit(kind: str) -> None:
    rng = np.random.default_rng(7)
    fast, plain = EncodingAccumulator.for_encoding(ENC), EncodingAccumulator.for_encoding(ENC)
    assert fast is not None and plain is not None
    for b in _blocks(kind, rng):
        fast.update(b)
        _plain_update(plain, b)
    assert _exact(astuple(fast)) == _exact(astuple(plain))
    assert _exact(fast.result().values()) == _exact(plain.result().values())
    # the blocks take the paths they are named after
    if kind == "in-range":
        assert fast.clipped == 0 and fast.n_inf == fast.n == 15000
    if kind == "lowest-bin":
        assert fast.clipped == 0 and 0 < fast.n_inf < fast.n
    if kind == "clipped":  # 6.374 and -6.424 are within half a step of the range, 6.376 and -6.426 are not
        assert fast.clipped >= 2 and fast.clip_sq > 0 and 0 < fast.result()["clipped_fraction"] < 0.2
    if kind == "non-finite":
        assert fast.n == 3000 - 3 + 50
    if kind == "overflowing-square":
        assert fast.sig_sq == math.inf and fast.n == 14


def test_a_float64_block_is_not_modified() -> None:
    x = np.linspace(-7, 7, 999)
    before = x.copy()
    acc = EncodingAccumulator.for_encoding(ENC)
    assert acc is not None
    acc.update(x)
    assert np.array_equal(x, before)
