"""The KV-cache rotation estimate, on keys rotated by transformers' own RoPE implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

from ivq_debug.diagnose.positions import estimate_rotation


@pytest.mark.parametrize(("true_pos", "used_pos"), [(30, 2), (30, 0), (57, 45), (12, 12), (3, 40)])
def test_offset_of_hf_rope_keys(true_pos: int, used_pos: int) -> None:
    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    rot = Qwen2RotaryEmbedding(cfg)
    torch.manual_seed(true_pos)
    k = torch.randn(1, 2, 1, 16)

    def rope(pos: int) -> np.ndarray:
        cos, sin = rot(torch.zeros(1, 1, 64), torch.tensor([[pos]]))
        return apply_rotary_pos_emb(k, k, cos, sin)[1].numpy()

    est = estimate_rotation(rope(true_pos), rope(used_pos), base=10000.0, max_offset=512)
    assert est.offset == used_pos - true_pos
    assert est.fit == pytest.approx(1.0, abs=1e-6)
    assert est.confidence > 0.5  # the default min_confidence of position_findings
    # quantization-like noise on the test keys keeps the estimate
    noisy = rope(used_pos) + 0.03 * np.random.default_rng(0).standard_normal((1, 2, 1, 16))
    assert estimate_rotation(rope(true_pos), noisy, base=10000.0, max_offset=512).offset == used_pos - true_pos
