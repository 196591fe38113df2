"""The three deployment parts of a VLM as torch modules: vision, LLM prefill, LLM decode step.

These wrappers are what :mod:`ivq_debug.vlm.export` exports and what
:mod:`ivq_debug.vlm.torch_generate` runs, so the torch reference and the ONNX graphs compute the
same thing with the same inputs. Every wrapper keeps the HF model under ``self.model`` and calls its
sub-modules, so forward hooks on the HF model see their usual module paths
(``model.language_model.layers.0.self_attn``) and the legacy exporter's scopes are relative to them.

Part contract (static shapes; ``S`` = prefill length of the bucket, ``C`` = ``max_cache``,
``L`` layers, ``H_kv`` KV heads, ``d`` head dim, ``D`` hidden size, ``V`` vocab):

=========  ==============================================================  ======================================
part       inputs                                                          outputs
=========  ==============================================================  ======================================
vision     ``pixel_values`` InternVL ``[1,3,H,W]``; Qwen2-VL ``[h·w,1176]``   ``image_features`` ``[1,N,D]``
prefill    ``inputs_embeds [1,S,D]``, ``attention_mask [1,1,S,S]``,        ``logits [1,S,V]``,
           ``position_ids [1,S]`` (M-RoPE ``[3,1,S]``)                     ``present.{i}.key/value [1,H_kv,S,d]``
decode     ``inputs_embeds [1,1,D]``, ``attention_mask [1,1,1,C+1]``,      ``logits [1,1,V]``,
           ``position_ids [1,1]`` (M-RoPE ``[3,1,1]``),                    ``present.{i}.key/value [1,H_kv,1,d]``
           ``past.{i}.key/value [1,H_kv,C,d]``
=========  ==============================================================  ======================================

``attention_mask`` is **additive** float32: 0 where attention is allowed, ``MASK_VALUE`` (−1e4)
where not. The decode mask's first ``C`` columns mark the valid cache slots, the last column is the
new token itself (always 0). ``present`` K are post-RoPE.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from ivq_debug.vlm.build import MASK_VALUE, PATCH, family_of


def text_config(model: Any) -> Any:
    """The text config of a VLM."""
    return model.config.text_config


def kv_shape(model: Any, length: int) -> tuple[int, int, int, int]:
    """``[1, H_kv, length, d]`` of one layer's K or V."""
    tc = text_config(model)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return (1, tc.num_key_value_heads, length, head_dim)


def num_layers(model: Any) -> int:
    """Number of decoder layers of the text model."""
    return int(text_config(model).num_hidden_layers)


def kv_names(prefix: str, n_layers: int) -> list[str]:
    """``[f"{prefix}.0.key", f"{prefix}.0.value", …]`` for ``n_layers`` layers."""
    return [f"{prefix}.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


class VisionPart(nn.Module):
    """Vision tower + projector → image features ``[1, N, D]`` for one bucket (grid fixed in the graph)."""

    def __init__(self, model: Any, bucket: int) -> None:
        super().__init__()
        self.model = model
        self.family = family_of(model)
        self.bucket = bucket
        if self.family == "qwen2vl":
            from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

            g = bucket // PATCH
            thw = torch.tensor([[1, g, g]], dtype=torch.long)
            self.register_buffer("grid_thw", thw, persistent=False)
            merge = model.config.vision_config.spatial_merge_size
            # precomputed geometry: constants in the graph (no CumSum / data-dependent ops)
            self.register_buffer("vision_position_ids", get_vision_position_ids(thw, merge), persistent=False)
            self.register_buffer("cu_seqlens", get_vision_cu_seqlens(thw), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.family == "internvl":
            return self.model.model.get_image_features(pixel_values=pixel_values).pooler_output
        out = self.model.model.visual(
            pixel_values, grid_thw=self.grid_thw, position_ids=self.vision_position_ids,
            cu_seqlens=self.cu_seqlens,
        )
        return out.pooler_output.unsqueeze(0)


class PrefillPart(nn.Module):
    """LLM prefill: embeddings, additive mask, positions → logits and the prompt's KV cache."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache(config=text_config(self.model))
        out = self.model.model.language_model(
            inputs_embeds=inputs_embeds, attention_mask={"full_attention": attention_mask},
            position_ids=position_ids, cache=cache, use_cache=True,
        )
        logits = self.model.lm_head(out.last_hidden_state)
        return (logits, *[t for layer in out.cache.layers for t in (layer.keys, layer.values)])


class DecodePart(nn.Module):
    """One LLM decode step over a fixed-size KV cache → logits and the new token's K/V only."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        cache = DynamicCache(ddp_cache_data=pairs, config=text_config(self.model))
        out = self.model.model.language_model(
            inputs_embeds=inputs_embeds, attention_mask={"full_attention": attention_mask},
            position_ids=position_ids, cache=cache, use_cache=True,
        )
        logits = self.model.lm_head(out.last_hidden_state)
        new = [t[:, :, -1:, :] for layer in out.cache.layers for t in (layer.keys, layer.values)]
        return (logits, *new)


@contextlib.contextmanager
def static_vision(model: Any, bucket: int) -> Iterator[None]:
    """Export patch for InternVL: the bucket's (interpolated) position embedding becomes a constant.

    Under tracing HF always re-interpolates the position table (bicubic ``Resize`` in the graph);
    eagerly it interpolates only when the size differs. The patched method returns the very tensor the
    eager path computes for this bucket, so the graph is numerically identical and QNN-friendly.
    No-op for Qwen2-VL (its geometry is precomputed by :class:`VisionPart`).
    """
    if family_of(model) != "internvl":
        yield
        return
    emb = model.model.vision_tower.embeddings
    n = (bucket // PATCH) ** 2
    with torch.no_grad():
        dummy = torch.zeros(1, n + 1, emb.position_embeddings.shape[-1])
        table = emb.interpolate_pos_encoding(dummy, bucket, bucket).detach().clone()
    emb.interpolate_pos_encoding = lambda embeddings, height, width: table
    try:
        yield
    finally:
        del emb.interpolate_pos_encoding


# ------------------------------------------------------------------------------------------ masks
def prefill_mask(length: int, valid: int | None = None) -> np.ndarray:
    """Additive causal mask ``[1,1,S,S]`` (0 allowed, −1e4 masked); ``valid`` < S masks right padding."""
    keep = np.tril(np.ones((length, length), dtype=bool))
    if valid is not None:
        keep[:, valid:] = False
        keep[np.arange(length), np.arange(length)] = True  # padded rows attend to themselves (no NaN)
    return np.where(keep, 0.0, MASK_VALUE).astype(np.float32)[None, None]


def decode_mask(cache_len: int, max_cache: int) -> np.ndarray:
    """Additive decode mask ``[1,1,1,C+1]``: slots ``< cache_len`` and the new token are 0, the rest −1e4."""
    keep = np.zeros(max_cache + 1, dtype=bool)
    keep[:cache_len] = True
    keep[max_cache] = True
    return np.where(keep, 0.0, MASK_VALUE).astype(np.float32)[None, None, None]
