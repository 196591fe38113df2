#!/usr/bin/env python
"""Measure a shipped reference VLM the way docs/reference-models.md reports it (CPU, minutes).

    python scripts/measure_reference.py --model qwen3vl-tiny                 # everything, 64 samples per bucket
    python scripts/measure_reference.py --model qwen2vl-tiny --samples 16 --json /tmp/q2.json

Per bucket of the fixed eval set: HF greedy caption accuracy; the legacy split export's worst ORT-vs-torch
max_abs per part over every sample; the ORT scheduler against HF ``generate`` (tokens equal, worst step
logit difference, exact match, ms per caption); and every fault knob the model's family has (positions
``restart`` / ``mrope_text_len``, ``deepstack`` ``dropped`` / ``before_layer``, ``mrope_layout``
``sectioned``): ORT caption accuracy with the knob, and the largest logit change of the teacher-forced
steps against the clean path. Prints one JSON document (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _knobs(family: Any) -> dict[str, dict[str, str]]:
    """The fault knobs a family has, as Scheduler keyword arguments."""
    knobs = {"positions=restart": {"positions": "restart"}}
    if family.mrope:
        knobs["positions=mrope_text_len"] = {"positions": "mrope_text_len"}
    if family.deepstack:
        knobs["deepstack=dropped"] = {"deepstack": "dropped"}
        knobs["deepstack=before_layer"] = {"deepstack": "before_layer"}
    if family.mrope_layout == "interleaved":
        knobs["mrope_layout=sectioned"] = {"mrope_layout": "sectioned"}
    return knobs


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see scripts/train_reference.py
    import numpy as np
    import torch

    from ivq_debug.outputs import atomic_write_text
    from ivq_debug.vlm import task
    from ivq_debug.vlm.build import BUCKETS, MODEL_NAMES, family
    from ivq_debug.vlm.export import export_parts
    from ivq_debug.vlm.load import load_vlm
    from ivq_debug.vlm.scheduler import Scheduler
    from ivq_debug.vlm.torch_generate import hf_generate
    from ivq_debug.vlm.train import evaluate_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODEL_NAMES, required=True)
    ap.add_argument("--samples", type=int, default=task.EVAL_SIZE, help="eval samples per bucket")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--force", action="store_true", help="replace an existing --json file")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    lv = load_vlm(a.model)
    fam = family(lv.model)
    out: dict[str, Any] = {"model": a.model, "samples": a.samples, "load_average": os.getloadavg()}
    acc, margin = evaluate_model(lv.model, BUCKETS, a.samples)
    out["hf_accuracy"] = {b: v.as_dict() for b, v in acc.items()}
    out["hf_min_margin"] = margin
    variants = ("mrope_sectioned",) if fam.mrope_layout == "interleaved" else ()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        res = export_parts(lv.model, tmp, buckets=BUCKETS, verify_samples=a.samples, variants=variants)
        out["export_seconds"] = time.perf_counter() - t0
        out["export_max_abs"] = [
            {"part": p.part, "bucket": p.bucket, "variant": p.variant, "nodes": p.nodes, "max_abs": p.check.worst}
            for p in res.parts if p.check is not None
        ]
        out["scheduler"], out["knobs"] = {}, {}
        for b in BUCKETS:
            samples = task.eval_set(b, a.samples)
            sched = Scheduler.from_export(tmp, b)
            equal, worst, preds, secs, clean = 0, 0.0, [], 0.0, []
            for s in samples:
                t0 = time.perf_counter()
                g = sched.generate(s.image)
                secs += time.perf_counter() - t0
                h = hf_generate(lv.model, s.image, b)
                equal += g.tokens == h.tokens
                if g.logits.shape == h.logits.shape:
                    worst = max(worst, float(np.abs(g.logits - h.logits).max()))
                preds.append(g.text)
                clean.append(sched.generate(s.image, forced_tokens=task.caption_ids(s.caption)).logits)
            refs = [s.caption for s in samples]
            out["scheduler"][b] = {"tokens_equal_hf": f"{equal}/{len(samples)}", "max_step_logit_diff": worst,
                                   "exact_match": task.caption_accuracy(preds, refs).exact_match,
                                   "ms_per_caption": 1000 * secs / len(samples)}
            for label, kw in _knobs(fam).items():
                ks = Scheduler.from_export(tmp, b, **kw)
                kp = [ks.generate(s.image).text for s in samples]
                dl = [np.abs(ks.generate(s.image, forced_tokens=task.caption_ids(s.caption)).logits - c).max(axis=1)
                      for s, c in zip(samples, clean, strict=True)]
                out["knobs"].setdefault(label, {})[b] = task.caption_accuracy(kp, refs).as_dict() | {
                    "max_logit_change_step0": float(max(d[0] for d in dl)),
                    "max_logit_change": float(max(d.max() for d in dl)),
                }
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if a.json is not None:
        atomic_write_text(a.json, text, overwrite=a.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
