"""``dequantize`` equals ONNX DequantizeLinear's int64 formulation bit for bit, on its float32 fast path too."""

from __future__ import annotations

import numpy as np
import pytest

from ivq_debug.dump.quant import dequantize


def _int64_formula(q: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
    return (q.astype(np.int64) - zp).astype(np.float32) * scale


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int16, np.int32])
def test_every_integer_and_zero_point_gives_the_int64_values(dtype: type) -> None:
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    q = rng.integers(info.min, info.max, size=(2, 9, 300), endpoint=True, dtype=dtype)
    q.flat[:2] = info.min, info.max  # the extremes: the largest differences
    for zp in (0, int(info.min), int(info.max), (int(info.min) + int(info.max)) // 2):
        for scale in (1.52e-5, 0.0123, 3.7):
            got = dequantize(q, {"scale": scale, "zero_point": zp})
            want = _int64_formula(q, np.float32(scale), np.int64(zp))
            assert got.dtype == np.float32 and got.shape == q.shape
            assert got.tobytes() == want.tobytes()
    scales = rng.random(300).astype(np.float32) * 0.01
    zps = rng.integers(info.min, info.max, 300)
    got = dequantize(q, {"scale": scales, "zero_point": zps, "axis": 2})
    assert got.tobytes() == _int64_formula(q, scales.reshape(1, 1, -1), zps.reshape(1, 1, -1)).tobytes()


def test_a_scalar_against_a_one_element_encoding_keeps_the_broadcast_shape() -> None:
    got = dequantize(np.asarray(np.uint8(5)), {"scale": [0.02], "zero_point": [3]})
    assert got.shape == (1,) and got.tobytes() == np.array([2 * np.float32(0.02)], np.float32).tobytes()
