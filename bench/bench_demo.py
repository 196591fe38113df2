"""Time ``ivq demo`` (issue 33's goal: at most 100 s with a warm QNN context cache on 2 idle cores): wall and CPU
seconds (user + sys of the process and its children, from ``os.wait4``: far less sensitive to a shared machine's
load than the wall), peak RSS, the load average, the demo's own phases (``timings_s``); with ``--baseline-src`` an
older revision's code runs alternately in the same session and each pair's ``demo.json`` is compared (accuracy,
findings, SQNRs, tune: everything but timings and paths must be identical).

    python bench/bench_demo.py [--model internvl-tiny] [--runs 1] [--no-warm]
    git archive <rev> ivq_debug | tar -x -C /tmp/ivq-old
    python bench/bench_demo.py --runs 2 --baseline-src /tmp/ivq-old

The first run (not reported; ``--no-warm`` skips it) fills the user's QNN context cache, as a user's first demo
does; the reported runs are warm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: issue 33's goal for a warm demo on 2 idle cores (seconds)
GOAL_S = 100.0
#: what differs between two runs of the same demo: the measured seconds and the run's own folders
VOLATILE = ("timings_s",)


def run_once(src: str | None, model: str, root: Path) -> dict[str, Any]:
    """One ``ivq demo`` into ``root`` (``src``: the source tree on ``PYTHONPATH``, None: the installed code)."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    cmd = [sys.executable, "-m", "ivq_debug", "demo", "--model", model, "--golden", str(root / "golden"),
           "--reports", str(root / "reports"), "--workdir", str(root / "work"), "--force"]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=src or None, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read() if p.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"ivq demo failed ({src or 'installed code'}):\n{err[-2000:]}")
    doc = json.loads((root / "reports" / "demo.json").read_text())
    return {"wall_s": round(wall, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1), "rss_mib": ru.ru_maxrss // 1024,
            "load": (round(load0, 2), round(os.getloadavg()[0], 2)), "timings_s": doc.get("timings_s"),
            "doc": _stable(doc, str(root))}


def _stable(x: Any, root: str) -> Any:
    """``demo.json`` without its timings, the run's folder replaced by ``<root>``."""
    if isinstance(x, dict):
        return {k: _stable(v, root) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_stable(v, root) for v in x]
    return x.replace(root, "<root>") if isinstance(x, str) else x


def _say(tag: str, r: dict[str, Any]) -> None:
    phases = ", ".join(f"{k} {v:.1f}" for k, v in (r["timings_s"] or {}).items() if k != "total")
    verdict = "goal met" if r["wall_s"] <= GOAL_S else f"over the {GOAL_S:.0f} s goal"
    print(f"{tag}: {r['wall_s']:.1f} s wall ({verdict}), {r['cpu_s']:.1f} s CPU, peak RSS {r['rss_mib']} MiB, "
          f"load {r['load'][0]:.2f} -> {r['load'][1]:.2f}\n  phases (s): {phases}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="internvl-tiny")
    ap.add_argument("--runs", type=int, default=1, help="reported runs (of each revision with --baseline-src)")
    ap.add_argument("--baseline-src", help="a folder holding an older revision's ivq_debug/, run alternately (first)")
    ap.add_argument("--no-warm", action="store_true", help="no warm-up run (the QNN context cache is warm already)")
    a = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    revs = ([("baseline", a.baseline_src)] if a.baseline_src else []) + [("this", here)]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    with tempfile.TemporaryDirectory(prefix="ivq-bench-demo-") as td:
        if not a.no_warm:
            for tag, src in revs:
                _say(f"warm-up ({tag}, not counted)", run_once(src, a.model, Path(td) / f"warm-{tag}"))
        got: dict[str, list[dict[str, Any]]] = {tag: [] for tag, _ in revs}
        for i in range(a.runs):
            for tag, src in revs:
                root = Path(td) / f"{tag}-{i}"
                got[tag].append(run_once(src, a.model, root))
                _say(f"run {i + 1} {tag}", got[tag][-1])
                shutil.rmtree(root, ignore_errors=True)
        for tag, rs in got.items():
            print(f"{tag}: best wall {min(r['wall_s'] for r in rs):.1f} s, best CPU {min(r['cpu_s'] for r in rs):.1f} s "
                  f"over {len(rs)} run(s)")
        if a.baseline_src:
            same = all(b["doc"] == t["doc"] for b, t in zip(got["baseline"], got["this"], strict=True))
            print("demo.json (timings and paths aside): " + ("IDENTICAL" if same else "DIFFERENT"))
            if not same:
                raise SystemExit(1)


if __name__ == "__main__":
    main()
