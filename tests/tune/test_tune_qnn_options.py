"""One QNN setting for the whole tune (issue 29): ``ivq tune --optimization`` reaches every HTP session and is
recorded in each trial; the paddle2onnx-style ``Shape -> Reshape`` chain HTP refused at ORT optimization
``disable`` is folded by the quantizer, so the default level runs; a refusal is exit 7 with the whole reason (a
model with ten quantized ``Erf`` nodes HTP does not take)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.support import qnn_models
from tests.support.cli import ivq_cli
from tests.support.thirdparty_models import save_textline, textline_feeds


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tune-qnn-options")
    cal = textline_feeds(1, 8)
    np.savez(d / "cal.npz", x=np.concatenate([f["x"] for f in cal]))
    for i, f in enumerate(textline_feeds(2, 2)):
        np.savez(d / f"in{i}.npz", **f)
    return {"model": save_textline(d, "shape.onnx", shape_reshape=True, width=32), "cal": d / "cal.npz",
            "inputs": ["--inputs", d / "in0.npz", "--inputs", d / "in1.npz"]}


def _trials(workdir: Path) -> dict:
    return json.loads((workdir / "trials" / "checkpoint.json").read_text())["trials"]


@pytest.mark.qnn
def test_the_shape_chain_htp_refused_tunes_at_the_default_level(files, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_qnn")
    # HTP refused the Shape chain at "disable" (the baseline failed, exit 7) until the quantizer folded it
    assert ivq_cli("tune", files["model"], "--calibration", files["cal"], *files["inputs"], "--no-diagnose",
                   "-o", tmp_path / "d") in (0, 1)
    trials = _trials(tmp_path / "d")
    assert trials and all(t["session"]["optimization"] == "disable" and "error" not in t for t in trials.values())
    doc = json.loads((tmp_path / "d" / "tune.json").read_text())  # the report names the session of its trials
    assert doc["before"]["session"] == doc["after"]["session"] == {"optimization": "disable"}


@pytest.mark.qnn
@pytest.mark.slow
def test_optimization_reaches_the_trials(files, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_qnn")
    assert ivq_cli("tune", files["model"], "--calibration", files["cal"], *files["inputs"], "--no-diagnose",
                   "-o", tmp_path / "a", "--optimization", "all") in (0, 1)
    trials = _trials(tmp_path / "a")
    assert trials and all(t["session"]["optimization"] == "all" for t in trials.values())
    doc = json.loads((tmp_path / "a" / "tune.json").read_text())
    assert doc["before"]["session"]["optimization"] == doc["after"]["session"]["optimization"] == "all"


@pytest.mark.qnn
def test_a_refusal_is_exit_7_with_the_whole_reason(tmp_path: Path, capfd) -> None:
    pytest.importorskip("onnxruntime_qnn")
    model = tmp_path / "erf10.onnx"
    onnx.save(qnn_models.build_erf(0, erfs=10), str(model))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", x=rng.standard_normal((4, 1, qnn_models.S, qnn_models.D)).astype(np.float32))
    np.savez(tmp_path / "in.npz", x=rng.standard_normal((1, qnn_models.S, qnn_models.D)).astype(np.float32))
    capfd.readouterr()
    assert ivq_cli("tune", model, "--calibration", tmp_path / "cal.npz", "--inputs", tmp_path / "in.npz",
                   "--no-diagnose", "-o", tmp_path / "t") == 7
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("ivq: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    line = lines[0]  # one line: every distinct reason, the count, the advice at its end (not cut at 400)
    assert "baseline trial failed on QNN HTP (optimization disable)" in line
    assert "10 node(s) not supported by QNN HTP" in line and "Operators of type `Erf` are not supported" in line
    assert line.endswith("--optimization all does not fix it either (checked)")
    assert "[10: bare_erf (Erf), bare_erf_2 (Erf), bare_erf_3 (Erf) +7 more]" in line  # the reason once, counted
    # the trial's record names every refused node with its reason
    before = next(t for t in _trials(tmp_path / "t").values() if t["label"] == "before")
    assert before["error"] in line
    refused = {u["name"]: u for u in before["unsupported"] if u["op_type"] == "Erf"}
    assert set(refused) == {"bare_erf", *(f"bare_erf_{i}" for i in range(2, 11))}
    assert all("not supported by QNN EP" in u["reason"] for u in refused.values())
