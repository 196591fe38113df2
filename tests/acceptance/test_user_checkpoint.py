"""A user checkpoint folder saved with ``save_pretrained`` runs through ``ivq demo --model PATH``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_ivq_demo_on_a_save_pretrained_folder(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_qnn")
    from ivq_debug.cli.main import main
    from ivq_debug.vlm import task
    from ivq_debug.vlm.load import load_vlm

    user = tmp_path / "my-internvl"
    load_vlm("internvl-tiny").model.save_pretrained(user)  # a plain HF folder: no ivq metadata
    task.save_tokenizer(user)
    assert not (user / "ivq_reference.json").exists()
    with pytest.raises(SystemExit) as e:
        main(["demo", "--model", str(user), "--golden", str(tmp_path / "g"), "--reports", str(tmp_path / "r"),
              "--workdir", str(tmp_path / "w"), "--samples", "1", "--eval", "4"])
    assert e.value.code == 0
    doc = json.loads((tmp_path / "r" / "demo.json").read_text())
    assert doc["accuracy"]["fp32"]["exact_match"] >= 0.75
    assert max(doc["export_max_abs"].values()) <= 1e-5
