"""Deterministic CPU training of the reference VLMs on the caption task.

:func:`train` builds a model from :mod:`ivq_debug.vlm.build`, trains all of it (vision tower, projector,
text model) with teacher-forced cross-entropy on the caption tokens, cycling through the resolution
buckets, then measures greedy caption accuracy on the fixed eval set of every bucket.
Determinism: seeds for torch and the data stream, a fixed thread count; bit-identical weights need the
same torch build and thread count (float reductions depend on both), the accuracy does not.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import UsageError
from ivq_debug.outputs import atomic_write_text
from ivq_debug.vlm import task
from ivq_debug.vlm.build import (
    BUCKETS,
    DEFAULT_BUCKET,
    MASK_VALUE,
    MAX_CACHE,
    MAX_NEW_TOKENS,
    build_model,
    family_of,
    num_image_tokens,
    param_count,
    prefill_len,
)
from ivq_debug.vlm.inputs import hf_inputs, training_batch

#: training recipe per shipped model (steps, batch, peak lr); measured to reach exact-match >= 0.9
RECIPES: dict[str, dict[str, Any]] = {
    "internvl-tiny": dict(steps=2500, batch_size=32, lr=3e-3, weight_decay=0.1),
    "qwen2vl-tiny": dict(steps=2500, batch_size=32, lr=3e-3, weight_decay=0.1),
    "qwen3vl-tiny": dict(steps=2000, batch_size=32, lr=3e-3, weight_decay=0.1, label_smoothing=0.1),
}
TRAIN_SEED = 7
REFERENCE_JSON = "ivq_reference.json"


@dataclass
class TrainResult:
    """What a training run produced."""

    name: str
    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    seed: int
    threads: int
    params: int
    wall_time_s: float
    final_loss: float
    accuracy: dict[int, dict[str, float]]  # bucket -> caption accuracy numbers
    min_margin: float  # smallest top-1/top-2 logit gap over the eval generations
    losses: list[float] = field(default_factory=list)
    model: Any = None  # the trained model (not serialised)
    label_smoothing: float = 0.0
    cpu: dict[str, Any] = field(default_factory=lambda: cpu_signature())

    @property
    def exact_match(self) -> float:
        """Exact match over all buckets' eval sets."""
        return float(np.mean([a["exact_match"] for a in self.accuracy.values()]))

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (no model, losses subsampled)."""
        d = asdict(self)
        d.pop("model")
        d["losses"] = [round(x, 5) for x in self.losses[:: max(1, len(self.losses) // 50)]]
        d["exact_match"] = self.exact_match
        d["accuracy"] = {str(k): v for k, v in self.accuracy.items()}
        return d


def cpu_signature() -> dict[str, Any]:
    """What the bits of a training run depend on besides the code, torch build and thread count: the CPU's
    vector ISA (oneDNN / ATen pick kernels by it, and kernels with other tile sizes sum in another order).
    Measured: the shipped internvl-tiny recipe rerun on an AMX / AVX-512 Xeon diverges from the checkpoint made
    on another host from step ~150 (loss 0.44976 vs 0.45)."""
    import platform

    import torch

    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = sorted(x for x in flags if x.startswith(("avx", "amx", "fma", "f16c")))
    return {"machine": platform.machine(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "isa": isa}


def _batches(bucket_cycle: Sequence[int], batch_size: int, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    step = 0
    while True:
        bucket = bucket_cycle[step % len(bucket_cycle)]
        samples = []
        for _ in range(batch_size):
            scene = task.sample_scene(rng)
            samples.append(task.Sample(step, scene, task.render(scene, bucket, rng), scene.caption, bucket))
        yield samples
        step += 1


def train(
    name: str,
    steps: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    weight_decay: float | None = None,
    label_smoothing: float | None = None,
    seed: int = TRAIN_SEED,
    buckets: Sequence[int] = BUCKETS,
    threads: int = 2,
    eval_size: int = task.EVAL_SIZE,
    log_every: int = 0,
) -> TrainResult:
    """Train one reference model from scratch and evaluate it; returns the model inside the result."""
    import torch

    recipe = RECIPES[name]
    steps = recipe["steps"] if steps is None else steps
    batch_size = recipe["batch_size"] if batch_size is None else batch_size
    lr = recipe["lr"] if lr is None else lr
    weight_decay = recipe["weight_decay"] if weight_decay is None else weight_decay
    label_smoothing = recipe.get("label_smoothing", 0.0) if label_smoothing is None else label_smoothing
    torch.set_num_threads(threads)
    model = build_model(name, seed=seed)
    family = family_of(model)

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    warm = max(1, steps // 20)

    def lr_at(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, steps - warm))) * 0.98 + 0.02

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    data = _batches(list(buckets), batch_size, seed)
    for i in range(steps):
        batch = training_batch(family, next(data))
        labels = batch.pop("labels")
        out = model(**batch)
        logits = out.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
            label_smoothing=label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"{name} step {i:5d} loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    wall = time.perf_counter() - t0
    model.eval()
    acc, margin = evaluate_model(model, buckets, eval_size)
    return TrainResult(
        name, steps, batch_size, lr, weight_decay, seed, threads, param_count(model), wall, float(np.mean(losses[-20:])),
        {b: a.as_dict() for b, a in acc.items()}, margin, losses, model, label_smoothing,
    )


def generate_captions(model: Any, samples: Sequence[task.Sample], batch_size: int = 64) -> tuple[list[str], float]:
    """Greedy HF ``generate`` captions for samples of one bucket, and the smallest top-1/top-2 gap."""
    import torch


    family = family_of(model)
    preds: list[str] = []
    margin = math.inf
    for k in range(0, len(samples), batch_size):
        chunk = samples[k : k + batch_size]
        per = [hf_inputs(family, s.image, s.bucket) for s in chunk]
        batch = {key: torch.cat([p[key] for p in per]) for key in per[0]}
        with torch.no_grad():
            out = model.generate(
                **batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True,
            )
        n_prompt = batch["input_ids"].shape[1]
        seqs = out.sequences[:, n_prompt:].tolist()
        for j, seq in enumerate(seqs):
            preds.append(task.decode_ids(seq))
            for step, lg in enumerate(out.logits):
                if step >= len(seq):
                    break
                top = torch.topk(lg[j].float(), 2).values
                margin = min(margin, float(top[0] - top[1]))
                if seq[step] == task.VOCAB[task.EOS]:
                    break
    return preds, margin


def evaluate_model(
    model: Any, buckets: Sequence[int] = BUCKETS, eval_size: int = task.EVAL_SIZE
) -> tuple[dict[int, task.CaptionAccuracy], float]:
    """HF greedy caption accuracy per bucket on the fixed eval set, and the smallest argmax margin."""
    acc = {}
    margin = math.inf
    for b in buckets:
        samples = task.eval_set(b, eval_size)
        preds, m = generate_captions(model, samples)
        margin = min(margin, m)
        acc[b] = task.caption_accuracy(preds, [s.caption for s in samples])
    return acc, margin


def save_reference(result: TrainResult, folder: str | os.PathLike, overwrite: bool = False) -> Path:
    """Save a trained model (safetensors), the tokenizer and ``ivq_reference.json`` into ``folder``."""

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise UsageError("reference folder exists and is not empty; pass overwrite=True", folder)
    folder.mkdir(parents=True, exist_ok=True)
    result.model.save_pretrained(folder, safe_serialization=True)
    task.save_tokenizer(folder)
    meta = reference_metadata(result.model)
    meta["training"] = result.as_dict()
    meta["prefill_len"] = {str(b): prefill_len(b) for b in BUCKETS}
    meta["max_cache"] = MAX_CACHE
    atomic_write_text(folder / REFERENCE_JSON, json.dumps(meta, indent=1, sort_keys=True), overwrite=True)
    return folder


def reference_metadata(model: Any) -> dict[str, Any]:
    """Task and bucket metadata stored beside a reference checkpoint."""

    return {
        "schema": "ivq-reference/1",
        "family": family_of(model),
        "task": "shapes-caption/1",
        "vocab": dict(task.VOCAB),
        "colours": list(task.COLOURS),
        "shapes": list(task.SHAPES),
        "relations": list(task.RELATIONS),
        "prompt": task.prompt_tokens(1),
        "pixel_mean": task.PIXEL_MEAN,
        "pixel_std": task.PIXEL_STD,
        "buckets": list(BUCKETS),
        "default_bucket": DEFAULT_BUCKET,
        "image_tokens": {str(b): num_image_tokens(b) for b in BUCKETS},
        "max_new_tokens": MAX_NEW_TOKENS,
        "mask_value": MASK_VALUE,
        "eval": {"seed": task.EVAL_SEED, "size": task.EVAL_SIZE},
    }
