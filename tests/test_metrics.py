"""The pinned metric definitions, checked against direct float64 formulas."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.comparator import compare
from ivq_debug.dump import DumpWriter
from ivq_debug.metrics import MetricAccumulator, compute


def test_definitions_match_float64_formulas() -> None:
    rng = np.random.default_rng(0)
    r = rng.standard_normal((4, 33, 17)).astype(np.float32)
    t = (r + 0.01 * rng.standard_normal(r.shape)).astype(np.float32)
    m = compute(r, t)
    r64, t64 = r.astype(np.float64), t.astype(np.float64)
    d = t64 - r64
    assert m["status"] == "ok"
    assert m["max_abs"] == np.abs(d).max()
    assert m["mean_abs"] == pytest.approx(np.abs(d).mean(), rel=1e-12)
    assert m["rmse"] == pytest.approx(math.sqrt((d**2).mean()), rel=1e-12)
    assert m["rel_l2"] == pytest.approx(np.linalg.norm(d) / np.linalg.norm(r64), rel=1e-12)
    assert m["cosine"] == pytest.approx((t64 * r64).sum() / np.linalg.norm(t64) / np.linalg.norm(r64), rel=1e-12)
    assert m["sqnr_db"] == pytest.approx(10 * math.log10((r64**2).sum() / (d**2).sum()), rel=1e-12)
    # ~1 % noise amplitude is ~40 dB
    assert 39 < m["sqnr_db"] < 41


def test_streaming_equals_one_shot() -> None:
    rng = np.random.default_rng(2)
    r = rng.standard_normal((64, 50))
    t = r + rng.standard_normal(r.shape) * 0.1
    one = compute(r, t, logits=True)
    acc = MetricAccumulator(logits=True)
    for i in range(0, 64, 7):
        acc.update(r[i : i + 7], t[i : i + 7])
    streamed = acc.result()
    for k in ("max_abs", "mean_abs", "rmse", "rel_l2", "cosine", "sqnr_db", "top1", "kl"):
        assert streamed[k] == pytest.approx(one[k], rel=1e-10), k


def test_statuses_instead_of_epsilons() -> None:
    a = np.arange(6, dtype=np.float32)
    same = compute(a, a.copy())
    assert same["status"] == "identical" and same["sqnr_db"] == math.inf and same["max_abs"] == 0
    z = compute(np.zeros(4), np.ones(4))
    assert z["status"] == "zero_norm" and z["sqnr_db"] is None and z["cosine"] is None and z["max_abs"] == 1
    nf = compute(np.array([1.0, np.nan]), np.array([1.0, 2.0]))
    assert nf["status"] == "non_finite" and nf["max_abs"] is None and nf["nonfinite_ref"] == 1
    sm = compute(np.zeros((2, 3)), np.zeros((3, 2)))
    assert sm["status"] == "shape_mismatch"
    assert compute(np.zeros(0), np.zeros(0))["status"] == "empty"


def test_logits_metrics_and_lsb() -> None:
    rng = np.random.default_rng(3)
    r = rng.standard_normal((10, 20))
    t = r.copy()
    t[0, r[0].argmax()] -= 100  # row 0's argmax moves
    m = compute(r, t, logits=True, encoding={"scale": 0.5})
    assert m["top1"] == pytest.approx(0.9)
    p = np.exp(r - r.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    q = np.exp(t - t.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    assert m["kl"] == pytest.approx(np.mean(np.sum(p * np.log(p / q), 1)), rel=1e-9)
    assert m["lsb_rmse"] == pytest.approx(m["rmse"] / 0.5)


_SUMS = """
import json, sys
import numpy as np
from ivq_debug.encoding_fit import EncodingAccumulator
from ivq_debug.metrics import MetricAccumulator
from threadpoolctl import threadpool_info, threadpool_limits
blas_threads = lambda: [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
before = blas_threads()
rng = np.random.default_rng(0)
r = rng.standard_normal(400_000).astype(np.float32)  # long enough for OpenBLAS to split ddot over threads
t = (r + 0.01 * rng.standard_normal(r.size)).astype(np.float32)
acc, enc = MetricAccumulator(), EncodingAccumulator.for_encoding({"scale": 0.03, "zero_point": 128})
for i in range(0, r.size, 150_000):  # three blocks
    enc.update(acc.update(r[i:i + 150_000], t[i:i + 150_000]))
r64 = r.astype(np.float64)
pinned = 0.0
with threadpool_limits(1, user_api="blas"):  # the definition: one-thread ddot per block, blocks in order
    for i in range(0, r.size, 150_000):
        pinned += float(r64[i:i + 150_000] @ r64[i:i + 150_000])
print(json.dumps({"ours": {k: float(v).hex() for k, v in {**vars(acc), **vars(enc)}.items()
                          if isinstance(v, float)}, "blas": float(r64 @ r64).hex(), "pinned_r2": pinned.hex(),
                  "threads": [before, blas_threads()]}))
"""


def test_sums_do_not_depend_on_the_blas_thread_count() -> None:
    """The pinned sums are the same with 1 and 4 OpenBLAS threads (and run to run); BLAS ddot's are not
    always (when they are equal, this machine's BLAS did not split the vector, and only ours are checked). The
    metric sums are one-thread ddots per block (what the code before issue 22 gave with ``OPENBLAS_NUM_THREADS=1``),
    and the process's BLAS thread count is what it was once the sums are done."""

    runs = []
    for threads in ("1", "4", "4"):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
        out = subprocess.run([sys.executable, "-c", _SUMS], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout))
    assert len(runs[0]["ours"]) == 16
    assert all(r["ours"] == runs[0]["ours"] for r in runs)
    assert all(r["ours"]["sum_r2"] == r["pinned_r2"] for r in runs)
    assert runs[0]["threads"][0] == [1] and all(r["threads"][0] == r["threads"][1] for r in runs), runs
    blas = {r["blas"] for r in runs}
    print(f"BLAS ddot over 1 and 4 threads: {len(blas)} distinct results")


def test_workers_do_not_change_a_comparison(tmp_path: Path) -> None:
    """The same table with 1 and 3 worker threads, and twice with the default."""

    rng = np.random.default_rng(5)
    for side, noise in (("r", 0.0), ("t", 0.02)):
        rng_side = np.random.default_rng(5)
        with DumpWriter(tmp_path / f"{side}.h5", backend="x", overwrite=True) as w:
            w.begin_record()
            for k in range(6):
                x = rng_side.standard_normal((2, 197, 384)).astype(np.float32)
                w.add_tensor(f"t{k}", x + np.float32(noise) * rng.standard_normal(x.shape).astype(np.float32),
                             order=k, encoding={"scale": 0.02, "zero_point": 128} if side == "t" else None)
    tables = [compare(tmp_path / "r.h5", tmp_path / "t.h5", progress=False, workers=w).table for w in (1, 3, None, None)]
    cols = ["ref_name", "status", "max_abs", "mean_abs", "rmse", "rel_l2", "cosine", "sqnr_db", "clipped_fraction",
            "clip_snr_db", "grid_snr_db"]
    first = tables[0][cols].to_dict("records")
    assert all(t[cols].to_dict("records") == first for t in tables[1:])
    assert 30 < first[0]["sqnr_db"] < 40


def test_accumulator_feeds_the_error_histogram_of_finite_pairs() -> None:
    """``update(..., errors=h)`` bins ``|t − r|`` of the pairs finite on both sides (the three-way's histograms)."""
    from ivq_debug.metrics import ErrorHistogram, MetricAccumulator

    rng = np.random.default_rng(5)
    r = rng.standard_normal(5000).astype(np.float32)
    t = r + np.float32(0.01) * rng.standard_normal(5000).astype(np.float32)
    t[7], r[9] = np.nan, np.inf
    h, want = ErrorHistogram(4.0), ErrorHistogram(4.0)
    acc = MetricAccumulator()
    acc.update(r[:2500], t[:2500], h)
    acc.update(r[2500:], t[2500:], h)
    ok = np.isfinite(r) & np.isfinite(t)
    want.update(np.abs(t[ok].astype(np.float64) - r[ok].astype(np.float64)))
    assert np.array_equal(h.counts, want.counts) and h.counts.sum() == 4998
    assert acc.n == 4998 and acc.nonfinite_test == 1 and acc.nonfinite_ref == 1
