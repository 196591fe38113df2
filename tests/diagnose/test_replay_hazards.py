"""Introduced-vs-inherited replay and encoding hazards on a real a8w8 QDQ model with an injected fault."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import ivq_debug as ivq
from ivq_debug.diagnose.replay import find_units, replay
from tests.support import tiny
from tests.support.vit import scale_activation as _scale_encoding

FAULT = "/blocks.1/fc1/Add_output_0"


def _quantize(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"x": np.random.RandomState(i).randn(2, 8, 16).astype(np.float32)} for i in range(8)])

        def get_next(self):
            return next(self.it, None)

    cfg = get_qnn_qdq_config(str(src), Reader(), activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8)
    quantize(str(src), str(dst), cfg)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    _, x, float_model = tiny.build(tmp)
    _quantize(float_model, tmp / "q.onnx")
    _scale_encoding(tmp / "q.onnx", tmp / "bad.onnx", FAULT, 20.0)
    ref = tiny.capture_ort(float_model, x, tmp / "ref.h5")
    test = tiny.capture_ort(tmp / "bad.onnx", x, tmp / "test.h5")
    clean = tiny.capture_ort(tmp / "q.onnx", x, tmp / "clean.h5")
    return {"tmp": tmp, "ref": ref, "test": test, "clean": clean, "bad": tmp / "bad.onnx", "q": tmp / "q.onnx"}


def test_units_cover_every_compute_node(faulty) -> None:
    units = find_units(onnx.load(str(faulty["bad"])))
    assert len(units) == 37
    u = next(u for u in units if u.output == FAULT)
    assert u.op_type == "Add" and u.inputs == ["/blocks.1/fc1/MatMul_output_0"]


def test_corrupted_encoding_is_first_by_introduced_error(faulty) -> None:
    cmp = ivq.compare(faulty["ref"], faulty["test"])
    r = replay(faulty["bad"], faulty["ref"], cumulative=cmp, budget_sqnr_db=25)
    t = r.table.set_index("tensor")
    assert r.batches == 1 and not r.skipped and len(t) == 37
    assert r.first_breaking["tensor"] == FAULT
    # its error is its own (introduced ~= cumulative), while later layers mostly inherit theirs
    assert t.loc[FAULT, "intro_sqnr_db"] < 20
    assert t.loc[FAULT, "inherited_share"] < 0.1
    down = "/blocks.1/fc2/Add_output_0"
    assert t.loc[down, "cum_sqnr_db"] < 20 < 30 < t.loc[down, "intro_sqnr_db"]
    assert t.loc[down, "inherited_share"] > 0.9
    # ranked by cumulative error, later layers look as bad as the culprit; by introduced error it is first
    assert r.worst(1).iloc[0]["tensor"] == FAULT
    f = r.findings()[0]
    assert f.kind == "introduced_error" and f.where["tensor"] == FAULT


def test_clean_model_breaks_no_introduced_budget(faulty) -> None:
    r = replay(faulty["q"], faulty["ref"], budget_sqnr_db=25)
    assert r.first_breaking is None
    assert r.table["intro_sqnr_db"].min() > 30


def test_encoding_hazards_from_the_comparison(faulty) -> None:
    cmp = ivq.compare(faulty["ref"], faulty["test"])
    t = cmp.table.set_index("ref_name")
    healthy = t.drop(index=FAULT)["grid_snr_db"].dropna()
    assert healthy.min() > 35  # a healthy 8-bit tensor sits near 40 dB
    assert t.loc[FAULT, "grid_snr_db"] < 20
    kinds = {(f.kind, f.where.get("tensor")) for f in cmp.findings}
    assert ("resolution_collapse", FAULT) in kinds
    # shrinking an encoding instead makes values saturate
    _scale_encoding(faulty["q"], faulty["tmp"] / "narrow.onnx", FAULT, 0.2)
    _, x, _ = tiny.build(faulty["tmp"])
    narrow = tiny.capture_ort(faulty["tmp"] / "narrow.onnx", x, faulty["tmp"] / "narrow.h5")
    cmp2 = ivq.compare(faulty["ref"], narrow)
    sat = [f for f in cmp2.findings if f.kind == "saturation" and f.where["tensor"] == FAULT]
    assert sat and sat[0].severity == "error" and sat[0].evidence["clipped_fraction"] > 0.2


def _session_like(ref: Path, out: Path) -> Path:
    """``ref``'s record twice (samples 0 and 1) after a record of another part whose input ``x`` has another shape
    (a session dump holds vision, prefill and decode records; the sort key puts ``a-other`` first)."""
    from ivq_debug.dump import DumpWriter, open_dump

    with open_dump(ref) as d, DumpWriter(out, backend="onnxruntime") as w:
        (rid,) = d.record_keys().values()
        inputs, tensors = d.tensors(rid, kind="input"), d.tensors(rid)
        w.begin_record(sample=0, part="a-other", step=0)
        w.add_input("x", np.zeros((1, 8, 16), np.float32))
        for s in (0, 1):
            w.begin_record(sample=s, part="model", step=0)
            for e in inputs:
                w.add_input(e.name, d.read(e))
            for e in tensors:
                w.add_tensor(e.name, d.read(e), order=e.order, op_type=e.op_type)
    return out


def test_records_are_the_ones_holding_the_models_inputs(faulty) -> None:
    """The default and ``"all"`` take the records whose inputs fit the model (names and static dims); a record of
    another part named explicitly is a one-line usage error (it used to be an AssertionError in the replay)."""
    from ivq_debug.cli.common import run
    from ivq_debug.cli.main import _main as ivq_main
    from ivq_debug.dump import open_dump
    from ivq_debug.errors import UsageError

    mixed = _session_like(faulty["ref"], faulty["tmp"] / "mixed.h5")
    one = replay(faulty["bad"], faulty["ref"], budget_sqnr_db=25, lift=False, progress=False)
    first = replay(faulty["bad"], mixed, budget_sqnr_db=25, lift=False, progress=False)
    both = replay(faulty["bad"], mixed, record="all", budget_sqnr_db=25, lift=False, progress=False)
    assert len(first.records) == 1 and len(both.records) == 2
    cols = ["tensor", "intro_sqnr_db", "intro_max_abs"]
    assert first.table[cols].equals(one.table[cols])  # the model's record, not the first record of the dump
    assert both.table["intro_sqnr_db"].tolist() == pytest.approx(one.table["intro_sqnr_db"].tolist(), abs=1e-9)
    with open_dump(mixed) as d:
        other = d.record_keys()[(0, "a-other", 0)]
    with pytest.raises(UsageError, match=r"does not hold the model's input x of shape \[2, 8, 16\]"):
        replay(faulty["bad"], mixed, record=other, lift=False, progress=False)
    assert run("ivq", ivq_main, ["diagnose", str(mixed), str(faulty["test"]), "--model", str(faulty["bad"]),
                                 "--record", other, "--no-lift"]) == 2


def test_external_data_model_replays_from_any_folder(faulty, tmp_path, monkeypatch) -> None:
    """A QDQ model whose weights and quantization parameters are external data is read from its own folder, not
    the working directory (the weight spread and the activation bitwidth used to read ``./<model>.data``)."""
    from ivq_debug.cli.common import run
    from ivq_debug.cli.main import _main as ivq_main

    ext = tmp_path / "models" / "ext.onnx"
    ext.parent.mkdir()
    onnx.save(onnx.load(str(faulty["bad"])), str(ext), save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.onnx.data", size_threshold=0)
    assert (ext.parent / "ext.onnx.data").stat().st_size > 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "r.json"
    code = run("ivq", ivq_main, ["diagnose", str(faulty["ref"]), str(faulty["test"]), "--model", str(ext),
                                 "--budget-sqnr", "25", "--json", str(out)])
    assert code == 1  # the corrupted unit breaks the budget: found, as from the embedded model
    import json

    doc = json.loads(out.read_text())
    assert doc["findings"][0]["kind"] == "introduced_error" and doc["findings"][0]["where"]["tensor"] == FAULT


def test_lift_names_cannot_collide_with_model_names(faulty, tmp_path) -> None:
    """A model tensor called ``out::<output>`` (any name is legal ONNX) next to the lift's per-variant outputs
    ``v{k}::out::<output>``: the lift keeps model names in their own namespace (it built a graph with a duplicate
    definition before)."""
    m = onnx.load(str(faulty["bad"]))
    out = m.graph.output[0].name
    victim = next(n.output[0] for n in m.graph.node if n.op_type == "MatMul")
    for n in m.graph.node:
        n.input[:] = [f"out::{out}" if x == victim else x for x in n.input]
        n.output[:] = [f"out::{out}" if x == victim else x for x in n.output]
    odd = tmp_path / "odd.onnx"
    onnx.save(m, str(odd))
    cmp = ivq.compare(faulty["ref"], faulty["test"])
    r = replay(odd, faulty["ref"], cumulative=cmp, budget_sqnr_db=25, progress=False)
    assert r.lift and all(0.0 <= v["share"] <= 1.0 for v in r.lift.values()), r.lift
    assert r.first_breaking["tensor"] == FAULT
