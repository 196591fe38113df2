"""``ivq tune --sweep`` wall time: sequential vs ``--executor local --workers 2`` vs ``--executor ray`` (issue 15).

transformers' ViT (``tests/support/vit.py``; default 4 blocks, hidden 128, 64² images, 8² patches: 65 tokens),
a8w8 on ORT CPU-QDQ, 8 calibration images, one evaluation image, ``--groups 8 --precisions a16,fp16`` (16
candidates, each a re-quantize + capture + compare). Each run is one ``ivq tune`` process in a fresh workdir (the
reference capture, the baseline, the jobs, the final trial; Ray: a local cluster started for the run, its start-up
included), timed; the check: every run's candidates' numbers and chosen set equal the sequential run's.

    python bench/bench_sweep.py [--workdir DIR] [--layers 4] [--groups 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/common.py
from common import ivq_env, load_avg, run_measured  # noqa: E402

RUNS = {"sequential": [], "local-2": ["--executor", "local", "--workers", "2"], "ray": ["--executor", "ray"]}


def _model(wd: Path, layers: int) -> list[object]:
    """The ViT, its calibration folder and evaluation image; the ``ivq tune`` arguments naming them."""
    import numpy as np

    from tests.support import vit

    wd.mkdir(parents=True, exist_ok=True)
    fm = wd / "vit.onnx"
    if not fm.exists():
        vit.build(wd, layers=layers, hidden=128, heads=4, mlp=256, size=64, patch=8)
    cal = wd / "cal"
    cal.mkdir(exist_ok=True)
    for i, f in enumerate(vit.calibration(8, size=64)):
        np.savez(cal / f"{i}.npz", **f)
    np.savez(wd / "eval.npz", **vit.image(7, size=64))
    return [fm, "--calibration", cal, "--inputs", wd / "eval.npz"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/ivq-bench-sweep")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    a = p.parse_args(argv)
    wd = Path(a.workdir)
    model = _model(wd, a.layers)
    out: dict = {"load_before": load_avg()}
    docs = {}
    for name, extra in RUNS.items():
        run = wd / name
        shutil.rmtree(run, ignore_errors=True)
        m = run_measured([sys.executable, "-m", "ivq_debug", "tune", *map(str, model), "-o", str(run), "--backend",
                          "cpu", "--sweep", "--groups", str(a.groups), *extra], log=wd / "logs" / name,
                         env=ivq_env(ROOT))
        if not m.ok:
            raise SystemExit(f"{name} failed: {m.why()}")
        doc = json.loads((run / "tune.json").read_text())
        sw = doc["sweep"]
        out[name] = {"wall_s": round(m.seconds, 2), "jobs": sw["jobs"]["total"],
                     "job_s_sum": round(sum(r.get("seconds") or 0 for r in _results(run)), 2),
                     "chosen": sw["chosen"], "load": load_avg()}
        docs[name] = {"table": sw["table"], "chosen": sw["chosen"], "end_to_end": doc["end_to_end"]}
    out["identical"] = {k: v == docs["sequential"] for k, v in docs.items() if k != "sequential"}
    print(json.dumps(out, indent=1))
    return 0


def _results(run: Path) -> list[dict]:
    return [json.loads(p.read_text())["result"] for p in (run / "trials" / "sweep" / "shards").glob("*.json")]


if __name__ == "__main__":
    raise SystemExit(main())
