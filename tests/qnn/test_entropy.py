"""Entropy calibration (``ivq_debug.qnn.entropy``): ORT's algorithm with its threshold search vectorized. Every range
is compared with ORT's own ``create_calibrator(..., CalibrationMethod.Entropy, extra_options={"num_bins", "num_quantized_bins"})``
on the repo's small models, each window's divergence with ORT's own arithmetic, and a changed bin count is seen."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest

from ivq_debug.qnn.entropy import (
    ENTROPY_BINS,
    divergences,
    entropy_ranges,
    entropy_threshold,
    orts_divergence,
)
from ivq_debug.qnn.quantize import _reader, calibration_cache_key, preprocess_float_model, quantize_for_qnn
from tests.support import qnn_models
from tests.support.lever_models import build_two_causes, two_causes_sample

Ranges = dict[str, tuple[float, float]]


def _of(td: Any) -> Ranges:
    return {k: tuple(np.asarray(v, np.float32).item() for v in t.range_value) for k, t in td.data.items()}


def _orts(model: Path, samples: list[dict], bins: tuple[int, int], tmp: Path) -> Ranges:
    """ORT's own entropy calibration of ``model`` with ``bins`` (its Python threshold loop)."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    c = create_calibrator(model, list(set(QLinearOpsRegistry) | set(QDQRegistry)), str(tmp / "aug.onnx"),
                          CalibrationMethod.Entropy,
                          extra_options={"num_bins": bins[0], "num_quantized_bins": bins[1]})
    c.collect_data(SimpleNamespace(get_next=iter([*samples, None]).__next__))
    return _of(c.compute_data())


def _ours(model: Path, samples: list[dict], bins: tuple[int, int]) -> Ranges:
    """``entropy_ranges`` on the config ``quantize_for_qnn`` makes (a8w8: the model calibrated as it is)."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    cfg = get_qnn_qdq_config(model, _reader(samples), calibrate_method=CalibrationMethod.Entropy)
    return _of(entropy_ranges(model, cfg, bins))


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("two")
    model = build_two_causes(tmp / "two.onnx")
    cal = [two_causes_sample(i) for i in range(8)]
    return {"model": model, "cal": cal, "orts": _orts(model, cal, ENTROPY_BINS, tmp), "tmp": tmp}


def test_every_range_is_orts_entropy_calibration_with_its_bins(two: dict) -> None:
    ours = _ours(two["model"], two["cal"], ENTROPY_BINS)
    assert set(ours) == set(two["orts"]) and len(ours) >= 6
    assert ours == two["orts"]  # to the bit: ORT's edges, min and max
    # entropy clips: the ReLU output, 1/8 of it the constant 100, to 8.2 (measured), not MinMax's full range
    assert two["orts"]["rb"][1] < 10.0  # MinMax's: 100


def test_a_changed_bin_count_changes_the_ranges(two: dict) -> None:
    """The fault the comparison must see: 64 quantized bins instead of 128."""
    changed = _ours(two["model"], two["cal"], (ENTROPY_BINS[0], 64))
    assert set(changed) == set(two["orts"])
    assert changed != two["orts"]
    assert changed["rb"][1] != two["orts"]["rb"][1]


def test_every_range_of_the_transformer_block_is_orts(tmp_path: Path) -> None:
    """The 40-odd tensors of the test transformer block (LayerNorm, MatMul, Softmax, GELU...), 512 / 64 bins (ORT's
    loop at 2048 / 128 takes 0.5 s a tensor)."""
    model = tmp_path / "block.onnx"
    onnx.save(qnn_models.build_block(0), str(model))
    cal = qnn_models.block_feeds(3, 4)
    ours, orts = _ours(model, cal, (512, 64)), _orts(model, cal, (512, 64), tmp_path)
    assert set(ours) == set(orts) and len(ours) >= 20
    assert ours == orts


def _histograms() -> list[tuple[str, np.ndarray, np.ndarray, Any, Any]]:
    """ORT-made histograms of shapes a search meets: normal, a ReLU with outliers, few values (a spike train), a
    constant, every value in one bin off the middle, and an empty tensor."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    rng = np.random.default_rng(7)
    relu = np.maximum(rng.standard_normal(50_000), 0).astype(np.float32)
    relu[:3] = 60.0
    arrays = {"normal": rng.standard_normal(80_000).astype(np.float32), "relu": relu,
              "levels": (rng.integers(0, 5, 20_000) * 0.25).astype(np.float32), "constant": np.full(100, 3.0, np.float32),
              "skewed": np.concatenate([np.full(500, 1.0, np.float32), np.full(5, -0.01, np.float32)]),
              "empty": np.zeros(0, np.float32)}
    out = []
    for bins in ((256, 64), (301, 11)):
        col = HistogramCollector("entropy", False, bins[0], bins[1], 99.99, "same")
        col.collect({k: [v] for k, v in arrays.items()})
        out += [(f"{k} {bins}", h[0], h[1], h[2], h[3], bins[1], col) for k, h in col.histogram_dict.items()]
    return out


