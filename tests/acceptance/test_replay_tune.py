"""Issues 19, 20, 21 from the CLI a user takes: who introduced the error (against the user's own float model, on
CPU-QDQ and QNN HTP), the x² pattern, and a tuner that verifies on HTP before it recommends."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ivq_debug as ivq
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.diagnose.replay import replay
from tests.diagnose.test_weight_spread import build_conv
from tests.support import vit
from tests.support.cli import ivq_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    pytest.importorskip("onnxruntime_qnn")
    return vit.models(tmp_path_factory)


@pytest.fixture(scope="module")
def files(m, tmp_path_factory) -> dict[str, Path]:
    """Calibration folder and evaluation inputs of the outlier ViT, as a user would keep them."""
    d = tmp_path_factory.mktemp("user")
    (d / "cal").mkdir()
    for i, f in enumerate(vit.calibration(bright=3.0)):
        np.savez(d / "cal" / f"{i:02d}.npz", **f)
    np.savez(d / "eval.npz", **vit.image(7, bright=1.0))
    return {"cal": d / "cal", "eval": d / "eval.npz", "dir": d}


@pytest.mark.parametrize("backend", ["cpu", "qnn"])
@pytest.mark.parametrize("fault,node", [("act", vit.ACT_NODE), ("weight", vit.WEIGHT_NODE)])
def test_fault_is_first_against_the_users_float_model(m, tmp_path: Path, backend: str, fault: str, node: str) -> None:
    runner = "onnx" if backend == "cpu" else "qnn"
    test = capture(make_runner(runner, m[fault], selection=Selection()), [vit.image(7), vit.image(8)],
                   tmp_path / "test.h5", progress=None)
    for att in ("local", "iso"):
        out = tmp_path / f"{att}.json"
        code = ivq_cli("diagnose", m["ref"], test, "--model", m[fault], "--float-model", m["float"], "--backend",
                       backend, "--attribution", att, "--json", out)
        doc = json.loads(out.read_text())
        assert code == 1 and doc["skipped"] == {}  # every unit has a reference (aligned by values, by lineage)
        worst = min(doc["units"], key=lambda u: float(u["intro_sqnr_db"] if u["intro_sqnr_db"] is not None else "inf"))
        assert worst["node"] == node
        head = doc["findings"][0]
        assert head["kind"] == "introduced_error" and head["where"]["node"] == node
        if fault == "weight":
            # the weight re-quantized with a 20× coarser scale: its encoding spans 20× its values (issue 28)
            assert head["evidence"]["weight_share"] > 0.9 and head["evidence"]["fix"] == "requantize_weight"


def test_x2_pattern_on_htp_local_names_pow_iso_the_variance(m, tmp_path: Path) -> None:
    htp = capture(make_runner("qnn", m["x2_qdq"], selection=Selection()), [vit.image(7, bright=1.0)],
                  tmp_path / "htp.h5", progress=None)
    cmp = ivq.compare(m["x2_ref"], htp, progress=False)

    def factory(p):
        return make_runner("qnn", p)

    loc = replay(m["x2_qdq"], m["x2_ref"], cumulative=cmp, runner_factory=factory, float_model=m["x2_float"],
                 progress=False)
    iso = replay(m["x2_qdq"], m["x2_ref"], cumulative=cmp, runner_factory=factory, attribution="iso",
                 progress=False, lift=False)
    assert loc.findings()[0].evidence["label"] == "LayerNorm x² (Pow)"
    assert iso.findings()[0].evidence["label"] == "LayerNorm variance (ReduceMean)"
    t = loc.table
    views = t[t["op_type"].isin(["Reshape", "Transpose"])]
    assert np.isinf(views["local_sqnr_db"]).all() and views["replayed_on"].str.contains("data movement").all()
    assert t["selfcheck_steps"].notna().sum() > 50  # the self-check ran on the backend's own upstream integers


@pytest.mark.parametrize("fmt", ["legacy", "1.0.0", "ort"])
def test_ivq_tune_in_each_format_raises_htp_output(m, files, tmp_path: Path, fmt: str) -> None:
    wd = tmp_path / "wd"
    code = ivq_cli("tune", m["x2_float"], "--calibration", files["cal"], "--inputs", files["eval"], "-o", wd,
                   "--format", fmt)
    rep = json.loads((wd / "tune.json").read_text())
    assert code == 0 and rep["recommended"] and rep["backend"] == "qnn" and rep["format"] == fmt
    e2e = {r["what"]: r for r in rep["end_to_end"]}
    assert e2e["sqnr_db y"]["change"] > 5  # measured: 1.1 -> 8.8 dB on HTP (the x² group at 16 bits)
    assert any("Pow" in o["tensor"] and o["action"].startswith("a16") for o in rep["overrides"])
    assert (wd / "overrides.json").exists() and (wd / "trials" / "checkpoint.json").exists()


def test_ivq_tune_refuses_a_set_that_lowers_htp_output(m, files, tmp_path: Path) -> None:
    bad = tmp_path / "narrow.json"  # a hand-written file that clips the LayerNorm output feeding the MLP
    bad.write_text(json.dumps({"activation_encodings": {"/m/layers.1/layernorm_after/Add_1_output_0": [
        {"bitwidth": 8, "dtype": "int", "is_symmetric": "False", "min": -0.05, "max": 0.05}]}, "param_encodings": {}}))
    wd = tmp_path / "wd"
    code = ivq_cli("tune", m["x2_float"], "--calibration", files["cal"], "--inputs", files["eval"], "-o", wd,
                   "--overrides", bad)
    rep = json.loads((wd / "tune.json").read_text())
    assert code == 1 and not rep["recommended"] and rep["overrides"] == [] and not (wd / "overrides.json").exists()
    assert rep["refused"] and "lowers y from" in rep["refused"][0]["reason"]


def test_conv_weight_spread_gets_per_channel_verified_on_htp(m, tmp_path: Path) -> None:
    conv = build_conv(tmp_path)
    (tmp_path / "cal").mkdir()
    for i in range(8):
        np.savez(tmp_path / "cal" / f"{i}.npz", x=np.random.RandomState(i).randn(1, 3, 16, 16).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=np.random.RandomState(99).randn(1, 3, 16, 16).astype(np.float32))
    wd = tmp_path / "wd"
    # 16-bit activations keep the small channels' outputs; their 8-bit per-tensor weights are rounded to zero
    code = ivq_cli("tune", conv, "--calibration", tmp_path / "cal", "--inputs", tmp_path / "eval.npz", "-o", wd,
                   "--preset", "a16w8")
    rep = json.loads((wd / "tune.json").read_text())
    assert code == 0 and rep["recommended"]
    assert [o["action"] for o in rep["overrides"] if o["tensor"] == "0.weight"] == ["w_per_channel"]
    e2e = {r["what"]: r for r in rep["end_to_end"]}
    assert e2e["sqnr_db y"]["change"] > 10  # measured: 8.2 -> 40.5 dB on HTP
