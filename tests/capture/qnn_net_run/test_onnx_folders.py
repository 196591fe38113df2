"""qnn-net-run folders described by the ONNX graph alone (no QNN JSON): input lists, raw inputs, dynamic axes
resolved from byte sizes, names kept, and one-line errors (exit 3, no dump left) for bad folders."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ivq_debug.capture.qnn_net_run.folders import parse_input_list
from ivq_debug.capture.qnn_net_run.ingest import capture_net_run
from ivq_debug.cli.common import run
from ivq_debug.cli.main import _main as ivq_main
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.errors import InputError
from tests.support.qnn_fixtures import SINGLE

NAME = "internvl-tiny-dynamic-restart"


def ivq(*argv: object) -> int:
    return run("ivq", ivq_main, [str(a) for a in argv])


@pytest.fixture()
def session(device_sessions, tmp_path):
    """A writable copy of one device session's folders, and the ingest command over it."""
    s = device_sessions[NAME]
    root = tmp_path / "phone"
    shutil.copytree(s.root, root)
    out = tmp_path / "out" / "s.h5"
    out.parent.mkdir()

    def ingest(*extra: object) -> int:
        return ivq("ingest", "session", "--vision", root / "vision", "--prefill", root / "prefill", "--decode",
                   root / "decode", "--model-dir", s.parts["decode"].parent, "-o", out, *extra)

    return s, root, out, ingest


def _edit_line(root: Path, lineno: int, fn: Callable[[str], str]) -> None:
    lst = root / "decode" / "input_list.txt"
    lines = lst.read_text().splitlines()
    lines[lineno - 1] = fn(lines[lineno - 1])
    lst.write_text("\n".join(lines) + "\n")


def _truncate(path: Path, n: int) -> Path:
    path.write_bytes(path.read_bytes()[:n])
    return path


def _set_value(path: Path, i: int, v: float) -> Path:
    a = np.fromfile(path, "<f4")
    a[i] = v
    a.tofile(path)
    return path


