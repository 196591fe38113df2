"""Position offsets inferred from the KV cache of device sessions, on both cache styles, positions removed.

Every session of ``tests/fixtures/device_sessions.py`` (real ORT runs of split exports) is compared, as a
device would leave it (graph inputs and outputs only, no ``position_ids`` anywhere), with the reference: the
parts with a position input, correct positions, teacher-forced on the device's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ivq_debug.diagnose.positions import position_findings
from ivq_debug.dump import open_dump
from tests.fixtures.device_sessions import SESSIONS, device_view, reference_dump, session_image

NAMES = [f"{m}-{c}-{f}" for m, c, f in SESSIONS]


@pytest.fixture(scope="module")
def pairs(device_sessions, session_parts, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (reference dump, device dump without positions)."""
    tmp = tmp_path_factory.mktemp("kv")
    out = {}
    for name, s in device_sessions.items():
        ref = reference_dump(session_parts(s.model, s.cache).folder, s.cache, session_image(), s.tokens,
                             tmp / f"{name}.ref.h5")
        out[name] = (ref, device_view(s.dump, tmp / f"{name}.device.h5", s.parts, positions=False))
    return out


@pytest.mark.xfail(strict=True, reason="issue 12: the whole-cache present of a dynamic cache fits offset 0")
def test_dynamic_cache_restart_is_found_from_the_kv_cache(device_sessions, pairs):
    """Before: offset 0, fit 1.00, confidence 1.00 at every step (the S identical prefill slots dominate)."""
    s = device_sessions["internvl-tiny-dynamic-restart"]
    ref, dev = pairs[s.name]
    with open_dump(ref) as r, open_dump(dev) as d:
        found = position_findings(r, d, base=10000.0)
    assert [f.evidence["offset"] for f in found] == [-20]
