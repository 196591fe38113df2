"""Issue 17: the comparison contract. Dumps record their inputs' digests; ivq-diff refuses (exit 6) to compare
dumps that were not fed the same inputs, says so on every layer when allowed, and says "contract unknown" for old
dumps. Real ORT captures of the tiny exported model; the device-session flow (ivq reference recomputes positions on
purpose) on the real session fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from ivq_debug.cli.common import run
from ivq_debug.cli.diff import _main as diff_main
from ivq_debug.cli.main import _main as ivq_main
from ivq_debug.comparator.contract import check_contract
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.dump.contract import input_digest
from ivq_debug.errors import EXIT_CONTRACT
from tests.support import tiny


def ivq_diff(*argv: object) -> int:
    return run("ivq-diff", diff_main, [str(a) for a in argv])


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("contract")
    _m, x, onnx_path = tiny.build(tmp)
    other = x.copy()
    other[1, 3, 5] += 0.25  # a different "image": one value of the second sample
    out = {"a": tiny.capture_ort(onnx_path, x, tmp / "a.h5"), "b": tiny.capture_ort(onnx_path, x, tmp / "b.h5"),
           "other": tiny.capture_ort(onnx_path, other, tmp / "other.h5"), "tmp": tmp}
    # a dump as written before digests existed: the same capture with its record meta stripped
    old = tmp / "old.h5"
    old.write_bytes(out["a"].read_bytes())
    with h5py.File(old, "r+") as f:
        for g in f["records"].values():
            g.attrs["meta"] = "{}"
        del f["meta/contract"]
    out["old"] = old
    return out


def test_dump_records_digests_and_identity(dumps) -> None:
    d = open_dump(dumps["a"])
    fact = d.record_meta(None)["inputs"]["x"]
    assert fact["role"] == "external" and fact["shape"] == [2, 8, 16] and fact["dtype"] == "float32"
    assert fact["sha256"] == input_digest(d.read("x", kind="input"))
    ident = d.meta("contract")
    from ivq_debug.inputfiles import sha256_file

    assert ident["models"]["model"]["sha256"] == sha256_file(dumps["tmp"] / "tiny.onnx")
    assert ident["models"]["model"]["precision"] == "float"
    assert ident["platform"]["machine"]
    # token ids: int32 and int64 feeds of the same values are the same input, float16 is not float32
    assert input_digest(np.arange(4, dtype=np.int32)) == input_digest(np.arange(4, dtype=np.int64))
    assert input_digest(np.ones(3, np.float16)) != input_digest(np.ones(3, np.float32))


def test_different_inputs_exit_6_with_one_line(dumps, capfd, tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    code = ivq_diff(dumps["a"], dumps["other"], "--json", out)
    err = capfd.readouterr().err.strip().splitlines()
    assert code == EXIT_CONTRACT == 6
    assert len(err) == 1 and err[0].startswith("ivq-diff: error: contract:")
    assert "input 'x' of record 0/model/0 differs" in err[0] and "--allow-input-mismatch" in err[0]
    assert not out.exists()  # stopped before any metric


def test_allowed_mismatch_says_so_on_every_layer(dumps, capfd, tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    code = ivq_diff(dumps["a"], dumps["other"], "--allow-input-mismatch", "--json", out, "--top", "3")
    stdout, err = capfd.readouterr()
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["contract"]["status"] == "broken" and doc["contract"]["allowed"] is True
    assert doc["contract"]["first_mismatch"]["input"] == "x"
    assert doc["layers"] and all(layer["contract"].startswith("inputs differ") for layer in doc["layers"])
    assert "inputs differ" in doc["verdict"]["sentence"] and "inputs differ" in stdout  # (results: stdout)


def test_same_inputs_pass_and_old_dumps_are_contract_unknown(dumps, capfd, tmp_path: Path) -> None:
    out = tmp_path / "same.json"
    assert ivq_diff(dumps["a"], dumps["b"], "--json", out, "-q") == 0
    doc = json.loads(out.read_text())
    assert doc["contract"]["status"] == "ok" and doc["contract"]["inputs_checked"] == 1
    out2 = tmp_path / "old.json"
    assert ivq_diff(dumps["old"], dumps["other"], "--json", out2) == 0  # no digests: diffs, says so
    doc2 = json.loads(out2.read_text())
    assert doc2["contract"]["status"] == "unknown"
    assert "contract unknown" in doc2["verdict"]["sentence"] and "contract unknown" in capfd.readouterr().out


def test_roles_decide_what_is_compared(tmp_path: Path) -> None:
    """Teacher-forced tokens are compared; a reference's recomputed positions are skipped and said so; a
    scheduler's derived positions that differ are a note; the KV cache is carried."""
    def write(path: Path, token: int, pos: int, pos_role: str | None) -> Path:
        with DumpWriter(path, backend="onnxruntime-cpu") as w:
            w.begin_record(sample=0, part="decode", step=1)
            w.add_input("input_ids", np.array([[token]]), role="external")
            w.add_input("position_ids", np.array([[pos]]), role=pos_role,
                        reason="ivq reference: the model's positions" if pos_role == "recomputed" else None)
            w.add_input("past.0.key", np.full((1, 2, 4, 8), float(token + pos), np.float32))
            w.add_tensor("logits", np.zeros((1, 1, 4), np.float32))
        return path

    ref = open_dump(write(tmp_path / "ref.h5", 7, 20, "recomputed"))
    c = check_contract(ref, open_dump(write(tmp_path / "dev.h5", 7, 0, "derived")))
    assert c.status == "ok" and c.inputs_checked == 1
    assert c.skipped["position_ids"].startswith("recomputed by the ref side on purpose: ivq reference")
    assert c.skipped["past.0.key"].startswith("carried")
    assert "position_ids (recomputed" in c.line()
    derived = check_contract(open_dump(write(tmp_path / "a.h5", 7, 20, "derived")),
                             open_dump(write(tmp_path / "b.h5", 7, 0, "derived")))
    assert derived.status == "ok" and derived.derived["position_ids"] == {"first": "0/decode/1", "count": 1}
    forced = check_contract(ref, open_dump(write(tmp_path / "tok.h5", 8, 20, "recomputed")))
    assert forced.status == "broken" and forced.first["input"] == "input_ids" and forced.first["record"] == "0/decode/1"


