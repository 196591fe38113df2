"""The three deployment parts of a VLM as torch modules: vision, LLM prefill, LLM decode step.

These wrappers are what :mod:`ivq_debug.vlm.export` exports and what
:mod:`ivq_debug.vlm.torch_generate` runs, so the torch reference and the ONNX graphs compute the
same thing with the same inputs. Every wrapper keeps the HF model under ``self.model`` and calls its
sub-modules, so forward hooks on the HF model see their usual module paths
(``model.language_model.layers.0.self_attn``) and the legacy exporter's scopes are relative to them.

Part contract (static shapes; ``S`` = prefill length of the bucket, ``N`` image tokens, ``C`` =
``max_cache``, ``L`` layers, ``K`` DeepStack features (0 unless ``Family.deepstack``), ``H_kv`` KV heads,
``d`` head dim, ``D`` hidden size, ``V`` vocab):

=========  ==============================================================  ======================================
part       inputs                                                          outputs
=========  ==============================================================  ======================================
vision     ``pixel_values`` InternVL ``[1,3,H,W]``; Qwen-VL ``[h·w,1176]``    ``image_features`` ``[1,N,D]``,
                                                                           ``deepstack_features.{k}`` ``[1,N,D]``
prefill    ``inputs_embeds [1,S,D]``, ``attention_mask [1,1,S,S]``,        ``logits [1,S,V]``,
           ``position_ids [1,S]`` (M-RoPE ``[3,1,S]``),                    ``present.{i}.key/value [1,H_kv,S,d]``
           ``deepstack_embeds.{k} [1,S,D]``
decode     ``inputs_embeds [1,1,D]``, ``attention_mask [1,1,1,C+1]``,      ``logits [1,1,V]``,
           ``position_ids [1,1]`` (M-RoPE ``[3,1,1]``),                    ``present.{i}.key/value [1,H_kv,1,d]``
           ``past.{i}.key/value [1,H_kv,C,d]``
=========  ==============================================================  ======================================

``attention_mask`` is **additive** float32: 0 where attention is allowed, ``MASK_VALUE`` (−1e4)
where not. The decode mask's first ``C`` columns mark the valid cache slots, the last column is the
new token itself (always 0). ``present`` K are post-RoPE.

**DeepStack** (Qwen3-VL): ``deepstack_embeds.{k}`` is DeepStack feature ``k`` scattered to the
image-token rows of the prompt (zeros on text rows, as the scheduler builds it); the prefill adds it to
the hidden states right after LLM layer ``k``, which is HF's ``_deepstack_process`` (an in-place add on
the image rows) written as a dense ``h + e`` — the same numbers (``x + 0 = x`` on text rows) without
the boolean ``index_put`` the legacy exporter mis-exports. Decode never sees image tokens, so it has no
DeepStack input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from ivq_debug.errors import UsageError
from ivq_debug.vlm.build import (
    DEEPSTACK_INPUT,
    DEEPSTACK_OUTPUT,
    IMAGE_FEATURES,
    MASK_VALUE,
    PATCH,
    deepstack_count,
    family,
)
from ivq_debug.vlm.inputs import mrope_frequency_axes


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


def vision_output_names(model: Any) -> list[str]:
    """Outputs of the vision part: ``image_features`` then ``deepstack_features.{k}`` per DeepStack feature."""
    return [IMAGE_FEATURES, *[DEEPSTACK_OUTPUT.format(k=k) for k in range(deepstack_count(model))]]


def prefill_input_names(model: Any) -> list[str]:
    """Inputs of the prefill part, in call order (DeepStack inputs last)."""
    ds = [DEEPSTACK_INPUT.format(k=k) for k in range(deepstack_count(model))]
    return ["inputs_embeds", "attention_mask", "position_ids", *ds]


class VisionPart(nn.Module):
    """Vision tower + mergers → image features ``[1, N, D]`` (+ DeepStack features) for one bucket.

    For the patch families the vision geometry of the bucket (rotary ``position_ids``, ``cu_seqlens``
    and, for Qwen3-VL, the position-table interpolation taps) is precomputed with
    ``transformers.vision_utils`` and passed as the kwargs HF accepts, so it is constant in the graph.
    """

    def __init__(self, model: Any, bucket: int) -> None:
        super().__init__()
        self.model = model
        self.family = family(model)
        self.bucket = bucket
        self.n_deepstack = deepstack_count(model)
        self.geometry: list[str] = []
        if self.family.patches:
            from transformers import vision_utils as vu

            g = bucket // PATCH
            thw = torch.tensor([[1, g, g]], dtype=torch.long)
            self.register_buffer("grid_thw", thw, persistent=False)
            vis = model.model.visual
            merge = model.config.vision_config.spatial_merge_size
            # precomputed geometry: constants in the graph (no CumSum / data-dependent ops)
            geometry = {"position_ids": vu.get_vision_position_ids(thw, merge),
                        "cu_seqlens": vu.get_vision_cu_seqlens(thw)}
            if hasattr(vis, "pos_embed"):  # Qwen3-VL: learned table resampled to the grid
                geometry["interp_indices"], geometry["interp_weights"] = (
                    vu.get_vision_interpolation_indices_and_weights(
                        thw, num_grid_per_side=vis.num_grid_per_side, mode=vis.interpolation_mode,
                        align_corners=vis.interpolation_align_corners, spatial_merge_size=merge,
                    )
                )
            for key, value in geometry.items():
                self.register_buffer(f"geo_{key}", value, persistent=False)
                self.geometry.append(key)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not self.family.patches:
            return self.model.model.get_image_features(pixel_values=pixel_values).pooler_output
        kw = {key: getattr(self, f"geo_{key}") for key in self.geometry}
        out = self.model.model.visual(pixel_values, grid_thw=self.grid_thw, **kw)
        feats = out.pooler_output.unsqueeze(0)
        if not self.n_deepstack:
            return feats
        return (feats, *[d.unsqueeze(0) for d in out.deepstack_features])


class _TextPart(nn.Module):
    """Shared body of prefill and decode: the HF text model + ``lm_head`` under a rotary layout."""

    def __init__(self, model: Any, mrope_layout: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.mrope_layout = mrope_layout

    def _text(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
              cache: Any, deepstack: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
        lm = self.model.model.language_model
        kw: dict[str, Any] = {}
        if deepstack:
            kw = {"visual_pos_masks": None, "deepstack_visual_embeds": deepstack}
        with rope_layout(self.model, self.mrope_layout), dense_deepstack(lm if deepstack else None):
            out = lm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                     cache=cache, use_cache=True, **kw)
        return self.model.lm_head(out.last_hidden_state), out.cache


class PrefillPart(_TextPart):
    """LLM prefill: embeddings, additive mask, positions (+ DeepStack inputs) → logits and the prompt's KV.

    ``mrope_layout`` overrides the model's M-RoPE layout (``"sectioned"`` on an interleaved model: the
    fault variant of :mod:`ivq_debug.vlm.export`); None keeps the model's own.
    """

    def forward(
        self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        *deepstack_embeds: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache(config=text_config(self.model))
        logits, cache = self._text(inputs_embeds, attention_mask, position_ids, cache, list(deepstack_embeds))
        return (logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])


class DecodePart(_TextPart):
    """One LLM decode step over a fixed-size KV cache → logits and the new token's K/V only."""

    def forward(
        self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        cache = DynamicCache(ddp_cache_data=pairs, config=text_config(self.model))
        logits, cache = self._text(inputs_embeds, attention_mask, position_ids, cache)
        new = [t[:, :, -1:, :] for layer in cache.layers for t in (layer.keys, layer.values)]
        return (logits, *new)


@contextlib.contextmanager
def dense_deepstack(text_model: Any) -> Iterator[None]:
    """HF's DeepStack add at the image rows as a dense ``h + e`` (``e`` pre-scattered); None: no-op."""
    if text_model is None:
        yield
        return
    text_model._deepstack_process = lambda hidden, visual_pos_masks, visual_embeds: hidden + visual_embeds
    try:
        yield
    finally:
        del text_model._deepstack_process


def sectioned_recomposition(freq: torch.Tensor, mrope_section: list[int]) -> torch.Tensor:
    """Qwen2-VL's sectioned M-RoPE layout for Qwen3-VL's rotary: contiguous t | h | w frequency sections.

    ``freq`` is ``[3, B, S, F]`` (one row per position axis); returns ``[B, S, 2F]`` like
    ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies`` (the interleaved layout).
    """
    chunks = freq.split(list(mrope_section), dim=-1)
    half = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)
    return torch.cat((half, half), dim=-1)


