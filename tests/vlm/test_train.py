"""Training: determinism and learning on a short run; full reproduction of a shipped model (slow)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ivq_debug.vlm.load import REFERENCE_DIR

from .conftest import MODELS


@pytest.mark.slow  # two 40-step trainings (~60 s idle, 586 s at load 15-18); the recipe's determinism and learning:
# test_training_script_reproduces_shipped_checkpoint (slow), the saved folder: test_save_reference_roundtrip
def test_short_training_is_deterministic_and_learns():
    from ivq_debug.vlm.train import train

    a = train("internvl-tiny", steps=40, batch_size=16, eval_size=2, buckets=(56,))
    b = train("internvl-tiny", steps=40, batch_size=16, eval_size=2, buckets=(56,))
    assert a.losses == b.losses  # same seed, same threads → the same run
    assert a.losses[0] > 3.0 and a.final_loss < 1.0  # from ln(32)≈3.47 to clearly learning
    assert a.wall_time_s > 0 and a.params == b.params


def test_save_reference_roundtrip(tmp_path):
    from ivq_debug.vlm.load import load_vlm
    from ivq_debug.vlm.train import REFERENCE_JSON, save_reference, train

    r = train("qwen2vl-tiny", steps=3, batch_size=4, eval_size=1, buckets=(56,))
    folder = save_reference(r, tmp_path / "q")
    meta = json.loads((folder / REFERENCE_JSON).read_text())
    assert meta["training"]["steps"] == 3 and meta["family"] == "qwen2vl"
    assert load_vlm(folder).family == "qwen2vl"
    from ivq_debug.errors import UsageError

    with pytest.raises(UsageError):
        save_reference(r, folder)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_training_script_reproduces_shipped_checkpoint(name, tmp_path):
    """The full recipe from scratch reproduces the shipped weights bit for bit (minutes on 2 cores).

    Bit identity holds for the same torch build and thread count (the script's default, 2).
    """
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.numpy import load_file

    script = Path(__file__).resolve().parents[2] / "scripts" / "train_reference.py"
    subprocess.run([sys.executable, str(script), "--model", name, "--out", str(tmp_path)], check=True)
    new = json.loads((tmp_path / name / "ivq_reference.json").read_text())["training"]
    shipped = json.loads((REFERENCE_DIR / name / "ivq_reference.json").read_text())["training"]
    assert new["steps"] == shipped["steps"]
    if shipped.get("cpu") != new["cpu"]:
        # another CPU (vector ISA) or torch build: other kernels sum in another order, the bits part after some
        # hundred steps (train.cpu_signature). The recipe must still reproduce the checkpoint's quality.
        assert new["losses"][0] == shipped["losses"][0]  # same data, init and first step
        for b, acc in new["accuracy"].items():
            assert abs(acc["exact_match"] - shipped["accuracy"][b]["exact_match"]) <= 0.06, b
        assert new["exact_match"] >= 0.95
        pytest.skip(f"bit identity needs the CPU the checkpoint was trained on ({shipped.get('cpu')}); "
                    f"this one: {new['cpu']}; quality reproduced: exact match {new['exact_match']:.3f} "
                    f"(shipped {shipped['exact_match']:.3f})")
    assert new["losses"] == shipped["losses"]
    for b, acc in new["accuracy"].items():
        assert acc == shipped["accuracy"][b], b
    a, b = load_file(tmp_path / name / "model.safetensors"), load_file(REFERENCE_DIR / name / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
