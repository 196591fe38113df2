"""Only what the backend runs (issue 29): the HTP precision table against real HTP sessions, one test per
forbidden pair, and the table enforced in ``suggest()`` (legalize), in every trial and in ``verify``; and per
entry the table forbids (a8w16, a non-int32 bias), through ``suggest()``, the greedy mode, the search and the sweep:
never measured, never recommended."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.tune.legal import TABLES, forbidden, refusal, table, violations
from ivq_debug.tune.search import Lever, search
from ivq_debug.tune.suggest import Suggestion, legalize
from ivq_debug.tune.verify import Tuner, greedy, verify
from tests.diagnose.test_weight_spread import build_conv
from tests.support.lever_models import save_graph

_NP = {"uint8": np.uint8, "uint16": np.uint16, "int8": np.int8, "int16": np.int16, "int32": np.int32}
_BITS = {"uint8": 8, "uint16": 16}


def qdq_conv(path: Path, act: str, weight: str, bias: str = "int32") -> Path:
    """A hand-written QDQ Conv(4→8, 3×3) whose activations, weight and bias have the given integer types."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    inits: list = []

    def init(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    amax = np.iinfo(_NP[act]).max
    wmax = np.iinfo(_NP[weight]).max // 2
    ws = np.float32(np.abs(w).max() / wmax)
    wq = (np.round(w / ws) + wmax + 1).astype(_NP[weight])
    nodes = [helper.make_node("QuantizeLinear", ["x", init("xs", np.float32(8 / amax)),
                                                 init("xz", _NP[act](amax // 2))], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", [init("wq", wq), init("ws", ws), init("wz", _NP[weight](wmax + 1))],
                              ["wd"]),
             helper.make_node("DequantizeLinear", [init("bq", np.zeros(8, _NP[bias])),
                                                   init("bs", np.float32(ws * 8 / amax)),
                                                   init("bz", np.zeros((), _NP[bias]))], ["bd"]),
             helper.make_node("Conv", ["xd", "wd", "bd"], ["y0"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["y0", init("ys", np.float32(20 / amax)),
                                                 init("yz", _NP[act](amax // 2))], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    return save_graph(path, nodes, inits, [1, 4, 8, 8], [1, 8, 8, 8], opset=21)


PAIRS = [("uint8", "uint8"), ("uint16", "uint8"), ("uint16", "uint16"), ("uint8", "uint16")]


@pytest.mark.parametrize("act,weight", PAIRS)
def test_the_table_judges_each_pair_of_a_written_model(tmp_path: Path, act: str, weight: str) -> None:
    p = qdq_conv(tmp_path / "c.onnx", act, weight)
    bad = violations(p, "qnn")
    legal = TABLES["qnn"].allows(_BITS[act], _BITS[weight])
    assert bool(bad) is not legal
    if bad:
        assert bad[0].node == "conv" and "8-bit activation x 16-bit weight" in str(bad[0])
    assert not violations(p, "cpu")  # CPU-QDQ runs every pair


def test_htp_forbids_exactly_a8w16() -> None:
    assert TABLES["qnn"].forbidden() == [(8, 16)]


@pytest.mark.qnn
@pytest.mark.parametrize("act,weight", PAIRS)
def test_the_table_is_what_htp_compiles(tmp_path: Path, act: str, weight: str) -> None:
    """Each pair on the real (emulated) HTP: the table's legal pairs compile and run, its forbidden pair is
    refused at session creation (the measurement the table rests on)."""
    pytest.importorskip("onnxruntime_qnn")
    from ivq_debug.errors import CaptureError

    p = qdq_conv(tmp_path / "c.onnx", act, weight)
    x = {"x": np.random.default_rng(1).random((1, 4, 8, 8), dtype=np.float32)}
    if TABLES["qnn"].allows(_BITS[act], _BITS[weight]):
        out = make_runner("qnn", p, selection=Selection(), qnn_cache=False).run(x)
        assert out["y"].shape == (1, 8, 8, 8)
    else:
        with pytest.raises(CaptureError, match="session creation failed"):
            make_runner("qnn", p, selection=Selection(), qnn_cache=False).run(x)


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("legal")
    model = build_conv(d)
    cal = [{"x": np.random.RandomState(i).randn(1, 3, 16, 16).astype(np.float32)} for i in range(6)]
    feeds = [{"x": np.random.RandomState(99).randn(1, 3, 16, 16).astype(np.float32)}]
    ref = capture(make_runner("onnx", model, selection=Selection()), feeds, d / "ref.h5", progress=None)
    return {"model": model, "cal": cal, "feeds": feeds, "ref": ref}


def test_forbidden_names_the_op_and_its_activation(conv) -> None:
    w16 = Suggestion("2.weight", "w16", "t")
    why = forbidden([w16], conv["model"], "a8w8", "qnn")
    assert len(why) == 1 and "16-bit weight of" in why[0] and "8-bit activation" in why[0]
    assert not forbidden([w16], conv["model"], "a16w8", "qnn")  # a16w16: legal
    assert not forbidden([w16], conv["model"], "a8w8", "cpu")
    act = next(n.input[0] for n in onnx.load(str(conv["model"])).graph.node if n.op_type == "Conv" and
               n.input[1] == "2.weight")
    assert not forbidden([w16, Suggestion(act, "a16", "t", 0.0, 1.0)], conv["model"], "a8w8", "qnn")
    bias = forbidden([Suggestion("2.bias", "w16", "t")], conv["model"], "a16w16", "qnn")
    assert bias and "bias" in bias[0]


def test_suggest_never_leaves_a_16_bit_weight_under_an_8_bit_activation(conv) -> None:
    w16 = Suggestion("2.weight", "w16", "weight-dominated", priority=5.0)
    act = next(n.input[0] for n in onnx.load(str(conv["model"])).graph.node if n.input[1:2] == ["2.weight"])
    # the input's calibrated range known: the op goes a16w16
    out = legalize([w16], conv["model"], "a8w8", "qnn", lambda n: (0.0, 4.0) if n == act else None, False)
    assert {(s.tensor, s.action) for s in out} == {("2.weight", "w16"), (act, "a16")}
    assert not forbidden(out, conv["model"], "a8w8", "qnn")
    # unknown range: per-channel 8-bit weights instead; already per-channel: the entry is left out
    out = legalize([w16], conv["model"], "a8w8", "qnn", lambda n: None, False)
    assert [(s.tensor, s.action) for s in out] == [("2.weight", "w_per_channel")]
    assert legalize([w16], conv["model"], "a8w8", "qnn", lambda n: None, True) == []


def test_verify_refuses_an_illegal_set_without_running_it_and_trials_check_the_written_model(conv, tmp_path) -> None:
    tuner = Tuner(conv["model"], conv["cal"], conv["feeds"], conv["ref"], tmp_path / "wd", backend="cpu",
                  target="qnn")
    before = tuner.trial("before", [])
    illegal = [Suggestion("2.weight", "w16", "t")]
    legal = [Suggestion("0.weight", "w_per_channel", "t", axis=0)]
    rep = verify(tuner, [], before=before, candidates=[("a8w16", illegal), ("per-channel", legal)])
    assert rep.refused[0]["candidate"] == "a8w16" and rep.refused[0]["label"] is None  # never quantized
    assert "not run by QNN" in rep.refused[0]["reason"] and "2.weight" in rep.refused[0]["reason"]
    assert rep.recommended and [s.tensor for s in rep.after.suggestions] == ["0.weight"]
    assert not violations(rep.after.qdq_model, "qnn")
    bad = tuner.trial("bad", illegal)  # a trial asked directly refuses too, with the whole reason
    assert bad.error and bad.error.startswith("not run by QNN") and not bad.qdq_model.exists()


# ------------------------------------------------------------------ one test per forbidden pair, every path
def _forbidden_sets() -> list:
    """Per entry the table forbids on HTP, a set that asks for it on the conv (its second Conv reads ``2.weight``
    and ``2.bias``) and the preset under which it is forbidden: every forbidden (activation, weight) pair of the
    table, and a bias that is not one of the table's bias types."""
    out = []
    for a, w in TABLES["qnn"].forbidden():  # a8w16: a 16-bit weight under an 8-bit activation
        assert w == 16  # the only weight override that raises bits
        out.append(pytest.param(f"a{a}w8", [Suggestion("2.weight", "w16", "t")], id=f"a{a}w{w}"))
    assert TABLES["qnn"].bias == {"int32"}
    out.append(pytest.param("a16w16", [Suggestion("2.bias", "w16", "t")], id="bias-int16"))
    return out


FORBIDDEN = _forbidden_sets()
LEGAL = [Suggestion("0.weight", "w_per_channel", "t", axis=0)]


@pytest.fixture(scope="module")
def tuners(conv, tmp_path_factory) -> dict:
    """One CPU-QDQ tuner per preset, for QNN HTP, sharing a checkpoint (the baselines run once)."""
    wd = tmp_path_factory.mktemp("legal-paths")
    out = {}
    for preset in ("a8w8", "a16w16"):
        t = Tuner(conv["model"], conv["cal"], conv["feeds"], conv["ref"], wd / preset, backend="cpu", target="qnn",
                  preset=preset)
        out[preset] = (t, t.trial("before", []))
    return out


@pytest.mark.parametrize("preset,illegal", FORBIDDEN)
def test_suggest_never_delivers_a_forbidden_pair(conv, preset: str, illegal: list) -> None:
    assert forbidden(illegal, conv["model"], preset, "qnn")  # the set asks for what HTP does not run
    out = legalize([*illegal, *LEGAL], conv["model"], preset, "qnn", lambda n: None, False)
    assert not forbidden(out, conv["model"], preset, "qnn")
    assert LEGAL[0] in out and not any(s.tensor == "2.bias" for s in out)


@pytest.mark.parametrize("preset,illegal", FORBIDDEN)
def test_greedy_never_tries_a_forbidden_pair(tuners, preset: str, illegal: list) -> None:
    tuner, _ = tuners[preset]
    rep = greedy(tuner, [*illegal, *LEGAL], ["y"], budget_sqnr_db=200.0, max_trials=3, progress=False)
    no = [r for r in rep.refused if r["candidate"] == f"+{illegal[0].tensor} w16"]
    assert len(no) == 1 and no[0]["label"] is None and no[0]["reason"].startswith("not run by QNN")
    assert not any(s.get("added") == illegal[0].tensor for s in rep.steps)  # never quantized
    assert not forbidden(rep.after.suggestions, tuner.source(), preset, "qnn")
    assert not violations(rep.after.qdq_model, "qnn")


@pytest.mark.parametrize("preset,illegal", FORBIDDEN)
def test_search_never_measures_or_chooses_a_forbidden_pair(tuners, preset: str, illegal: list) -> None:
    tuner, before = tuners[preset]
    levers = [Lever("illegal", "unit", preset, False, "minmax", list(illegal)),
              Lever("illegal + per-channel", "unit", preset, False, "minmax", [*illegal, *LEGAL]),
              Lever("per-channel", "unit", preset, False, "minmax", list(LEGAL))]
    res = search(tuner, before, levers, watch=["y"], min_gain_db=0.0)
    rows = {r["lever"]: r for r in res.table}
    for name in ("illegal", "illegal + per-channel"):
        assert rows[name]["status"].startswith("not run by QNN") and rows[name]["sqnr_db"] is None, rows[name]
        assert not (Path(tuner.workdir) / f"lever-{name.replace(' + ', '---')}.qdq.onnx").exists()
    assert res.chosen is None or res.chosen.name == "per-channel"
    assert not forbidden(res.report.after.suggestions, tuner.source(), preset, "qnn")
    assert not violations(res.report.after.qdq_model, "qnn")


@pytest.mark.parametrize("preset,illegal", FORBIDDEN)
def test_the_sweep_neither_builds_nor_picks_a_forbidden_pair(tuners, preset: str, illegal: list,
                                                               tmp_path: Path) -> None:
    """The sweep's candidates (16-bit activations, nodes left float) are legal by construction; a candidate job
    handed a forbidden set fails without quantizing (the trial's check) and the selection never picks it."""
    from dataclasses import replace

    from ivq_debug.qnn.encodings import encodings_from_qdq_model
    from ivq_debug.tune.sweep import (
        block_groups,
        candidate,
        measure,
        quantized_activations,
        select,
        sweep_job,
    )

    tuner, before = tuners[preset]
    encs = encodings_from_qdq_model(before.qdq_model).activations
    for g in block_groups(quantized_activations(tuner, before), 3):
        for p in ("a16", "fp16"):
            assert not forbidden(candidate(g, p, encs), tuner.source(), preset, "qnn"), (g.name, p)
    worker = replace(tuner, resume=False, _checkpoint=None)
    bad = sweep_job(replace(worker, workdir=tmp_path / "bad"), "bad", [s.to_dict() for s in illegal], ["y"])
    good = sweep_job(replace(worker, workdir=tmp_path / "good"), "good", [s.to_dict() for s in LEGAL], ["y"])
    assert bad["error"].startswith("not run by QNN") and not good["error"]
    cands = [{"group": g, "group_index": i, "precision": "x", "precision_index": 0, "label": g, **r}
             for i, (g, r) in enumerate((("bad", bad), ("good", good)))]
    table, picked = select(measure(before, ["y"]), cands, ["y"], min_gain_db=-100.0)
    row = table.set_index("label").loc["bad"]
    assert not row["eligible"] and row["status"].startswith("failed: not run by QNN")
    assert picked["chosen"] == ["good"]


def test_htp_wants_16_bit_weights_symmetric(tmp_path: Path) -> None:
    """A 16-bit weight off the middle of its storage (asymmetric uint16, what the a16w16 preset wrote before
    quantize.WEIGHT16) breaks the HTP table's symmetric16 rule; the middle (uint16 32768, int16 0) does not."""
    from ivq_debug.qnn.encodings import Encoding

    p = qdq_conv(tmp_path / "c.onnx", "uint16", "uint16")  # weight zero point 32768: symmetric
    assert not violations(p, "qnn")
    m = onnx.load(str(p))
    z = next(t for t in m.graph.initializer if t.name == "wz")
    z.CopyFrom(numpy_helper.from_array(np.uint16(30000), "wz"))
    onnx.save(m, str(tmp_path / "asym.onnx"))
    (bad,) = violations(tmp_path / "asym.onnx", "qnn")
    assert bad.what == "asymmetric16" and bad.node == "conv" and "'wq' is asymmetric" in bad.detail
    assert not violations(tmp_path / "asym.onnx", "cpu")
    # a suggestion read from a file with an asymmetric 16-bit weight encoding is refused before any trial
    enc = Encoding(bitwidth=16, dtype="int", symmetric=False, scale=(1e-4,), zero_point=(30000,), signed=False)
    model = qdq_conv(tmp_path / "f.onnx", "uint16", "uint16")
    fm = onnx.load(str(model))  # the float view: the Conv reads 'wd' (the weight's DQ output) as its weight
    why = forbidden([Suggestion("wd", "w16", "from file", encoding=enc)], fm, "a16w16", "qnn")
    assert len(why) == 1 and "asymmetric 16-bit weight encoding" in why[0]
    sym = Encoding(bitwidth=16, dtype="int", symmetric=True, scale=(1e-4,), zero_point=(0,), signed=True)
    assert not forbidden([Suggestion("wd", "w16", "from file", encoding=sym)], fm, "a16w16", "qnn")


def test_a_refusal_names_each_weight_once_and_the_rule_once() -> None:
    """The reasons of many weights on one line: the backend's rule at the end, not after every weight."""
    rule = table("qnn").source
    why = [f"w{i}: 16-bit weight of n{i} (Conv) under its 8-bit activation 'x{i}': {rule}" for i in range(38)]
    line = refusal(why, "qnn")
    assert line.startswith("not run by QNN: w0: 16-bit weight of n0") and line.count(rule) == 1
    assert all(f"w{i}: " in line for i in range(38)) and line.endswith(f"({rule})")
    bias = ["b: a w16 override on the bias of n (Conv); a bias stays int32, derived from its input and weight scales"]
    assert refusal(bias, "qnn") == "not run by QNN: " + bias[0]  # no rule suffix to factor: the reason as it is
