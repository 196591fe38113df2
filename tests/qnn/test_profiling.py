"""Profiling parsers (QNN EP CSV, qnn-profile-viewer text, Chrome traces) and the op → tensor join."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ivq_debug.errors import InputError
from ivq_debug.qnn.profiling import (
    COLUMNS,
    join_tensors,
    read_chrome_trace,
    read_profile,
    read_profile_viewer_text,
    read_qnn_ep_csv,
    split_op_identifier,
    tensor_timings,
)
from tests.support.qnn_fixtures import MODEL, PROF, SINGLE, one_line


def test_detailed_csv() -> None:
    df = read_qnn_ep_csv(PROF / "qnn_ep_detailed.csv")
    assert tuple(df.columns) == COLUMNS
    assert sorted(df["run"].unique()) == [-1, 0, 1] and set(df["session"]) == {0}
    ops = df[df.is_op]
    assert ops.groupby("run").size().tolist() == [33, 33]
    assert set(ops["unit"]) == {"cycles"} and ops["op_id"].notna().all()
    ln = ops[(ops.run == 0) & (ops.qnn_name == "/ln/LayerNormalization")].iloc[0]
    assert ln.onnx_source_ops[-2:] == ["/ln/LayerNormalization", "/ln/LayerNormalization_output_0_QuantizeLinear"]
    fin = df[df.phase == "finalize"]
    assert len(fin) == 9 and fin.iloc[0].identifier == "QNN (finalize) time" and fin.iloc[0].unit == "us"
    ex = df[(df.identifier == "QNN (execute) time")]
    assert ex["run"].tolist() == [0, 1] and (ex["value"] > 0).all()


def test_detailed_csv_joins_to_the_tensors() -> None:
    """Acceptance: the profiling table of a detailed QNN EP run joins to the tensors."""
    import onnx

    from ivq_debug.onnxgraph.sites import list_sites

    df = read_qnn_ep_csv(PROF / "qnn_ep_detailed.csv")
    j = join_tensors(df, MODEL)
    ops = j[j.is_op & (j.run == 0)]
    exposed = {o.name for o in onnx.load(MODEL).graph.output}
    site_keys = {s.name for s in list_sites(onnx.load(MODEL), "qdq") if s.output in exposed}
    covered = {t for ts in ops.dump_tensors for t in ts}
    assert len(site_keys) == 17 and site_keys <= covered  # every captured tensor has its profiled op(s)
    named = ops[ops.tensors.map(len) > 0]
    assert len(named) == 26 and len(ops) == 33  # the rest: Input, Output, 4 layout transposes, 1 inserted DQ
    unres = {u for us in ops.unresolved_ops for u in us}
    assert unres <= {"Input", "Output", "DequantizeLinear"} | {u for u in unres if "_token_" in u}
    row = ops[ops.qnn_name == "/conv1/Conv_token_3"].iloc[0]  # a QNN-renamed node is resolved
    assert row.onnx_nodes[-2:] == ["/conv1/Conv", "/conv1/Conv_output_0_QuantizeLinear"]
    assert row.tensors == ["/conv1/Conv_output_0_QuantizeLinear_Output"] and row.dump_tensors == ["/conv1/Conv_output_0"]
    tt = tensor_timings(df, MODEL, runs=[0, 1])
    assert set(tt.dump_tensor) >= site_keys and (tt.unit == "cycles").all()
    assert tt[tt.dump_tensor == "/attn/Softmax_output_0"].run.tolist() == [0, 1]


def test_basic_csv_and_appended_sessions(tmp_path: Path) -> None:
    b = read_qnn_ep_csv(PROF / "qnn_ep_basic.csv")
    assert not b.is_op.any() and b["run"].max() == 0 and b.onnx_source_ops.map(len).sum() == 0
    text = (PROF / "qnn_ep_detailed.csv").read_text()
    body = text.split("\n", 1)[1]
    p = tmp_path / "appended.csv"
    p.write_text(text + body)  # ORT appends a second session without a header
    df = read_qnn_ep_csv(p)
    assert sorted(df["session"].unique()) == [0, 1]
    assert sorted(df[df.phase == "execute"]["run"].unique()) == [0, 1, 2, 3]
    assert df[df.is_op].groupby("run").size().tolist() == [33] * 4


def test_two_partition_csv_with_graphs_per_run() -> None:
    df = read_qnn_ep_csv(PROF / "fallback_qnn_ep_detailed.csv", graph=["qnn_0", "qnn_1"])
    ex = df[df.phase == "execute"]
    assert set(ex["run"]) == {0} and sorted(ex["exec_block"].unique()) == [0, 1]
    assert ex.groupby("graph").size().to_dict() == {"qnn_0": 25, "qnn_1": 18}
    one = read_qnn_ep_csv(PROF / "fallback_qnn_ep_detailed.csv")
    assert sorted(one[one.phase == "execute"]["run"].unique()) == [0, 1]  # without the hint: one block = one run


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda t: t[: t.index("\n0,NODE,") + 12], "has 3 fields, expected 8 (truncated file?)"),
        (lambda t: t.replace("0,FINALIZE,", "0,FINALIZE,x", 1), "Time 'x"),
        (lambda t: "Foo,Bar\n1,2\n", "not a QNN EP profiling CSV"),
        (lambda t: "", "empty profiling CSV"),
        (lambda t: t.split("\n", 1)[0] + "\n", "header but no rows"),
    ],
)
def test_bad_csv_is_one_line_naming_the_file(tmp_path: Path, mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "prof.csv"
    p.write_text(mutate((PROF / "qnn_ep_detailed.csv").read_text()))
    with pytest.raises(InputError) as ei:
        read_qnn_ep_csv(p)
    msg = one_line(ei.value)
    assert msg.startswith(str(p)) and needle in msg, msg


def test_profile_viewer_text() -> None:
    df = read_profile_viewer_text(PROF / "viewer_basic.txt")
    assert tuple(df.columns) == COLUMNS
    v = {(r.phase, r.stat, r.identifier): (r.value, r.unit, r.graph) for r in df.itertuples()}
    assert v[("init", None, "NetRun")] == (331158.0, "us", None)
    assert v[("finalize", None, "QNN (finalize) time")] == (256364.0, "us", "model")
    assert v[("execute", "average", "Accelerator (execute) time")] == (2492.0, "us", "model")
    assert v[("execute", "average", "Number of HVX threads used")] == (4.0, "count", "model")
    assert v[("execute", "overall", "NetRun IPS")] == (214.8888, "inf/sec", None)
    assert len(df) == 19 and not df.is_op.any()
    d = read_profile_viewer_text(PROF / "viewer_detailed.txt")
    ops = d[d.is_op]
    assert len(ops) == 33 and (ops.unit == "cycles").all() and ops.stat.eq("average").all()
    assert "_ln_LayerNormalization" in set(ops.qnn_name)
    j = join_tensors(d, MODEL)  # sanitized QNN op names resolve through the NameMap
    assert j[j.qnn_name == "_ln_LayerNormalization"].iloc[0].dump_tensors == ["/ln/LayerNormalization_output_0"]


def test_profile_viewer_bad_input(tmp_path: Path) -> None:
    p = tmp_path / "v.txt"
    text = (PROF / "viewer_basic.txt").read_text()
    p.write_text(text.rstrip("\n")[:-12])  # cut inside the last value line
    with pytest.raises(InputError, match="last line is cut"):
        read_profile_viewer_text(p)
    p.write_text("hello\nworld\n")
    with pytest.raises(InputError, match="no profiling values"):
        read_profile_viewer_text(p)


def test_ort_chrome_traces() -> None:
    df = read_chrome_trace(PROF / "ort_trace.json")
    ops = df[df.is_op]
    assert len(ops) == 2 and ops.backend.eq("QNN").all() and ops["run"].tolist() == [0, 1]
    assert ops.iloc[0].graph.startswith("QNNExecutionProvider_")
    fb = read_chrome_trace(PROF / "fallback_ort_trace.json")
    fops = fb[fb.is_op]
    assert fops.groupby("backend").size().to_dict() == {"CPU": 10, "QNN": 2} and set(fops["run"]) == {0}
    j = join_tensors(fb, MODEL)
    cpu = j[j.qnn_name == "/attn/scores/MatMul"].iloc[0]
    assert cpu.backend == "CPU" and cpu.tensors == ["/attn/scores/MatMul_output_0"]


def test_generic_chrome_trace_with_begin_end_pairs(tmp_path: Path) -> None:
    ev = [{"name": "_conv1_Conv:OpId_17 (cycles)", "ph": "B", "ts": 10, "pid": 1, "tid": 1},
          {"name": "_conv1_Conv:OpId_17 (cycles)", "ph": "E", "ts": 35, "pid": 1, "tid": 1},
          {"name": "relu", "ph": "X", "ts": 40, "dur": 5, "pid": 1, "tid": 1, "args": {"onnx_source_ops": "/relu/Relu"}},
          {"name": "process_name", "ph": "M", "pid": 1}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    df = read_profile(p)
    assert df.qnn_name.tolist() == ["_conv1_Conv", "relu"] and df.value.tolist() == [25.0, 5.0]
    assert df.op_id.iloc[0] == 17 and df.op_id.isna().iloc[1]
    assert df.onnx_source_ops.tolist() == [[], ["/relu/Relu"]]
    p.write_text(json.dumps({"traceEvents": ev})[:-20])
    with pytest.raises(InputError, match=r"bad JSON .* \(truncated file\?\)"):
        read_chrome_trace(p)


def test_dispatch_and_binary_log() -> None:
    assert read_profile(PROF / "qnn_ep_detailed.csv").source.iloc[0] == "qnn_ep_csv"
    assert read_profile(PROF / "viewer_basic.txt").source.iloc[0] == "profile_viewer"
    assert read_profile(PROF / "ort_trace.json").source.iloc[0] == "ort_trace"
    with pytest.raises(InputError, match="binary profiling log"):
        read_profile(SINGLE / "output" / "qnn-profiling-data_0.log")


def test_split_op_identifier() -> None:
    assert split_op_identifier("ln1:OpId_182 (cycles)") == ("ln1", 182)
    assert split_op_identifier("Input OpId_2 (cycles)") == ("Input", 2)
    assert split_op_identifier("onnx::MatMul_q_DequantizeLinear:OpId_5 (cycles)") == ("onnx::MatMul_q_DequantizeLinear", 5)
    assert split_op_identifier("Accelerator (execute) time") == (None, None)


def test_table_round_trips_through_a_dump(tmp_path: Path) -> None:
    from ivq_debug.dump import DumpWriter, open_dump

    df = read_qnn_ep_csv(PROF / "qnn_ep_detailed.csv")
    with DumpWriter(tmp_path / "p.h5", backend="qnn-htp") as w:
        w.add_table("profiling", df)
    with open_dump(tmp_path / "p.h5") as d:
        t = d.table("profiling")
    assert t.shape == df.shape and list(t.columns) == list(COLUMNS)

    def plain(col):  # type: ignore[no-untyped-def]  # missing values compare equal (the reader may give NaN)
        return [None if (not isinstance(v, list) and v != v) or v is None else v for v in col]

    assert df.op_id.map(type).isin([int, type(None)]).all()  # no pandas NA: JSON-clean
    for c in ("op_id", "exec_block", "qnn_name", "onnx_source_ops", "value", "run"):
        assert plain(t[c]) == plain(df[c]), c
