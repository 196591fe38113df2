"""One ``ivq tune`` trial vs one capture of the same model and inputs (issue 33: a trial = a partial capture).

The model: ``tests/support/ocr_models.py`` ``ocr`` (the PP-OCRv4-like recognizer, 1×3×48×320; ``--model`` any of
its names), 8 seeded calibration samples, ``--samples`` (default 4) evaluation inputs, ORT CPU-QDQ or the emulated
QNN HTP (``--backend``). One process per code revision (this one, and ``--baseline-src DIR``: an exported older
``ivq_debug``, ``git archive <rev> ivq_debug | tar -x -C DIR``, measured in the same run): the float reference is
captured, the baseline trial run (not timed: it fills the calibration and context caches as in a tune), then,
timed in that process, the capture of the baseline QDQ model with every tensor into a dump and one trial of the
same configuration (``one_trial`` where the revision has it, else ``Tuner.trial(keep_dump=False)``). Prints the
seconds, the ratio trial / capture (the goal: ≤ 1.5×), the load average and whether the trial's watched SQNR equals
the baseline's (exit 1 when not).

    python bench/bench_trial.py [--model ocr] [--backend cpu|qnn] [--samples 4] [--baseline-src /tmp/ivq-old]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # bench/common.py
from common import ivq_env, load_avg, run_measured, self_cmd, step_result  # noqa: E402


def step_trial(a: dict[str, Any]) -> dict[str, Any]:
    """In one process (the ``ivq_debug`` on ``PYTHONPATH``): the capture and one trial, timed."""
    sys.path.append(str(ROOT))  # tests.support (after the revision measured)
    import numpy as np

    from ivq_debug.capture.base import Selection, capture, make_runner
    from ivq_debug.tune import verify
    from tests.support import ocr_models

    wd = Path(a["dir"])
    model = wd / f"{a['model']}.onnx"
    _, shape = ocr_models.torch_model(a["model"])
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.random(shape, dtype=np.float32)} for _ in range(a["samples"])]
    tuner = verify.Tuner(model, ocr_models.calibration(shape, 8), feeds, wd / "ref.h5", wd / a["name"],
                         backend=a["backend"], resume=False)
    capture(make_runner("onnx", tuner.source(), selection=Selection()), feeds, tuner.reference, overwrite=True,
            progress=None)
    before = tuner.trial("before", [])
    if before.error:
        raise SystemExit(f"baseline trial failed: {before.error}")
    opts = {"optimization": "disable"} if a["backend"] == "cpu" else {}
    runner = make_runner("onnx" if a["backend"] == "cpu" else "qnn", before.qdq_model, selection=Selection(), **opts)
    t0 = time.perf_counter()
    capture(runner, feeds, wd / a["name"] / "capture.h5", overwrite=True, progress=None)
    t_cap = time.perf_counter() - t0
    t0 = time.perf_counter()
    if hasattr(verify, "one_trial"):
        tr = verify.one_trial(tuner, "again")
    else:
        tr = tuner.trial("again", [], keep_dump=False)
    t_trial = time.perf_counter() - t0
    watch = before.comparison.table.sort_values("order").iloc[-1]["ref_name"]
    same = tr.sqnr(watch) == before.sqnr(watch)
    shutil.rmtree(wd / a["name"], ignore_errors=True)  # the dumps (GBs at the default model)
    return {"capture_s": round(t_cap, 2), "trial_s": round(t_trial, 2), "ratio": round(t_trial / t_cap, 2),
            "same_sqnr": same, "watch": watch, "sqnr_db": tr.sqnr(watch)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ocr")
    p.add_argument("--backend", default="cpu", choices=["cpu", "qnn"])
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--workdir", default="/tmp/ivq-bench-trial")
    p.add_argument("--baseline-src", default=None, metavar="DIR", help="an older ivq_debug, measured in the same run")
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--step-args", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.step:
        print(json.dumps(step_trial(json.loads(a.step_args))))
        return 0
    sys.path.insert(0, str(ROOT))
    from tests.support import ocr_models

    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    if not (wd / f"{a.model}.onnx").exists():
        ocr_models.build(a.model, wd)
    runs = [("this", None)] + ([("baseline", a.baseline_src)] if a.baseline_src else [])
    ok = True
    print(f"{a.model}, {a.samples} evaluation inputs, {a.backend}; load average before: {load_avg()}")
    for name, src in runs:
        args = {"dir": str(wd), "model": a.model, "samples": a.samples, "backend": a.backend, "name": name}
        m = run_measured(self_cmd(__file__, "trial", args), log=wd / f"{name}.log",
                         env=ivq_env(src) if src else ivq_env(ROOT))
        r = step_result(m)
        if m.returncode != 0 or not r:
            print(f"{name}: failed ({m.returncode}); see {wd / name}.log.err")
            ok = False
            continue
        ok &= bool(r["same_sqnr"])
        print(f"{name:9s} capture {r['capture_s']:7.2f} s  trial {r['trial_s']:7.2f} s  trial/capture "
              f"{r['ratio']:.2f}x  {r['watch']} {r['sqnr_db']:.2f} dB (same as the baseline trial: {r['same_sqnr']})")
    (wd / "ref.h5").unlink(missing_ok=True)
    print(f"load average after: {load_avg()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
