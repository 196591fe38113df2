"""Exports: Perfetto trace JSON, JUnit XML, Model Explorer node-data overlay."""

from __future__ import annotations

import itertools
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.report.conftest import EDGE_NAMES, need_htp
from tests.report.pipeline import XSS


def _strict_json(path: Path) -> Any:
    def no_constants(name: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constants)


# ============================================================================ Perfetto
def test_perfetto_trace_is_valid_and_carries_layer_errors(comparisons: dict[str, Any], pipeline: dict[str, Path],
                                                          tmp_path: Path) -> None:
    from ivq_debug.dump import open_dump
    from ivq_debug.report import write_perfetto

    need_htp(pipeline)
    cmp = comparisons["main"]
    out = write_perfetto(cmp, tmp_path / "trace.json")
    doc = _strict_json(out)
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        for k in ("name", "ph", "ts", "dur", "pid", "tid"):
            assert k in e, (k, e)
        assert isinstance(e["name"], str) and e["ph"] in ("X", "M")
        assert isinstance(e["ts"], int | float) and isinstance(e["dur"], int | float)
        assert e["dur"] >= 0 and e["ts"] >= 0 and math.isfinite(e["ts"]) and math.isfinite(e["dur"])
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    ops = [e for e in events if e.get("cat") == "op"]
    prof = open_dump(pipeline["htp"]).table("profiling")
    n_ops = int((prof["is_op"].astype(bool) & (prof["phase"] == "execute") & (prof["run"] >= 0)).sum())
    assert len(ops) == n_ops
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert any("QNN HTP" in n and "emulation" in n for n in names)
    assert doc["otherData"]["emulated"] is True and "cycles" in doc["otherData"]["time_basis"]
    # ops of one run on one thread never overlap, and the four runs map to the four records
    by_track: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for e in ops:
        by_track.setdefault((e["pid"], e["tid"], e["args"]["run"]), []).append(e)
    for evs in by_track.values():
        evs.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(evs):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6
    assert {e["args"]["run"] for e in ops} == {0, 1, 2, 3}
    gelu = [e for e in ops if e["args"]["layer_error"] and e["args"]["layer_error"]["tensor"] == XSS]
    assert len(gelu) == 4
    for e in gelu:
        err = e["args"]["layer_error"]
        row = cmp.table[(cmp.table["test_name"] == XSS) & (cmp.table["step"] == err["record"]["step"])].iloc[0]
        assert err["sqnr_db"] == pytest.approx(row["sqnr_db"]) and err["report_anchor"].startswith("#L")
        assert err["record"]["step"] == e["args"]["run"]  # run k is record k (capture order)


