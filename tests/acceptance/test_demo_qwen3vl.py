"""Issue 13: ``ivq demo --model qwen3vl-tiny`` from the command line: the export comparison is clean (no false
divergence from the vision tower's ModelOutput aliases) and every injected fault is the headline of its
comparison (about 100 s on 2 cores)."""

from __future__ import annotations

import json

import pytest

from ivq_debug.cli.common import run
from ivq_debug.cli.main import _main as ivq_main

pytestmark = pytest.mark.slow

HEADLINES = {"projector calibration miss": "projector_drift", "positions restart": "position_id_offset",
             "rope delta dropped": "position_id_offset", "DeepStack dropped": "deepstack_missing",
             "DeepStack one layer early": "deepstack_misrouted", "sectioned M-RoPE": "mrope_layout"}


def test_qwen3vl_demo_story(tmp_path) -> None:
    pytest.importorskip("onnxruntime_qnn")
    argv = ["demo", "--model", "qwen3vl-tiny", "--samples", "1", "--eval", "8", "--golden", str(tmp_path / "g"),
            "--reports", str(tmp_path / "r"), "--workdir", str(tmp_path / "w")]
    assert run("ivq", ivq_main, argv) == 0
    doc = json.loads((tmp_path / "r" / "demo.json").read_text())
    comps = doc["comparisons"]
    export = next(v for k, v in comps.items() if k.startswith("export"))
    assert export["summary"]["passed"] and export["summary"]["min_sqnr_db"] > 100
    assert export["first_divergence"] is None and not export["findings"], export["findings"]
    for needle, kind in HEADLINES.items():
        c = next(v for k, v in comps.items() if needle in k)
        errors = [f for f in c["findings"] if f["severity"] == "error"]
        assert kind in {f["kind"] for f in errors}, (needle, [f["kind"] for f in errors])
    assert doc["accuracy"]["fp32"]["exact_match"] == 1.0
