"""Model inputs of the reference task, per family: pixel layouts, prompt ids, M-RoPE positions.

Pixel preprocessing is numpy (as a deployment's pre-processing would be): InternVL takes
``[B, 3, H, W]``; the Qwen-VL families (``Family.patches``) take flattened patches ``[B·h·w, 3·2·14·14]``
in their processor's order plus ``image_grid_thw``. Torch tensors are only built by :func:`hf_inputs` /
:func:`training_batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ivq_debug.vlm import task
from ivq_debug.vlm.build import MERGE, PATCH, family, num_image_tokens, prefill_len

TEMPORAL_PATCH = 2


def internvl_pixels(images: Sequence[np.ndarray]) -> np.ndarray:
    """``[B, 3, H, W]`` float32 normalised pixels (InternVL vision tower input)."""
    return np.stack([task.normalize(im) for im in images]).astype(np.float32)


def qwen_patches(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One image → (flattened patches ``[h·w, 1176]``, ``grid_thw`` ``[1, 3]``), Qwen2-/Qwen3-VL processor order."""
    chw = task.normalize(image)
    c, hh, ww = chw.shape
    gh, gw = hh // PATCH, ww // PATCH
    x = np.repeat(chw[None], TEMPORAL_PATCH, axis=0)  # [T=2, C, H, W] (a still image repeats in time)
    x = x.reshape(1, TEMPORAL_PATCH, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = x.reshape(gh * gw, c * TEMPORAL_PATCH * PATCH * PATCH)
    return np.ascontiguousarray(flat, dtype=np.float32), np.array([[1, gh, gw]], dtype=np.int64)


def qwen_pixels(images: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Flattened patches of several images (concatenated) and their ``image_grid_thw`` ``[B, 3]``."""
    parts = [qwen_patches(im) for im in images]
    return np.concatenate([p for p, _ in parts]), np.concatenate([g for _, g in parts])


def vision_feeds(name: str, image: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds of the exported vision graph for one image."""
    if not family(name).patches:
        return {"pixel_values": internvl_pixels([image])}
    return {"pixel_values": qwen_patches(image)[0]}


def hf_inputs(name: str, image: np.ndarray, bucket: int) -> dict[str, Any]:
    """Torch inputs of HF ``generate``/``forward`` for one image with the task prompt (batch 1)."""
    import torch

    ids = torch.tensor([task.prompt_ids(num_image_tokens(bucket))], dtype=torch.long)
    out: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return out | _pixel_inputs(name, [image], ids)


def _pixel_inputs(name: str, images: Sequence[np.ndarray], ids: Any) -> dict[str, Any]:
    """``pixel_values`` (and, for patch families, ``image_grid_thw`` + ``mm_token_type_ids``) as torch."""
    import torch

    if not family(name).patches:
        return {"pixel_values": torch.from_numpy(internvl_pixels(images))}
    pv, thw = qwen_pixels(images)
    return {"pixel_values": torch.from_numpy(pv), "image_grid_thw": torch.from_numpy(thw),
            "mm_token_type_ids": (ids == task.VOCAB[task.IMAGE]).to(torch.int32)}


def training_batch(name: str, samples: Sequence[task.Sample]) -> dict[str, Any]:
    """A teacher-forced batch (prompt + caption + eos, right-padded) with ``labels`` (-100 = ignored)."""
    import torch

    bucket = samples[0].bucket
    prompt = task.prompt_ids(num_image_tokens(bucket))
    seqs = [prompt + task.caption_ids(s.caption) for s in samples]
    L = max(len(s) for s in seqs)
    pad = task.VOCAB[task.PAD]
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    am = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, len(prompt) : len(s)] = torch.tensor(s[len(prompt) :])
        am[i, : len(s)] = 1
    out: dict[str, Any] = {"input_ids": ids, "attention_mask": am, "labels": labels}
    return out | _pixel_inputs(name, [s.image for s in samples], ids)


def text_positions(length: int) -> np.ndarray:
    """1-D positions ``[1, S]`` (InternVL / Qwen2 text)."""
    return np.arange(length, dtype=np.int64)[None]


def mrope_positions(model: Any, bucket: int) -> np.ndarray:
    """M-RoPE prefill positions ``[3, 1, S]`` of the task prompt, from HF's own ``get_rope_index``."""
    ids = np.asarray([task.prompt_ids(num_image_tokens(bucket))], dtype=np.int64)
    g = bucket // PATCH
    pos, _ = rope_index(model, (ids == task.VOCAB[task.IMAGE]).astype(np.int32), np.asarray([[1, g, g]]))
    return pos


def _rope_index_owner(model_or_config: Any) -> Any:
    """The object whose ``get_rope_index`` to call: a model's (``model.model``), or, for an HF config (a dict
    or ``PretrainedConfig``), an instance of the config's base model class that holds only the config: the
    method reads ``self.config`` alone, so no weights are built."""
    inner = getattr(model_or_config, "model", model_or_config)
    if hasattr(inner, "get_rope_index"):
        return inner
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    cfg = model_or_config
    if isinstance(cfg, dict):
        d = dict(cfg)
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    cls = MODEL_MAPPING[type(cfg)]
    owner = cls.__new__(cls)
    object.__setattr__(owner, "config", cfg)
    return owner


def rope_index(model_or_config: Any, mm_token_type_ids: np.ndarray, image_grid_thw: np.ndarray,
               attention_mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE positions ``[3, B, S]`` and ``rope_deltas`` ``[B, 1]`` of prompts, from transformers' own
    ``get_rope_index`` (Qwen2-VL family).

    Args:
        model_or_config: a loaded model, or its HF config (``config.json`` as a dict, or a ``PretrainedConfig``).
        mm_token_type_ids: ``[B, S]``, 1 at image tokens, 0 at text.
        image_grid_thw: ``[n_images, 3]`` patch grids (before the spatial merge).
        attention_mask: ``[B, S]`` 1/0 (padding), optional.
    """
    import torch

    owner = _rope_index_owner(model_or_config)
    tt = torch.from_numpy(np.ascontiguousarray(mm_token_type_ids, dtype=np.int32))
    kw: dict[str, Any] = {"mm_token_type_ids": tt,
                          "image_grid_thw": torch.from_numpy(np.asarray(image_grid_thw, dtype=np.int64))}
    if attention_mask is not None:
        kw["attention_mask"] = torch.from_numpy(np.asarray(attention_mask, dtype=np.int64))
    pos, deltas = owner.get_rope_index(torch.zeros(tt.shape, dtype=torch.long), **kw)
    return pos.numpy().astype(np.int64), np.asarray(deltas, dtype=np.int64).reshape(-1, 1)


def prefill_positions(name: str, model: Any, bucket: int) -> np.ndarray:
    """Prefill ``position_ids`` of the task prompt (``name``: a family name): ``[1, S]`` (1-D RoPE) or
    ``[3, 1, S]`` (M-RoPE)."""
    if not family(name).mrope:
        return text_positions(prefill_len(bucket))
    return mrope_positions(model, bucket)


def rope_delta(positions: np.ndarray) -> int:
    """M-RoPE rope delta of prefill ``positions`` ``[3, 1, S]``: ``max + 1 - S`` (0 for 1-D positions).

    HF's rule (``get_rope_index``): a decode token at cache position ``c`` gets position ``c + delta``
    on all three rows; with an image the delta is negative (the image occupies fewer positions than tokens).
    """
    p = np.asarray(positions)
    if p.ndim != 3:
        return 0
    return int(p.max()) + 1 - int(p.shape[-1])


def mrope_frequency_axes(mrope_section: Sequence[int], layout: str) -> np.ndarray:
    """Position axis (0 = t, 1 = h, 2 = w) that drives each of the ``sum(mrope_section)`` rotary frequencies.

    * ``sectioned`` (Qwen2-VL): contiguous sections, ``t…t h…h w…w``;
    * ``interleaved`` (Qwen3-VL, transformers' ``recomposition_frequencies``): frequency ``i`` takes h when
      ``i % 3 == 1`` and ``i < 3·section[1]``, w when ``i % 3 == 2`` and ``i < 3·section[2]``, t otherwise
      (``[3, 3, 2]`` → ``t h w t h w t h``).

    Each frequency is used twice (the rotary halves). Text tokens have equal t/h/w positions, so both
    layouts rotate them identically; only image tokens tell them apart.
    """
    section = [int(v) for v in mrope_section]
    if len(section) != 3:
        raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {section}")
    n = sum(section)
    if layout == "sectioned":
        return np.repeat(np.arange(3), section)
    if layout != "interleaved":
        raise ValueError(f"unknown M-RoPE layout {layout!r}")
    axes = np.zeros(n, dtype=np.int64)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes
