"""``ivq calib-stats`` over a calibration set: in this process vs a local pool vs Ray (issue 15).

A ViT at ViT-S widths (transformers' ``ViTModel``: hidden 384, 6 heads, MLP 1536, 224² images, 16² patches;
``--layers`` blocks, default 4), quantized a8w8 with ORT's QNN flow on 8 of the images, and ``--samples`` (default
200) noise images written as a folder of ``.npz`` files. Each run is one ``ivq calib-stats`` process (both passes,
coverage of the QDQ model's encodings, ``--samples-per-job`` 10): ``--executor local --workers 1`` (in this
process), each ``--workers N`` pool, and ``--executor ray`` (a local Ray cluster started for the run, its start-up
included). It prints the wall times, the load average, and the check that every run's document equals the
``--workers 1`` one but for its jobs' bookkeeping (exit 1 when one differs).

    python bench/bench_calib.py [--workdir DIR] [--samples 200] [--layers 4] [--workers 2 ...] [--no-ray]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/common.py
from common import ivq_env, load_avg, run_measured  # noqa: E402

SIZE = 224


def build(wd: Path, layers: int, samples: int) -> tuple[Path, Path, Path]:
    """The float ViT, its a8w8 QDQ model and the calibration folder."""
    import numpy as np

    from ivq_debug.qnn.quantize import quantize_for_qnn
    from tests.support import vit

    wd.mkdir(parents=True, exist_ok=True)
    fm = wd / "vit.onnx"
    if not fm.exists():
        vit.build(wd, layers=layers, hidden=384, heads=6, mlp=1536, size=SIZE, patch=16)
    q = wd / "vit.qdq.onnx"
    if not q.exists():
        quantize_for_qnn(fm, q, vit.calibration(8, size=SIZE))
    cal = wd / f"cal{samples}"
    if not cal.exists():
        tmp = wd / f".cal{samples}"
        tmp.mkdir(exist_ok=True)
        for i in range(samples):
            np.savez(tmp / f"s{i:04d}.npz", **vit.image(1000 + i, bright=2.0 if i % 4 == 0 else 0.0, size=SIZE))
        tmp.rename(cal)
    return fm, q, cal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/ivq-bench-calib")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workers", action="append", type=int, default=None, metavar="N",
                   help="local pool sizes besides 1 (repeatable; default 2)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    a = p.parse_args(argv)
    wd = Path(a.workdir)
    fm, q, cal = build(wd, a.layers, a.samples)
    runs = {"local-1": ["--workers", "1"]}
    runs.update({f"local-{n}": ["--workers", str(n)] for n in (a.workers or [2])})
    if not a.no_ray:
        runs["ray"] = ["--executor", "ray"]
    out: dict = {"model": f"ViT {a.layers} blocks at ViT-S widths, {SIZE}²", "samples": a.samples,
                 "load_before": load_avg()}
    docs = {}
    for name, extra in runs.items():
        js = wd / f"stats-{name}.json"
        m = run_measured([sys.executable, "-m", "ivq_debug", "calib-stats", str(fm), "--calibration", str(cal),
                          "--encodings", str(q), "-o", str(js), "--force", *extra], log=wd / "logs" / name,
                         env=ivq_env(ROOT), ok_codes=(0, 1))
        if not m.ok:
            raise SystemExit(f"{name} failed: {m.why()}")
        doc = json.loads(js.read_text())
        out[name] = {"wall_s": round(m.seconds, 2), "jobs": doc["jobs"]["total"],
                     "peak_rss_mib": round(m.peak_rss / 2**20)}
        doc.pop("jobs")
        docs[name] = doc
    first = docs["local-1"]
    out["tensors"] = len(first["tensors"])
    out["low_coverage"] = len(first["coverage"]["low"])
    out["identical"] = {k: v == first for k, v in docs.items() if k != "local-1"}
    out["load_after"] = load_avg()
    print(json.dumps(out, indent=1))
    return 0 if all(out["identical"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
