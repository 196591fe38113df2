"""Pinned metric definitions (contract; ``docs/metrics.md``).

``r`` is the reference, ``t`` the test; every sum is accumulated in float64 over blocks, so a tensor of
any size is compared in bounded memory. Each result carries a ``status`` instead of hidden epsilons.
Sums of products are :func:`dot` per block (BLAS ``ddot`` held at one thread), ``Σ |t − r|`` is numpy's
pairwise sum per block, and blocks add up in order: a result does not depend on threads, workers or cores.

=========== ======================================= ===================================
name        definition                              undefined (None) when
=========== ======================================= ===================================
max_abs     max |t − r|                             shape mismatch, non-finite values
mean_abs    mean |t − r|                            as above
rmse        sqrt(mean((t − r)²))                    as above
rel_l2      ‖t − r‖₂ / ‖r‖₂                         ‖r‖ = 0
cosine      ⟨t, r⟩ / (‖t‖ ‖r‖)                      a norm is 0
sqnr_db     10 · log10(Σ r² / Σ (t − r)²)           ‖r‖ = 0; +inf when t == r
lsb_rmse    rmse / scale of the test encoding       no encoding (per-channel: mean scale)
lsb_max     max_abs / scale of the test encoding:   as lsb_rmse
            max |Δq| in integer steps when both
            sides sit on the test encoding's grid
top1        fraction of rows (last axis) whose      not a logits tensor
            argmax agrees
kl          mean over rows of KL(softmax(r) ‖       not a logits tensor
            softmax(t)), natural log
=========== ======================================= ===================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

#: metric name → True when higher is better
HIGHER_IS_BETTER = {
    "max_abs": False,
    "mean_abs": False,
    "rmse": False,
    "rel_l2": False,
    "cosine": True,
    "sqnr_db": True,
    "lsb_rmse": False,
    "lsb_max": False,
    "top1": True,
    "kl": False,
}
METRICS = tuple(HIGHER_IS_BETTER)

# statuses
OK = "ok"
IDENTICAL = "identical"
ZERO_NORM = "zero_norm"
NON_FINITE = "non_finite"
SHAPE_MISMATCH = "shape_mismatch"
EMPTY = "empty"
SAMPLED = "sampled"  # computed on the strided sample of a summary-only dump


@dataclass
class MetricAccumulator:
    """Streams blocks of (reference, test) values and produces the pinned metrics."""

    n: int = 0
    sum_abs: float = 0.0
    sum_sq_err: float = 0.0
    sum_r2: float = 0.0
    sum_t2: float = 0.0
    sum_tr: float = 0.0
    max_abs: float = 0.0
    nonfinite_ref: int = 0
    nonfinite_test: int = 0
    logits: bool = False
    rows: int = 0
    top1_agree: int = 0
    kl_sum: float = 0.0

    def update(self, r: np.ndarray, t: np.ndarray, errors: ErrorHistogram | None = None) -> np.ndarray:
        """Add one block; ``r`` and ``t`` must have the same shape.

        Both sides are cast into per-thread float64 buffers (no new arrays per block); the sums of products
        are :func:`dot` (BLAS on one thread), and the non-finite check runs only when the sums say one is there.
        ``errors`` (when given) gets the block's ``|t − r|`` of the pairs finite on both sides.
        Returns the block of ``r`` as float64, flat (a view of this thread's buffer, valid until the
        thread's next update), so that other statistics of the same block need not cast it again.
        """
        r, t = np.asarray(r), np.asarray(t)
        n = r.size
        r64, t64, d = _buffers(n)
        np.copyto(r64, r.reshape(-1), casting="unsafe")
        np.copyto(t64, t.reshape(-1), casting="unsafe")
        ref64 = r64
        s_rr, s_tt, s_tr = dot(r64, r64), dot(t64, t64), dot(t64, r64)
        bad_r = bad_t = 0
        if not (math.isfinite(s_rr) and math.isfinite(s_tt) and math.isfinite(s_tr)):
            fr, ft = np.isfinite(r64), np.isfinite(t64)
            bad_r, bad_t = n - int(np.count_nonzero(fr)), n - int(np.count_nonzero(ft))
            if bad_r or bad_t:  # finite in both only
                both = fr & ft
                r64, t64 = r64[both], t64[both]
                d = np.empty_like(r64)
                s_rr, s_tt, s_tr = dot(r64, r64), dot(t64, t64), dot(t64, r64)
        self.nonfinite_ref += bad_r
        self.nonfinite_test += bad_t
        if r64.size:
            np.subtract(t64, r64, out=d)
            self.sum_sq_err += dot(d, d)
            np.abs(d, out=d)
            self.max_abs = max(self.max_abs, float(d.max()))
            self.sum_abs += float(d.sum())
            if errors is not None:
                errors.update(d)
            self.sum_r2 += s_rr
            self.sum_t2 += s_tt
            self.sum_tr += s_tr
        self.n += int(r64.size)
        if self.logits and r.ndim >= 1 and r.shape[-1] > 1 and not (bad_r or bad_t):
            rr2 = r.astype(np.float64, copy=False).reshape(-1, r.shape[-1])
            tt2 = t.astype(np.float64, copy=False).reshape(-1, t.shape[-1])
            self.rows += rr2.shape[0]
            self.top1_agree += int(np.count_nonzero(rr2.argmax(-1) == tt2.argmax(-1)))
            lp = _log_softmax(rr2)
            lq = _log_softmax(tt2)
            self.kl_sum += float(np.sum(np.exp(lp) * (lp - lq)))
        return ref64

    def merge(self, other: MetricAccumulator) -> MetricAccumulator:
        """Add another accumulator's blocks (a shard of the same tensors): counts and sums add, maxima take the
        larger; the result is that of one pass over both up to the order of the float64 additions."""
        for f in _SUM_FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.max_abs = max(self.max_abs, other.max_abs)
        self.logits = self.logits or other.logits
        return self

    def state(self) -> dict[str, Any]:
        """The accumulator as plain JSON values (floats round-trip exactly through ``json``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, doc: dict[str, Any]) -> MetricAccumulator:
        """The accumulator of :meth:`state`."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(doc) - set(fields)
        if unknown:
            raise ValueError(f"unknown accumulator fields {sorted(unknown)}")
        return cls(**{k: (bool(v) if k == "logits" else int(v) if isinstance(getattr(cls, k), int) else float(v))
                      for k, v in doc.items()})

    def result(self, encoding: dict[str, Any] | None = None) -> dict[str, Any]:
        """The metrics and their status."""
        out: dict[str, Any] = dict.fromkeys(METRICS)
        out["nonfinite_ref"] = self.nonfinite_ref
        out["nonfinite_test"] = self.nonfinite_test
        if self.n == 0 and not (self.nonfinite_ref or self.nonfinite_test):
            out["status"] = EMPTY
            return out
        if self.nonfinite_ref or self.nonfinite_test:
            out["status"] = NON_FINITE
            return out
        n = self.n
        out["max_abs"] = self.max_abs
        out["mean_abs"] = self.sum_abs / n
        out["rmse"] = math.sqrt(self.sum_sq_err / n)
        nr, nt = math.sqrt(self.sum_r2), math.sqrt(self.sum_t2)
        status = OK
        if self.sum_sq_err == 0.0:
            status = IDENTICAL
        if nr > 0:
            out["rel_l2"] = math.sqrt(self.sum_sq_err) / nr
            out["sqnr_db"] = math.inf if self.sum_sq_err == 0 else 10.0 * math.log10(self.sum_r2 / self.sum_sq_err)
        elif status != IDENTICAL:
            status = ZERO_NORM
        if nr > 0 and nt > 0:
            out["cosine"] = max(-1.0, min(1.0, self.sum_tr / (nr * nt)))
        if encoding is not None and encoding.get("scale") is not None:
            scale = float(np.mean(np.asarray(encoding["scale"], dtype=np.float64)))
            if scale > 0:
                out["lsb_rmse"] = out["rmse"] / scale
                out["lsb_max"] = out["max_abs"] / scale
        if self.logits and self.rows:
            out["top1"] = self.top1_agree / self.rows
            out["kl"] = max(0.0, self.kl_sum / self.rows)
        out["status"] = status
        return out


#: the fields of :class:`MetricAccumulator` that add when two accumulators merge
_SUM_FIELDS = ("n", "sum_abs", "sum_sq_err", "sum_r2", "sum_t2", "sum_tr", "nonfinite_ref", "nonfinite_test", "rows",
               "top1_agree", "kl_sum")


class _OneBlasThread(contextlib.ContextDecorator):
    """Holds numpy's BLAS at one thread while any :func:`dot` runs (re-entrant, counted over threads).

    The first entry saves the BLAS thread count and sets it to 1, the last exit restores it: a notebook's own
    numpy keeps its threads outside the comparison. threadpoolctl finds the BLAS numpy loaded (OpenBLAS in the
    wheels, MKL or another build elsewhere); a BLAS it cannot control is left as it is. Changing the count costs
    far more than a short ``ddot`` while other threads run (OpenBLAS wakes its pool): loops over many tensors
    enter it once around the loop (``with one_blas_thread:`` or as a decorator), so the dots inside only count.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._libs: list[Any] | None = None
        self._saved: list[int] = []

    def _controllers(self) -> list[Any]:
        if self._libs is None:
            from threadpoolctl import ThreadpoolController

            blas = ThreadpoolController().select(user_api="blas").lib_controllers
            mine = [c for c in blas if "numpy" in str(getattr(c, "filepath", ""))]
            self._libs = mine or blas
        return self._libs

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                libs = self._controllers()
                self._saved = [c.get_num_threads() for c in libs]
                for c, n in zip(libs, self._saved, strict=True):
                    if n != 1:
                        c.set_num_threads(1)
            self._depth += 1

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for c, n in zip(self._controllers(), self._saved, strict=True):
                    if n != 1:
                        c.set_num_threads(n)


one_blas_thread = _OneBlasThread()


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """``Σ a·b`` of two flat float64 arrays: BLAS ``ddot`` on one thread (:data:`one_blas_thread`).

    OpenBLAS splits a long ``ddot`` (over 10,000 elements) across its thread pool, so its last bits depend on
    the number of threads and cores; on one thread it is one fixed order for a given BLAS and CPU kernel. One
    thread is also the fast choice here: the comparator's workers are the parallelism, and BLAS pools per
    worker thread fought over the cores (the ``bench/bench_many.py`` diff took 101-129 s with them, 10-12 s
    without: ``docs/scale.md``, ``docs/metrics.md``).
    """
    with one_blas_thread:
        return float(a @ b)


_local = threading.local()


def _buffers(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three float64 work arrays of ``n`` elements, reused by the calling thread."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.shape[1] < n:
        buf = np.empty((3, max(n, 1024)), dtype=np.float64)
        _local.buf = buf
    return buf[0, :n], buf[1, :n], buf[2, :n]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compute(r: np.ndarray, t: np.ndarray, *, logits: bool = False,
            encoding: dict[str, Any] | None = None) -> dict[str, Any]:
    """All metrics for two in-memory arrays (status ``shape_mismatch`` when shapes differ)."""
    r, t = np.asarray(r), np.asarray(t)
    if r.shape != t.shape:
        out: dict[str, Any] = dict.fromkeys(METRICS)
        out.update(status=SHAPE_MISMATCH, nonfinite_ref=None, nonfinite_test=None)
        return out
    acc = MetricAccumulator(logits=logits)
    acc.update(r, t)
    return acc.result(encoding)


def is_better(metric: str, a: float | None, b: float | None) -> bool:
    """True when value ``a`` is strictly better than ``b`` for ``metric`` (None is worst)."""
    if a is None:
        return False
    if b is None:
        return True
    return a > b if HIGHER_IS_BETTER[metric] else a < b


def sort_key(metric: str, value: float | None, status: str) -> float:
    """Sort key putting the worst value first (non-finite / mismatched first of all)."""
    if status in (NON_FINITE, SHAPE_MISMATCH):
        return -math.inf
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return math.inf
    return value if HIGHER_IS_BETTER[metric] else -value


# ------------------------------------------------------------------------------- three-way (backend vs quantization)
#: |error| histograms of the distribution-shape test: log10 bins per decade, decades below the reference's scale
ERR_HIST_BINS_PER_DECADE = 8
ERR_HIST_DECADES = 12
#: values a distribution-shape test needs (fewer: the Bhattacharyya coefficient is undefined)
SHAPE_TEST_MIN_VALUES = 64


def rel_linf(max_abs_err: float | None, max_abs_ref: float | None) -> float | None:
    """Relative L∞ error ``max|t − r| / max|r|`` (None when either is unknown or ``max|r| = 0``)."""
    if max_abs_err is None or max_abs_ref is None or not max_abs_ref > 0:
        return None
    return float(max_abs_err) / float(max_abs_ref)


@dataclass
class ErrorHistogram:
    """Float64 counts of ``|t − r|`` on fixed log10 bins set by the reference's scale ``s = max|r|``.

    With ``b = ERR_HIST_BINS_PER_DECADE`` and ``D = ERR_HIST_DECADES`` there are ``B = b·D`` log bins plus two
    end bins: bin 0 holds ``|d| < s·10^-D`` (exact zeros included), bin ``k = 1..B`` holds
    ``s·10^(−D + (k−1)/b) <= |d| < s·10^(−D + k/b)``, bin ``B + 1`` holds ``|d| >= s``. The bins depend only on
    the reference, so the histograms of two tests against the same reference (a backend and CPU-QDQ) share
    them and are built in one streaming pass.
    """

    scale: float
    counts: Any = None

    def __post_init__(self) -> None:
        if self.counts is None:
            self.counts = np.zeros(ERR_HIST_BINS_PER_DECADE * ERR_HIST_DECADES + 2, dtype=np.float64)
        if not (self.scale > 0 and math.isfinite(self.scale)):
            self.scale = 1.0

    def merge(self, other: ErrorHistogram) -> ErrorHistogram:
        """Add another shard's counts; its bins must be the same (the same reference scale)."""
        if other.scale != self.scale:
            raise ValueError(f"cannot merge error histograms on different bins ({self.scale!r} vs {other.scale!r})")
        self.counts = self.counts + other.counts
        return self

    def update(self, abs_err: np.ndarray) -> None:
        """Add a block of finite ``|t − r|`` values."""
        n = self.counts.size
        with np.errstate(divide="ignore"):
            x = (np.log10(np.asarray(abs_err, dtype=np.float64) / self.scale) + ERR_HIST_DECADES)
        x *= ERR_HIST_BINS_PER_DECADE
        np.floor(x, out=x)
        x += 1
        np.clip(x, 0, n - 1, out=x)  # -inf (exact zeros) -> bin 0
        self.counts += np.bincount(x.astype(np.int64), minlength=n)


def bhattacharyya(h1: np.ndarray, h2: np.ndarray) -> float | None:
    """Bhattacharyya coefficient ``BC = Σ_k sqrt(p_k · q_k)`` of two histograms on the same bins, with
    ``p = h1 / Σ h1``, ``q = h2 / Σ h2`` (float64). 1 when the two distributions are the same, 0 when they
    share no bin; None when a histogram is empty."""
    a, b = np.asarray(h1, dtype=np.float64), np.asarray(h2, dtype=np.float64)
    sa, sb = float(a.sum()), float(b.sum())
    if not (sa > 0 and sb > 0):
        return None
    return float(min(1.0, np.sqrt((a / sa) * (b / sb)).sum()))
