"""Capture and diff throughput and peak memory on a model producing >= 1 GB of activations.

Run by hand (``make bench`` or ``python bench/bench_spine.py``); prints figures, asserts nothing but the
memory bound it reports. Each measured step runs in its own process so peak RSS is that step's own.

    python bench/bench_spine.py [--gib 1.5] [--workdir /tmp/ivq-bench] [--compression lzf|gzip|none]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CAPTURE = r"""
import json, sys, time, torch
from torch import nn
from ivq_debug.dump import DumpWriter
from ivq_debug.capture.torch.hooks import TorchCapture
cfg = json.loads(sys.argv[1])
torch.manual_seed(cfg["seed"])
torch.set_num_threads(2)
class Block(nn.Module):
    def __init__(s, d, f):
        super().__init__(); s.ln = nn.LayerNorm(d); s.fc1 = nn.Linear(d, f); s.act = nn.GELU(); s.fc2 = nn.Linear(f, d)
    def forward(s, x): return x + s.fc2(s.act(s.fc1(s.ln(x))))
class M(nn.Module):
    def __init__(s, d, f, n):
        super().__init__(); s.blocks = nn.ModuleList([Block(d, f) for _ in range(n)])
    def forward(s, x):
        for b in s.blocks: x = b(x)
        return x
m = M(cfg["d"], cfg["f"], cfg["layers"]).eval()
if cfg["noise"]:
    with torch.no_grad():
        blk = m.blocks[cfg["layers"] // 2]
        blk.fc1.weight.add_(0.01 * torch.randn_like(blk.fc1.weight))
x = torch.randn(cfg["batch"], cfg["seq"], cfg["d"], generator=torch.Generator().manual_seed(1))
comp = None if cfg["compression"] == "none" else cfg["compression"]
t0 = time.perf_counter()
with torch.no_grad():
    m(x)
t_fwd = time.perf_counter() - t0
t0 = time.perf_counter()
with DumpWriter(cfg["out"], backend="torch", compression=comp, overwrite=True) as w, TorchCapture(m, w) as cap:
    w.begin_record(); w.add_input("x", x)
    with torch.no_grad():
        m(x)
t_cap = time.perf_counter() - t0
print(json.dumps({"forward_s": t_fwd, "capture_s": t_cap, "tensors": cap.captured}))
"""


def run_measured(cmd: list[str]) -> tuple[float, int, str]:
    """Run a command; return (seconds, peak RSS bytes of that process, stdout)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    out = p.stdout.read() if p.stdout else ""
    err = p.stderr.read() if p.stderr else ""
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode not in (0, 1):
        raise SystemExit(f"command failed ({p.returncode}): {' '.join(cmd)}\n{err[-2000:]}")
    return dt, ru.ru_maxrss * 1024, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.5, help="approximate activation volume to capture (GiB)")
    ap.add_argument("--workdir", default="/tmp/ivq-bench-spine")
    ap.add_argument("--compression", default="auto", choices=["auto", "lzf", "gzip", "none"])
    ap.add_argument("--keep", action="store_true", help="keep the dumps")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    d, f, batch, seq = 1024, 2048, 2, 4096
    per_layer = batch * seq * (d * 3 + f * 2) * 4  # ln, fc2, block out (d) + fc1, act (f)
    layers = max(1, round(a.gib * 2**30 / per_layer))
    largest = batch * seq * f * 4
    cfg = {"d": d, "f": f, "batch": batch, "seq": seq, "layers": layers, "compression": a.compression, "seed": 0}
    py = sys.executable
    rows = {}
    for name, noise in (("ref", False), ("test", True)):
        out = work / f"{name}.h5"
        c = dict(cfg, out=str(out), noise=noise)
        dt, rss, so = run_measured([py, "-c", CAPTURE, json.dumps(c)])
        info = json.loads(so.strip().splitlines()[-1])
        rows[name] = {"wall_s": dt, "rss": rss, **info, "file_bytes": out.stat().st_size}
    from ivq_debug.dump import open_dump

    with open_dump(work / "ref.h5") as dref:
        act_bytes = sum(e.nbytes for e in dref.entries)
        n_t = len(dref.entries)
        largest = max(e.nbytes for e in dref.entries)
    # fixed overhead: ivq-diff on two tiny dumps
    tiny = work / "tiny.h5"
    import numpy as np

    from ivq_debug.dump import DumpWriter

    with DumpWriter(tiny, backend="torch", overwrite=True) as w:
        w.add_tensor("a", np.zeros(4, np.float32))
    _, rss_base, _ = run_measured([shutil.which("ivq-diff") or "ivq-diff", str(tiny), str(tiny), "-q"])
    dt_diff, rss_diff, _ = run_measured([shutil.which("ivq-diff") or "ivq-diff", str(work / "ref.h5"),
                                         str(work / "test.h5"), "-q", "--min-sqnr", "40"])
    mb = 1 / 2**20
    bound = 2 * largest + rss_base
    print(f"model: {layers} pre-LN MLP blocks, d={d}, ffn={f}, activations [{batch},{seq},*]; compression={a.compression}")
    print(f"captured: {n_t} tensors, {act_bytes * mb:,.0f} MiB of activations; largest tensor {largest * mb:,.0f} MiB")
    print("| step | wall s | MB/s | peak RSS MiB |")
    print("|---|---|---|---|")
    for name in ("ref", "test"):
        r = rows[name]
        over = r["capture_s"] - r["forward_s"]
        print(f"| torch capture ({name}) | {r['capture_s']:.2f} (forward alone {r['forward_s']:.2f}) | "
              f"{act_bytes * mb / r['capture_s']:,.0f} (writer {act_bytes * mb / max(over, 1e-9):,.0f}) | "
              f"{r['rss'] * mb:,.0f} |")
    print(f"| ivq-diff (both dumps read) | {dt_diff:.2f} | {2 * act_bytes * mb / dt_diff:,.0f} | {rss_diff * mb:,.0f} |")
    print(f"| ivq-diff on tiny dumps (fixed overhead) | | | {rss_base * mb:,.0f} |")
    print(f"dump file size: {rows['ref']['file_bytes'] * mb:,.0f} MiB")
    verdict = "OK" if rss_diff <= bound else "OVER"
    print(f"diff peak RSS {rss_diff * mb:,.0f} MiB vs bound 2 x largest + overhead = {bound * mb:,.0f} MiB: {verdict}")
    if not a.keep:
        for p in work.glob("*.h5"):
            p.unlink()


if __name__ == "__main__":
    main()
