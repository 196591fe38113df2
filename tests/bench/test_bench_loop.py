"""The loop benchmark (bench/bench_loop.py) end to end on small models (slow: torch export, QNN QDQ quantization,
QNN HTP compiles; about 4 min on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_loop.py"


@pytest.mark.slow
def test_quick_loop_prints_every_ratio_with_the_load(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    p = subprocess.run([sys.executable, str(BENCH), "--quick", "--layers", "2", "--images", "2", "--sections",
                        "capture,diagnose,tune", "--no-polygraphy", "--workdir", str(tmp_path / "w"), "--json",
                        str(out)], capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0 and out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    r = doc["ratios"]
    for key in ("ivq_vs_ort", "ivq_vs_limit", "memory_vs_ort", "diagnose_cpu", "diagnose_htp", "trial"):
        assert isinstance(r[key], float) and r[key] > 0, (key, r)
    assert r["ivq_vs_poly"] is None and r["demo_s"] is None  # left out: printed as —
    lim = doc["capture"]["limit"]
    assert lim["total_s"] > 0 and lim["read"]["bytes"] == sum(doc["capture"]["dump_bytes"].values())
    assert doc["capture"]["memory_identity"].endswith("IDENTICAL")  # ivq diff in memory: the dump path's document
    assert doc["tune"]["same_sqnr"] is True  # the timed trial reproduced the baseline's figures
    assert doc["diagnose"]["htp"]["this"]["units"] > 0 and doc["diagnose"]["cpu"]["this"]["units"] > 0
    assert "load average" in p.stdout.splitlines()[0]
    assert "| ivq diagnose / one capture (QNN HTP) |" in p.stdout and "issue 33's ratios (load average" in p.stdout


def test_repeat_reports_each_steps_fastest_round_and_every_round() -> None:
    """``--repeat``: the CPU diagnose row keeps each step's fastest round that did not fail, lists every round, and
    calls the documents identical only when every round's were."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_loop

    caps = [{"wall_s": 7.0}, {"wall_s": 5.0}, {"error": "killed", "wall_s": 1.0}]
    tries = [{"baseline": {"wall_s": 16.0}, "this": {"wall_s": 13.0, "units": 447}, "identical": True},
             {"baseline": {"wall_s": 15.0}, "this": {"wall_s": 14.0, "units": 447}, "identical": True},
             {"baseline": {"wall_s": 19.0}, "this": {"wall_s": 12.5, "units": 447}, "identical": False}]
    row = bench_loop._best_of(caps, tries)
    assert row["capture"] == {"wall_s": 5.0, "rounds_s": [7.0, 5.0, 1.0]}
    assert row["baseline"]["wall_s"] == 15.0 and row["this"] == {"wall_s": 12.5, "units": 447,
                                                                   "rounds_s": [13.0, 14.0, 12.5]}
    assert row["identical"] is False
    one = bench_loop._best_of([{"wall_s": 6.0}], [{"this": {"wall_s": 12.0}}])
    assert one == {"capture": {"wall_s": 6.0}, "this": {"wall_s": 12.0}}  # one round: as before, no rounds list


def test_the_capture_sections_identity_check_names_a_difference(tmp_path: Path) -> None:
    """``--baseline-src``: both revisions' dumps and ``ivq-diff`` documents go through ``check_identity.py``; the same
    capture written twice is IDENTICAL, one changed value is not."""
    import numpy as np

    from ivq_debug.dump import DumpWriter
    from tests.support.cli import ivq_cli

    sys.path.insert(0, str(BENCH.parent))
    import bench_loop

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for rev, bump in (("base", 0.0), ("this", 0.0), ("moved", 1e-3)):
        d = tmp_path / rev
        d.mkdir()
        for side, noise in (("ref", 0.0), ("test", 0.01)):
            with DumpWriter(d / f"{side}.h5", backend="x") as w:
                w.begin_record()
                w.add_tensor("y", x + np.float32(noise) + np.float32(bump if side == "test" else 0.0), order=0)
        assert ivq_cli("diff", d / "ref.h5", d / "test.h5", "--json", d / "diff.json", "-q") in (0, 1)
    same = bench_loop.identity(tmp_path / "base", tmp_path / "this", tmp_path / "logs")
    assert same["ref dumps"].endswith("IDENTICAL") and same["ivq-diff --json"].endswith("IDENTICAL"), same
    moved = bench_loop.identity(tmp_path / "base", tmp_path / "moved", tmp_path / "logs")
    assert moved["ref dumps"].endswith("IDENTICAL")
    assert moved["test dumps"].startswith("DIFFERENT") and moved["ivq-diff --json"].startswith("DIFFERENT"), moved


