"""The scale benchmark (bench/bench_scale.py) end to end at a tiny size, and ivq-diff's memory bound.

Two tests run the whole benchmark once at ``--scale tiny`` (a narrow model, every tool, all three ivq-debug rows;
Polygraphy only when it is already installed) and check what it prints and measures: the side-by-side table, the
cross-tool agreement, and ivq-diff under an ``RLIMIT_AS`` smaller than the dumps it compares, with peak RSS under
2 × largest tensor + fixed overhead. That run is an end-to-end benchmark (~40 s idle, 90 s at load 10), so those
two are slow tests with the real-width one; the default run keeps :func:`test_rlimit_is_enforced` (the limit the
bound relies on is real).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_scale.py"


def _bench_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = mod
    spec.loader.exec_module(mod)
    return mod


def _run_bench(work: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = work / "figures.json"
    p = subprocess.run([sys.executable, str(BENCH), "--workdir", str(work / "w"), "--no-install", "--json", str(out),
                        *args], capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"benchmark failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p, json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """One benchmark run at the tiny scale, shared by the two tests that read it (about 40 s on 2 cores)."""
    return _run_bench(tmp_path_factory.mktemp("bench-tiny"), "--scale", "tiny", "--bound-multiples", "1.5",
                      timeout=300)


@pytest.mark.slow
def test_tiny_benchmark_prints_the_table(tiny_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    p, doc = tiny_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| tool | capture ref s"))
    body = [ln for ln in lines[header + 2 :] if ln.startswith("| ")]
    tools = [ln.split("|")[1].strip() for ln in body]
    assert tools[:3] == ["ivq-debug", "ivq-debug --max-outputs-per-run 64", "ivq-debug --summary-only"]
    assert "Polygraphy" in tools and "ORT qdq_loss_debug" in tools
    rows = {r["tool"]: r for r in doc["rows"]}
    for name in ("ivq-debug", "ivq-debug --summary-only", "ORT qdq_loss_debug"):
        r = rows[name]
        assert r["failed"] is None, r
        assert r["total_s"] > 0 and all(v > 0 for v in r["peak_rss"].values()), r
    assert rows["ivq-debug"]["disk"] > rows["ivq-debug --summary-only"]["disk"]  # summary-only stores less
    assert rows["ivq-debug"]["pairs"] > 100
    # the tools that ran agree on the worst layer and on SQNR over the shared tensors
    assert doc["agree"], p.stdout
    assert "-> AGREE" in p.stdout
    if rows["Polygraphy"]["failed"] is None:
        assert rows["Polygraphy"]["pairs"] > 100
    else:  # not installed and --no-install: the column is skipped with its reason, never a failure
        assert "not installed" in rows["Polygraphy"]["failed"]


@pytest.mark.slow
def test_tiny_benchmark_memory_bound(tiny_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    p, doc = tiny_run
    b = doc["bound"]
    assert doc["bound_ok"], p.stdout[-3000:]
    assert b["limit"] == b["vm_base"] + 2 * b["largest"] + b["margin"]
    limited = [c for c in b["cases"] if c["limit_as"]]
    big = [c for c in limited if c["dump_bytes"] > 2 * c["limit_as"]]
    assert big, "no bounded run on dumps larger than the limit"
    for c in b["cases"]:
        assert c["completed"], c
        assert c["peak_rss"] <= c["bound"] == 2 * c["largest"] + b["overhead"], c
        assert c["correct"] is not False, c
    for c in big:  # each dump alone exceeds RLIMIT_AS; the result matches the exact SQNR of every tensor
        assert c["dump_bytes"] / 2 > c["limit_as"] and c["correct"] is True, c
    assert "memory bound held at every size: YES" in p.stdout


def test_rlimit_is_enforced(tmp_path: Path) -> None:
    """The limit is real: ivq-diff under a quarter of its baseline virtual size fails instead of running."""
    bench = _bench_module()
    tiny = [tmp_path / "a.h5", tmp_path / "b.h5"]
    bench.step_tiny_dumps({"paths": [str(x) for x in tiny], "block": False})
    ok = bench.run_measured([bench.bin_path("ivq-diff"), *map(str, tiny), "-q"], log=tmp_path / "ok",
                            ok_codes=bench.DIFF_OK)
    assert ok.ok and ok.peak_rss > 0
    starved = bench.run_measured([bench.bin_path("ivq-diff"), *map(str, tiny), "-q", "--json", str(tmp_path / "s.json")],
                                 log=tmp_path / "starved", limit_as=64 << 20, ok_codes=bench.DIFF_OK,
                                 require=tmp_path / "s.json")
    assert not starved.ok


@pytest.mark.slow
def test_real_width_benchmark(tmp_path: Path) -> None:
    """InternVL2-2B widths (2 ViT + 1 LLM layers, ~1 GiB of activations per capture), every tool."""
    p, doc = _run_bench(tmp_path, "--scale", "0.25", "--bound-multiples", "3", timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = {r["tool"]: r for r in doc["rows"]}
    assert rows["ivq-debug"]["failed"] is None and rows["ivq-debug"]["pairs"] > 100
    assert doc["agree"] and doc["bound_ok"]
    big = [c for c in doc["bound"]["cases"] if c["limit_as"] and c["dump_bytes"] > 4 * c["limit_as"]]
    assert big and all(c["completed"] and c["peak_rss"] <= c["bound"] for c in big)
