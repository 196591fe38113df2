"""Issue 30: the dynamic axes of a qnn-net-run folder solved as one system, and ``--debug`` intermediates of graphs
without ``value_info`` ingested; small legacy-style graphs run on real ORT, the CLI path a user takes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ivq_debug.capture.qnn_net_run.shapes import GraphIO, config_sizes
from ivq_debug.cli.common import run
from ivq_debug.cli.main import _main as ivq_main
from ivq_debug.dump import open_dump
from ivq_debug.qnn.names import qnn_sanitize


def ivq(*argv: object) -> int:
    return run("ivq", ivq_main, [str(a) for a in argv])


def legacy_graph(path: Path) -> Path:
    """A decoder step as the legacy exporter leaves it: a ``Shape -> Gather -> Concat -> Reshape`` chain, a KV
    concat, outputs whose axes are named after their producer, and no ``value_info``."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "W2")
    c = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
         (("one", [1]), ("two2", [2, 2]), ("idx", 1), ("ax0", [0]))]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["/MatMul_output_0"], name="/MatMul"),
        helper.make_node("Shape", ["x"], ["/Shape_output_0"], name="/Shape"),
        helper.make_node("Gather", ["/Shape_output_0", "idx"], ["/Gather_output_0"], name="/Gather", axis=0),
        helper.make_node("Unsqueeze", ["/Gather_output_0", "ax0"], ["/Unsqueeze_output_0"], name="/Unsqueeze"),
        helper.make_node("Concat", ["one", "/Unsqueeze_output_0", "two2"], ["/Concat_output_0"], name="/Concat", axis=0),
        helper.make_node("Reshape", ["/MatMul_output_0", "/Concat_output_0"], ["/Reshape_output_0"], name="/Reshape"),
        helper.make_node("Transpose", ["/Reshape_output_0"], ["/Transpose_output_0"], name="/Transpose", perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["past", "/Transpose_output_0"], ["present.0.key"], name="/Concat_1", axis=2),
        helper.make_node("MatMul", ["/MatMul_output_0", "W2"], ["logits"], name="/MatMul_1"),
    ]
    f = TensorProto.FLOAT
    g = helper.make_graph(
        nodes, "legacy",
        [helper.make_tensor_value_info("x", f, [1, "seq", 4]),
         helper.make_tensor_value_info("past", f, [1, 2, "past_sequence_length", 2])],
        [helper.make_tensor_value_info("logits", f, ["MatMullogits_dim_0", "MatMullogits_dim_1", 8]),
         helper.make_tensor_value_info("present.0.key", f, ["Concatpresent.0.key_dim_0", "Concatpresent.0.key_dim_1",
                                                            "Concatpresent.0.key_dim_2", "Concatpresent.0.key_dim_3"])],
        [w, w2, *c])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


DEBUG = ["/MatMul_output_0", "/Reshape_output_0", "/Transpose_output_0"]


def debug_run(model: Path, folder: Path, shapes: list[tuple[int, int]]) -> list[dict[str, np.ndarray]]:
    """Run the graph on ORT for each (seq, past) and write the folder as ``qnn-net-run --debug`` does."""
    m = onnx.load(str(model))
    for n in DEBUG:
        m.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    lines, runs = [], []
    for i, (seq, past) in enumerate(shapes):
        feeds = {"x": rng.standard_normal((1, seq, 4)).astype(np.float32),
                 "past": rng.standard_normal((1, 2, past, 2)).astype(np.float32)}
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
        for n, v in feeds.items():
            (folder / "inputs" / str(i)).mkdir(parents=True, exist_ok=True)
            v.tofile(folder / "inputs" / str(i) / f"{n}.raw")
        rd = folder / "output" / f"Result_{i}"
        rd.mkdir(parents=True)
        for n, v in got.items():
            v.astype("<f4").tofile(rd / f"{qnn_sanitize(n)}.raw")
        lines.append(f"x:=inputs/{i}/x.raw past:=inputs/{i}/past.raw")
        runs.append(feeds | got)
    (folder / "input_list.txt").write_text("\n".join(lines) + "\n")
    return runs


