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
    effect_run,
    effect_runs,
    measure_effects,
    shared_encodings,
    why_small,
)
from ivq_debug.diagnose.replay import replay
from ivq_debug.dump import open_dump
from ivq_debug.executor import LocalExecutor
from ivq_debug.onnxgraph.load import load, load_model
from tests.support import remedy_models as rm
from tests.support.cli import ivq_cli
from tests.support.parses import counting
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


def specs_of(effects: dict) -> list[tuple[list[str], list[str]]]:
    """The unchanged model and every target a replay measured, as ``(tensors, weights)``."""
    out = [([], [])] + [(t["tensors"], sorted(t["weights_lifted"] + t["unreached"]))
                        for t in effects["targets"].values()]
    return list({(tuple(a), tuple(b)): (list(a), list(b)) for a, b in out}.values())


def one_graph_equals_one_by_one(qdq, fmodel, ref, rids, specs) -> None:
    """The targets' runs as one graph (one session) give each target's figures of its own model, to the bit."""
    with counting() as c:
        together = effect_runs(qdq, ref, rids, specs, fmodel, None)
    assert sum(c["ort_session"].values()) == 1
    alone = [effect_run(qdq, ref, rids, t, w, fmodel, None) for t, w in specs]
    strip = [{k: v for k, v in d.items() if k != "seconds"} for d in (*together, *alone)]
    assert strip[:len(specs)] == strip[len(specs):]
    # the targets change the output differently (a mix-up of the variants' outputs would show); one whose error is
    # absorbed downstream (the gate) leaves it as it is
    assert len({d["noise"] for d in together}) >= 3


@pytest.mark.parametrize("tag", ["act", "weight"])
def test_the_counterfactual_runs_as_one_graph_equal_the_runs_one_by_one(m, runs, tag) -> None:
    ref = open_dump(m["ref"])
    specs = specs_of(runs[tag].effects)
    assert len(specs) >= 4 and any(w for _, w in specs)  # lifted weights (the float model's) and encodings
    one_graph_equals_one_by_one(load(m[tag]), load(m["float"]), ref, [ref.records["rid"].iloc[0]], specs)
    # an injected fault in the model shows in the batched figures as in the replay's own: the fault's lift removes
    # most of the output error (the act fault: its encoding with its Reshape copy)
    if tag == "act":
        fix = next(d for (t, _), d in zip(specs, effect_runs(load(m[tag]), ref, [ref.records["rid"].iloc[0]], specs,
                                                             load(m["float"]), None), strict=True)
                   if rm.FC1_COPY in t)
        assert fix["noise"] < 0.05 * runs[tag].effects["base"]["noise"]


def test_two_workers_split_the_targets_into_two_graphs_with_the_same_figures(m, runs, tmp_path) -> None:
    ref = open_dump(m["ref"])
    rid = ref.records["rid"].iloc[0]
    targets = [Target(f"t{i}", t, w) for i, (t, w) in enumerate(specs_of(runs["act"].effects)[1:])]
    one = measure_effects(m["act"], ref, [rid], targets, float_model=m["float"], executor=LocalExecutor(1))
    two = measure_effects(m["act"], ref, [rid], targets, float_model=m["float"], executor=LocalExecutor(2),
                          shards=tmp_path / "sh")
    assert len(list((tmp_path / "sh").glob("*.json"))) == 2 and two["runs"] == one["runs"] == len(targets) + 1
    assert {k: v for k, v in two.items() if k != "seconds"} == {k: v for k, v in one.items() if k != "seconds"}


