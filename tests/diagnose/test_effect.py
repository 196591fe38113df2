"""Issue 28's acceptance: effect on the output and the fix by cause, on a block built in the repo with injected
faults (tests/support/remedy_models.py): an activation scale × 0.05 shared with a Reshape copy, a weight scale × 4,
and a saturating gate whose error does not reach the output (in every faulty model)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.diagnose.effect import (
    EFFECT_GROUPS,
    EFFECT_UNITS,
    Target,
    measure_effects,
    shared_encodings,
    why_small,
)
from ivq_debug.diagnose.replay import replay
from ivq_debug.dump import open_dump
from ivq_debug.executor import LocalExecutor
from ivq_debug.onnxgraph.load import load_model
from tests.support import remedy_models as rm
from tests.support.cli import ivq_cli
from tests.support.qnn_models import needs_qnn


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> dict[str, Path]:
    return rm.models(tmp_path_factory.mktemp("remedy"))


@pytest.fixture(scope="module")
def runs(m) -> dict[str, object]:
    return {tag: replay(m[tag], m["ref"], float_model=m["float"], progress=False) for tag in ("gate", "act", "weight")}


def _removal(runs, tag: str) -> float:
    """The share of the output error removed by removing the injected fault (the gate-only model as the fix)."""
    return 1.0 - runs["gate"].effects["base"]["noise"] / runs[tag].effects["base"]["noise"]


def test_the_copy_shares_the_faulty_encoding(m) -> None:
    fam = shared_encodings(load_model(m["act"]))
    assert fam[rm.FC1_TENSOR] == [rm.FC1_TENSOR, rm.FC1_COPY]


@pytest.mark.parametrize("tag,node,lever,names", [
    ("act", rm.FC1_NODE, "widen", [rm.FC1_TENSOR, rm.FC1_COPY]),
    ("weight", rm.FC2_NODE, "requantize_weight", [rm.FC2_WEIGHT]),
])
def test_headline_names_the_fault_with_its_effect_and_the_causes_fix(runs, tag, node, lever, names) -> None:
    r = runs[tag]
    head = r.findings()[0]
    assert head.kind == "introduced_error" and head.severity == "error" and head.where["node"] == node
    removal = _removal(runs, tag)  # measured: act 0.999, weight 0.71
    assert removal > 0.5 and head.evidence["output_error_share"] >= 0.5 * removal
    assert head.evidence["fix"] == lever and all(n in head.suggestion for n in names)
    assert "fc2.b" not in head.suggestion and "16-bit" not in head.suggestion
    assert set(head.evidence["override"]) == set(names)
    # the same unit's own row carries its measured effect
    row = r.table.set_index("node").loc[node]
    assert row["effect_share"] >= 0.5 * removal and row["effect_gain_db"] > 3


def test_the_gate_is_never_the_headline_and_says_why_its_effect_is_zero(runs) -> None:
    for tag in ("act", "weight"):
        fs = [f for f in runs[tag].findings() if f.kind == "introduced_error"]
        assert fs[0].where["node"] != rm.GATE_NODE
        gate = next(f for f in fs if f.where["node"] == rm.GATE_NODE)
        assert gate.evidence["worst"]["intro_sqnr_db"] < 2  # by introduced error it is the worst unit
        assert gate.evidence["output_error_share"] == 0.0 and "absorbed downstream" in gate.evidence["effect_why"]
        assert "removes" not in gate.message and gate.evidence["fix"] == "widen" and "gate" in gate.suggestion


def test_lifting_the_units_own_encoding_alone_misses_the_copy(m) -> None:
    ref = open_dump(m["ref"])
    rid = ref.records["rid"].iloc[0]
    e = measure_effects(m["act"], ref, [rid], [Target("own", [rm.FC1_TENSOR], []),
                                               Target("shared", [rm.FC1_TENSOR, rm.FC1_COPY], [])])
    assert e["targets"]["own"]["share"] < 0.05 < 0.99 < e["targets"]["shared"]["share"]  # measured 0.00 / 1.00
    assert e["targets"]["shared"]["unreached_tensors"] == []


def test_a_lift_that_cannot_reach_its_encoding_says_so(m) -> None:
    ref = open_dump(m["ref"])
    e = measure_effects(m["act"], ref, [ref.records["rid"].iloc[0]], [Target("t", ["branch_not_quantized"], [])])
    t = e["targets"]["t"]
    assert t["unreached_tensors"] == ["branch_not_quantized"] and t["share"] == 0.0
    assert "could not reach the encodings of branch_not_quantized" in why_small(t, 0.0)


def test_cost_is_bounded_and_shards_resume(m, runs, tmp_path) -> None:
    for r in runs.values():
        assert 1 < r.effects["runs"] <= 1 + EFFECT_GROUPS + EFFECT_UNITS
    first = replay(m["act"], m["ref"], float_model=m["float"], progress=False, shards=tmp_path / "sh",
                   executor=LocalExecutor(1))
    again = replay(m["act"], m["ref"], float_model=m["float"], progress=False, shards=tmp_path / "sh")
    assert first.effects["resumed"] == 0 and again.effects["resumed"] == again.effects["runs"]
    assert again.findings()[0].evidence["lift"] == first.findings()[0].evidence["lift"]


def test_cli_diagnose_names_the_fault_and_its_fix(m, tmp_path, capsys) -> None:
    test = capture(make_runner("onnx", m["act"], selection=Selection()), [rm.sample(7), rm.sample(8)],
                   tmp_path / "test.h5", progress=None)
    code = ivq_cli("diagnose", m["ref"], test, "--model", m["act"], "--float-model", m["float"], "--json",
                   tmp_path / "d.json")
    out = capsys.readouterr().out
    assert code == 1 and "effect dB" in out and "run(s) of the whole model" in out
    doc = json.loads((tmp_path / "d.json").read_text())
    head = doc["findings"][0]
    assert head["where"]["node"] == rm.FC1_NODE and head["evidence"]["fix"] == "widen"
    assert head["evidence"]["output_error_share"] > 0.9 and rm.FC1_COPY in head["suggestion"]
    assert doc["effects"]["runs"] >= 2 and doc["remedies"][rm.FC1_NODE][0]["cause"] == "clipping"


@needs_qnn
@pytest.mark.qnn
def test_effect_runs_on_the_replays_backend_and_the_lever_matches_cpu(m, runs) -> None:
    htp = replay(m["weight"], m["ref"], float_model=m["float"], progress=False,
                 runner_factory=partial(make_runner, "qnn"))
    assert "qnn" in htp.effects["base"]["backend"].lower() or "htp" in htp.effects["base"]["backend"].lower()
    head, cpu = htp.findings()[0], runs["weight"].findings()[0]
    assert head.where["node"] == cpu.where["node"] == rm.FC2_NODE
    assert head.evidence["fix"] == cpu.evidence["fix"] == "requantize_weight"


def test_remedies_only_for_the_units_the_findings_fix(runs) -> None:
    r = runs["weight"]
    assert [x.cause for x in r.remedies(rm.FC2_NODE)] == ["weight_range"]  # within the budget, but the culprit
    assert [x.cause for x in r.remedies(rm.GATE_NODE)] == ["clipping"]  # over budget
    healthy = [n for n in r.evidence if n not in (rm.FC2_NODE, rm.GATE_NODE, "gated/Mul")]
    assert healthy and all(r.remedies(n) == [] for n in healthy)  # measured (top 5), not a finding's unit
