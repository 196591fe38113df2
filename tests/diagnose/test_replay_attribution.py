"""Both attributions of the replay (iso, local) on a real ViT (transformers' ViTModel, decomposed LayerNorm)
quantized with ORT's QNN flow, diagnosed against the user's own float model, with injected faults (CPU-QDQ)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import ivq_debug as ivq
from ivq_debug import defaults
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.diagnose.effect import measure_effects
from ivq_debug.diagnose.patterns import groups
from ivq_debug.diagnose.replay import intro_budget, replay
from ivq_debug.dump import open_dump
from ivq_debug.onnxgraph.load import load_model
from tests.support import vit


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    return vit.models(tmp_path_factory)


@pytest.fixture(scope="module")
def runs(m, tmp_path_factory):
    """The faulty models captured on CPU-QDQ and replayed under both attributions (first record)."""
    d = tmp_path_factory.mktemp("attr")
    out = {}
    for tag in ("act", "weight"):
        test = capture(make_runner("onnx", m[tag], selection=Selection()), [vit.image(7), vit.image(8)],
                       d / f"{tag}.h5", progress=None)
        cmp = ivq.compare(m["ref"], test, progress=False)
        for att in ("local", "iso"):
            out[(tag, att)] = replay(m[tag], m["ref"], cumulative=cmp, attribution=att, float_model=m["float"],
                                     progress=False, lift=att == "local")
    return out


@pytest.mark.parametrize("tag,node", [("act", vit.ACT_NODE), ("weight", vit.WEIGHT_NODE)])
@pytest.mark.parametrize("att", ["local", "iso"])
def test_injected_fault_is_first_under_both_attributions(runs, tag, node, att) -> None:
    r = runs[(tag, att)]
    assert not r.skipped  # the user's float model names no Gemm tensor: matched by lineage, verified by values
    assert r.worst(1).iloc[0]["node"] == node
    head = r.findings()[0]
    assert head.kind == "introduced_error" and head.severity == "error" and head.where["node"] == node


def test_weight_fault_is_charged_to_the_weights_and_the_activation_fault_to_activations(runs) -> None:
    t = runs[("weight", "local")].table.set_index("node")
    assert t.loc[vit.WEIGHT_NODE, "weight_share"] > 0.9
    assert runs[("weight", "local")].findings()[0].evidence["weight_share"] > 0.9
    a = runs[("act", "local")].table.set_index("node")
    assert a.loc[vit.ACT_NODE, "weight_share"] < 0.1


def test_local_charges_the_producer_and_data_movement_is_lossless(runs) -> None:
    loc, iso = runs[("act", "local")].table, runs[("act", "iso")].table
    # the reshape after the faulty Gemm reads the same (faulty) encoding: iso repeats the error, local is exact
    after = loc[(loc["tensor"] == vit.ACT_TENSOR)].iloc[0]
    after_iso = iso[(iso["tensor"] == vit.ACT_TENSOR)].iloc[0]
    assert after["op_type"] == "Reshape" and math.isinf(after["local_sqnr_db"])
    assert after_iso["iso_sqnr_db"] < 20
    views = loc[loc["op_type"].isin(["Reshape", "Transpose"])]
    assert len(views) > 10 and np.isinf(views["local_sqnr_db"]).all()
    # the faulty tensor's consumers are clean under local (its Q/DQ is the Gemm's charge)
    assert (loc.sort_values("local_sqnr_db")["local_sqnr_db"].iloc[1]) > 25
    # tensors the user's model does not name take the reference of the tensor they reshape (the alignment's
    # ``reshape`` strategy; without a comparison, the QDQ model's own lineage)
    assert {r["ref_match"].split(":")[0] for r in loc.to_dict("records")} == {"name", "alignment"}


def test_records_accumulate_in_reused_sessions(m, runs) -> None:
    r1 = runs[("weight", "local")]
    r2 = replay(m["weight"], m["ref"], record="all", float_model=m["float"], progress=False, lift=False)
    assert len(r2.records) == 2 and r2.sessions == r1.sessions == r2.batches == 1
    w1 = r1.table.set_index("node").loc[vit.WEIGHT_NODE, "local_sqnr_db"]
    w2 = r2.table.set_index("node").loc[vit.WEIGHT_NODE, "local_sqnr_db"]
    assert abs(w1 - w2) < 1.5 and w2 < 20
    assert {r["ref_match"].split(":")[0] for r in r2.table.to_dict("records")} == {"name", "lineage"}


def test_x2_outliers_local_names_pow_iso_names_the_variance(m) -> None:
    test = capture(make_runner("onnx", m["x2_qdq"], selection=Selection()), [vit.image(7, bright=1.0)],
                   m["x2_ref"].parent / "x2_test.h5", progress=None)
    cmp = ivq.compare(m["x2_ref"], test, progress=False)
    loc = replay(m["x2_qdq"], m["x2_ref"], cumulative=cmp, float_model=m["x2_float"], progress=False)
    iso = replay(m["x2_qdq"], m["x2_ref"], cumulative=cmp, float_model=m["x2_float"], progress=False,
                 attribution="iso")
    h_loc, h_iso = loc.findings()[0], iso.findings()[0]
    assert h_loc.evidence["label"] == "LayerNorm x² (Pow)" and h_loc.evidence["fix"] == "a16"
    assert h_loc.evidence["units"] == 5 and "blocks" in h_loc.message  # 2 LayerNorms per block + the final one
    # lifting the x² encodings removes most of the output error; lifting the variance's removes none of it
    assert h_loc.evidence["output_error_share"] > 0.3
    # iso's worst introducer is the variance (where it shows); ranked by the effect on the output, iso's headline is
    # the x² group too, and the variance group says why its effect is ≈ 0
    assert groups(iso.table)[0].label == "LayerNorm variance (ReduceMean)"
    assert h_iso.evidence["label"] == "LayerNorm x² (Pow)"
    var = next(f for f in iso.findings() if f.evidence.get("label") == "LayerNorm variance (ReduceMean)")
    assert var.evidence["output_error_share"] < 0.1 and var.evidence["effect_why"]
    assert h_loc.evidence["first_over_budget"]["tensor"]


def test_default_budget_follows_the_preset(m, tmp_path) -> None:
    from ivq_debug.qnn.quantize import quantize_for_qnn

    assert intro_budget(load_model(m["qdq"])) == defaults.INTRO_BUDGET_DB[8]
    a16 = quantize_for_qnn(m["float"], tmp_path / "a16.onnx", vit.calibration(4), preset="a16w8").model_path
    assert intro_budget(load_model(a16)) == defaults.INTRO_BUDGET_DB[16]
    r = replay(a16, m["ref"], progress=False, lift=False)
    clean = replay(m["qdq"], m["ref"], progress=False, lift=False)
    assert r.budget_sqnr_db == 40 and clean.budget_sqnr_db == 20
    # 16-bit units sit far above the 8-bit ones; the clean a8w8 model breaks no 8-bit budget
    assert r.table["local_sqnr_db"].median() > clean.table["local_sqnr_db"].median() + 30
    assert clean.findings() == [] and clean.table["local_sqnr_db"].min() > 30


@pytest.mark.parametrize("tag,node", [("act", vit.ACT_NODE), ("weight", vit.WEIGHT_NODE)])
def test_headline_effect_is_most_of_what_removing_the_fault_gives(m, runs, tag, node) -> None:
    """Issue 28: the fault costs the output 0.6 / 1.1 dB on this 2-block ViT; putting the headline back to float
    (the act fault's encoding with its Reshape copy, the weight fault's float weight) recovers as much."""
    r = runs[(tag, "local")]
    ref = open_dump(m["ref"])
    recs = ref.records
    rid = recs[(recs["sample"] == r.record["sample"]) & (recs["part"] == r.record["part"])
               & (recs["step"] == r.record["step"])]["rid"].iloc[0]
    clean = measure_effects(m["qdq"], ref, [rid], [])["base"]["noise"]
    removal = 1.0 - clean / r.effects["base"]["noise"]  # measured: act 0.125, weight 0.227
    head = r.findings()[0]
    assert head.where["node"] == node and removal > 0.1
    assert head.evidence["output_error_share"] >= 0.5 * removal  # measured: act 0.127, weight 0.259


def test_the_counterfactual_runs_as_one_graph_equal_the_runs_one_by_one_on_the_vit(m, runs) -> None:
    """The effect runs of a real ViT's replay (its targets, the user's float weights, both records) as one graph
    and one session give every target's noise and signal of its own model, to the bit."""
    from ivq_debug.diagnose.graphs import lifted_variants, mergeable
    from ivq_debug.onnxgraph.load import load
    from tests.diagnose.test_effect import one_graph_equals_one_by_one, specs_of

    r = runs[("act", "local")]
    ref = open_dump(m["ref"])
    specs = specs_of(r.effects)
    qdq = load(m["act"])
    assert len(specs) >= 4 and mergeable(qdq.proto)
    one_graph_equals_one_by_one(qdq, load(m["float"]), ref, list(ref.records["rid"][:2]), specs)
    from ivq_debug.diagnose.effect import _lift_plan

    merged, _ = lifted_variants(qdq.proto, [_lift_plan(qdq.proto, set(t), {}, qdq.base_dir) for t, _ in specs])
    # the unchanged part runs once: fewer nodes than a model per target
    assert len(merged.graph.node) < len(specs) * len(qdq.proto.graph.node)


