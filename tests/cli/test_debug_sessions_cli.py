"""Issue 30: a phone's ``qnn-net-run`` folders compared layer by layer with no glue, from the command line.

* A ``--debug`` session of legacy-exported parts without ``value_info`` and with producer-named output axes
  (``tests/support/debug_sessions.py``): ``ivq ingest session`` needs no ``--dim`` and ingests every
  intermediate; ``ivq-diff`` against ``ivq reference`` aligns every one of them at every step and names the
  layer of the injected fault at its step.
* A decode folder whose ``input_list.txt`` does not feed ``position_ids``, ingested with the graph that takes
  it: accepted, recorded as not fed, and the offset inferred from the KV cache.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from ivq_debug.cli.common import run
from ivq_debug.cli.diff import _main as diff_main
from ivq_debug.cli.main import _main as ivq_main
from ivq_debug.dump import open_dump
from tests.support.device_sessions import graph_io


def ivq(*argv: object) -> int:
    return run("ivq", ivq_main, [str(a) for a in argv])


def ivq_diff(*argv: object) -> int:
    return run("ivq-diff", diff_main, [str(a) for a in argv])


@pytest.fixture(scope="module")
def debug_session(tmp_path_factory):
    from ivq_debug.vlm.load import load_vlm, reference_path
    from tests.support.debug_sessions import MODEL, build_debug_session

    return build_debug_session(load_vlm(MODEL).model, tmp_path_factory.mktemp("debug-session"),
                               reference_path(MODEL) / "config.json")


@pytest.mark.slow
def test_debug_session_layer_by_layer_with_no_pin(debug_session, tmp_path, capfd):
    s = debug_session
    sess, ref, js, diff = tmp_path / "s.h5", tmp_path / "r.h5", tmp_path / "ingest.json", tmp_path / "d.json"
    capfd.readouterr()
    assert ivq("ingest", "session", "--vision", s.folders["vision"], "--prefill", s.folders["prefill"],
               "--decode", s.folders["decode"], "--model-dir", s.parts_dir, "-o", sess, "--json", js) == 0
    assert "--dim" not in capfd.readouterr().err
    doc = json.loads(js.read_text())
    assert doc["unmatched"] == []  # every --debug file named a graph tensor and was ingested
    n_out = {p: len(graph_io(s.parts[p])[1]) for p in s.parts}  # the graph outputs of each part
    with open_dump(sess) as d:
        for (_sample, part, step), rid in d.record_keys().items():
            names = {e.name for e in d.tensors(rid)}
            assert len(names) == len(s.intermediates[part]) + n_out[part], (part, step)
            assert set(s.intermediates[part]) <= names, (part, step)
        assert d.record_meta(d.record_keys()[(0, "decode", 1)])["result_dir"] == "Result_0"
    assert ivq("reference", sess, "--model-dir", s.parts_dir, "-o", ref) == 0
    ivq_diff(ref, sess, "--json", diff, "-q")
    out = json.loads(diff.read_text())
    per_step = Counter((r["record"]["part"], r["record"]["step"]) for r in out["layers"])
    steps = len(s.tokens) - 1
    want = {("vision", 0): len(s.intermediates["vision"]) + n_out["vision"],
            ("prefill", 0): len(s.intermediates["prefill"]) + n_out["prefill"]}
    want |= {("decode", k): len(s.intermediates["decode"]) + n_out["decode"] for k in range(1, steps + 1)}
    assert dict(per_step) == want  # aligned tensors per step == the graph's intermediates + its outputs
    assert len(s.intermediates["decode"]) == 160 and n_out["decode"] == 5
    assert out["unmatched"]["ref"]["count"] == out["unmatched"]["test"]["count"] == 0
    fd = out["first_divergence"]
    assert fd["ref_name"] == s.fault_tensor == "/language_model/layers.1/mlp/gate_proj/MatMul_output_0"
    assert fd["record"] == {"sample": 0, "part": "decode", "step": s.fault_step}
    # before the fault, every aligned layer agrees to ORT rounding
    before = [r for r in out["layers"] if r["record"]["part"] != "decode" or r["record"]["step"] < s.fault_step]
    assert max(float(r["metrics"]["max_abs"]) for r in before) < 1e-4


def _drop_positions(folder: Path, positional: bool = False) -> None:
    lst = folder / "input_list.txt"
    out = []
    for line in lst.read_text().splitlines():
        if line.startswith("#"):
            out.append(line)
            continue
        toks = [t for t in line.split() if not t.startswith("position_ids:=")]
        out.append(" ".join(t.split(":=", 1)[1] if positional else t for t in toks))
    lst.write_text("\n".join(out) + "\n")
    for p in folder.glob("inputs/*/position_ids.raw"):
        p.unlink()


def test_decode_without_positions_ingested_with_the_graph_that_takes_them(device_sessions, session_parts, tmp_path,
                                                                         capfd):
    s = device_sessions["internvl-tiny-dynamic-off_by_one"]
    root = tmp_path / "phone"
    shutil.copytree(s.root, root)
    _drop_positions(root / "decode")
    args = ["ingest", "session", "--vision", root / "vision", "--prefill", root / "prefill", "--decode",
            root / "decode", "--model-dir", s.parts["decode"].parent, "--config", s.config]
    capfd.readouterr()
    assert ivq(*args, "-o", tmp_path / "s.h5") == 0
    assert "not fed by the device (decode): position_ids" in capfd.readouterr().out
    with open_dump(tmp_path / "s.h5") as d:
        rid = d.record_keys()[(0, "decode", 1)]
        assert d.record_meta(rid)["not_fed"] == ["position_ids"]
        assert "position_ids" not in {e.name for e in d.tensors(rid, kind="input")}
    ref, js = tmp_path / "r.h5", tmp_path / "d.json"
    assert ivq("reference", tmp_path / "s.h5", "--model-dir", s.parts["decode"].parent, "-o", ref) == 0
    assert ivq_diff(ref, tmp_path / "s.h5", "--json", js, "-q") == 1
    found = [f for f in json.loads(js.read_text())["findings"] if f["kind"] == "position_id_offset"]
    assert len(found) == 1
    ev = found[0]["evidence"]
    assert (ev["method"], ev["offset"], ev["first_wrong_step"]) == ("inferred", s.expected_offset, 1)
    assert ev["fit"] > 0.99 and ev["result_dir"] == "Result_0" and ev["folder"] == str(root / "decode")
    # bare paths shorter than the graph's inputs: --missing-input names the one left out
    _drop_positions(root / "decode", positional=True)
    assert ivq(*args, "-o", tmp_path / "p.h5") == 3
    assert "--missing-input NAME" in capfd.readouterr().err
    assert ivq(*args, "--missing-input", "decode:position_ids", "-o", tmp_path / "p.h5") == 0
    assert ivq(*args, "--missing-input", "nope", "-o", tmp_path / "q.h5") == 2
    with open_dump(tmp_path / "p.h5") as a, open_dump(tmp_path / "s.h5") as b:
        assert sorted(a.record_keys()) == sorted(b.record_keys())