def test_perfetto_needs_a_profile(comparisons: dict[str, Any], tmp_path: Path) -> None:
    from ivq_debug.errors import UsageError
    from ivq_debug.report import write_perfetto

    with pytest.raises(UsageError, match="profiling"):
        write_perfetto(comparisons["quant"], tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


# ============================================================================ JUnit
def _junit_counts(root: ET.Element) -> tuple[int, int, list[ET.Element]]:
    cases = root.findall(".//testcase")
    failing = [c for c in cases if c.find("failure") is not None]
    return len(cases), len(failing), failing


@pytest.mark.parametrize("which", ["main", "edge"])
def test_junit_one_failing_case_per_violation(which: str, comparisons: dict[str, Any], edge_cmp: Any,
                                              tmp_path: Path) -> None:
    from ivq_debug.report import write_junit

    cmp = comparisons["main"] if which == "main" else edge_cmp
    out = write_junit(cmp, tmp_path / "junit.xml")
    root = ET.parse(out).getroot()  # valid XML, control characters included
    assert root.tag == "testsuites"
    n_cases, n_fail, failing = _junit_counts(root)
    t = cmp.table
    violations = sum(len(v) for v in t["violations"])
    assert violations > 0
    assert n_fail == violations
    assert n_cases == n_fail + int(t["passed"].sum())  # every tensor here is budget-checked
    suite = root.find("testsuite")
    assert int(suite.get("failures")) == n_fail and int(suite.get("tests")) == n_cases
    assert int(root.get("failures")) == n_fail
    assert all(f.find("failure").get("type") == "budget" for f in failing)
    if which == "edge":
        names = {c.get("name") for c in root.iter("testcase")}
        assert any(n.startswith("ctrl\\x01\\x1b[31mname</script><!--") for n in names)  # escaped, intact
        assert any(n.startswith(EDGE_NAMES["quote"]) for n in names)


def test_junit_without_budgets_passes_every_tensor(pipeline: dict[str, Path]) -> None:
    from ivq_debug.api import compare
    from ivq_debug.report import junit_xml

    cmp = compare(pipeline["float"], pipeline["cpu"], progress=False)
    root = ET.fromstring(junit_xml(cmp))
    n_cases, n_fail, _ = _junit_counts(root)
    assert n_fail == 0 and n_cases == len(cmp.table)
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["budgets"] == "none"


# ============================================================================ Model Explorer
def test_model_explorer_overlay_value_per_aligned_tensor(comparisons: dict[str, Any], tmp_path: Path) -> None:
    from ivq_debug.report import write_model_explorer

    cmp = comparisons["main"]
    doc = _strict_json(write_model_explorer(cmp, tmp_path / "me.json"))
    assert list(doc) == ["main_graph"]
    graph = doc["main_graph"]
    res = graph["results"]
    assert set(res) == set(cmp.table["test_name"])
    for v in res.values():
        assert isinstance(v["value"], int | float) and math.isfinite(v["value"])
    worst = cmp.table[cmp.table["test_name"] == XSS]["sqnr_db"].min()  # worst over the decode steps
    assert res[XSS]["value"] == pytest.approx(worst, abs=1e-5)
    th = [x["value"] for x in graph["thresholds"]]
    assert th == sorted(th) and all("bgColor" in x for x in graph["thresholds"])


def test_model_explorer_keys_by_node_with_the_model(comparisons: dict[str, Any], pipeline: dict[str, Path]) -> None:
    import onnx

    from ivq_debug.report import model_explorer_overlay

    cmp = comparisons["main"]
    m = onnx.load(str(pipeline["qdq"]))
    prod = {o: n.name for n in m.graph.node for o in n.output}
    doc = model_explorer_overlay(cmp, model=pipeline["qdq"], metric="max_abs", record=(0, "prefill", 0))
    assert list(doc) == [m.graph.name]
    res = doc[m.graph.name]["results"]
    assert set(res) == {prod.get(n, n) for n in cmp.table["test_name"]}
    assert "/blk/mlp/act/Gelu" in res and "gradient" in doc[m.graph.name]


def test_model_explorer_undefined_and_identical(edge_cmp: Any) -> None:
    from ivq_debug.report import model_explorer_overlay
    from ivq_debug.report.exports import SQNR_CAP_DB, UNDEFINED_VALUE

    res = model_explorer_overlay(edge_cmp)["main_graph"]["results"]
    assert res["same"]["value"] == SQNR_CAP_DB
    for k in ("nan", "zero", "shape"):
        assert res[k]["value"] == UNDEFINED_VALUE and "bgColor" in res[k]
    assert set(res) == set(edge_cmp.table["test_name"])


def test_chrome_trace_profile_gives_us_timeline_with_cpu_lane(tmp_path: Path) -> None:
    """A µs profile with real start times (Chrome trace), QNN and CPU ops, joined through the model."""
    import numpy as np
    import onnx
    from onnx import TensorProto
    from onnx import helper as h

    from ivq_debug.api import compare
    from ivq_debug.dump import DumpWriter
    from ivq_debug.qnn.profiling import join_tensors, read_chrome_trace
    from ivq_debug.report import perfetto_trace, render_report
    from ivq_debug.report.timeline import build_timeline

    g = h.make_graph([h.make_node("Relu", ["x"], ["a"], name="fc1"), h.make_node("Neg", ["a"], ["b"], name="act"),
                      h.make_node("Relu", ["b"], ["y"], name="fc2")], "g",
                     [h.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = tmp_path / "m.onnx"
    onnx.save(h.make_model(g), str(model))
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"name": "fc1:OpId_1", "ph": "X", "ts": 1000, "dur": 50, "pid": 1, "tid": 1,
         "args": {"provider": "QNNExecutionProvider", "onnx_source_ops": ["fc1"]}},
        {"name": "act", "ph": "X", "ts": 1060, "dur": 20, "pid": 2, "tid": 1, "args": {"provider": "CPUExecutionProvider"}},
        {"name": "fc2:OpId_2", "ph": "X", "ts": 1090, "dur": 30, "pid": 1, "tid": 1,
         "args": {"provider": "QNNExecutionProvider", "onnx_source_ops": ["fc2"]}}]}))
    for side in ("ref", "test", "unjoined"):
        with DumpWriter(tmp_path / f"{side}.h5", backend=side, backend_info={"model_path": str(model)}) as w:
            w.begin_record()
            for k, n in enumerate(("a", "b", "y")):
                w.add_tensor(n, np.arange(4, dtype=np.float32) + k + (0.01 if side != "ref" else 0.0))
            if side == "test":  # joined at capture time, as the QNN runner and the ingest store it
                w.add_table("profiling", join_tensors(read_chrome_trace(trace), model))
            elif side == "unjoined":
                w.add_table("profiling", read_chrome_trace(trace))
    cmp = compare(tmp_path / "ref.h5", tmp_path / "test.h5", progress=False)
    model.unlink()  # the report needs no model file: the join travels with the dump
    tl = build_timeline(cmp.test)
    assert tl is not None and tl.unit == "us" and tl.join == "capture" and tl.runs == [0]
    # a path named inside a dump is never opened: without a stored join there is no model join
    onnx.save(h.make_model(g), str(model))
    un = build_timeline(compare(tmp_path / "ref.h5", tmp_path / "unjoined.h5", progress=False).test)
    assert un is not None and un.join == "none" and all(not o.tensors for o in un.ops)
    assert [(o.backend, o.start, o.dur, o.tensors) for o in tl.ops] == [
        ("QNN", 0.0, 50.0, ["a"]), ("CPU", 60.0, 20.0, ["b"]), ("QNN", 90.0, 30.0, ["y"])]
    doc = perfetto_trace(cmp)
    procs = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {"QNN HTP", "CPU"}
    ops = {e["name"]: e for e in doc["traceEvents"] if e.get("cat") == "op"}
    assert ops["act"]["ts"] == 60.0 and ops["act"]["dur"] == 20.0 and ops["act"]["pid"] != ops["fc1"]["pid"]
    assert ops["fc2"]["args"]["layer_error"]["tensor"] == "y"
    page = render_report(cmp)
    assert 'id="timeline"' in page and ">CPU</text>" in page and ">HTP</text>" in page and "latency µs" in page
