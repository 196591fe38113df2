"""The committed QNN fixture files (``tests/fixtures/qnn``) and small helpers of the QNN format tests."""

from __future__ import annotations

from pathlib import Path

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "qnn"
MODEL = FIX / "model.qdq.onnx"
FLOAT_MODEL = FIX / "model.onnx"
SINGLE = FIX / "net_run" / "single"
MULTI = FIX / "net_run" / "multi"
PROF = FIX / "profiling"


def one_line(err: BaseException) -> str:
    s = str(err)
    assert "\n" not in s, s
    return s
