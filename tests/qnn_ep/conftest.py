"""Fixtures for the QNN EP tests: real tiny models, quantized once per session with ORT's QNN helpers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest

from tests.qnn_ep import models

HAVE_QNN = importlib.util.find_spec("onnxruntime_qnn") is not None
needs_qnn = pytest.mark.skipif(not HAVE_QNN, reason="onnxruntime-qnn is not installed (QNN HTP emulation)")

#: the calibration seed and the capture-feed seed every test uses
CAL_SEED, FEED_SEED = 1, 5


@pytest.fixture(scope="session")
def qnn_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Float models and their QDQ versions: ``block``, ``block.a8w8``, ``block.a16w8``, ``erf.a8w8``."""
    if not HAVE_QNN:
        pytest.skip("onnxruntime-qnn is not installed")
    from ivq_debug.qnn.quantize import quantize_for_qnn

    d = tmp_path_factory.mktemp("qnn-models")
    out: dict[str, Path] = {}
    for name, model in (("block", models.build_block(0)), ("erf", models.build_erf(0))):
        p = d / f"{name}.onnx"
        onnx.save(model, str(p))
        out[name] = p
    cal = models.block_feeds(CAL_SEED, 8)
    for preset in ("a8w8", "a16w8"):
        out[f"block.{preset}"] = quantize_for_qnn(out["block"], d / f"block.{preset}.onnx", cal,
                                                  preset=preset).model_path
    erf_cal = [{"x": f["x"]} for f in cal]
    out["erf.a8w8"] = quantize_for_qnn(out["erf"], d / "erf.a8w8.onnx", erf_cal).model_path
    return out
