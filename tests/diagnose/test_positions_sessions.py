"""Position offsets inferred from the KV cache of device sessions, on both cache styles, positions removed.

Every session of ``tests/support/device_sessions.py`` (real ORT runs of split exports) is compared, as a
device would leave it (graph inputs and outputs only, no ``position_ids`` anywhere), with the reference: the
parts with a position input, correct positions, teacher-forced on the device's tokens. The RoPE parameters
come from the checkpoint's HF ``config.json``, passed by the caller.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ivq_debug.diagnose.positions import estimate_rotation, infer_offsets, position_findings, rope_from_config
from ivq_debug.dump import open_dump
from tests.support.device_sessions import SESSIONS, device_view, reference_dump, session_image

NAMES = [f"{m}-{c}-{f}" for m, c, f in SESSIONS]
NO_POSITIONS = ("position_ids",)


def _ref(s, session_parts, dst: Path, tokens=None) -> Path:
    return reference_dump(session_parts(s.model, s.cache).folder, s.cache, session_image(),
                          s.tokens if tokens is None else tokens, dst)


@pytest.fixture(scope="module")
def pairs(device_sessions, session_parts, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (reference dump, device dump without positions)."""
    tmp = tmp_path_factory.mktemp("kv")
    return {name: (_ref(s, session_parts, tmp / f"{name}.ref.h5"),
                   device_view(s.dump, tmp / f"{name}.device.h5", s.parts, drop=NO_POSITIONS))
            for name, s in device_sessions.items()}


def test_dynamic_cache_restart_is_found_from_the_kv_cache(device_sessions, pairs):
    """Issue 12: comparing the whole ``present`` cache gave offset 0, fit 1.00, confidence 1.00 at every step."""
    s = device_sessions["internvl-tiny-dynamic-restart"]
    ref, dev = pairs[s.name]
    with open_dump(ref) as r, open_dump(dev) as d:
        whole = estimate_rotation(r.read("present.0.key", (0, "decode", 2)), d.read("present.0.key", (0, "decode", 2)),
                                  10000.0)
        assert whole.offset == 0 and whole.confidence > 0.99  # the trap: the prompt's identical slots dominate
        found = position_findings(r, d, base=10000.0)
    assert [f.evidence["offset"] for f in found] == [-20]


@pytest.mark.parametrize("name", NAMES)
def test_offset_and_first_wrong_step_without_positions(name, device_sessions, pairs):
    s = device_sessions[name]
    ref, dev = pairs[name]
    with open_dump(ref) as r, open_dump(dev) as d:
        found = position_findings(r, d, config=s.config)
    if s.expected_offset is None:
        assert found == []  # a correct run gives no position finding
        return
    assert len(found) == 1
    ev = found[0].evidence
    assert ev["method"] == "inferred" and ev["layer"] == 0
    assert (ev["offset"], ev["first_wrong_step"], ev["constant_offset"]) == (s.expected_offset, s.first_wrong_step,
                                                                           s.expected_offset)
    assert ev["cache"] == ("growing" if s.cache == "dynamic" else "new_slot")
    assert ev["fit"] > 0.999 and ev["confidence"] > 0.99
    steps = ev["steps"]
    assert sorted(steps) == list(range(1, len(s.tokens)))
    for k, st in steps.items():
        assert st["offset"] == s.expected_offset and st["same_token"] is True and st["fit"] > 0.999
        assert st["slot"] == (s.prefill_len + k - 1 if s.cache == "dynamic" else 0)
    if s.fault == "restart":
        assert "restart at 0" in found[0].message
    if s.fault == "naive_text":
        assert ev["rope_delta"] == s.rope_delta == -12 and "M-RoPE" in found[0].message
    assert ev["rope"]["rope_theta"] == 10000.0 and ev["rope"]["source"].endswith("config.json")


def test_steps_fed_another_token_are_not_used(device_sessions, session_parts, tmp_path):
    """A reference that followed other tokens from step 3 on: those steps carry no offset, earlier ones do."""
    s = device_sessions["internvl-tiny-dynamic-restart"]
    other = list(s.tokens)
    other[2] = 16 if other[2] != 16 else 17  # the reference feeds another word at step 3 (and follows it)
    ref = _ref(s, session_parts, tmp_path / "ref.h5", other)
    dev = device_view(s.dump, tmp_path / "device.h5", s.parts, drop=NO_POSITIONS)
    with open_dump(ref) as r, open_dump(dev) as d:
        steps = infer_offsets(r, d, base=rope_from_config(s.config))
        found = position_findings(r, d, config=s.config)
    assert [k for k, st in steps.items() if st.same_token is False] == [3]
    assert steps[3].offset is None and steps[3].estimate is None and "another token" in steps[3].reason
    assert {steps[k].offset for k in steps if k != 3} == {-20}
    assert found[0].evidence["first_wrong_step"] == 1 and found[0].evidence["steps"][3]["offset"] is None
    # without inputs_embeds the token cannot be told: the other token's key does not fit, so no offset either
    blind = device_view(s.dump, tmp_path / "blind.h5", s.parts, drop=(*NO_POSITIONS, "inputs_embeds"))
    with open_dump(ref) as r, open_dump(blind) as d:
        steps = infer_offsets(r, d, base=rope_from_config(s.config))
    assert steps[3].same_token is None and steps[3].offset is None and "low fit" in steps[3].reason
    assert steps[3].estimate is not None and steps[3].estimate.fit < 0.9
    assert {steps[k].offset for k in steps if k != 3} == {-20}


def test_no_rope_parameters_no_inferred_check(device_sessions, pairs):
    ref, dev = pairs["internvl-tiny-dynamic-restart"]
    with open_dump(ref) as r, open_dump(dev) as d:
        assert position_findings(r, d) == []  # neither base, nor config, nor dump attributes


def test_direct_check_still_wins_when_positions_are_kept(device_sessions, session_parts, tmp_path):
    s = device_sessions["qwen2vl-tiny-dynamic-naive_text"]
    ref = _ref(s, session_parts, tmp_path / "ref.h5")
    dev = device_view(s.dump, tmp_path / "device.h5", s.parts)
    with open_dump(ref) as r, open_dump(dev) as d:
        found = position_findings(r, d, config=s.config)
    assert found[0].evidence["method"] == "direct" and found[0].evidence["offset"] == 12