def test_graph_without_value_info_lists_every_intermediate(tmp_path):
    g = GraphIO.from_model(legacy_graph(tmp_path / "m.onnx"))
    assert g.values["/Transpose_output_0"].dims == (1, 2, "seq", 2)  # shape inference, the input's axis name kept
    assert g.values["/Shape_output_0"].dtype == np.int64 and set(DEBUG) <= set(g.values)
    assert g.output_names().resolve("_Transpose_output_0", kinds=("tensor",)).onnx_name == "/Transpose_output_0"


def test_producer_named_axes_and_intermediates_without_a_pin(tmp_path, capfd):
    model = legacy_graph(tmp_path / "m.onnx")
    runs = debug_run(model, tmp_path / "run", [(3, 5), (1, 8)])
    out, js = tmp_path / "d.h5", tmp_path / "m.json"
    assert ivq("ingest", "qnn-net-run", tmp_path / "run", "--model", model, "-o", out, "--json", js) == 0
    doc = json.loads(js.read_text())
    assert doc["unmatched"] == []
    assert "needs rope_theta" in capfd.readouterr().out  # a graph with a KV cache: the --config hint applies
    with open_dump(out) as d:
        for i, (seq, past) in enumerate([(3, 5), (1, 8)]):
            names = {e.name for e in d.tensors((i, "model", 0))}
            assert names == {"logits", "present.0.key", *DEBUG}  # every intermediate, none dropped
            assert d.entry("present.0.key", (i, "model", 0)).shape == (1, 2, past + seq, 2)
            assert d.entry("logits", (i, "model", 0)).shape == (1, seq, 8)
            for n in [*DEBUG, "logits", "present.0.key"]:
                assert np.array_equal(d.read(n, (i, "model", 0)), runs[i][n])
            assert d.entry("/Reshape_output_0", (i, "model", 0)).op_type == "Reshape"


def test_unmatched_files_say_whether_name_or_shape_failed(tmp_path):
    model = legacy_graph(tmp_path / "m.onnx")
    debug_run(model, tmp_path / "run", [(3, 5)])
    rd = tmp_path / "run" / "output" / "Result_0"
    (rd / "_Nope_output_0.raw").write_bytes(b"\0" * 16)
    (rd / "_Reshape_output_0.raw").write_bytes(b"\0" * 20)  # 5 floats: not [1, 3, 2, 2]
    np.array([1, 3, 4], "<f4").tofile(rd / "_Shape_output_0.raw")  # int64 in the graph, float32 on disk
    np.array([0.5], "<f4").tofile(rd / "_Gather_output_0.raw")  # not a whole number: kept as the device wrote it
    js = tmp_path / "m.json"
    assert ivq("ingest", "qnn-net-run", tmp_path / "run", "--model", model, "-o", tmp_path / "d.h5", "--json", js) == 0
    why = {Path(u["file"]).name: u["reason"] for u in json.loads(js.read_text())["unmatched"]}
    assert why["_Nope_output_0.raw"].startswith("name: no tensor of m.onnx is named '_Nope_output_0'")
    assert why["_Reshape_output_0.raw"] == "shape: 20 bytes is not '/Reshape_output_0' [1, 3, 2, 2] x float32"
    with open_dump(tmp_path / "d.h5") as d:
        shape = d.read("/Shape_output_0", (0, "model", 0))
        assert shape.dtype == np.int64 and shape.tolist() == [1, 3, 4]
        assert d.read("/Gather_output_0", (0, "model", 0)).tolist() == 0.5