def test_aligning_up_to_the_replayed_record_pairs_it_as_the_whole_alignment(m, tmp_path) -> None:
    """``ivq diagnose`` aligns the dumps only up to its record (``align(until=...)``): each record's pairs, the
    value-checked reshape pairs included (checked on the first record and reused), and its metrics equal the
    whole comparison's; the later records are left out."""
    from ivq_debug.align.matcher import align
    from ivq_debug.comparator.comparison import compare

    test = capture(make_runner("onnx", m["act"], selection=Selection()), [vit.image(7), vit.image(8)],
                   tmp_path / "act.h5", progress=None)
    ref, t = open_dump(m["ref"]), open_dump(test)
    full = align(ref, t)
    keys = sorted({p.ref.record for p in full.pairs})
    assert len(keys) == 2 and any(p.match == "reshape" for p in full.pairs)

    def names(pairs):
        return [(p.ref.name, p.test.name, p.match) for p in pairs]

    for k in keys:
        got = align(ref, t, until=lambda key, k=k: key == k)
        mine = [p for p in got.pairs if p.ref.record == k]
        assert names(mine) == names([p for p in full.pairs if p.ref.record == k])
    first = align(ref, t, until=lambda key: key == keys[0])
    assert {p.ref.record for p in first.pairs} == {keys[0]}
    assert not any(e.record == keys[1] for e in [*first.unmatched_ref, *first.unmatched_test])
    cut = compare(ref, t, records=lambda key: key == keys[0], only_records=True, progress=False).table
    whole = compare(ref, t, records=lambda key: key == keys[0], progress=False).table
    assert cut.drop(columns=["violations"]).equals(whole.drop(columns=["violations"])) and len(cut) > 100


