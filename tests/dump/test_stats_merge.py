"""Statistics that merge exactly (issue 15): per-tensor summaries (count, sum, sum of squares, min, max, a histogram on
fixed edges) and the error sums behind SQNR, accumulated per shard (200 samples here, as a calibration set over 200
images) and merged, equal one pass over every sample: counts, histograms and extrema exactly, sums to 1e-12 relative,
also through the shards' JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ivq_debug.dump.stats import StatsAccumulator
from ivq_debug.metrics import ErrorHistogram, MetricAccumulator

EDGES = np.linspace(-4.0, 4.0, 33)


def samples(n: int = 200) -> list[np.ndarray]:
    rng = np.random.default_rng(15)
    return [(rng.standard_normal(rng.integers(50, 400)) * (1 + i % 7)).astype(np.float32) for i in range(n)]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def test_tensor_summaries_merge_to_one_pass() -> None:
    xs = samples()
    xs[17][3] = np.nan  # a non-finite value counts the same either way
    one = StatsAccumulator(EDGES)
    for x in xs:
        one.update(x)
    shards = []
    for chunk in (xs[i:i + 13] for i in range(0, len(xs), 13)):  # 16 shards of up to 13 samples
        acc = StatsAccumulator(EDGES)
        for x in chunk:
            acc.update(x)
        shards.append(StatsAccumulator.from_state(json.loads(json.dumps(acc.state()))))  # through a JSON shard
    merged = StatsAccumulator(EDGES)
    for s in reversed(shards):  # any order
        merged.merge(s)
    assert (merged.count, merged.nonfinite, merged.min, merged.max) == (one.count, one.nonfinite, one.min, one.max)
    assert merged.hist.tolist() == one.hist.tolist() and merged.hist.sum() == one.count
    assert rel(merged.sum, one.sum) < 1e-12 and rel(merged.sumsq, one.sumsq) < 1e-12
    a, b = merged.result(), one.result()
    assert rel(a["mean"], b["mean"]) < 1e-12 and rel(a["std"], b["std"]) < 1e-12
    # the histogram on its fixed edges: bin 0 below the first edge, the last at or above the last edge
    flat = np.concatenate(xs).astype(np.float64)
    flat = flat[np.isfinite(flat)]
    inner, _ = np.histogram(flat[(flat >= EDGES[0]) & (flat < EDGES[-1])], EDGES)
    assert one.hist[1:-1].tolist() == inner.tolist()
    assert one.hist[0] == np.count_nonzero(flat < EDGES[0]) and one.hist[-1] == np.count_nonzero(flat >= EDGES[-1])
    with pytest.raises(ValueError, match="different histogram edges"):
        merged.merge(StatsAccumulator(EDGES[::2]))


def test_error_sums_behind_sqnr_merge_to_one_pass() -> None:
    rng = np.random.default_rng(16)
    refs = samples()
    tests = [(r + 0.01 * rng.standard_normal(r.size)).astype(np.float32) for r in refs]
    scale = max(float(np.max(np.abs(r))) for r in refs)
    one, one_h = MetricAccumulator(), ErrorHistogram(scale)
    for r, t in zip(refs, tests, strict=True):
        one.update(r, t)
        one_h.update(np.abs(t.astype(np.float64) - r))
    merged, merged_h = MetricAccumulator(), ErrorHistogram(scale)
    for i in range(0, len(refs), 9):
        acc, h = MetricAccumulator(), ErrorHistogram(scale)
        for r, t in zip(refs[i:i + 9], tests[i:i + 9], strict=True):
            acc.update(r, t)
            h.update(np.abs(t.astype(np.float64) - r))
        merged.merge(MetricAccumulator.from_state(json.loads(json.dumps(acc.state()))))
        merged_h.merge(h)
    assert merged.n == one.n and merged.max_abs == one.max_abs
    for f in ("sum_abs", "sum_sq_err", "sum_r2", "sum_t2", "sum_tr"):
        assert rel(getattr(merged, f), getattr(one, f)) < 1e-12, f
    a, b = merged.result(), one.result()
    for m in ("sqnr_db", "rmse", "rel_l2", "cosine", "mean_abs", "max_abs"):
        assert rel(a[m], b[m]) < 1e-12, m
    assert 38 < a["sqnr_db"] < 60 and merged_h.counts.tolist() == one_h.counts.tolist()
    with pytest.raises(ValueError, match="different bins"):
        merged_h.merge(ErrorHistogram(scale * 2))


@pytest.mark.parametrize("lo, hi, n", [(-3.0, 5.0, 257), (0.0, 1e-300, 9), (-1e300, 1e300, 257), (1.0, 1.0 + 1e-12, 65),
                                       (-4.0, 4.0, 33)])
def test_evenly_spaced_edges_give_the_binary_search_bins(lo: float, hi: float, n: int) -> None:
    """The arithmetic bins of evenly spaced edges equal ``np.searchsorted``'s, values on and next to every edge
    included (``calib_stats`` fixes its edges with ``np.linspace``)."""
    edges = np.unique(np.linspace(lo, np.nextafter(hi, np.inf), n))
    rng = np.random.default_rng(n)
    x = np.concatenate([rng.uniform(lo, hi, 20000), edges, np.nextafter(edges, -np.inf), np.nextafter(edges, np.inf),
                        [lo - 1.0, hi + 1.0, -1e308, 1e308]])
    acc = StatsAccumulator(edges)
    assert acc._linear is not None
    acc.update(x)
    assert acc.hist.tolist() == np.bincount(np.searchsorted(edges, x, side="right"), minlength=edges.size + 1).tolist()
