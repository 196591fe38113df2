"""The overrides loop on a real model: a calibration miss, suggested overrides, verified on QNN HTP."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ivq_debug.qnn.encodings import read_encodings
from ivq_debug.tune.suggest import suggest, write_suggestions
from ivq_debug.tune.verify import Tuner, greedy, verify
from tests.support import tiny

pytestmark = pytest.mark.qnn


@pytest.fixture(scope="module")
def tuner(tmp_path_factory) -> Tuner:
    pytest.importorskip("onnxruntime_qnn")
    tmp = tmp_path_factory.mktemp("tune")
    m, x, _ = tiny.build(tmp)
    fm = tmp / "gelu.onnx"  # opset 20: GELU is the Gelu op, so every node runs on HTP
    torch.onnx.export(m, (torch.from_numpy(x),), str(fm), input_names=["x"], output_names=["logits"],
                      dynamo=False, opset_version=20)
    # the calibration set misses the real input range (5x narrower)
    calib = [{"x": (0.2 * np.random.RandomState(i).randn(2, 8, 16)).astype(np.float32)} for i in range(8)]
    ref = tiny.capture_ort(fm, x, tmp / "ref.h5")
    return Tuner(fm, calib, [{"x": x}], ref, tmp / "trials")


def test_suggest_write_and_verify_recovers_sqnr(tuner: Tuner, tmp_path: Path) -> None:
    before = tuner.trial("before", [])
    sug = suggest(before.comparison)
    by = {s.tensor: s for s in sug}
    # the graph input is the most clipped tensor: its range must be widened to the reference range
    assert by["x"].action == "widen" and by["x"].evidence["clipped_fraction"] > 0.3
    assert by["x"].rmin < -3 and by["x"].rmax > 2.5
    path, md = write_suggestions(sug, tmp_path / "overrides.json")
    encs = read_encodings(path, model=str(tuner.float_model))  # a valid legacy file naming real tensors
    assert set(encs.activations) == set(by)
    assert "saturation" in md.read_text()
    rep = verify(tuner, sug, ["logits"], before=before)
    e2e = rep.end_to_end.set_index("what")
    assert e2e.loc["sqnr_db logits", "before"] < 10
    assert e2e.loc["sqnr_db logits", "change"] > 20  # measured: 5.1 -> 32.8 dB
    changed = rep.changed.set_index("tensor")
    assert changed.loc["x", "gain_db"] > 30
    assert rep.before.cycles and rep.after.cycles  # emulated per-op cycles from the QNN profile
    assert json.dumps(rep.to_dict())


def test_greedy_stops_when_the_budget_is_met(tuner: Tuner) -> None:
    before = tuner.trial("before", [])
    sug = suggest(before.comparison)
    rep = greedy(tuner, sug, ["logits"], budget_sqnr_db=25, progress=False)
    assert rep.after.sqnr("logits") >= 25
    kept = [s for s in rep.steps[1:] if s["kept"]]
    assert 1 <= len(kept) <= len(sug)
    assert len(rep.after.suggestions) == len(kept)