@pytest.mark.parametrize("case", _histograms(), ids=lambda c: c[0])
def test_the_threshold_is_orts_on_the_histograms_a_search_meets(case: tuple) -> None:
    name, hist, edges, mn, mx, nq, col = case
    assert entropy_threshold(hist, edges, mn, mx, nq) == col.get_entropy_threshold((hist, edges, mn, mx), nq)
    kl, tol = divergences(hist, nq)
    exact = np.array([orts_divergence(hist, nq // 2 + k, nq, edges.dtype) for k in range(kl.size)])
    assert np.array_equal(np.isinf(kl), np.isinf(exact)), name
    fin = np.isfinite(kl)
    assert np.all(np.abs(kl[fin] - exact[fin]) <= 0.1 * tol[fin]), name  # measured at most 0.02 of it


def test_quantize_entropy_is_not_minmax_at_8_bits_and_minmax_at_16(two: dict, tmp_path: Path) -> None:
    """``quantize_for_qnn(calibrate_method="entropy")``: its calibration cache holds ORT's entropy ranges, its model
    differs from MinMax's and is the same bytes without the cache; at 16-bit activations it is MinMax's model, said;
    the cache key of entropy holds its bins."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import load_tensors_data

    model, cal = two["model"], two["cal"]
    digest = lambda f: hashlib.sha256(Path(f).read_bytes()).hexdigest()  # noqa: E731
    cache = tmp_path / "cache"
    q = {m: quantize_for_qnn(model, tmp_path / f"{m}.onnx", cal, calibrate_method=m, calibration_cache=cache)
         for m in ("minmax", "entropy")}
    assert digest(q["entropy"].model_path) != digest(q["minmax"].model_path)
    assert q["entropy"].calibration_samples == 8
    fresh = quantize_for_qnn(model, tmp_path / "fresh.onnx", cal, calibrate_method="entropy")  # no cache
    assert digest(fresh.model_path) == digest(q["entropy"].model_path)
    ranges = {(td := load_tensors_data(f)).calibration_method: _of(td) for f in cache.glob("*.json")}
    pre = tmp_path / "pre.onnx"
    calibrated = pre if preprocess_float_model(model, pre, cal) else model
    want = two["orts"] if calibrated == model else _orts(calibrated, cal, ENTROPY_BINS, tmp_path)
    assert ranges[CalibrationMethod.Entropy] == want
    mm = ranges[CalibrationMethod.MinMax]
    assert mm["rb"][1] == pytest.approx(100.0) and ranges[CalibrationMethod.Entropy]["rb"][1] < 10.0
    a16 = {m: quantize_for_qnn(model, tmp_path / f"a16{m}.onnx", cal, preset="a16w8", calibrate_method=m)
           for m in ("minmax", "entropy")}
    assert digest(a16["entropy"].model_path) == digest(a16["minmax"].model_path)
    assert any("16-bit activations is MinMax" in w for w in a16["entropy"].warnings)
    cfg = SimpleNamespace(extra_options={}, op_types_to_quantize=["Conv"], activation_type="QUInt8",
                          weight_type="QUInt8", calibration_providers=None)
    keys = {str(m): calibration_cache_key(model, cal, SimpleNamespace(**vars(cfg), calibrate_method=m))
            for m in CalibrationMethod}
    assert len(set(keys.values())) == len(keys)
