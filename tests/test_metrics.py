"""The pinned metric definitions, checked against direct float64 formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

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