# each case: (what it breaks) -> (the file the error must name, a phrase of the message)
BAD: dict[str, Callable[[Path], tuple[Path, str]]] = {
    "missing input raw": lambda r: ((r / "decode/inputs/1/attention_mask.raw").unlink() or
                                    r / "decode/inputs/1/attention_mask.raw", "missing raw input file"),
    "missing output raw": lambda r: ((r / "decode/output/Result_2/logits.raw").unlink() or
                                     r / "decode/output/Result_2/logits.raw", "missing raw file for graph output"),
    "wrong static size": lambda r: (_truncate(r / "vision/inputs/0/pixel_values.raw", 1000), "wrong byte size 1000"),
    "size against another file's axis": lambda r: (
        _truncate(r / "decode/output/Result_0/present_0_key.raw", 20 * 2 * 16 * 4),
        "total_sequence_length=21 (from attention_mask.raw)"),
    "not whole values": lambda r: (_truncate(r / "decode/inputs/0/inputs_embeds.raw", 255), "not a whole number"),
    "token without path": lambda r: (_edit_line(r, 3, lambda s: s.replace("inputs/1/inputs_embeds.raw", "")) or
                                     r / "decode/input_list.txt", "line 3: token 'inputs_embeds:='"),
    "header after the first line": lambda r: (_edit_line(r, 4, lambda s: "#late\n" + s) or
                                              r / "decode/input_list.txt", "line 4: a '#' line"),
    "a token missing": lambda r: (_edit_line(r, 2, lambda s: s.split(" ", 1)[1]) or r / "decode/input_list.txt",
                                  "line 2: no token for input(s) inputs_embeds, which line 3 feeds"),
    "unknown tensor name": lambda r: (_edit_line(r, 2, lambda s: s.replace("attention_mask:=", "mask:=")) or
                                      r / "decode/input_list.txt", "line 2: tensor 'mask' is not an input"),
    "relative path outside": lambda r: (_edit_line(r, 2, lambda s: s.replace(
        "inputs/0/inputs_embeds.raw", "../../phone-copy/decode/inputs/0/inputs_embeds.raw")) or
        r / "decode/input_list.txt", "leaves the session folder"),
    "absolute path outside": lambda r: (_edit_line(r, 2, lambda s: s.replace(
        "inputs/0/inputs_embeds.raw", str(r.parent / "phone-copy/decode/inputs/0/inputs_embeds.raw"))) or
        r / "decode/input_list.txt", "--allow-outside-inputs"),
    "a float where the graph wants int64": lambda r: (_set_value(r / "decode/inputs/1/attention_mask.raw", 3, 0.5),
                                                      "non-integer value (0.5)"),
    "a Result folder missing": lambda r: (shutil.rmtree(r / "decode/output/Result_1") or r / "decode/output",
                                          "Result_1 is missing"),
    "more lines than Result folders": lambda r: (shutil.rmtree(r / "decode/output/Result_4") or
                                                 r / "decode/input_list.txt", "5 inference line(s) but 4 Result"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_folders_one_line_exit_3_no_dump(case, session, capfd):
    _s, root, out, ingest = session
    shutil.copytree(root, root.parent / "phone-copy")  # a real file outside the session folder
    named, phrase = BAD[case](root)
    capfd.readouterr()
    assert ingest() == 3
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"ivq: error: {named}: ") and phrase in err[0], err[0]
    assert list(out.parent.iterdir()) == []  # no dump, no partial file


def test_outside_paths_read_when_allowed_and_device_paths_rebased(session, capfd):
    s, root, out, ingest = session
    shutil.copytree(root, root.parent / "phone-copy")
    BAD["absolute path outside"](root)
    assert ingest("--allow-outside-inputs") == 0
    # an absolute path of the phone (/data/local/tmp/...) is found again under the session folder
    _edit_line(root, 2, lambda line: line.replace("inputs/0/", "/data/local/tmp/ivq/decode/inputs/0/"))
    assert ingest("--force", "--json", out.parent / "m.json") == 0
    rows = json.loads((out.parent / "m.json").read_text())["tensors"]
    emb = next(r for r in rows if r["record"]["step"] == 1 and r["name"] == "inputs_embeds")
    assert emb["file"] == str(root / "decode/inputs/0/inputs_embeds.raw")
    with open_dump(out) as d, open_dump(s.dump) as sched:
        assert np.array_equal(d.read("inputs_embeds", (0, "decode", 1), kind="input"),
                              sched.read("inputs_embeds", (0, "decode", 1), kind="input"))


def test_input_list_rules(tmp_path):
    lst = tmp_path / "input_list.txt"
    lst.write_text("#out_a out_b\n\n%comment\na.raw b.raw\n  \nx:=c.raw y:=d.raw\n")
    lines = parse_input_list(lst)
    assert [ln.line for ln in lines] == [4, 6]
    assert [(t.name, t.path) for t in lines[0].tokens] == [(None, "a.raw"), (None, "b.raw")]
    assert [(t.name, t.path) for t in lines[1].tokens] == [("x", "c.raw"), ("y", "d.raw")]
    for text, phrase in (("x:=a.raw b.raw\n", "mixes"), ("#only a header\n", "no inference"),
                         (":=a.raw\n", "needs a tensor name")):
        lst.write_text(text)
        with pytest.raises(InputError, match=phrase) as e:
            parse_input_list(lst)
        assert str(lst) in str(e.value) and "\n" not in str(e.value)


def test_positional_tokens_and_unmatched_files(session, capfd):
    s, root, out, ingest = session
    lst = root / "prefill" / "input_list.txt"
    header, row = lst.read_text().splitlines()
    lst.write_text(header + "\n" + " ".join(t.split(":=")[1] for t in row.split()) + "\n")  # bare paths, graph order
    (root / "decode/output/Result_0/_model_layers_0_mlp_Gelu_output_0.raw").write_bytes(b"\0" * 64)  # a --debug file
    assert ingest("--json", out.parent / "m.json") == 0
    doc = json.loads((out.parent / "m.json").read_text())
    assert [u["file"] for u in doc["unmatched"]] == [str(root / "decode/output/Result_0/_model_layers_0_mlp_Gelu_output_0.raw")]
    assert "matched no tensor" in capfd.readouterr().err
    with open_dump(out) as d, open_dump(s.dump) as sched:
        for name in ("inputs_embeds", "attention_mask", "position_ids"):
            assert np.array_equal(d.read(name, (0, "prefill", 0), kind="input"),
                                  sched.read(name, (0, "prefill", 0), kind="input"))
        assert d.meta("ingest_unmatched")[0]["reason"].startswith("name: no tensor of decode.onnx")


def test_native_inputs(device_sessions, tmp_path, capfd):
    from tests.support.device_sessions import make_session, session_image

    s = device_sessions["qwen2vl-tiny-dynamic-correct"]
    n = make_session("native", s.model, s.cache, s.fault, s.parts["decode"].parent, tmp_path / "native",
                     session_image(), s.config, native_inputs=True)
    args = ["ingest", "session", "--prefill", n.folders["prefill"], "--decode", n.folders["decode"],
            "--model-dir", s.parts["decode"].parent]
    assert ivq(*args, "--native-inputs", "-o", tmp_path / "n.h5") == 0
    with open_dump(tmp_path / "n.h5") as d, open_dump(n.dump) as sched:
        pos = d.read("position_ids", (0, "decode", 1), kind="input")
        assert pos.dtype == np.int64 and pos.reshape(-1).tolist() == [8, 8, 8]  # M-RoPE: max(prefill) + 1
        for k in range(1, len(n.tokens)):
            for e in d.tensors((0, "decode", k), kind="input"):
                assert np.array_equal(d.read(e), sched.read(e.name, (0, "decode", k), kind="input"))
    capfd.readouterr()
    assert ivq(*args, "-o", tmp_path / "f.h5") == 3  # int64 files read as float32: the sizes disagree
    err = capfd.readouterr().err
    assert "wrong byte size" in err and not (tmp_path / "f.h5").exists()


def _identity_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_ambiguous_axes_name_the_file_and_dim_pins_them(tmp_path, capfd):
    model = _identity_model(tmp_path / "m.onnx")
    run_dir = tmp_path / "run"
    (run_dir / "inputs").mkdir(parents=True)
    (run_dir / "output" / "Result_0").mkdir(parents=True)
    np.arange(6, dtype="<f4").tofile(run_dir / "inputs" / "x.raw")
    np.arange(6, dtype="<f4").tofile(run_dir / "output" / "Result_0" / "y.raw")
    (run_dir / "input_list.txt").write_text("inputs/x.raw\n")
    capfd.readouterr()
    assert ivq("ingest", "qnn-net-run", run_dir, "--model", model, "-o", tmp_path / "a.h5") == 3
    err = capfd.readouterr().err.strip()
    assert err.startswith(f"ivq: error: {run_dir / 'inputs' / 'x.raw'}: 2 dynamic axes that the byte sizes")
    # every open axis in one error, with the values the size allows
    assert "batch (x.raw [batch, seq]: candidates 1, 2, 3, 6); seq (x.raw" in err and len(err.splitlines()) == 1
    assert "--dim NAME=VALUE" in err and not (tmp_path / "a.h5").exists()
    assert ivq("ingest", "qnn-net-run", run_dir, "--model", model, "--dim", "batch=2", "-o", tmp_path / "a.h5") == 0
    assert "config" not in capfd.readouterr().out  # no KV cache, no logits: no --config / rope_theta hint
    with open_dump(tmp_path / "a.h5") as d:
        assert d.read("x", (0, "model", 0), kind="input").shape == (2, 3)
        assert d.entry("y", (0, "model", 0)).shape == (2, 3)
    assert ivq("ingest", "qnn-net-run", run_dir, "--model", model, "--dim", "batch", "-o", tmp_path / "b.h5") == 2


def test_one_step_convention(device_sessions, tmp_path, capfd):
    s = device_sessions[NAME]
    dec = s.folders["decode"]
    args = ["ingest", "qnn-net-run", dec / "output", "--model", s.parts["decode"]]
    assert ivq(*args, "--as-steps", "--part", "decode", "-o", tmp_path / "d.h5") == 0
    with open_dump(tmp_path / "d.h5") as d:
        assert sorted(d.record_keys()) == [(0, "decode", k) for k in range(1, len(s.tokens))]
        assert d.read("attention_mask", (0, "decode", 1), kind="input").shape == (1, s.prefill_len + 1)
    capfd.readouterr()
    assert ivq(*args, "--part", "decode", "-o", tmp_path / "x.h5") == 2  # decode calls as samples at step 0
    assert "decode record at step 0" in capfd.readouterr().err
    assert ivq(*args, "--as-steps", "--first-step", "0", "-o", tmp_path / "x.h5") == 2
    assert not (tmp_path / "x.h5").exists()
    # the API and the CLI number Result_0 the same: decode step 1
    api = capture_net_run(SINGLE / "output", tmp_path / "api.h5", SINGLE / "model_net.json", as_steps=True)
    assert ivq("ingest", "qnn-net-run", SINGLE / "output", "--graph", SINGLE / "model_net.json", "--as-steps",
               "-o", tmp_path / "cli.h5") == 0
    with open_dump(tmp_path / "cli.h5") as d:
        assert api.records == sorted(d.record_keys()) == [(0, "model", 1), (0, "model", 2)]


def test_graph_json_ingest_keeps_qnn_names_and_files(tmp_path):
    cap = capture_net_run(SINGLE / "output", tmp_path / "q.h5", SINGLE / "model_net.json")
    with open_dump(tmp_path / "q.h5") as d:
        e = d.entry("_conv1_Conv_output_0", (0, "model", 0))
        assert e.qnn_name == "_conv1_Conv_output_0" and Path(e.source_file).parent.name == "Result_0"
    assert {r["file"] for r in cap.to_json()["tensors"]} >= {e.source_file}


def test_dumps_without_the_new_manifest_columns_still_read(tmp_path):
    p = tmp_path / "old.h5"
    with DumpWriter(p, backend="x") as w:
        w.add_tensor("t", np.ones(3, np.float32))
    with h5py.File(p, "r+") as f:  # the manifest as version 1 wrote it before qnn_name / source_file
        m = json.loads(f["manifest"][()])
        keep = [i for i, c in enumerate(m["columns"]) if c not in ("qnn_name", "source_file")]
        m = {"columns": [m["columns"][i] for i in keep], "rows": [[r[i] for i in keep] for r in m["rows"]]}
        del f["manifest"]
        f.create_dataset("manifest", data=json.dumps(m))
    with open_dump(p) as d:
        e = d.entry("t")
        assert e.qnn_name is None and e.source_file is None and np.array_equal(d.read(e), np.ones(3))
