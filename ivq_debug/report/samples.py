"""Bounded value samples of dump tensors for the report's drill-downs.

A sample is the evenly strided set of flat indices ``round(linspace(0, n − 1, k))`` (the same rule as
summary-only dumps), so the reference and the test sample of one pair sit at the same positions. Full
tensors are streamed block by block (:meth:`Dump.iter_blocks`): memory stays bounded by one block plus
the sample, whatever the tensor size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.dump.stats import sample_indices

#: values per tensor behind each drill-down histogram
HIST_SAMPLES = 65536


def strided_sample(dump: Any, entry: Any, k: int, block_bytes: int = defaults.COMPARE_BLOCK_BYTES) -> np.ndarray:
    """``k`` (or fewer) evenly strided values of a tensor as float64, read in bounded memory.

    Summary-only tensors return (a strided subset of) their stored sample.
    """

    if entry.stored != "full":
        s = np.asarray(dump.read_sample(entry), dtype=np.float64).reshape(-1)
        return s[sample_indices(s.size, k)]
    n = int(entry.size)
    idx = sample_indices(n, k)
    if n == 0:
        return np.zeros(0)
    out = np.empty(idx.size, dtype=np.float64)
    pos = 0  # flat offset of the current block
    j = 0  # next sample index to fill
    for block in dump.iter_blocks(entry, block_bytes):
        flat = np.asarray(block).reshape(-1)
        end = pos + flat.size
        stop = int(np.searchsorted(idx, end, side="left"))
        if stop > j:
            out[j:stop] = flat[idx[j:stop] - pos]
            j = stop
        pos = end
        if j >= idx.size:
            break
    return out[:j]


def pair_samples(cmp: Any, row: int, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Reference and test samples (same positions) of row ``row`` of a comparison; ``None`` when the pair
    has different element counts or its entries cannot be found."""
    pairs = cmp.alignment.pairs
    if len(pairs) != len(cmp.table) or row >= len(pairs):
        return None
    p = pairs[row]
    if p.ref.name != cmp.table["ref_name"].iloc[row] or p.ref.size != p.test.size:
        return None
    a = strided_sample(cmp.ref, p.ref, k)
    b = strided_sample(cmp.test, p.test, k)
    m = min(a.size, b.size)
    return a[:m], b[:m]
