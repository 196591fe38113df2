"""Per-tensor summary statistics, computed in float64 in bounded-size blocks."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

STAT_FIELDS = ("min", "max", "mean", "std", "nonfinite")

#: elements per block when statistics stream through an in-memory array.
_BLOCK_ELEMS = 1 << 20


def flat_blocks(arr: np.ndarray, block_elems: int = _BLOCK_ELEMS) -> Iterator[np.ndarray]:
    """Yield contiguous flat views of ``arr`` of at most ``block_elems`` elements (no copy when contiguous)."""
    flat = arr.reshape(-1)
    for start in range(0, flat.size, block_elems):
        yield flat[start : start + block_elems]


class StatsAccumulator:
    """Streaming min/max/mean/std/non-finite count over finite values, float64 accumulation."""

    __slots__ = ("count", "max", "min", "nonfinite", "sum", "sumsq")

    def __init__(self) -> None:
        self.count = 0
        self.nonfinite = 0
        self.sum = 0.0
        self.sumsq = 0.0
        self.min = math.inf
        self.max = -math.inf

    def update(self, block: np.ndarray) -> None:
        """Add one block of values (any numeric dtype)."""
        if block.size == 0:
            return
        x = block
        if x.dtype.kind == "b":
            x = x.astype(np.uint8)
        total = None
        if x.dtype.kind == "f":
            # a float64 sum of float16/32 values cannot overflow, so it is finite exactly when every value
            # is: the NaN/Inf pass (a bool array and a count) runs only for blocks that hold one
            total = x.sum(dtype=np.float64)
            if not math.isfinite(total):
                finite = np.isfinite(x)
                total = None
                if not finite.all():
                    self.nonfinite += int(x.size - np.count_nonzero(finite))
                    x = x[finite]
                    if x.size == 0:
                        return
        self.count += int(x.size)
        # min/max in the native dtype; sums in float64 without BLAS (einsum is exact-enough and fast)
        self.min = min(self.min, float(x.min()))
        self.max = max(self.max, float(x.max()))
        self.sum += float(x.sum(dtype=np.float64) if total is None else total)
        x64 = x.astype(np.float64, copy=False)
        self.sumsq += float(np.einsum("i,i->", x64.reshape(-1), x64.reshape(-1)))

    def result(self) -> dict[str, float | int | None]:
        """The statistics as a dict (``None`` where undefined, e.g. no finite value)."""
        if self.count == 0:
            return {"min": None, "max": None, "mean": None, "std": None, "nonfinite": self.nonfinite}
        mean = self.sum / self.count
        var = max(self.sumsq / self.count - mean * mean, 0.0)
        return {"min": self.min, "max": self.max, "mean": mean, "std": math.sqrt(var), "nonfinite": self.nonfinite}


def tensor_stats(arr: np.ndarray) -> dict[str, float | int | None]:
    """Summary statistics of an array (see :class:`StatsAccumulator`)."""
    acc = StatsAccumulator()
    for block in flat_blocks(np.asarray(arr)):
        acc.update(block)
    return acc.result()


def sample_indices(size: int, k: int) -> np.ndarray:
    """Deterministic, evenly strided flat indices used by summary-only dumps (same shape, same indices)."""
    if size <= k:
        return np.arange(size, dtype=np.int64)
    return np.linspace(0, size - 1, k).round().astype(np.int64)
