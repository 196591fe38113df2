"""An interrupted ``ivq tune`` keeps its checkpoint and finished trials, and ``--resume`` from another working
directory continues to the same recommendation (issue 33, item 3): SIGTERM after the baseline, like a CI timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.diagnose.test_weight_spread import build_conv

ROOT = Path(__file__).resolve().parents[2]


def _run(cwd: Path, *args: object) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), IVQ_NO_PROGRESS="1")
    return subprocess.Popen([sys.executable, "-m", "ivq_debug", "tune", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _trials(wd: Path) -> dict:
    p = wd / "trials" / "checkpoint.json"
    try:
        return json.loads(p.read_text())["trials"]
    except (OSError, ValueError, KeyError):
        return {}


@pytest.mark.slow  # three tune runs in subprocesses: ~70 s on 2 loaded cores
def test_sigterm_after_the_baseline_then_resume_from_another_directory(tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    build_conv(user)
    (user / "cal").mkdir()
    for i in range(6):
        np.savez(user / "cal" / f"{i}.npz", x=np.random.RandomState(i).randn(1, 3, 16, 16).astype(np.float32))
    np.savez(user / "eval.npz", x=np.random.RandomState(99).randn(1, 3, 16, 16).astype(np.float32))
    args = ("--calibration", "cal", "--inputs", "eval.npz", "--backend", "cpu", "--preset", "a16w8")

    full = _run(user, "conv.onnx", *args, "-o", "full")  # the uninterrupted run, for the recommendation
    assert full.wait(timeout=600) == 0, full.stderr.read().decode()[-2000:]

    proc = _run(user, "conv.onnx", *args, "-o", "t")
    deadline = time.monotonic() + 300
    while proc.poll() is None and not _trials(user / "t") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and b"Traceback" not in err, err.decode()[-2000:]
    kept = _trials(user / "t")
    assert kept and all(not t.get("error") for t in kept.values())  # the baseline survived the interrupt
    assert all(not os.path.isabs(t["qdq_model"]) for t in kept.values())  # paths relative to the workdir
    assert not (user / "t" / "tune.json").exists()

    other = tmp_path / "elsewhere"
    other.mkdir()
    res = _run(other, "../user/conv.onnx", "--calibration", "../user/cal", "--inputs", "../user/eval.npz",
               "--backend", "cpu", "--preset", "a16w8", "-o", "../user/t", "--resume")
    _, err = res.communicate(timeout=600)
    assert res.returncode == 0, err.decode()[-2000:]
    a = json.loads((user / "full" / "tune.json").read_text())
    b = json.loads((user / "t" / "tune.json").read_text())
    assert [(o["tensor"], o["action"]) for o in b["overrides"]] == [(o["tensor"], o["action"]) for o in a["overrides"]]
    assert b["end_to_end"] == a["end_to_end"]
    # the finished trials were reused, not run again: one entry per trial, as in the uninterrupted run
    assert len(_trials(user / "t")) == len(_trials(user / "full"))
