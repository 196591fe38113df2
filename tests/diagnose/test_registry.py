"""The diagnostics registry: one unit per finding kind, ranked; compare() measures, ivq.compare() also diagnoses."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import ivq_debug as ivq
from ivq_debug.comparator import compare
from ivq_debug.diagnose import DIAGNOSTICS, diagnose, headline, order, rank_of
from ivq_debug.diagnose.findings import KINDS, Finding
from ivq_debug.dump import DumpWriter


def test_every_kind_has_one_ranked_diagnostic() -> None:
    kinds = [d.kind for d in DIAGNOSTICS]
    assert sorted(kinds) == sorted(KINDS) and len(set(kinds)) == len(kinds)
    assert [d.rank for d in DIAGNOSTICS] == sorted(d.rank for d in DIAGNOSTICS)
    assert rank_of("projector_drift") < rank_of("introduced_error") < rank_of("first_divergence")


def test_order_and_headline() -> None:
    f = [Finding("first_divergence", "error", "a"), Finding("saturation", "warning", "b"),
         Finding("position_id_offset", "error", "c")]
    assert [x.kind for x in order(f)] == ["position_id_offset", "first_divergence", "saturation"]
    assert headline(f).kind == "position_id_offset"
    assert headline([]) is None


def test_compare_only_measures_and_the_api_composes_diagnostics(tmp_path: Path) -> None:
    for side, bad in (("r", 0.0), ("t", np.nan)):
        with DumpWriter(tmp_path / f"{side}.h5", backend=side) as w:
            w.begin_record()
            w.add_tensor("a", np.array([1.0, 2.0, bad], np.float32), order=0)
    plain = compare(tmp_path / "r.h5", tmp_path / "t.h5", progress=False)
    assert plain.findings == []
    full = ivq.compare(tmp_path / "r.h5", tmp_path / "t.h5", progress=False)
    kinds = [f.kind for f in full.findings]
    assert kinds[0] == "non_finite" and kinds == [f.kind for f in diagnose(plain)]
    assert diagnose(plain, kinds=["fp64_op"]) == []
