"""No unit over the introduced budget, the output over it: the replay says where the error accumulates (issue 32).

The fault: every activation encoding of a real a8w8 QDQ model made 6x coarser (a calibration that overshoots every
range). Each unit alone then stays above the 20 dB budget (worst ~24 dB), while the logits end near 16 dB; the
clean model's logits stay above the budget and nothing is said.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import ivq_debug as ivq
from ivq_debug.diagnose.replay import replay, replay_records
from tests.diagnose.test_replay_hazards import _quantize
from tests.support import tiny
from tests.support.dynamic_models import run_ivq

FACTOR = 6.0


def _coarse(src: Path, dst: Path, factor: float) -> None:
    """Every activation QuantizeLinear scale multiplied by ``factor``."""
    m = onnx.load(str(src))
    inits = {i.name: i for i in m.graph.initializer}
    for name in {q.input[1] for q in m.graph.node if q.op_type == "QuantizeLinear" and q.input[1] in inits}:
        v = numpy_helper.to_array(inits[name])
        inits[name].CopyFrom(numpy_helper.from_array((v * factor).astype(v.dtype), name))
    onnx.save(m, str(dst))


@pytest.fixture(scope="module")
def coarse(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("accumulation")
    _, x, float_model = tiny.build(tmp)
    _quantize(float_model, tmp / "q.onnx")
    _coarse(tmp / "q.onnx", tmp / "coarse.onnx", FACTOR)
    ref = tiny.capture_ort(float_model, x, tmp / "ref.h5")
    return {"ref": ref, "q": tmp / "q.onnx", "coarse": tmp / "coarse.onnx",
            "test": tiny.capture_ort(tmp / "coarse.onnx", x, tmp / "test.h5"),
            "clean": tiny.capture_ort(tmp / "q.onnx", x, tmp / "clean.h5")}


def test_accumulated_error_says_where_when_no_unit_breaks_the_budget(coarse: dict[str, Any]) -> None:
    cmp = ivq.compare(coarse["ref"], coarse["test"], progress=False)
    r = replay(coarse["coarse"], coarse["ref"], cumulative=cmp, progress=False, lift=False)
    t = r.table.sort_values("order")
    assert r.first_breaking is None and t["intro_sqnr_db"].min() > r.budget_sqnr_db == 20  # no unit over budget
    acc = r.accumulation
    assert acc is not None
    out = acc.outputs[0]
    logits = cmp.table.set_index("test_name").loc["logits", "sqnr_db"]
    assert out["tensor"] == "logits" and out["cum_sqnr_db"] == pytest.approx(logits) and logits < 20
    assert out["inherited_share"] > 0.8  # the output's error comes from upstream
    # the crossing is the first unit, in execution order, whose cumulative SQNR is below the budget
    below = t[t["cum_sqnr_db"] < 20]
    assert acc.crossing["tensor"] == below.iloc[0]["tensor"] and acc.crossing["of"] == len(t)
    assert acc.closest[0]["intro_sqnr_db"] == pytest.approx(t["intro_sqnr_db"].min())
    # the model input arrives only with its own 8-bit quantization (above the budget: not in the sentence)
    assert [i["tensor"] for i in acc.inputs] == ["x"] and acc.inputs[0]["sqnr_db"] > 20
    f = r.findings()[0]
    assert f.kind == "accumulated_error" and f.severity == "error" and f.where["tensor"] == "logits"
    assert "no unit introduces more error than the budget" in f.message and "logits is at" in f.message
    assert "input x" not in f.message and f"from {acc.crossing['tensor']} on" in f.message
    doc = r.to_json()
    assert doc["accumulation"]["outputs"][0]["tensor"] == "logits"
    assert doc["findings"][0]["kind"] == "accumulated_error"


def test_clean_model_and_a_unit_over_budget_say_nothing_of_accumulation(coarse: dict[str, Any]) -> None:
    clean = replay(coarse["q"], coarse["ref"], cumulative=ivq.compare(coarse["ref"], coarse["clean"], progress=False),
                   progress=False, lift=False)
    assert clean.accumulation is None and not [f for f in clean.findings() if f.kind == "accumulated_error"]
    # with a budget some unit breaks, the introduced-error headline names it instead
    cmp = ivq.compare(coarse["ref"], coarse["test"], progress=False)
    strict = replay(coarse["coarse"], coarse["ref"], cumulative=cmp, progress=False, lift=False, budget_sqnr_db=30)
    assert strict.first_breaking is not None and strict.accumulation is None
    assert strict.findings()[0].kind == "introduced_error"


def test_replay_records_are_the_ones_the_replay_uses(coarse: dict[str, Any]) -> None:
    assert replay_records(coarse["coarse"], coarse["ref"]) == [(0, "model", 0)]
    assert np.isfinite(replay(coarse["coarse"], coarse["ref"], progress=False, lift=False).table["intro_sqnr_db"]).all()


def test_ivq_diagnose_says_where_and_exits_1(coarse: dict[str, Any], tmp_path: Path, capfd: Any) -> None:
    """The CLI a user runs: the accumulation instead of "no unit introduces more error than the budget", exit 1,
    the cumulative column filled, and the JSON's accumulation block."""
    code, out, err = run_ivq(["diagnose", coarse["ref"], coarse["test"], "--model", coarse["coarse"], "--no-lift",
                              "--json", tmp_path / "d.json"], capfd)
    text = " ".join((out + err).split())
    assert code == 1, text[-600:]
    assert "accumulated_error no unit introduces more error than the budget (20 dB" in text
    assert "yet model output logits is at" in text and "[green]" not in text
    assert "no unit introduces more error than the budget (20 dB)" not in text  # the green all-clear line
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["accumulation"]["outputs"][0]["tensor"] == "logits"
    assert all(u["cum_sqnr_db"] is not None for u in doc["units"])  # the replayed record's cumulative error


def test_the_diagnose_fits_the_encodings_only_for_the_accumulation(coarse: dict[str, Any], monkeypatch) -> None:
    """``ivq.diagnose`` compares without the encoding fit and fits the encodings when the replay says where the
    error accumulates (the related findings read it): the document of the comparison made with the fit, to the bit;
    with a unit over budget the fit is never computed."""
    from ivq_debug.comparator.comparison import Comparison

    fitted: list[int] = []
    fit = Comparison.fit_encodings

    def counted(self: Comparison, *a: Any) -> None:
        if self.unfitted is not None:  # a comparison made without the fit
            fitted.append(1)
        fit(self, *a)

    monkeypatch.setattr(Comparison, "fit_encodings", counted)

    def timeless(r: Any) -> Any:
        doc = json.loads(json.dumps(r.to_json()))
        doc.pop("seconds")
        return doc

    r = ivq.diagnose(coarse["ref"], coarse["test"], coarse["coarse"], lift=False, progress=False)
    seq = replay(coarse["coarse"], coarse["ref"], progress=False, lift=False,
                 cumulative=ivq.compare(coarse["ref"], coarse["test"], diagnose=False, progress=False))
    assert fitted == [1] and r.accumulation is not None
    assert timeless(r) == timeless(seq)
    strict = ivq.diagnose(coarse["ref"], coarse["test"], coarse["coarse"], lift=False, progress=False,
                          budget_sqnr_db=30)
    assert strict.first_breaking is not None and fitted == [1]
