#!/usr/bin/env python
"""The findings each Qwen3-VL fault knob gives, with their evidence numbers (docs/findings.md reports them).

    python scripts/measure_findings.py                       # qwen3vl-tiny, bucket 112, 1 eval image
    python scripts/measure_findings.py --bucket 56 --images 2 --preset a8w8   # CPU-QDQ parts as the test

Exports the model split (fixed cache, with the ``mrope_sectioned`` variant) into a temporary folder, captures
the clean ORT run and one run per knob (``deepstack`` dropped / before_layer, ``mrope_layout`` sectioned,
``positions`` mrope_text_len), teacher-forced on the clean tokens, and diffs each against the clean run
(``ivq.compare``: the registered diagnostics, as ``ivq-diff`` runs them). With ``--preset`` the test runs use
CPU-QDQ parts quantized with that preset (8 calibration images through the fp32 scheduler; the sectioned knob
is its quantized variant graph). Prints one JSON document.
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
    p.add_argument("--preset", default=None, help="quantize the test's parts (a8w8, a16w8, ...)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import ivq_debug as ivq
    from ivq_debug.capture.base import Selection, make_runner
    from ivq_debug.diagnose.positions import rope_of_dumps
    from ivq_debug.diagnose.rope_layout import layout_residuals
    from ivq_debug.qnn.quantize import quantize_for_qnn
    from ivq_debug.vlm import task
    from ivq_debug.vlm.export import export_parts
    from ivq_debug.vlm.load import load_vlm
    from ivq_debug.vlm.pipeline import capture_run
    from ivq_debug.vlm.scheduler import Scheduler, collect_feeds

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
        graphs = dict(clean.spec.part_paths)
        if args.preset:
            feeds = collect_feeds(clean, task.make_samples(8, args.bucket, 99))
            sources = graphs | {"sectioned": clean.spec.variant_paths["mrope_sectioned"]["prefill"]}
            graphs = {}
            for part, path in sources.items():
                graphs[part] = Path(tmp) / f"{part}.{args.preset}.qdq.onnx"
                quantize_for_qnn(path, graphs[part], feeds["prefill" if part == "sectioned" else part],
                                 preset=args.preset)
        out["preset"] = args.preset
        for label, knobs in {"clean": {}, **KNOBS}.items():
            factory = None
            if args.preset:
                paths = dict(graphs, prefill=graphs["sectioned"]) if "mrope_layout" in knobs else graphs
                knobs = {k: v for k, v in knobs.items() if k != "mrope_layout"}  # the quantized variant is the knob

                def factory(part: str, _path: Any, paths: dict = paths) -> Any:
                    return make_runner("onnx", paths[part], selection=Selection())
            test = capture_run(folder, args.bucket, images, Path(tmp) / f"run-{label}.h5", forced=forced,
                               runner_factory=factory, **knobs)
            cmp = ivq.compare(ref, test, progress=False)
            out["knobs"][label] = [_summary(f) for f in cmp.findings if f.kind.startswith(("deepstack", "mrope", "position"))
                                   or (f.severity == "error" and not args.preset)]
            rk, tk = cmp.ref.record_keys(), cmp.test.record_keys()
            rope = rope_of_dumps(cmp.ref)
            out.setdefault("mrope_statistics", {})[label] = {  # every sample's, found or not
                s: {k: v for k, v in (layout_residuals(cmp.ref, cmp.test, rk[key], tk[key], rope) or {}).items()
                    if k in ("shift", "residual", "residual_other_tokens")}
                for key in sorted(rk) if key[1] == "prefill" and (s := key[0]) is not None}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
