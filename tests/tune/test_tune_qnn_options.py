"""One QNN setting for the whole tune (issue 29): ``ivq tune --optimization`` reaches every HTP session, is
recorded in each trial, and a refusal is exit 7 with the whole reason (a paddle2onnx-style model whose
``Shape -> Reshape`` chain HTP refuses at ORT optimization ``disable``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

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


@pytest.mark.qnn
def test_optimization_reaches_the_trials_and_a_refusal_is_exit_7_in_full(files, tmp_path: Path, capfd) -> None:
    pytest.importorskip("onnxruntime_qnn")
    args = ("tune", files["model"], "--calibration", files["cal"], *files["inputs"], "--no-diagnose")
    assert ivq_cli(*args, "-o", tmp_path / "d") == 7  # HTP refuses the Shape chain at "disable"
    err = capfd.readouterr().err
    line = next(ln for ln in err.splitlines() if "baseline trial failed" in ln)
    assert "optimization disable" in line and "not supported by QNN HTP" in line and "--optimization all" in line
    assert len(line) > 400 and "Traceback" not in err  # the whole reason, not cut at 400 characters
    code = ivq_cli(*args, "-o", tmp_path / "a", "--optimization", "all")
    assert code in (0, 1)  # the baseline runs on HTP; whether a set is recommended depends on the model
    trials = json.loads((tmp_path / "a" / "trials" / "checkpoint.json").read_text())["trials"]
    assert trials and all(t["session"]["optimization"] == "all" for t in trials.values())
