"""The fix by cause (diagnose/remedy.py): one rule per cause, on unit evidence written here; the acceptance on real
models with injected faults is tests/diagnose/test_effect.py."""

from __future__ import annotations

from ivq_debug.diagnose.remedy import RULES, UnitEvidence, group_remedy, remedies_for


def _ev(**kw) -> UnitEvidence:
    base = dict(node="/b.0/fc/Gemm", op_type="Gemm", tensor="fc_out", budget_sqnr_db=20.0, intro_sqnr_db=8.0,
                weight="fc.weight", bias="fc.bias", inputs=["x"], replayed_on="onnxruntime-cpu-qdq")
    return UnitEvidence(**(base | kw))


def test_one_rule_per_cause_registered() -> None:
    causes = [r.cause for r in RULES]
    assert len(causes) == len(set(causes))
    assert {"weight_range", "weight_spread", "weight_resolution", "clipping", "resolution", "precision",
            "arithmetic"} <= set(causes)


def test_weight_spread_names_that_weight_never_its_bias() -> None:
    ev = _ev(weight_sqnr_db=9.0, weight_share=0.95,
             weight_enc={"bits": 8, "signed": False, "per_channel": False, "axis": 0, "channels": 64,
                         "dead_channels": 3, "spread": 5000.0, "min_bits": 0.4, "range_ratio": 1.0, "scale": 0.01,
                         "absmax": 1.27})
    (r,) = remedies_for(ev)
    assert r.cause == "weight_spread" and r.lever == "w_per_channel" and r.weights == ("fc.weight",)
    assert "fc.bias" not in r.text and "61 live" in r.text and "3 dead" in r.text
    assert r.override == {"fc.weight": [{"axis": 0}]}


def test_a_mis_fit_weight_scale_is_re_quantized() -> None:
    ev = _ev(weight_sqnr_db=12.0, weight_share=0.97,
             weight_enc={"bits": 8, "signed": False, "per_channel": False, "axis": 0, "channels": 8, "spread": 3.0,
                         "min_bits": 6.0, "range_ratio": 4.0, "scale": 0.04, "absmax": 1.27})
    (r,) = remedies_for(ev)
    assert r.cause == "weight_range" and "4.0×" in r.text
    assert r.override == {"fc.weight": [{"quant_type": "QUInt8", "scale": 0.01, "zero_point": 128}]}


def test_per_channel_weights_already_get_16_bit_weights_with_16_bit_activations_on_htp() -> None:
    enc = {"bits": 8, "signed": False, "per_channel": True, "axis": 0, "channels": 8, "spread": 5000.0}
    (r,) = remedies_for(_ev(weight_sqnr_db=12.0, weight_share=0.9, weight_enc=enc))
    assert r.lever == "w16" and "per-channel" not in r.text
    # the 16-bit weight HTP computes right: signed symmetric, whatever the preset's weight storage
    assert r.override["fc.weight"] == [{"quant_type": "QInt16", "symmetric": True}]
    assert r.override["x"] == [{"quant_type": "QUInt16"}]
    (r16,) = remedies_for(_ev(weight_sqnr_db=12.0, weight_share=0.9, weight_enc=enc, activation_bits=16))
    assert set(r16.override) == {"fc.weight"}


def test_clipping_widens_to_the_range_needed_on_the_tensor_and_its_copies() -> None:
    ev = _ev(weight=None, bias=None, act_sqnr_db=2.0, weight_share=0.0, copies=["fc_flat"],
             out_enc={"bits": 8, "signed": False, "lo": -0.2, "hi": 0.2, "step": 0.0016},
             fit={"clipped_fraction": 0.8, "clip_snr_db": 1.5, "grid_snr_db": 30.0, "ref_min": -4.0, "ref_max": 3.0})
    (r,) = remedies_for(ev)
    assert r.cause == "clipping" and r.lever == "widen" and r.tensors == ("fc_out", "fc_flat")
    assert r.override == {"fc_out": [{"rmin": -4.0, "rmax": 3.0}], "fc_flat": [{"rmin": -4.0, "rmax": 3.0}]}
    assert "[-4, 3]" in r.text and "16-bit" not in r.text


def test_never_16_bit_on_a_16_bit_tensor() -> None:
    ev = _ev(weight=None, bias=None, act_sqnr_db=30.0, budget_sqnr_db=40.0, weight_share=0.0,
             out_enc={"bits": 16, "signed": False, "lo": 0.0, "hi": 1.0, "step": 1.5e-5},
             fit={"clipped_fraction": 0.0, "clip_snr_db": float("inf"), "grid_snr_db": 31.0, "ref_min": 0.0,
                  "ref_max": 1.0})
    (r,) = remedies_for(ev)
    assert r.lever == "fp16" and r.cause == "precision" and r.override is None and r.exclude_nodes == (ev.node,)
    ev8 = _ev(weight=None, bias=None, act_sqnr_db=15.0, weight_share=0.0,
              out_enc={"bits": 8, "signed": False, "lo": 0.0, "hi": 1.0, "step": 0.004},
              fit={"clipped_fraction": 0.0, "clip_snr_db": float("inf"), "grid_snr_db": 16.0, "ref_min": 0.0,
                   "ref_max": 1.0})
    assert [r.lever for r in remedies_for(ev8)] == ["a16"]


def test_the_backends_arithmetic_is_its_own_cause_off_cpu() -> None:
    enc = {"bits": 8, "signed": False, "lo": 0.0, "hi": 1.0, "step": 0.004}
    fit = {"clipped_fraction": 0.0, "clip_snr_db": float("inf"), "grid_snr_db": 40.0, "ref_min": 0.0, "ref_max": 1.0}
    htp = _ev(weight=None, bias=None, act_sqnr_db=12.0, weight_share=0.0, out_enc=enc, fit=fit, replayed_on="qnn-htp")
    assert [r.cause for r in remedies_for(htp)] == ["arithmetic"]
    cpu = _ev(weight=None, bias=None, act_sqnr_db=12.0, weight_share=0.0, out_enc=enc, fit=fit)
    assert [r.cause for r in remedies_for(cpu)] == ["resolution"]  # CPU arithmetic is exact: the encoding's


def test_group_fix_names_the_culprits_first_over_the_units_given() -> None:
    enc = {"bits": 8, "signed": False, "per_channel": False, "axis": 0, "channels": 8, "spread": 900.0,
           "min_bits": 1.0, "range_ratio": 1.0, "scale": 0.01, "absmax": 1.27}
    worst = remedies_for(_ev(node="/b.7/fc/Gemm", weight="b7.w", weight_sqnr_db=3.0, weight_share=0.99,
                             weight_enc=enc))
    next_ = remedies_for(_ev(node="/b.1/fc/Gemm", weight="b1.w", weight_sqnr_db=9.0, weight_share=0.6,
                             weight_enc=enc))
    lever, text, override, exclude = group_remedy(worst + next_)
    assert lever == "w_per_channel" and text.index("b7.w") < text.index("b1.w") and set(override) == {"b7.w", "b1.w"}
    assert exclude == []