def _opaque_graph(path: Path, op: str = "Attend") -> Path:
    """A KV step whose op no shape inference knows: only the byte sizes and the config can shape its output."""
    f = TensorProto.FLOAT
    g = helper.make_graph(
        [helper.make_node(op, ["past"], ["present.0.key"], domain="vendor.ops")], "opaque",
        [helper.make_tensor_value_info("past", f, [1, 2, "past_sequence_length", 16])],
        [helper.make_tensor_value_info("present.0.key", f, [f"{op}present.0.key_dim_0", f"{op}present.0.key_dim_1",
                                                            "past_sequence_length", f"{op}present.0.key_dim_3"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("vendor.ops", 1)])
    onnx.save(m, str(path))
    return path


def test_config_sizes_resolve_kv_axes_and_every_open_axis_is_listed(tmp_path, capfd):
    model = _opaque_graph(tmp_path / "m.onnx")
    rd = tmp_path / "run" / "output" / "Result_0"
    rd.mkdir(parents=True)
    (tmp_path / "run" / "inputs").mkdir()
    np.zeros((1, 2, 5, 16), "<f4").tofile(tmp_path / "run" / "inputs" / "past.raw")
    np.zeros((1, 2, 5, 16), "<f4").tofile(rd / "present_0_key.raw")
    (tmp_path / "run" / "input_list.txt").write_text("past:=inputs/past.raw\n")
    capfd.readouterr()
    assert ivq("ingest", "qnn-net-run", tmp_path / "run", "--model", model, "-o", tmp_path / "a.h5") == 3
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "3 dynamic axes" in err
    for axis in ("Attendpresent.0.key_dim_0 (present_0_key.raw", "Attendpresent.0.key_dim_1 (", "key_dim_3 ("):
        assert axis in err
    assert "candidates 1, 2, 4, 8, 16, 32" in err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "x", "text_config": {"num_key_value_heads": 2, "hidden_size": 64,
                                                                  "num_attention_heads": 4, "rope_theta": 1e4}}))
    assert config_sizes(json.loads(cfg.read_text()))["head_dim"] == 16  # hidden_size / num_attention_heads
    assert ivq("ingest", "qnn-net-run", tmp_path / "run", "--model", model, "--config", cfg, "-o", tmp_path / "a.h5") == 0
    with open_dump(tmp_path / "a.h5") as d:
        assert d.entry("present.0.key", (0, "model", 0)).shape == (1, 2, 5, 16)
    # a pin still decides what nothing else does, and contradicts what the config says only with an error
    assert ivq("ingest", "qnn-net-run", tmp_path / "run", "--model", model, "--dim", "Attendpresent.0.key_dim_0=1",
               "--dim", "Attendpresent.0.key_dim_1=2", "-o", tmp_path / "b.h5") == 0


def test_a_session_lists_the_open_axes_of_every_part_in_one_error(tmp_path, capfd):
    parts = tmp_path / "parts"
    parts.mkdir()
    for part, n in (("prefill", 3), ("decode", 4)):
        _opaque_graph(parts / f"{part}.onnx", part.capitalize())
        run_dir = tmp_path / part
        (run_dir / "output" / "Result_0").mkdir(parents=True)
        (run_dir / "inputs").mkdir()
        np.zeros((1, 2, n, 16), "<f4").tofile(run_dir / "inputs" / "past.raw")
        np.zeros((1, 2, n, 16), "<f4").tofile(run_dir / "output" / "Result_0" / "present_0_key.raw")
        (run_dir / "input_list.txt").write_text("past:=inputs/past.raw\n")
    capfd.readouterr()
    assert ivq("ingest", "session", "--prefill", tmp_path / "prefill", "--decode", tmp_path / "decode",
               "--model-dir", parts, "-o", tmp_path / "s.h5") == 3
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "6 dynamic axes" in err and "Traceback" not in err
    for j in (0, 1, 3):  # every axis of both parts, each with the values its file allows
        assert f"Prefillpresent.0.key_dim_{j} (present_0_key.raw [Prefillpresent.0.key_dim_0" in err
        assert f"Decodepresent.0.key_dim_{j} (present_0_key.raw [Decodepresent.0.key_dim_0" in err
    assert err.count("candidates 1, 2, 4, 8, 16, 32)") == 6  # 1 x 2 x 16 values left by each file
    assert str(tmp_path / "prefill") in err and not (tmp_path / "s.h5").exists()
