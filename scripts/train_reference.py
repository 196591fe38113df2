#!/usr/bin/env python
"""Train the shipped reference VLMs from scratch (deterministic, CPU) and save them.

    python scripts/train_reference.py                      # both models → ivq_debug/reference/<name>/
    python scripts/train_reference.py --model internvl-tiny --out /tmp/ref --steps 300

Prints the caption accuracy per bucket, the smallest argmax margin and the wall time; the same
figures are stored in ``ivq_reference.json`` beside the checkpoint. Everything is a call into
:func:`ivq_debug.vlm.train.train` and :func:`ivq_debug.vlm.train.save_reference`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    # Passive OpenMP waits (set before torch loads): on a shared, oversubscribed 2-core machine the default
    # spin-waiting made a 2-thread qwen3vl-tiny step take ~10 s instead of ~0.4 s (load average 12-16); the
    # work split, and so every weight bit, is the same (checked: identical state_dict after 15 steps).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from ivq_debug.vlm.build import MODEL_NAMES
    from ivq_debug.vlm.load import REFERENCE_DIR
    from ivq_debug.vlm.train import TRAIN_SEED, save_reference, train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=[*MODEL_NAMES, "all"], default="all")
    ap.add_argument("--out", type=Path, default=REFERENCE_DIR, help="parent folder (default: the shipped one)")
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    ap.add_argument("--seed", type=int, default=TRAIN_SEED)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--force", action="store_true", help="replace existing checkpoints")
    a = ap.parse_args(argv)
    names = MODEL_NAMES if a.model == "all" else (a.model,)
    for name in names:
        res = train(name, steps=a.steps, seed=a.seed, threads=a.threads, log_every=a.log_every)
        folder = save_reference(res, a.out / name, overwrite=a.force)
        summary = {k: v for k, v in res.as_dict().items() if k != "losses"}
        print(json.dumps({"saved": str(folder), **summary}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
