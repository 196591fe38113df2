#!/usr/bin/env python
"""The findings each Qwen3-VL fault knob gives, with their evidence numbers (docs/findings.md reports them).

    python scripts/measure_findings.py                       # qwen3vl-tiny, bucket 112, 1 eval image
    python scripts/measure_findings.py --bucket 56 --images 4 --json /tmp/f.json

Exports the model split (fixed cache, with the ``mrope_sectioned`` variant) into a temporary folder, captures
the clean ORT run and one run per knob (``deepstack`` dropped / before_layer, ``mrope_layout`` sectioned,
``positions`` mrope_text_len), teacher-forced on the clean tokens, and diffs each against the clean run
(``ivq.compare``: the registered diagnostics, as ``ivq-diff`` runs them). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KNOBS = {"deepstack=dropped": {"deepstack": "dropped"}, "deepstack=before_layer": {"deepstack": "before_layer"},
         "mrope_layout=sectioned": {"mrope_layout": "sectioned"}, "positions=mrope_text_len": {"positions": "mrope_text_len"}}
SHOWN = ("feature", "boundary", "after_layer", "found_after_layer", "ref_jump", "test_jump", "error_by_boundary",
         "positions", "layout", "model_layout", "shift", "residual", "residual_other_tokens", "layer", "offset", "cause",
         "method", "first_wrong_step", "rope_delta")


def _summary(f: Any) -> dict[str, Any]:
    return {"kind": f.kind, "severity": f.severity, "where": f.where,
            "evidence": {k: v for k, v in f.evidence.items() if k in SHOWN}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", default="qwen3vl-tiny")
    p.add_argument("--bucket", type=int, default=112)
    p.add_argument("--images", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import ivq_debug as ivq
    from ivq_debug.vlm import task
    from ivq_debug.vlm.export import export_parts
    from ivq_debug.vlm.load import load_vlm
    from ivq_debug.vlm.pipeline import capture_run
    from ivq_debug.vlm.scheduler import Scheduler

    t0 = time.perf_counter()
    out: dict[str, Any] = {"model": args.model, "bucket": args.bucket, "images": args.images, "knobs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        export_parts(load_vlm(args.model).model, folder, buckets=[args.bucket], model_id=args.model,
                     verify_samples=1, variants=("mrope_sectioned",))
        images = [s.image for s in task.eval_set(args.bucket, args.images)]
        clean = Scheduler.from_export(folder, args.bucket)
        forced = [clean.generate(im).tokens for im in images]
        ref = capture_run(folder, args.bucket, images, Path(tmp) / "clean.h5", forced=forced)
        for label, knobs in {"clean": {}, **KNOBS}.items():
            test = capture_run(folder, args.bucket, images, Path(tmp) / f"run-{label}.h5", forced=forced, **knobs)
            cmp = ivq.compare(ref, test, progress=False)
            out["knobs"][label] = [_summary(f) for f in cmp.findings if f.severity == "error"
                                   or f.kind.startswith(("deepstack", "mrope", "position"))]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