def test_the_in_memory_rows_identity_check_names_a_difference(tmp_path: Path) -> None:
    """The capture section's row ``ivq diff in memory``: its document against the dump path's (``check_identity.py
    compare``, paths and creation times aside) is IDENTICAL on a real float block vs its a8w8 QDQ model; one
    value changed is not."""
    from tests.support import qnn_models
    from tests.support.cli import ivq_cli

    if not qnn_models.HAVE_QNN:
        pytest.skip("onnxruntime-qnn is not installed")
    sys.path.insert(0, str(BENCH.parent))
    import bench_loop

    fm, qm, args = qnn_models.block_files(tmp_path, 2)
    dumps, mem = tmp_path / "dumps", tmp_path / "memory"
    for d in (dumps, mem):
        d.mkdir()
    for side, model in (("ref", fm), ("test", qm)):
        assert ivq_cli("capture", "onnx", model, *args, "-o", dumps / f"{side}.h5") == 0
    assert ivq_cli("diff", dumps / "ref.h5", dumps / "test.h5", "--json", dumps / "diff.json", "-q") in (0, 1)
    assert ivq_cli("diff", fm, qm, *args, "--json", mem / "diff.json", "-q") in (0, 1)
    assert bench_loop.memory_identity(dumps, mem, tmp_path / "logs").endswith("IDENTICAL")
    doc = json.loads((mem / "diff.json").read_text())
    doc["layers"][3]["metrics"]["sqnr_db"] += 1e-9
    (mem / "diff.json").write_text(json.dumps(doc))
    assert bench_loop.memory_identity(dumps, mem, tmp_path / "logs").startswith("DIFFERENT")


def test_the_diagnose_rows_print_each_steps_cpu_beside_its_wall() -> None:
    """The processes' CPU (user + system, ``os.wait4``) beside their wall time: what a shared machine's load
    inflates least, every round's too."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_loop

    caps = [{"wall_s": 3.0, "cpu_s": 2.4}, {"wall_s": 2.6, "cpu_s": 2.3}]
    tries = [{"this": {"wall_s": 6.0, "cpu_s": 6.3, "units": 447, "sessions": 1}},
             {"this": {"wall_s": 5.2, "cpu_s": 6.1, "units": 447, "sessions": 1}}]
    row = {"model": "ViT 12 blocks", **bench_loop._best_of(caps, tries)}
    row["this"]["ratio"] = 2.0
    (line,) = bench_loop.details({"diagnose": {"cpu": row}})
    assert "capture 2.6 s (CPU 2.3 s), diagnose 5.2 s (CPU 6.1 s) = 2.0×" in line
    assert "diagnose [6.0, 5.2] s (CPU [6.3, 6.1] s)" in line


def test_the_goals_table_gives_each_ratio_its_floor_on_this_machine() -> None:
    """The floor column: the machine's limit over ``qdq_loss_debug``, and a diagnose's CPU seconds spread over every
    core over its capture's wall; a floor above its goal is called so, a row without a bound has none."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_loop

    res = {"cores": 2,
           "capture": {"ratios": {"ivq_vs_ort": 0.92}, "limit": {"total_s": 7.5},
                       "rows": {"ORT qdq_loss_debug": {"total_s": 9.0}}},
           "diagnose": {"cpu": {"ratio": 2.9, "capture": {"wall_s": 1.0}, "this": {"wall_s": 2.9, "cpu_s": 4.9}},
                        "htp": {"ratio": 1.3, "capture": {"wall_s": 15.0}, "this": {"wall_s": 20.0, "cpu_s": 24.0}}}}
    lines = bench_loop.report(res)
    assert res["floors"] == {"ivq_vs_ort": 0.833, "diagnose_cpu": 2.45, "diagnose_htp": 0.8}
    row = {ln.split(" | ")[0].lstrip("| "): ln for ln in lines}
    assert row["ivq diagnose / one capture (CPU-QDQ)"].endswith("| NOT met | 2.45 (above the goal) |")
    assert row["ivq diagnose / one capture (QNN HTP)"].endswith("| met | 0.80 |")
    assert row["capture ×2 + diff / ORT qdq_loss_debug"].endswith("| NOT met | 0.83 (above the goal) |")
    assert row["one tune trial / one capture"].endswith("| — | — |")