def test_the_shadow_model_returns_its_own_values_bit_for_bit(m, tmp_path) -> None:
    """The CPU shadow model returns each result as the value itself (a graph output, no Identity copy per result:
    1,033 copies on bench_loop's 12-block ViT): every unit's ``out`` / ``fq`` / ``fw`` equals, to the bit, what the
    same graph with an Identity copy per result returns, on the captured values of the model itself."""
    from ivq_debug.diagnose.batch import cpu_runner
    from ivq_debug.diagnose.graphs import typed_inputs, unit_value
    from ivq_debug.diagnose.units import build_replay_model, model_units
    from ivq_debug.onnxgraph.load import load

    model = load(m["act"])
    units = model_units(model)
    shadow, gmap, names = build_replay_model(model, units, shadow=True, xq=False)
    results = set(names.values())
    assert not [n for n in shadow.proto.graph.node if n.op_type == "Identity" and set(n.output) & results]
    made = {o for n in shadow.proto.graph.node for o in n.output}
    want = {}  # each result's value, as the units define it (the ReLU an encoding folds applied after fq / fw)
    for k, u in enumerate(units):
        pre = f"u{k}::"
        want[pre + "out"] = unit_value(pre, u.out_value)
        want[pre + "fq"] = pre + "fq::relu" if pre + "fq::relu" in made else unit_value(pre, u.compute.output[0])
        if u.weights:
            want[pre + "fw"] = pre + "fw::relu" if pre + "fw::relu" in made else pre + "fw::0"
    assert names == want and sum(1 for r in names if r.endswith("::fw")) > 0
    d = open_dump(capture(make_runner("onnx", m["act"], selection=Selection()), [vit.image(7)], tmp_path / "t.h5",
                          progress=None))
    rid = next(iter(d.record_keys().values()))
    by_name = {e.name: e for e in d.tensors(rid)} | {e.name: e for e in d.tensors(rid, kind="input")}
    feeds = {gi: d.read(by_name[x]) for gi, (_, x) in gmap.items()}
    typed_inputs(shadow.proto, feeds)
    copied = type(shadow.proto)()
    copied.CopyFrom(shadow.proto)
    g = copied.graph
    del g.output[:]
    for r, v in names.items():  # the graph as it was: one Identity copy per result
        g.node.add(op_type="Identity", name=r, input=[v], output=[r])
        g.output.add(name=r)
    got, before = cpu_runner(shadow).run(feeds), cpu_runner(shadow.derive(copied)).run(feeds)
    assert len(before) == len(names) > 2 * len(units)
    for r, v in names.items():
        assert got[v].dtype == before[r].dtype and np.array_equal(got[v], before[r], equal_nan=True), r


