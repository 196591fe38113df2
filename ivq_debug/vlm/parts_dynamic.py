"""The LLM parts of an HF-style split export with a dynamic KV cache, as torch modules.

This is the layout optimum and most phone split exports use (``decoder_model`` with
``past_key_values.*`` inputs): the cache is a graph input and every ``present`` output holds the
WHOLE cache, past slots plus the new one, so it grows by one slot per decode step. It differs from the
embedded reference's fixed-cache parts (:mod:`ivq_debug.vlm.parts`), whose decode graph reads a fixed
``C``-slot buffer and returns only the new slot. The vision part is shared (:class:`~ivq_debug.vlm.parts.VisionPart`).

Part contract (``S`` prompt length and ``P`` past length are dynamic axes; ``L`` layers, ``H_kv`` KV heads,
``d`` head dim, ``D`` hidden size, ``V`` vocab):

=========  ==============================================================  ======================================
part       inputs                                                          outputs
=========  ==============================================================  ======================================
prefill    ``inputs_embeds [1,S,D]``, ``attention_mask [1,S]`` (int64),    ``logits [1,S,V]``,
           ``position_ids [1,S]`` (M-RoPE ``[3,1,S]``), Qwen3-VL:          ``present.{i}.key/value [1,H_kv,S,d]``
           ``deepstack_embeds.{k} [1,S,D]``
decode     ``inputs_embeds [1,1,D]``, ``attention_mask [1,P+1]`` (int64),  ``logits [1,1,V]``,
           ``position_ids [1,1]`` (M-RoPE ``[3,1,1]``; absent in the       ``present.{i}.key/value [1,H_kv,P+1,d]``
           no-position variant), ``past_key_values.{i}.key/value
           [1,H_kv,P,d]``
=========  ==============================================================  ======================================

``attention_mask`` is HF's 2-D padding mask (1 = attend, 0 = padding); transformers builds the causal
mask from it inside the graph. ``present`` K are post-RoPE.

The no-position decode variant (``position_input=False``) computes its positions inside the graph from
the cache length, ``P + position_offset`` on every M-RoPE row: offset 0 is transformers' own rule when no
``position_ids`` are given (``cache_position``; correct for 1-D RoPE, the naive text rule for M-RoPE),
``−S`` counts positions from the start of decoding (they restart at 0).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ivq_debug.vlm.build import family
from ivq_debug.vlm.parts import PrefillPart, text_config

#: names of the cache inputs and outputs (optimum's convention)
PAST_PREFIX = "past_key_values"
PRESENT_PREFIX = "present"


def _whole_cache(cache: Any) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


class HFPrefillPart(PrefillPart):
    """LLM prefill with HF's own 2-D mask handling → logits and the prompt's KV cache (``S`` slots).

    The fixed-cache :class:`~ivq_debug.vlm.parts.PrefillPart` computes exactly this (a fresh cache holds the
    prompt's ``S`` slots, transformers builds the causal mask from the 2-D padding mask as from the additive
    one), including the Qwen3-VL DeepStack inputs ``deepstack_embeds.{k} [1,S,D]`` after ``position_ids``.
    """


class HFDecodePart(nn.Module):
    """One decode step over a dynamic cache → logits and the WHOLE cache (``P + 1`` slots).

    Args:
        model: the HF VLM.
        position_input: the graph takes ``position_ids`` (default); ``False`` computes them inside from the
            cache length (``P + position_offset``), as a graph exported without a position input does.
        position_offset: added to the cache length when ``position_input`` is ``False``.
    """

    def __init__(self, model: Any, position_input: bool = True, position_offset: int = 0) -> None:
        super().__init__()
        self.model = model
        self.position_input = position_input
        self.position_offset = int(position_offset)
        self.mrope = family(model).mrope

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        if self.position_input:
            position_ids, past = rest[0], rest[1:]
        else:
            past = rest
            start = past[0].shape[2] + self.position_offset  # traced: the cache length is a graph value
            pos = torch.arange(inputs_embeds.shape[1], dtype=torch.long) + start
            position_ids = pos.view(1, 1, -1).expand(3, 1, -1) if self.mrope else pos.view(1, -1)
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        out = self.model.model.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            cache=DynamicCache(ddp_cache_data=pairs, config=text_config(self.model)), use_cache=True,
        )
        return (self.model.lm_head(out.last_hidden_state), *_whole_cache(out.cache))