@contextlib.contextmanager
def rope_layout(model: Any, layout: str | None) -> Iterator[None]:
    """Run the text model's rotary embedding with another M-RoPE layout (None / its own: no-op).

    Only an interleaved model can be switched (to ``"sectioned"``): that is the fault a runtime or kernel
    written for Qwen2-VL makes on Qwen3-VL. Exact on text tokens (their three position rows are equal).
    """
    own = family(model).mrope_layout
    if layout is None or layout == own:
        yield
        return
    if own != "interleaved" or layout != "sectioned":
        raise UsageError(f"M-RoPE layout {layout!r} cannot be applied to a {own or '1-D RoPE'} model")
    rot = model.model.language_model.rotary_emb
    section = list(rot.mrope_section)
    rot.recomposition_frequencies = lambda freq: sectioned_recomposition(freq, section)
    try:
        yield
    finally:
        del rot.recomposition_frequencies


def mrope_axes_of(model: Any, layout: str | None = None) -> np.ndarray:
    """Position axis (0 t, 1 h, 2 w) of each rotary frequency of an M-RoPE model under ``layout``."""
    tc = text_config(model)
    return mrope_frequency_axes(tc.rope_parameters["mrope_section"], layout or family(model).mrope_layout)


@contextlib.contextmanager
def static_vision(model: Any, bucket: int) -> Iterator[None]:
    """Export patch for InternVL: the bucket's (interpolated) position embedding becomes a constant.

    Under tracing HF always re-interpolates the position table (bicubic ``Resize`` in the graph);
    eagerly it interpolates only when the size differs. The patched method returns the very tensor the
    eager path computes for this bucket, so the graph is numerically identical and QNN-friendly.
    No-op for the patch families (their geometry is precomputed by :class:`VisionPart`).
    """
    if family(model).patches:
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