def test_without_an_executor_the_cpu_runs_are_two_graphs_in_threads_with_the_figures_of_one(m, runs) -> None:
    """``defaults.EFFECT_THREADS``: without an executor (and no kept shard) the CPU targets go in two groups, each
    one graph and one ONNX Runtime session run in its own thread; every figure is the one graph's, to the bit."""
    import os

    from ivq_debug import defaults

    ref = open_dump(m["ref"])
    rid = ref.records["rid"].iloc[0]
    targets = [Target(f"t{i}", t, w) for i, (t, w) in enumerate(specs_of(runs["act"].effects)[1:])]
    assert len(targets) >= 2 and defaults.EFFECT_THREADS == 2
    with counting() as one_graph:
        one = measure_effects(m["act"], ref, [rid], targets, float_model=m["float"], executor=LocalExecutor(1))
    with counting() as threaded:
        both = measure_effects(m["act"], ref, [rid], targets, float_model=m["float"])
    groups = min(defaults.EFFECT_THREADS, os.cpu_count() or 1)  # one per core at most
    assert sum(one_graph["ort_session"].values()) == 1 and sum(threaded["ort_session"].values()) == groups
    assert {k: v for k, v in both.items() if k != "seconds"} == {k: v for k, v in one.items() if k != "seconds"}


def test_the_weight_spreads_are_computed_when_read(m) -> None:
    """``ReplayResult.spread``: the float model's per-tensor weight spreads, computed on first read (the replay's
    document, findings and remedies do not read them)."""
    from ivq_debug.diagnose.weight_spread import spread_by_weight

    r = replay(m["weight"], m["ref"], float_model=m["float"], progress=False, lift=False)
    assert "spread" not in vars(r)
    assert r.spread == spread_by_weight(load(m["float"])) and len(r.spread) >= 2
    assert replay(m["weight"], m["ref"], progress=False, lift=False).spread == spread_by_weight(load(m["weight"]))


def test_a_shard_with_fewer_runs_than_its_targets_is_refused(m, tmp_path) -> None:
    from ivq_debug.errors import InputError

    ref = open_dump(m["ref"])
    rid = ref.records["rid"].iloc[0]
    targets = [Target("own", [rm.FC1_TENSOR], []), Target("gate", [rm.GATE_TENSOR], [])]
    measure_effects(m["act"], ref, [rid], targets, shards=tmp_path / "sh", executor=LocalExecutor(1))
    (shard,) = (tmp_path / "sh").glob("*.json")
    doc = json.loads(shard.read_text())
    doc["result"]["results"].pop()
    shard.write_text(json.dumps(doc))
    with pytest.raises(InputError) as e:
        measure_effects(m["act"], ref, [rid], targets, shards=tmp_path / "sh", executor=LocalExecutor(1))
    assert "holds 2 effect runs for 3 targets" in e.value.one_line() and str(shard) in e.value.one_line()


def test_the_cpu_groups_split_the_targets_by_where_their_lift_starts() -> None:
    """``graphs.split_by_start`` on the starts of bench_loop's 12-block ViT's effect targets (1,689 nodes: the empty
    lift, the Softmax group from block 0, the Softmax units of blocks 7, 1, 2, 3 and 11): the early-starting targets
    in one graph, which runs the unchanged model only up to block 2, the rest with the unchanged model in the other.
    The cost (copied nodes and the model's own up to the latest start) of the larger group: 4,529 instead of 5,130
    in order; the graphs built: 4,517 + 3,492 nodes instead of 5,130 + 4,122 (``docs/scale.md``, sixth pass)."""
    from ivq_debug.diagnose.graphs import split_by_start

    starts, n = [1689, 206, 1088, 332, 458, 584, 1592], 1689

    def cost(g: list[int]) -> int:
        return sum(n - starts[i] for i in g) + max(starts[i] for i in g)

    got = split_by_start(starts, n, 2)
    assert got == [[1, 3, 4], [5, 2, 6, 0]] and [cost(g) for g in got] == [4529, 3492]
    assert [cost(g) for g in ([0, 1, 2, 3], [4, 5, 6])] == [5130, 4025]  # in order (the graphs: 5,130 and 4,122 nodes)
    assert split_by_start(starts, n, 1) == [[1, 3, 4, 5, 2, 6, 0]] and split_by_start([], n, 2) == []