def test_a_group_without_the_unchanged_model_runs_it_only_up_to_what_its_copies_read(m, runs) -> None:
    """A group of lift variants without the empty lift (the second effect thread's) keeps the model's own nodes only
    up to what its copies read, and its own outputs only where a variant reads one it does not change: on the ViT's
    targets fewer of the model's nodes than the model has, with every target's figures of its own model, to the bit
    (before, every group held the whole unchanged model)."""
    from ivq_debug.diagnose.effect import _lift_plan
    from ivq_debug.diagnose.graphs import lift_starts, lifted_variants
    from ivq_debug.onnxgraph.load import load
    from tests.diagnose.test_effect import one_graph_equals_one_by_one, specs_of

    ref = open_dump(m["ref"])
    qdq = load(m["act"])
    specs = [s for s in specs_of(runs[("act", "local")].effects) if s != ([], [])]
    n = len(qdq.proto.graph.node)
    latest = max(lift_starts(qdq.proto, specs))
    merged, _ = lifted_variants(qdq.proto, [_lift_plan(qdq.proto, set(t), {}, qdq.base_dir) for t, _ in specs])
    own = [x for x in merged.graph.node if not x.name.startswith(tuple(f"v{v}::" for v in range(len(specs))))]
    assert len(specs) >= 3 and latest < n and len(own) < n
    assert {o.name for o in merged.graph.output}.isdisjoint(o.name for o in qdq.proto.graph.output)
    one_graph_equals_one_by_one(qdq, load(m["float"]), ref, list(ref.records["rid"][:1]), specs)


@pytest.mark.parametrize("att", ["local", "iso"])
def test_the_sums_added_while_the_effects_run_equal_those_of_one_pass(m, att) -> None:
    """On the exact CPU path the replay adds the last record's ranking sums first, starts the effect runs on the
    targets they choose, and adds the other sums while those run: over two records and under either attribution,
    every column equals, to the bit, the replay that adds every sum in one pass (without effect runs), and the
    effects are measured on the targets the finished table chooses."""
    from ivq_debug.diagnose.effect_targets import effect_plan
    from ivq_debug.onnxgraph.load import load

    common = dict(record="all", attribution=att, float_model=m["float"], progress=False)
    deferred = replay(m["act"], m["ref"], lift=True, **common)
    one_pass = replay(m["act"], m["ref"], lift=False, **common)
    effect_cols = ["effect_share", "effect_gain_db"]
    assert len(deferred.records) == 2 and deferred.effects["runs"] > 1
    a, b = deferred.table.drop(columns=effect_cols), one_pass.table.drop(columns=effect_cols)
    assert a.columns.tolist() == b.columns.tolist() and len(a) == len(b)
    for c in a.columns:
        assert a[c].tolist() == b[c].tolist() or np.array_equal(a[c], b[c], equal_nan=True), c
    plan = effect_plan(load(m["act"]), b, deferred.budget_sqnr_db)
    assert sorted(deferred.effects["targets"]) == sorted(t.key for t in plan.targets)


def test_the_reference_read_in_one_block_is_the_dumps_read(m) -> None:
    """The replay reads its reference values by the reader's streaming read (``refs.read_whole``: ``os.pread``, no
    h5py dataset per read): every tensor and input of every record of the ViT's reference, in the dtype, shape and
    bytes of ``Dump.read``."""
    from ivq_debug.diagnose.refs import read_whole

    d = open_dump(m["ref"])
    ents = [e for rid in d.records["rid"] for e in [*d.tensors(rid), *d.tensors(rid, kind="input")]]
    assert len(ents) > 200
    for e in ents:
        a, b = read_whole(d, e), d.read(e)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), e.name
