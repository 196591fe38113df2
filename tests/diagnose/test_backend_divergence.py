"""Issue 17: the three-way verdict. fp32 (ORT CPU), CPU-QDQ (ORT CPU fake-quant) and QNN HTP (emulated) dumps of
the seed-0 block at a16w8: the clean HTP run is as bad as its quantization (ratios near 1, no
``backend_divergence``); an HTP run of the same QDQ model with one activation encoding corrupted (``v``, scale
x 0.1: a wrong encoding on the device side only) is named at that layer with a ratio far above k = 1.5, while
the CPU-QDQ side stays clean there. API and the ``ivq-diff --expected`` path a CI takes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ivq_debug import api, defaults
from ivq_debug.capture.base import Selection
from ivq_debug.capture.onnxrt.runner import OrtRunner
from ivq_debug.cli.common import run
from ivq_debug.cli.diff import _main as diff_main
from ivq_debug.diagnose.backend import departure
from ivq_debug.errors import EXIT_FAIL
from tests.support import qnn_models as models
from tests.support.faults import corrupt_encoding
from tests.support.qnn_models import FEED_SEED, capture_feeds, needs_qnn

pytestmark = [pytest.mark.qnn, needs_qnn]

FAULT = "v"  # the V projection's output: its encoding is corrupted on the HTP side only


def _capture(runner, feeds: dict[str, np.ndarray], path: Path) -> Path:
    capture_feeds(runner, feeds, path)
    return path


@pytest.fixture(scope="module")
def dumps(qnn_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from ivq_debug.capture.qnn_ep.runner import QnnHtpRunner

    d = tmp_path_factory.mktemp("threeway")
    qdq = qnn_models["block.a16w8"]
    bad = corrupt_encoding(qdq, FAULT, 0.1, d / "block.a16w8.corrupted.onnx")
    feeds = models.block_feeds(FEED_SEED)[0]
    out = {"fp32": _capture(OrtRunner(qnn_models["block"], selection=Selection()), feeds, d / "fp32.h5"),
           "qdq": _capture(OrtRunner(qdq, selection=Selection(), optimization="disable"), feeds, d / "qdq.h5")}
    for key, model in (("htp", qdq), ("htp_bad", bad)):
        r = QnnHtpRunner(model, selection=Selection())
        try:
            out[key] = _capture(r, feeds, d / f"{key}.h5")
        finally:
            r.close()
    out["dir"] = d
    return out


def _by_kind(cmp, kind: str) -> list:
    return [f for f in cmp.findings if f.kind == kind]


def test_clean_htp_is_explained_by_quantization(dumps) -> None:
    cmp = api.compare(dumps["fp32"], dumps["htp"], expected=dumps["qdq"], progress=False)
    layers = cmp.three_way.layers()
    ok = layers[layers["status"] == "ok"]
    assert len(ok) >= 30  # every exposed tensor of the block has a ratio
    # measured (onnxruntime-qnn 2.7.0 / QNN 2.51, soc 60): rel-L2 ratios 1.00 .. 1.12, the HTP error is CPU-QDQ's
    assert ok["ratio_l2"].max() < defaults.BACKEND_DIVERGENCE_K and ok["ratio_l2"].min() > 0.8
    assert _by_kind(cmp, "backend_divergence") == []
    assert cmp.verdict.applied["three_way"]["k"] == defaults.BACKEND_DIVERGENCE_K


def test_backend_only_fault_is_named_at_its_layer(dumps) -> None:
    cmp = api.compare(dumps["fp32"], dumps["htp_bad"], expected=dumps["qdq"], progress=False)
    (f,) = _by_kind(cmp, "backend_divergence")
    assert f.severity == "error" and f.where["tensor"] == FAULT
    ev = f.evidence
    assert ev["ratio_l2"] > 20 * defaults.BACKEND_DIVERGENCE_K  # measured 93.7x (rel-L2), 111x (rel-L∞)
    assert ev["rel_l2_expected"] < 0.02  # CPU-QDQ stays clean at that layer (measured 0.0076)
    assert ev["bc"] is not None and ev["bc"] < 0.8  # the error's shape differs too (measured 0.53)
    layers = cmp.three_way.layers().set_index("ref_name")
    upstream = layers.loc[["x1", "q", "k"]]  # before the fault: still explained by quantization
    assert (upstream["ratio_l2"] < defaults.BACKEND_DIVERGENCE_K).all()
    assert not cmp.verdict.passed and "backend_divergence at v" in cmp.verdict.sentence
    # the declared k is the one applied: above the fault's ratio, the finding goes
    k = ev["ratio_l2"] * 2
    k = max(k, ev["ratio_linf"] * 2)
    quiet = api.compare(dumps["fp32"], dumps["htp_bad"], expected=dumps["qdq"], progress=False, k=k)
    assert _by_kind(quiet, "backend_divergence") == [] and quiet.verdict.applied["three_way"]["k"] == k


def test_cli_expected_names_the_layer(dumps, capfd) -> None:
    d = dumps["dir"]
    out, rep = d / "diff.json", d / "diff.html"
    code = run("ivq-diff", diff_main, [str(dumps["fp32"]), str(dumps["htp_bad"]), "--expected", str(dumps["qdq"]),
                                       "--json", str(out), "--report", str(rep), "-q"])
    stdout, err = capfd.readouterr()
    assert code == EXIT_FAIL, err
    assert "FAIL" in stdout and "backend_divergence at v" in stdout  # the one-glance verdict says why (stdout)
    doc = json.loads(out.read_text())
    assert doc["contract"]["status"] == "ok" and doc["three_way"]["contract"]["status"] == "ok"
    row = next(r for r in doc["three_way"]["layers"] if r["ref_name"] == FAULT)
    assert row["ratio_l2"] > 20 * defaults.BACKEND_DIVERGENCE_K
    assert [f["where"]["tensor"] for f in doc["findings"] if f["kind"] == "backend_divergence"] == [FAULT]
    assert doc["verdict"]["passed"] is False
    html = rep.read_text()
    assert 'id="threeway"' in html and "Backend vs quantization" in html


def _diff(dumps, out: Path, *args: object) -> tuple[int, dict]:
    code = run("ivq-diff", diff_main, [str(dumps["fp32"]), str(dumps["htp"]), "--json", str(out), "--force", "-q",
                                       "--fail-on", "never", *map(str, args)])
    return code, json.loads(out.read_text())


def test_declared_thresholds_flip_the_verdict_exactly_at_their_value(dumps, tmp_path: Path) -> None:
    """A borderline case for every declared threshold: the measured worst value itself passes, the next float
    beyond it fails, and the JSON echoes the threshold as applied (source, value) -- no hidden default."""
    _, doc = _diff(dumps, tmp_path / "base.json")
    assert doc["verdict"]["passed"] and doc["verdict"]["applied"]["budgets"] == []
    metrics = [layer["metrics"] for layer in doc["layers"] if layer["status"] == "ok"]
    worst = {"sqnr_db": min(m["sqnr_db"] for m in metrics), "cosine": min(m["cosine"] for m in metrics),
             "max_abs": max(m["max_abs"] for m in metrics)}
    cases = [("--min-sqnr", "sqnr_db", ">=", math.inf), ("--min-cosine", "cosine", ">=", math.inf),
             ("--max-abs", "max_abs", "<=", 0.0)]
    for flag, metric, op, beyond in cases:
        v = worst[metric]
        for value, passed in ((v, True), (math.nextafter(v, beyond), False)):
            code, doc = _diff(dumps, tmp_path / "t.json", flag, repr(value))
            assert (code == 0) is passed and doc["verdict"]["passed"] is passed, (flag, value)
            (applied,) = doc["verdict"]["applied"]["budgets"]
            assert applied == {**applied, "metric": metric, "op": op, "value": value, "source": flag}
            if not passed:
                assert "threshold" in doc["verdict"]["sentence"] and metric in doc["verdict"]["sentence"]
    v = worst["sqnr_db"]  # a pattern budget, declared with --budget
    for value, passed in ((v, True), (math.nextafter(v, math.inf), False)):
        code, doc = _diff(dumps, tmp_path / "b.json", "--budget", f"*:sqnr_db>={value!r}")
        assert (code == 0) is passed, value
        assert doc["verdict"]["applied"]["budgets"][0]["source"] == "--budget"
    # the three-way k (--max-ratio): the largest counted ratio itself is not a departure, the float below it is
    cmp = api.compare(dumps["fp32"], dumps["htp"], expected=dumps["qdq"], progress=False)
    k = max(x for r in cmp.three_way.layers().to_dict("records") for x in [departure(r, 0.0)] if x is not None)
    for value, found in ((k, False), (math.nextafter(k, 0.0), True)):
        _, doc = _diff(dumps, tmp_path / "k.json", "--expected", dumps["qdq"], "--max-ratio", repr(value))
        assert any(f["kind"] == "backend_divergence" for f in doc["findings"]) is found, value
        assert doc["verdict"]["applied"]["three_way"]["k"] == value
