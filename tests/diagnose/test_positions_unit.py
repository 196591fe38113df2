"""The KV-cache rotation estimate and its RoPE parameters, on keys rotated by transformers' own RoPE implementation."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PhiConfig, Qwen2Config
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

from ivq_debug.diagnose.positions import estimate_rotation, infer_offsets, rope_from_config
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.errors import InputError, UsageError


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


def _hf_keys(cfg, positions: list[int], seed: int = 0) -> list[np.ndarray]:
    """The same pre-RoPE key [1, 2, 1, d] rotated at each position by transformers' own RoPE for ``cfg``
    (Qwen2's rotary embedding, or Phi's, which rotates ``partial_rotary_factor`` of the head)."""
    rot = (PhiRotaryEmbedding if isinstance(cfg, PhiConfig) else Qwen2RotaryEmbedding)(cfg)
    d = cfg.hidden_size // cfg.num_attention_heads
    k = torch.randn(1, 2, 1, d, generator=torch.Generator().manual_seed(seed))
    out = []
    for p in positions:
        cos, sin = rot(torch.zeros(1, 1, cfg.hidden_size), torch.tensor([[p]]))
        r = cos.shape[-1]  # partial rotary: only the first r dims rotate
        out.append(torch.cat([apply_rotary_pos_emb(k[..., :r], k[..., :r], cos, sin)[1], k[..., r:]], -1).numpy())
    return out


def test_off_by_one_competes_with_offset_zero():
    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    ref, test = _hf_keys(cfg, [20, 21])
    est = estimate_rotation(ref, test, base=10000.0, max_offset=64)
    assert est.offset == 1 and est.fit == pytest.approx(1.0, abs=1e-6)
    assert 0.5 < est.fit_at_zero < est.fit  # the neighbour fits well: low frequencies
    assert est.margin <= est.fit - est.fit_at_zero + 1e-12  # offset 0 is always a rival
    # noise as large as the gap to offset 0 lowers the confidence instead of flipping the offset silently
    rng = np.random.default_rng(1)
    noisy = [estimate_rotation(ref, test + 0.5 * rng.standard_normal(test.shape), 10000.0, 64) for _ in range(20)]
    assert min(e.confidence for e in noisy) < 0.5
    assert all(e.offset == 1 or e.confidence < 0.5 for e in noisy)  # never a confident wrong offset


@pytest.mark.parametrize(("cls", "rope"), [
    (Qwen2Config, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    (PhiConfig, {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}),
])
def test_config_rope_variants_match_hf(cls, rope, tmp_path):
    cfg = cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    spec = rope_from_config(tmp_path)  # a checkpoint folder holding config.json
    assert spec.head_dim == 16 and spec.source == str(tmp_path / "config.json")
    ref, test = _hf_keys(cfg, [40, 9])
    assert estimate_rotation(ref, test, spec, max_offset=128).offset == -31
    assert estimate_rotation(ref, test, spec, max_offset=128).fit == pytest.approx(1.0, abs=1e-6)


def test_reference_configs():
    from ivq_debug.vlm.load import reference_path

    iv = rope_from_config(reference_path("internvl-tiny") / "config.json")
    qw = rope_from_config(reference_path("qwen2vl-tiny"))
    assert (iv.theta, iv.head_dim, iv.rotary_dim, iv.mrope_section) == (10000.0, 16, None, None)
    assert (qw.theta, qw.head_dim, qw.mrope_section) == (10000.0, 16, (2, 3, 3))


def test_config_errors(tmp_path):
    with pytest.raises(InputError, match=r"no such config\.json") as e:
        rope_from_config(tmp_path)
    assert str(tmp_path) in str(e.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match=r"config\.json: bad JSON at line 1"):
        rope_from_config(tmp_path / "config.json")
    with pytest.raises(InputError, match="no rope_theta"):
        rope_from_config({"text_config": {"hidden_size": 64}})
    with pytest.raises(UsageError, match="rope_type 'yarn' is not supported"):
        rope_from_config({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}})


def test_fixed_buffer_returned_whole_uses_the_written_slot(tmp_path):
    """A fixed-cache graph that returns its whole C-slot buffer: the slot it wrote is compared, not the buffer."""
    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    S, C = 6, 12
    buf = np.random.default_rng(0).standard_normal((1, 2, C, 16)).astype(np.float32)
    buf[:, :, S:] = 0

    def dump(path, shift: int, whole: bool) -> Any:
        past = buf.copy()
        with DumpWriter(path, backend="test") as w:
            w.begin_record(part="prefill", step=0)
            w.add_input("position_ids", np.arange(S)[None])
            w.add_tensor("present.0.key", buf[:, :, :S])
            for k in (1, 2, 3):
                new = _hf_keys(cfg, [S + k - 1 + shift], seed=k)[0].astype(np.float32)
                w.begin_record(part="decode", step=k)
                w.add_input("past.0.key", past)
                out = past.copy()
                out[:, :, S + k - 1] = new[:, :, 0]
                w.add_tensor("present.0.key", out if whole else new)
                past = out
        return open_dump(path)

    with dump(tmp_path / "ref.h5", 0, whole=False) as r, dump(tmp_path / "dev.h5", -S, whole=True) as d:
        steps = infer_offsets(r, d, base=10000.0)
        assert [(st.cache, st.slot, st.offset) for st in steps.values()] == [("fixed_buffer", S + k - 1, -S)
                                                                             for k in (1, 2, 3)]
        whole = estimate_rotation(r.read("present.0.key", (0, "decode", 3)),
                                  d.read("present.0.key", (0, "decode", 3))[:, :, S + 2 : S + 3], 10000.0)
        assert whole.offset == -S


def test_rope_from_dump_attributes(tmp_path):
    from ivq_debug.diagnose.positions import rope_of_dumps
    from ivq_debug.vlm.load import reference_path

    cfg = json.loads((reference_path("qwen2vl-tiny") / "config.json").read_text())
    paths = {}
    for name, model in (("cfg", {"config": cfg}), ("theta", {"rope_theta": 500.0}), ("none", {}),
                        ("yarn", {"config": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}})):
        paths[name] = tmp_path / f"{name}.h5"
        with DumpWriter(paths[name], backend="test", model=model) as w:
            w.begin_record()
    with open_dump(paths["cfg"]) as a, open_dump(paths["theta"]) as b, open_dump(paths["none"]) as c, \
            open_dump(paths["yarn"]) as y:
        spec = rope_of_dumps(c, a, b)
        assert (spec.theta, spec.mrope_section, spec.source) == (10000.0, (2, 3, 3), "cfg.h5 model attributes")
        assert rope_of_dumps(c, b).theta == 500.0
        assert rope_of_dumps(c) is None and rope_of_dumps(y) is None  # yarn: no inferred check, no error


def _positions_dump(path, prefill: list[float], decode: list[float]):
    """A dump holding only the position inputs of a prefill and its decode steps (as a scheduler records them)."""
    with DumpWriter(path, backend="test", overwrite=True) as w:
        w.begin_record(sample=0, part="prefill", step=0)
        w.add_input("position_ids", np.asarray([prefill], np.float32), role="derived")
        for k, p in enumerate(decode, start=1):
            w.begin_record(sample=0, part="decode", step=k)
            w.add_input("position_ids", np.asarray([[p]], np.float32), role="derived")
    return path


def test_fractional_positions_flow_through_the_direct_check(tmp_path):
    """V2PE-style prefill positions (visual tokens advance by 0.5): decode at S + k − 1 instead of
    max(pos) + k is off by +1.5, named as the dropped delta, not rounded to an integer."""
    from ivq_debug.diagnose.positions import check_positions, position_findings

    prefill = [0, 1, 1.5, 2.0, 2.5, 3.5, 4.5]  # S = 7, max 4.5, delta −1.5
    ref = _positions_dump(tmp_path / "ref.h5", prefill, [5.5, 6.5, 7.5])
    test = _positions_dump(tmp_path / "test.h5", prefill, [7, 8, 9])
    with open_dump(ref) as r, open_dump(test) as t:
        assert check_positions(r).first_wrong_step is None
        chk = check_positions(t)
        assert chk.max_prefill_pos == 4.5 and chk.rope_delta == -1.5 and chk.offsets == {1: 1.5, 2: 1.5, 3: 1.5}
        (f,) = position_findings(r, t)
    assert f.evidence["offset"] == 1.5 and f.evidence["cause"] == "rope_delta_dropped"
    assert "off by +1.5 from step 1" in f.message
    assert json.loads(json.dumps(f.to_dict()))["evidence"]["observed"] == {"1": 7, "2": 8, "3": 9}
    # ... and through the report a user opens: the fractional offset, unrounded, escaped into the HTML
    from ivq_debug.cli.common import run
    from ivq_debug.cli.main import _main as ivq_main

    html = tmp_path / "r.html"
    assert run("ivq", ivq_main, ["report", str(ref), str(test), "-o", str(html)]) == 0
    page = html.read_text()
    assert "position_id_offset" in page and "off by +1.5 from step 1" in page
