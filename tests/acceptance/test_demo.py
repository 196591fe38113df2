"""Issue: the reference VLM and ``ivq demo`` (export, quantization, captures, accuracy, outputs)."""

from __future__ import annotations

import json
from typing import Any

from ivq_debug.dump import open_dump
from tests.acceptance.conftest import label


def test_demo_writes_dumps_report_and_summary(demo: Any) -> None:
    assert set(demo.dumps) == {"torch", "ort-fp32", "cpu-qdq-a8w8", "cpu-qdq-a16w8", "htp-a8w8", "htp-a16w8",
                               "htp-projector-miss", "ort-fp32-restart"}
    for path in demo.dumps.values():
        with open_dump(path) as d:
            assert d.complete and d.model["demo"] is True
            keys = d.record_keys()
            assert {(s, p) for s, p, _ in keys} >= {(0, "vision"), (0, "prefill"), (1, "decode")}
    htp = open_dump(demo.dumps["htp-a8w8"])
    info = htp.backend_info
    assert info["soc_model"] == "60" and info["htp_arch"] == "73" and info["emulated"] is True
    assert info["qnn_sdk_version"] and info["decode"]["exposure_check"]["bit_identical"] is True
    doc = json.loads(demo.summary.read_text())
    assert doc["schema"] == "ivq-demo/1" and demo.report.exists()
    assert demo.report.read_text().startswith("<!DOCTYPE html>")


def test_export_matches_pytorch(demo: Any) -> None:
    # part outputs within the seed's 1e-5, every aligned layer above the export preset (SQNR >= 90 dB)
    assert max(demo.export_max_abs.values()) <= 1e-5
    cmp = demo.comparisons[label(demo, "export")]
    assert cmp.passed and cmp.summary["pairs"] > 400 and cmp.summary["min_sqnr_db"] > 100
    assert cmp.unmatched["ref"]["count"] == 0  # every hooked torch module found its ONNX tensor


def test_caption_accuracy_tells_the_story(demo: Any) -> None:
    acc = {k: v["exact_match"] for k, v in demo.accuracy.items()}
    assert acc["fp32"] == 1.0 and acc["htp-a16w8"] == 1.0
    assert acc["htp-a8w8"] <= 0.1  # the 8-bit shared mask/score scale wrecks the decoder
    assert acc["htp-projector-miss"] <= 0.7  # colour / position words break
    miss = demo.accuracy["htp-projector-miss"]
    assert min(miss["colour"], miss["position"]) < 1.0
    assert acc["fp32-restart"] < 1.0
