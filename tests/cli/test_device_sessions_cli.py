"""Issue 12: every device-session fixture diagnosed from the CLI alone: ingest session -> reference -> ivq-diff.

The fixtures (``tests/support/device_sessions.py``) are real ORT runs of split exports of transformers' own
InternVL and Qwen2-VL classes (HF-style dynamic cache, and the embedded reference's fixed cache), written as
qnn-net-run lays its folders out. Each is ingested with the parts the "device" ran, its reference is built
from the parts with a position input, and ``ivq-diff`` must name the fixture's exact offset and first wrong
step (and nothing for a correct run). The exhaustive matrix is ``slow``; the default run keeps one fixture of
each kind (correct, off-by-one on the fixed cache, restart without decode positions, Qwen2-VL naive text rule).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.cli.common import run
from ivq_debug.cli.diff import _main as diff_main
from ivq_debug.cli.main import _main as ivq_main
from ivq_debug.diagnose.positions import rope_from_config
from ivq_debug.dump import open_dump
from tests.support.device_sessions import SESSIONS

FAST = {"internvl-tiny-dynamic-correct", "internvl-tiny-fixed-off_by_one", "internvl-tiny-dynamic-restart",
        "qwen2vl-tiny-dynamic-naive_text"}
NAMES = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
         for n in (f"{m}-{c}-{f}" for m, c, f in SESSIONS)]


def ivq(*argv: object) -> int:
    return run("ivq", ivq_main, [str(a) for a in argv])


def ivq_diff(*argv: object) -> int:
    return run("ivq-diff", diff_main, [str(a) for a in argv])


def ingest_args(s, out: Path) -> list[object]:
    """``ivq ingest session`` as a user types it: the folders, the parts the device ran, the HF config."""
    return ["ingest", "session", "--vision", s.folders["vision"], "--prefill", s.folders["prefill"],
            "--decode", s.folders["decode"], "--model-dir", s.parts["decode"].parent, "--config", s.config,
            "-o", out]


@pytest.fixture(scope="module")
def diagnosed(device_sessions, session_parts, tmp_path_factory):
    """name -> (session dump, reference dump, ivq-diff JSON, exit codes); built on first use."""
    tmp = tmp_path_factory.mktemp("cli-sessions")
    done: dict[str, tuple[Path, Path, dict, tuple[int, int, int]]] = {}

    def get(name: str):
        if name not in done:
            s = device_sessions[name]
            sess, ref, js = tmp / f"{name}.h5", tmp / f"{name}.ref.h5", tmp / f"{name}.diff.json"
            codes = (ivq(*ingest_args(s, sess), "--json", tmp / f"{name}.ingest.json"),
                     ivq("reference", sess, "--model-dir", session_parts(s.model, s.cache).folder, "-o", ref),
                     ivq_diff(ref, sess, "--json", js, "-q"))
            done[name] = (sess, ref, json.loads(js.read_text()) if js.exists() else {}, codes)
        return done[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_fixture_diagnosed_from_the_cli(name, device_sessions, diagnosed):
    s = device_sessions[name]
    sess, ref, doc, codes = diagnosed(name)
    with open_dump(sess) as d, open_dump(ref) as r:  # the faults are in decode: the prefill rule must agree
        assert np.array_equal(r.read("position_ids", (0, "prefill", 0), kind="input"),
                              d.read("position_ids", (0, "prefill", 0), kind="input"))
    found = [f for f in doc["findings"] if f["kind"] == "position_id_offset"]
    if s.expected_offset is None:
        assert codes == (0, 0, 0) and found == [] and doc["verdict"]["passed"]
        # the replay is the device's own computation here: every aligned output agrees to ORT rounding
        assert doc["unmatched"]["ref"]["count"] == doc["unmatched"]["test"]["count"] == 0
        assert max(float(layer["metrics"]["max_abs"]) for layer in doc["layers"]) <= 1e-5
        return
    assert codes == (0, 0, 1)
    assert len(found) == 1
    ev = found[0]["evidence"]
    assert (ev["offset"], ev["first_wrong_step"]) == (s.expected_offset, s.first_wrong_step)
    assert ev["method"] == ("direct" if s.decode_has_positions else "inferred")
    assert found[0]["severity"] == "error" and found[0]["where"]["record"]["step"] == s.first_wrong_step
    assert any("position_id_offset" in r for r in doc["verdict"]["reasons"])
    # the reference used the model's positions: decode step k at max(prefill positions) + k
    with open_dump(ref) as r:
        for k in range(1, len(s.tokens)):
            meta = r.record_meta((0, "decode", k))
            assert set(meta["position_ids"]) == {s.prefill_len + s.rope_delta + k - 1}
            assert meta["forced_token"] == s.tokens[k]
        pre = r.record_meta((0, "prefill", 0))
        assert pre["rope_delta"] == s.rope_delta and pre["image_rows"] == [2, 18]


def test_session_dump_holds_the_device_inputs_names_and_files(device_sessions, diagnosed, tmp_path):
    s = device_sessions["internvl-tiny-dynamic-restart"]
    sess, _ref, _doc, _ = diagnosed(s.name)
    mapping = json.loads((sess.parent / f"{s.name}.ingest.json").read_text())
    assert mapping["schema"] == "ivq-ingest/1" and mapping["unmatched"] == []
    with open_dump(sess) as d, open_dump(s.dump) as sched:
        assert rope_from_config(d.model["config"]).theta == 10000.0  # from --config, for the KV-cache check
        keys = sorted(d.record_keys())
        assert keys == sorted([(0, "vision", 0), (0, "prefill", 0)] + [(0, "decode", k) for k in range(1, 6)])
        for k in range(1, 6):
            ins = {e.name: e for e in d.tensors((0, "decode", k), kind="input")}
            assert "position_ids" not in ins  # the decode graph computes them: the folder has none
            mask = d.read(ins["attention_mask"])
            assert mask.dtype == np.int64 and mask.shape == (1, s.prefill_len + k)  # float32 file, cast back
            assert d.record_meta((0, "decode", k))["token"] == s.tokens[k]
            assert d.record_meta((0, "decode", k))["cache_len"] == s.prefill_len + k - 1
            e = ins["past_key_values.0.key"]
            assert e.qnn_name == "past_key_values_0_key" and e.source_file.endswith(f"inputs/{k - 1}/past_key_values_0_key.raw")
            want = sched.read("past_key_values.0.key", (0, "decode", k), kind="input")
            assert np.array_equal(d.read(e), want)
            out = d.entry("present.0.key", (0, "decode", k))
            assert out.qnn_name == "present_0_key" and out.source_file.endswith(f"Result_{k - 1}/present_0_key.raw")
        rows = [r for r in mapping["tensors"] if r["record"] == {"sample": 0, "part": "decode", "step": 2}]
        assert {r["qnn_name"] for r in rows} >= {"inputs_embeds", "attention_mask", "logits", "present_1_value"}


def _concat(folders: list[Path], dst: Path) -> Path:
    """One qnn-net-run folder holding the runs of several folders one after the other (a phone that ran
    several sessions through one input list)."""
    lines = []
    for f in folders:
        rows = [ln for ln in (f / "input_list.txt").read_text().splitlines() if ln and not ln.startswith("#")]
        for i, row in enumerate(rows):
            n = len(lines)
            toks = []
            for tok in row.split():
                name, _, rel = tok.partition(":=")
                target = dst / "inputs" / str(n) / Path(rel).name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f / rel, target)
                toks.append(f"{name}:={os.path.relpath(target, dst)}")
            shutil.copytree(f / "output" / f"Result_{i}", dst / "output" / f"Result_{n}")
            lines.append(" ".join(toks))
    (dst / "input_list.txt").write_text("#header\n" + "\n".join(lines) + "\n")
    return dst


def test_folders_holding_two_sessions_give_two_samples(device_sessions, session_parts, tmp_path):
    """Two runs (a correct one, then an off-by-one) through one set of folders: two samples, one finding."""
    a, b = device_sessions["internvl-tiny-dynamic-correct"], device_sessions["internvl-tiny-dynamic-off_by_one"]
    both = {p: _concat([a.folders[p], b.folders[p]], tmp_path / p) for p in ("vision", "prefill", "decode")}
    sess, ref, js = tmp_path / "s.h5", tmp_path / "ref.h5", tmp_path / "d.json"
    assert ivq("ingest", "session", "--vision", both["vision"], "--prefill", both["prefill"], "--decode",
               both["decode"], "--model-dir", a.parts["decode"].parent, "-o", sess) == 0
    with open_dump(sess) as d:
        steps = {s: sorted(k for (ss, p, k) in d.record_keys() if ss == s and p == "decode") for s in (0, 1)}
    assert steps == {0: list(range(1, len(a.tokens))), 1: list(range(1, len(b.tokens)))}  # split at the cache restart
    assert ivq("reference", sess, "--model-dir", session_parts(a.model, a.cache).folder, "-o", ref) == 0
    assert ivq_diff(ref, sess, "--json", js, "-q") == 1
    found = [f for f in json.loads(js.read_text())["findings"] if f["kind"] == "position_id_offset"]
    assert [(f["where"]["record"]["sample"], f["evidence"]["offset"], f["evidence"]["first_wrong_step"])
            for f in found] == [(1, 1, 1)]
    # one decode folder per sample works the same
    assert ivq("ingest", "session", "--prefill", a.folders["prefill"], "--prefill", b.folders["prefill"],
               "--decode", a.folders["decode"], "--decode", b.folders["decode"], "--model-dir",
               a.parts["decode"].parent, "-o", tmp_path / "s2.h5") == 0
    with open_dump(tmp_path / "s2.h5") as d:
        assert {k[0] for k in d.record_keys()} == {0, 1} and (1, "decode", 1) in d.record_keys()


def test_session_spec_file(device_sessions, tmp_path, capfd):
    s = device_sessions["qwen2vl-tiny-fixed-naive_text"]
    spec = tmp_path / "session.json"
    spec.write_text(json.dumps({"schema": "ivq-session/1", "model_dir": str(s.parts["decode"].parent),
                                "config": str(s.config), "vision": str(s.folders["vision"]),
                                "prefill": str(s.folders["prefill"]), "decode": [str(s.folders["decode"])]}))
    # the folders lie outside the spec's folder: refused unless the command line allows it
    assert ivq("ingest", "session", "--spec", spec, "-o", tmp_path / "s.h5") == 3
    assert "leaves the spec's folder" in capfd.readouterr().err and not (tmp_path / "s.h5").exists()
    assert ivq("ingest", "session", "--spec", spec, "-o", tmp_path / "s.h5", "--allow-outside-inputs") == 0
    with open_dump(tmp_path / "s.h5") as d:
        assert len([k for k in d.record_keys() if k[1] == "decode"]) == len(s.tokens) - 1
        assert d.model["config"]["model_type"] == "qwen2_vl"
    capfd.readouterr()
    for bad, why in (({"schema": "ivq-session/2"}, "schema"), ({"prefill": 3}, "'prefill' must be"),
                     ({"decode": []}, "'decode' must be"), ({"oops": 1}, "unknown field 'oops'"),
                     ({"dims": {"x": 0}}, "'dims' must be")):
        doc = {"schema": "ivq-session/1", "prefill": "p"} | bad
        spec.write_text(json.dumps(doc))
        assert ivq("ingest", "session", "--spec", spec, "-o", tmp_path / "x.h5") == 3
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(spec) in err[0] and why in err[0]
    assert not (tmp_path / "x.h5").exists()


def test_reference_refuses_what_it_cannot_do(device_sessions, session_parts, diagnosed, tmp_path, capfd):
    s = device_sessions["internvl-tiny-dynamic-restart"]
    sess, *_ = diagnosed(s.name)
    capfd.readouterr()
    # the no-position decode graph the device ran cannot be given the model's positions: a usage error
    assert ivq("reference", sess, "--model-dir", s.parts["decode"].parent, "-o", tmp_path / "r.h5") == 2
    assert "no position_ids input" in capfd.readouterr().err
    # a Qwen2-VL export without its config.json: without --config, M-RoPE positions cannot be computed
    q = device_sessions["qwen2vl-tiny-fixed-naive_text"]
    bare = tmp_path / "parts"
    shutil.copytree(q.parts["decode"].parent, bare, ignore=shutil.ignore_patterns("config.json"))
    qs = tmp_path / "q.h5"
    assert ivq("ingest", "session", "--vision", q.folders["vision"], "--prefill", q.folders["prefill"], "--decode",
               q.folders["decode"], "--model-dir", bare, "-o", qs) == 0
    capfd.readouterr()
    assert ivq("reference", qs, "--model-dir", bare, "-o", tmp_path / "r.h5") == 2
    assert "--config" in capfd.readouterr().err and not (tmp_path / "r.h5").exists()
    # nor without the vision record, which tells the image rows
    nv = tmp_path / "nv.h5"
    assert ivq("ingest", "session", "--prefill", q.folders["prefill"], "--decode", q.folders["decode"],
               "--model-dir", q.parts["decode"].parent, "--config", q.config, "-o", nv) == 0
    capfd.readouterr()
    assert ivq("reference", nv, "--model-dir", q.parts["decode"].parent, "-o", tmp_path / "r.h5") == 2
    assert "--vision" in capfd.readouterr().err
    assert ivq("reference", qs, "--model-dir", q.parts["decode"].parent, "--config", q.config, "--grid-thw", "1,8",
               "-o", tmp_path / "r.h5") == 2
    assert not (tmp_path / "r.h5").exists()
    # an unreadable session dump: exit 3
    assert ivq("reference", tmp_path / "missing.h5", "--model-dir", s.parts["decode"].parent, "-o",
               tmp_path / "r.h5") == 3


def test_diff_fail_on(diagnosed, capfd, tmp_path):
    sess, ref, _doc, _ = diagnosed("internvl-tiny-dynamic-restart")
    capfd.readouterr()
    assert ivq_diff(ref, sess, "-q") == 1  # no threshold given: the error finding alone fails the run
    out = capfd.readouterr().out
    assert "FAIL: 1 error finding(s): position_id_offset (decode step 1)" in out  # the verdict says why (stdout)
    assert ivq_diff(ref, sess, "-q", "--fail-on", "never") == 0
    assert ivq_diff(ref, sess, "-q", "--fail-on", "warning") == 1
    assert ivq_diff(ref, sess, "-q", "--fail-on", "bogus") == 2
    # against a baseline that already had the finding, it is not a regression
    base = tmp_path / "base.json"
    assert ivq_diff(ref, sess, "-q", "--json", base) == 1
    assert ivq_diff(ref, sess, "-q", "--baseline", base) == 0
    ok_sess, ok_ref, *_ = diagnosed("internvl-tiny-dynamic-correct")
    assert ivq_diff(ok_ref, ok_sess, "-q", "--fail-on", "warning") == 0  # a correct run has no finding at all