def test_device_session_reference_passes_the_contract(device_sessions, session_parts, tmp_path: Path) -> None:
    """``ivq reference`` vs the ingested session: the reference recomputes positions (and the image rows) on
    purpose; the device's pixels and teacher-forced token embeddings must and do agree."""
    s = device_sessions["internvl-tiny-fixed-off_by_one"]
    sess, ref = tmp_path / "s.h5", tmp_path / "r.h5"
    assert run("ivq", ivq_main, [str(a) for a in ("ingest", "session", "--vision", s.folders["vision"],
                                                  "--prefill", s.folders["prefill"], "--decode",
                                                  s.folders["decode"], "--model-dir", s.parts["decode"].parent,
                                                  "--config", s.config, "-o", sess)]) == 0
    folder = session_parts(s.model, s.cache).folder
    assert run("ivq", ivq_main, ["reference", str(sess), "--model-dir", str(folder), "-o", str(ref)]) == 0
    c = check_contract(open_dump(ref), open_dump(sess))
    assert c.status == "ok" and c.records >= 3
    # pixel_values and every decode step's teacher-forced token embeddings; the prefill's embeddings hold each
    # side's own vision output (carried / recomputed), so that record has no external input
    assert c.records == 7 and c.inputs_checked == c.records - 1
    assert "recomputed" in c.skipped["position_ids"] and "model's" in c.skipped["position_ids"]


def test_dumps_without_a_common_record_say_so_and_suggest_part(dumps, capfd, tmp_path: Path) -> None:
    """Issue 32: a ``--part model`` capture against ``vision`` records is not "N of N tensors unmatched" nor
    "contract unknown (written before the contract existed)": no record is common, both sides listed, --part."""
    _m, x, onnx_path = tiny.build(tmp_path)
    from ivq_debug.capture.base import Selection, capture
    from ivq_debug.capture.onnxrt.runner import OrtRunner

    vision = capture(OrtRunner(onnx_path, selection=Selection()), [{"x": x}], tmp_path / "vision.h5", part="vision",
                     progress=None)
    capfd.readouterr()
    assert ivq_diff(dumps["a"], vision) == 4
    _, err = capfd.readouterr()
    line = err.strip().splitlines()[-1]
    assert len(err.strip().splitlines()) == 1 and "no record is common" in line, err
    assert "model: 0/model/0" in line and "vision: 0/vision/0" in line and "--part vision" in line
    assert "tensors unmatched" not in line and "contract unknown" not in line and "--map" not in line


def test_optimization_level_is_part_of_the_contract(dumps, capfd, tmp_path: Path) -> None:
    """Issue 32: dumps captured at different ORT optimization levels compare with a warning naming both."""
    _m, x, onnx_path = tiny.build(tmp_path)
    fused = tiny.capture_ort(onnx_path, x, tmp_path / "all.h5", optimization="all")
    chk = check_contract(open_dump(dumps["a"]), open_dump(fused))
    assert chk.status == "ok" and chk.identity["test"]["ort_optimization"] == "ORT_ENABLE_ALL"
    (w,) = chk.warnings
    assert "ORT optimization level differs" in w and "ref ORT_DISABLE_ALL" in w and "test ORT_ENABLE_ALL" in w
    assert check_contract(open_dump(dumps["a"]), open_dump(dumps["b"])).warnings == []
    capfd.readouterr()
    assert ivq_diff(dumps["a"], fused, "--json", tmp_path / "d.json") == 0
    out, _ = capfd.readouterr()
    assert "warning: ORT optimization level differs" in out
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["contract"]["warnings"] == [w] and w in doc["verdict"]["notes"]
