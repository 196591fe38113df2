"""Time ``ivq demo`` end to end (target: under 3 minutes on 2 cores) and print its phases and peak RSS.

    python bench/bench_demo.py [--model internvl-tiny] [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="internvl-tiny")
    ap.add_argument("--runs", type=int, default=1)
    a = ap.parse_args()
    ivq = shutil.which("ivq") or "ivq"
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load average {load:.2f} at start")
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="ivq-bench-demo-") as td:
            root = Path(td)
            cmd = [ivq, "demo", "--model", a.model, "--golden", str(root / "golden"), "--reports",
                   str(root / "reports"), "--workdir", str(root / "work")]
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            _, status, ru = os.wait4(p.pid, 0)
            wall = time.perf_counter() - t0
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"ivq demo failed:\n{p.stderr.read()[-2000:] if p.stderr else ''}")
            doc = json.loads((root / "reports" / "demo.json").read_text())
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in doc["timings_s"].items() if k != "total")
            verdict = "OK" if wall < 180 else "OVER the 3-minute target"
            print(f"run {i + 1}: {wall:.1f} s wall ({verdict}), peak RSS {ru.ru_maxrss / 1024:.0f} MiB")
            print(f"  phases: {phases}")
            print("  caption exact match: " + ", ".join(f"{k} {v['exact_match']:.2f}" for k, v in doc["accuracy"].items()))


if __name__ == "__main__":
    main()
