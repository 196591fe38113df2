"""A baseline trial that failed is a failed run through the API as through the CLI (``RunError``, exit 7), not an
input error: ``verify`` and ``sweep`` given a real failed baseline (the two-cause model fed an input of the wrong
shape: ONNX Runtime refuses the run, the trial records it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ivq_debug.errors import EXIT_RUN, RunError
from ivq_debug.tune.sweep import sweep
from ivq_debug.tune.verify import Tuner, verify
from tests.support.lever_models import build_two_causes, two_causes_sample


@pytest.fixture()
def failed(tmp_path: Path) -> tuple[Tuner, object]:
    model = build_two_causes(tmp_path / "two.onnx")
    cal = [two_causes_sample(i) for i in range(4)]
    feeds = [{"x": np.zeros((1, 16, 5, 5), np.float32)}]  # the model takes 1x16x4x4
    tuner = Tuner(model, cal, feeds, None, tmp_path / "wd", backend="cpu", resume=False)
    before = tuner.trial("before", [])
    assert before.error  # the real failure, recorded as the trial's result
    return tuner, before


def test_verify_and_sweep_raise_a_run_error_for_a_failed_baseline(failed) -> None:
    tuner, before = failed
    for call in (lambda: verify(tuner, [], before=before), lambda: sweep(tuner, precisions=["a16"], before=before)):
        with pytest.raises(RunError, match="the baseline trial failed") as e:
            call()
        assert e.value.exit_code == EXIT_RUN == 7
