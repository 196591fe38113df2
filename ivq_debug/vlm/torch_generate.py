"""The PyTorch reference generation, split exactly like the deployment, plus HF ``generate``.

:func:`torch_generate` runs the vision / prefill / decode wrappers of :mod:`ivq_debug.vlm.parts` on the
HF model in torch through the *same* :class:`~ivq_debug.vlm.scheduler.Scheduler` loop as ONNX Runtime
(with :class:`~ivq_debug.capture.torch.runner.TorchPartRunner` runners), so a torch dump and an ORT dump have the
same records ``(sample, part, step)``, the same inputs, the same meta and the same output names;
per-module tensors come from ``TorchCapture`` (HF module paths) when that module exists.

:func:`hf_generate` is the independent ground truth: HF's own ``generate`` (greedy) with its own masks,
positions and cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivq_debug.capture.torch.runner import TorchPartRunner
from ivq_debug.vlm.build import MAX_NEW_TOKENS, family_of
from ivq_debug.vlm.inputs import hf_inputs
from ivq_debug.vlm.scheduler import DeepStackPolicy, Generation, PositionsPolicy, Scheduler, SplitSpec
from ivq_debug.vlm.task import decode_ids


def torch_scheduler(
    model: Any, bucket: int, positions: PositionsPolicy | str = "correct", max_new_tokens: int | None = None,
    selection: Any = None, max_cache: int | None = None, *, deepstack: DeepStackPolicy | str = "correct",
    mrope_layout: str | None = None,
) -> Scheduler:
    """A scheduler whose runners are the torch part wrappers of ``model`` (same loop and knobs as ORT).

    ``selection`` (``ivq_debug.capture.base.Selection``) turns on per-module capture into the dump;
    ``mrope_layout`` runs the prefill wrapper under that M-RoPE layout (as the ORT variant graph does).
    """
    from ivq_debug.vlm.parts import (
        DecodePart,
        PrefillPart,
        VisionPart,
        kv_names,
        num_layers,
        vision_output_names,
    )

    model.eval()
    spec = SplitSpec.from_model(model, bucket, max_cache)
    kv = kv_names("present", num_layers(model))
    runners = {
        "vision": TorchPartRunner(VisionPart(model, bucket), vision_output_names(model), model, selection),
        "prefill": TorchPartRunner(PrefillPart(model, mrope_layout), ["logits", *kv], model, selection),
        "decode": TorchPartRunner(DecodePart(model), ["logits", *kv], model, selection),
    }
    return Scheduler(spec, runners, positions, max_new_tokens, deepstack=deepstack, mrope_layout=mrope_layout)


def torch_generate(
    model: Any, image: np.ndarray, bucket: int | None = None, *, sample: int = 0, writer: Any = None,
    forced_tokens: Sequence[int] | None = None, max_new_tokens: int | None = None,
    positions: PositionsPolicy | str = "correct", selection: Any = None,
    deepstack: DeepStackPolicy | str = "correct", mrope_layout: str | None = None,
) -> Generation:
    """Split greedy generation in torch (vision, prefill, decode steps), records aligned with ORT's."""
    bucket = int(image.shape[0]) if bucket is None else bucket
    sched = torch_scheduler(model, bucket, positions, max_new_tokens, selection, deepstack=deepstack,
                            mrope_layout=mrope_layout)
    return sched.generate(image, sample=sample, writer=writer, forced_tokens=forced_tokens)


@dataclass
class HFGeneration:
    """HF ``generate`` output for one image: new tokens (eos included) and per-step logits ``[steps, V]``."""

    tokens: list[int]
    logits: np.ndarray

    @property
    def text(self) -> str:
        """Caption text up to ``<eos>``."""

        return decode_ids(self.tokens)


def hf_generate(model: Any, image: np.ndarray, bucket: int | None = None, max_new_tokens: int | None = None) -> HFGeneration:
    """HF ``model.generate`` (greedy, batch 1) on the task prompt; tokens and raw per-step logits."""
    import torch


    bucket = int(image.shape[0]) if bucket is None else bucket
    inputs = hf_inputs(family_of(model), image, bucket)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens or MAX_NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )
    n = inputs["input_ids"].shape[1]
    toks = out.sequences[0, n:].tolist()
    logits = torch.stack([lg[0] for lg in out.logits]).float().numpy()
    return HFGeneration(toks, logits)
