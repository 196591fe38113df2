"""``ivq tune`` knobs from the CLI a user takes (issue 20): ``--backend cpu``, ``--tensors``, ``--per-channel``,
``--calibrate-method``, ``--task-metric`` on a real conv whose first weight's channel ranges spread 3000x."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.diagnose.test_weight_spread import build_conv
from tests.support.cli import ivq_cli
from tests.tune.test_deliver import reproduces


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict[str, Path]:
    """The conv, a calibration folder, one evaluation input and a task metric file (−MSE to the float output)."""
    d = tmp_path_factory.mktemp("tune_cli")
    conv = build_conv(d)
    (d / "cal").mkdir()
    for i in range(8):
        np.savez(d / "cal" / f"{i}.npz", x=np.random.RandomState(i).randn(1, 3, 16, 16).astype(np.float32))
    x = np.random.RandomState(99).randn(1, 3, 16, 16).astype(np.float32)
    np.savez(d / "eval.npz", x=x)
    np.save(d / "want.npy", ort.InferenceSession(str(conv)).run(None, {"x": x})[0])
    (d / "score.py").write_text(
        f"import numpy as np\nWANT = np.load({str(d / 'want.npy')!r})\n\n\n"
        "def score(outputs):\n    return {'neg_mse': -float(np.mean((outputs[0]['y'] - WANT) ** 2))}\n")
    return {"conv": conv, "cal": d / "cal", "eval": d / "eval.npz", "score": d / "score.py"}


def _tune(user: dict[str, Path], wd: Path, *extra: object) -> tuple[int, dict]:
    code = ivq_cli("tune", user["conv"], "--calibration", user["cal"], "--inputs", user["eval"], "-o", wd,
                   "--backend", "cpu", "--preset", "a16w8", *extra)
    return code, json.loads((wd / "tune.json").read_text())


def _e2e(rep: dict) -> dict[str, dict]:
    return {r["what"]: r for r in rep["end_to_end"]}


def test_tune_knobs_on_cpu(user, tmp_path: Path) -> None:
    code, rep = _tune(user, tmp_path / "all", "--task-metric", f"{user['score']}:score", "--calibrate-method",
                      "percentile")
    assert code == 0 and rep["recommended"] and rep["backend"] == "cpu"
    got = [(o["tensor"], o["action"]) for o in rep["overrides"]]
    assert got[:2] == [("0.weight", "w_per_channel"), ("2.weight", "w16")]
    # the held-out calibration samples reach beyond the range the other six calibrate: the input is widened
    assert got[2:] in ([], [("x", "widen")])
    e2e = _e2e(rep)
    # one --inputs: 2 of the 8 calibration samples held out and evaluated too; mean and worst sample reported
    assert rep["evaluation"]["held_out"] == 2 and rep["evaluation"]["samples"] == 3
    per = rep["samples"]["after"]["y"]
    assert per["n"] == 3 and per["worst"] <= per["mean"] and per["worst"] == pytest.approx(e2e["sqnr_db y"]["after"])
    assert e2e["sqnr_db y"]["change"] > 20  # measured: 8.3 -> 43.2 dB on CPU-QDQ
    assert e2e["task neg_mse"]["after"] > e2e["task neg_mse"]["before"]  # the user's metric scored every trial
    # what is delivered re-applies to the model that was verified (every recommendation of this test)
    reproduces(user["conv"], user["cal"], tmp_path / "all", tmp_path, "--preset", "a16w8", "--calibrate-method",
               "percentile")

    code, only2 = _tune(user, tmp_path / "w2", "--tensors", "2.*")
    assert code == 0 and [(o["tensor"], o["action"]) for o in only2["overrides"]] == [("2.weight", "w16")]
    # the calibration method reaches the quantizer: the same model, another baseline
    assert _e2e(only2)["sqnr_db y"]["before"] != e2e["sqnr_db y"]["before"]
    reproduces(user["conv"], user["cal"], tmp_path / "w2", tmp_path, "--preset", "a16w8")

    code, pc = _tune(user, tmp_path / "pc", "--per-channel")
    assert code == 0 and pc["recommended"]
    assert _e2e(pc)["model bytes"]["before"] > e2e["model bytes"]["before"]  # per-channel scales in the baseline
    # weights already per channel: 16-bit is the step (and the input widened for the held-out samples)
    assert {o["action"] for o in pc["overrides"] if o["tensor"] != "x"} == {"w16"}
    reproduces(user["conv"], user["cal"], tmp_path / "pc", tmp_path, "--preset", "a16w8", "--per-channel")


def test_bad_task_metric_is_one_line(user, tmp_path: Path, capsys) -> None:
    # a .py file without the function is a bad input (exit 3, naming the file); a bad spec is a usage error
    assert ivq_cli("tune", user["conv"], "--calibration", user["cal"], "--inputs", user["eval"], "-o",
                   tmp_path / "wd", "--task-metric", f"{user['score']}:nope") == 3
    err = capsys.readouterr().err
    assert f"{user['score']}: --task-metric: the file has no function 'nope'" in err and "Traceback" not in err
    assert ivq_cli("tune", user["conv"], "--calibration", user["cal"], "--inputs", user["eval"], "-o",
                   tmp_path / "wd", "--task-metric", str(user["score"])) == 2
    assert "MODULE:FUNCTION" in capsys.readouterr().err


def test_too_few_calibration_samples_to_hold_out_is_said() -> None:
    from ivq_debug.tune.verify import evaluation_split

    one = [{"x": np.zeros(1, np.float32)}]
    cal, ev, info = evaluation_split(one * 3, one)
    assert len(cal) == 3 and len(ev) == 1 and "flatters" in info["warning"]
    cal, ev, info = evaluation_split(one * 3, one * 2)  # two inputs: an evaluation set already
    assert len(cal) == 3 and len(ev) == 2 and info["warning"] is None
