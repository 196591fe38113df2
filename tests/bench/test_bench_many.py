"""The many-tensor benchmark (bench/bench_many.py) end to end at a small size (slow: torch export, QNN QDQ
quantization and three tools; about 2 min on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_many.py"


@pytest.mark.slow
def test_small_vit_benchmark_prints_table_goals_and_profiles(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    p = subprocess.run([sys.executable, str(BENCH), "--layers", "2", "--images", "2", "--workdir", str(tmp_path / "w"),
                        "--no-install", "--profile", "--json", str(out)], capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0 and out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["build"]["ops"]["ReduceMean"] == 2 * (2 * 2 + 1)  # 2 per LayerNorm, 2 per block + the final one
    rows = {r["tool"]: r for r in doc["rows"]}
    ivq = rows["ivq-debug"]
    assert ivq["failed"] is None and ivq["pairs"] > 100, ivq
    assert rows["ORT qdq_loss_debug"]["failed"] is None and rows["ORT qdq_loss_debug"]["pairs"] > 50
    assert "| ivq-debug: capture a8w8 |" in p.stdout and "ratios (ivq-debug / peer" in p.stdout
    assert "time vs ORT qdq_loss_debug:" in p.stdout
    if "Polygraphy" in rows and rows["Polygraphy"]["failed"] is None:
        assert doc["agree"], p.stdout  # same per-tensor SQNR as Polygraphy
    assert "### capture, cprofile" in p.stdout and "writer.py" in p.stdout  # the dump writer shows in the profile
