"""Machine-readable exports of a comparison (``docs/report.md``).

* :func:`perfetto_trace` — the profiling timeline of the test dump as Chrome / Perfetto trace JSON
  (``traceEvents``, ``ph: "X"`` complete events in µs, one ``pid`` per partition (HTP, CPU), one ``tid`` per
  graph), each op's ``args`` carrying the error of the tensor it produces. Open it in https://ui.perfetto.dev
  or ``chrome://tracing`` (both load local files; nothing is uploaded by ivq-debug).
* :func:`model_explorer_overlay` — per-tensor error as Google AI Edge Model Explorer *node data*
  (``{graph_id: {"results": {key: {"value": v}}, "thresholds" | "gradient": [...]}}``, the
  ``ModelNodeData`` layout of ``model_explorer/node_data_builder.py``); load it with
  ``model-explorer MODEL --node_data_paths=overlay.json``.
* :func:`junit_xml` — JUnit XML for CI systems: one test case per budget-checked tensor (per record), and
  one failing test case per budget violation.

Every writer is atomic (temp file + rename) and refuses to replace an existing file unless ``overwrite``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ivq_debug.errors import UsageError
from ivq_debug.jsonio import as_float, json_safe
from ivq_debug.metrics import HIGHER_IS_BETTER, METRICS
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.outputs import atomic_write_text
from ivq_debug.report.layers import build_layers
from ivq_debug.report.timeline import build_timeline

#: SQNR written for identical tensors (+inf) in the Model Explorer overlay (its values must be finite)
SQNR_CAP_DB = 200.0
#: value written for undefined metrics (non-finite tensors, mismatched shapes, all-zero references)
UNDEFINED_VALUE = -100.0
UNDEFINED_COLOR = "#5b2a86"
#: Model Explorer thresholds for SQNR (upper bounds: value ≤ threshold takes its colour)
SQNR_THRESHOLDS = (
    (0.0, "#67001f"),
    (10.0, "#b2182b"),
    (20.0, "#d6604d"),
    (30.0, "#f4a582"),
    (40.0, "#fddbc7"),
    (60.0, "#d1e5f0"),
    (SQNR_CAP_DB, "#4393c3"),
)


def _dumps(doc: Any) -> str:

    return json.dumps(json_safe(doc), indent=1, allow_nan=False, ensure_ascii=False) + "\n"


def write_text(path: str | os.PathLike, text: str, overwrite: bool) -> Path:
    """Write a report file atomically (temp file + rename).

    Raises :class:`~ivq_debug.errors.UsageError` when ``path`` exists and ``overwrite`` is False.
    """

    return atomic_write_text(path, text, overwrite=overwrite)


# ============================================================================ Perfetto / Chrome trace
def perfetto_trace(cmp: Any, *, model: Any = None) -> dict[str, Any]:
    """The test dump's profiling timeline as a Chrome / Perfetto trace document.

    Every op is one complete event (``ph: "X"``, ``ts`` / ``dur`` in µs) on ``pid`` = its partition (HTP or
    CPU) and ``tid`` = its graph; runs are laid one after the other, each also drawn as a ``run N`` event on
    thread 0. ``args`` holds the op id, the profile's raw value and unit, the produced tensors and
    ``layer_error`` (record, tensor, SQNR, max |Δ|, cosine, status, budget verdict) of the worst of them.
    Metadata events (``ph: "M"``) name processes and threads. ``otherData`` records the time basis (cycles
    → µs), the op → tensor join and whether the timings come from the emulated HTP.

    Raises:
        UsageError: the test dump holds no profiling table (capture with ``profiling_level``).
    """

    tl = build_timeline(cmp.test, model)
    if tl is None:
        raise UsageError("the test dump has no profiling table with per-op rows "
                         "(capture with QnnHtpRunner(profiling_level='detailed', profiling_path=...))", cmp.test.path)
    view = build_layers(cmp)
    by: dict[tuple[Any, str], dict[str, Any]] = {}
    for r in view.rows:
        by.setdefault((r["record"], r["test_name"]), r)
    info = cmp.test.backend_info or {}
    emulated = tl.emulated is True or info.get("emulated") is True
    pids: dict[str, int] = {}
    tids: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []

    def meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> None:
        events.append({"name": name, "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": tid, "args": args})

    def pid_of(backend: str) -> int:
        if backend not in pids:
            pids[backend] = len(pids) + 1
            pname = ("QNN HTP" + (" (x86_64 emulation)" if emulated else "")) if backend == "QNN" else backend
            meta("process_name", pids[backend], 0, {"name": pname})
            meta("process_sort_index", pids[backend], 0, {"sort_index": pids[backend]})
            meta("thread_name", pids[backend], 0, {"name": "runs"})
        return pids[backend]

    def tid_of(pid: int, graph: str | None) -> int:
        key = (pid, graph or "graph")
        if key not in tids:
            tids[key] = 1 + sum(1 for k in tids if k[0] == pid)
            meta("thread_name", pid, tids[key], {"name": graph or "graph"})
        return tids[key]

    # µs per timeline unit: cycles become µs with one ratio for the whole trace (the median of the runs'
    # own accelerator-time ratios), so runs stay comparable; without any ratio one cycle is drawn as 1 ns
    if tl.unit == "cycles":
        k = tl.trace_us_per_cycle
        basis = (f"cycles × {k:.6g} µs/cycle (median of the runs' accelerator execute µs / cycles)" if k
                 else "cycles × 0.001 (1 cycle drawn as 1 ns: the profile gives no µs reference)")
        k = k or 1e-3
    else:
        k, basis = 1.0, "µs from the profile"
    offset = 0.0
    for run in tl.runs:
        ops = tl.run_ops(run)
        rec = tl.run_records.get(run)
        span = max((o.start + o.dur for o in ops), default=0.0) * k
        for o in ops:
            pid = pid_of(o.backend)
            cands = []
            for t in o.tensors:
                if rec is not None:
                    hit = by.get((rec, t))
                    cands += [hit] if hit else []
                else:
                    cands += [r for (k, n), r in by.items() if n == t]
            worst = min(cands, key=lambda r: (as_float(r["sqnr_db"]) if as_float(r["sqnr_db"]) is not None else -math.inf),
                        default=None)
            err = None
            if worst is not None:
                err = {"tensor": worst["test_name"], "record": {"sample": worst["record"][0], "part": worst["record"][1],
                                                                "step": worst["record"][2]},
                       "sqnr_db": worst["sqnr_db"], "max_abs": worst["max_abs"], "cosine": worst["cosine"],
                       "status": worst["status"], "passed": bool(worst["passed"]), "precision": worst["precision"],
                       "report_anchor": f"#L{worst['row']}"}
            ts = round(offset + o.start * k, 3)
            end = round(offset + (o.start + max(o.dur, 0.0)) * k, 3)  # adjacent ops share the rounded instant
            events.append({
                "name": o.name, "cat": "op", "ph": "X", "ts": ts,
                "dur": round(end - ts, 3), "pid": pid, "tid": tid_of(pid, o.graph),
                "args": {"op_id": o.op_id, "run": run, "raw": o.raw, "unit": o.unit, "tensors": o.tensors,
                         "onnx_nodes": o.onnx_nodes, "layer_error": err},
            })
        lab = f"run {run}" + (f" ({rec[1]} step {rec[2]}, sample {rec[0]})" if rec else "")
        for pid in {pid_of(o.backend) for o in ops}:
            events.append({"name": lab, "cat": "run", "ph": "X", "ts": round(offset, 3), "dur": round(span, 3),
                           "pid": pid, "tid": 0, "args": {"run": run}})
        offset += span + max(span * 0.05, 1.0)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "ivq-debug", "source": tl.source, "time_basis": basis, "join": tl.join,
            "emulated": emulated, "label": info.get("label"), "dump": str(cmp.test.path),
            "note": ("emulated HTP: host-side timings, not device latency" if emulated else ""),
        },
    }


def write_perfetto(cmp: Any, path: str | os.PathLike, *, model: Any = None, overwrite: bool = False) -> Path:
    """Write :func:`perfetto_trace` as JSON (atomic; no overwrite unless asked)."""
    return write_text(path, _dumps(perfetto_trace(cmp, model=model)), overwrite)


# ============================================================================ Model Explorer node data
_LOWER_IS_BETTER = {"max_abs", "mean_abs", "rmse", "rel_l2", "lsb_rmse", "lsb_max", "kl"}


def _producers(model: Any) -> tuple[str, dict[str, str]]:

    m = load_model(model)
    prod = {o: n.name for n in m.graph.node for o in n.output if o and n.name}
    return m.graph.name or "main_graph", prod


def model_explorer_overlay(cmp: Any, *, metric: str = "sqnr_db", graph_id: str | None = None, model: Any = None,
                           record: Any = None) -> dict[str, Any]:
    """Per-tensor error as Model Explorer node data (``ModelNodeData`` JSON).

    Keys: the test tensor names (Model Explorer matches a result to the node that outputs a tensor of that
    name). With ``model`` (the ONNX model the test ran), keys are the producing *node names* (node ids in
    Model Explorer's ONNX adapter) and ``graph_id`` defaults to the model's graph name, else ``main_graph``.

    Values: the metric per tensor; over several records (decode steps) the worst one, unless ``record``
    (``(sample, part, step)``) picks one. SQNR uses fixed colour thresholds (:data:`SQNR_THRESHOLDS`), +inf
    (identical) is written as :data:`SQNR_CAP_DB`; other metrics use a gradient. Undefined values (non-finite,
    mismatched shapes, zero-norm references) are written as :data:`UNDEFINED_VALUE` with their own colour.
    """

    if metric not in METRICS:
        raise UsageError(f"unknown metric {metric!r} (known: {', '.join(METRICS)})")
    t = cmp.table
    if record is not None:
        s, p, st = record
        t = t[(t["sample"] == s) & (t["part"] == p) & (t["step"] == st)]
    gid, prod = (graph_id or "main_graph"), {}
    if model is not None:
        name, prod = _producers(model)
        gid = graph_id or name
    higher = HIGHER_IS_BETTER.get(metric, False)
    best: dict[str, tuple[float, bool]] = {}  # key → (value, undefined)
    for name, v, status in zip(t["test_name"], t[metric], t["status"], strict=True):
        key = prod.get(name, name) if prod else name
        f = as_float(v)
        if f is None:
            if status in ("identical",) and metric == "sqnr_db":
                f, undef = SQNR_CAP_DB, False
            elif status in ("non_finite", "shape_mismatch", "zero_norm"):
                f, undef = UNDEFINED_VALUE, True
            else:
                continue  # metric does not apply (top1 on a non-logits tensor, …)
        else:
            undef = False
            if math.isinf(f):
                f = SQNR_CAP_DB if f > 0 else UNDEFINED_VALUE
            if metric == "sqnr_db":
                f = max(min(f, SQNR_CAP_DB), UNDEFINED_VALUE)
        cur = best.get(key)
        if cur is None or (not cur[1] and (undef or (f < cur[0] if higher else f > cur[0]))):
            best[key] = (f, undef)  # keep the worst; an undefined value is the worst of all
    results: dict[str, dict[str, Any]] = {}
    for key, (f, undef) in best.items():
        res: dict[str, Any] = {"value": round(f, 6)}
        if undef:
            res["bgColor"] = UNDEFINED_COLOR
            res["textColor"] = "#ffffff"
        results[key] = res
    graph: dict[str, Any] = {"results": results}
    if metric == "sqnr_db":
        graph["thresholds"] = [{"value": v, "bgColor": c} for v, c in SQNR_THRESHOLDS]
    else:
        good, bad = "#d1e5f0", "#b2182b"
        lo_c, hi_c = (good, bad) if metric in _LOWER_IS_BETTER else (bad, good)
        graph["gradient"] = [{"stop": 0, "bgColor": lo_c}, {"stop": 1, "bgColor": hi_c}]
    return {gid: graph}


def write_model_explorer(cmp: Any, path: str | os.PathLike, *, metric: str = "sqnr_db", graph_id: str | None = None,
                         model: Any = None, record: Any = None, overwrite: bool = False) -> Path:
    """Write :func:`model_explorer_overlay` as JSON (atomic; no overwrite unless asked)."""
    doc = model_explorer_overlay(cmp, metric=metric, graph_id=graph_id, model=model, record=record)
    return write_text(path, _dumps(doc), overwrite)


# ============================================================================ JUnit XML
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _x(v: Any) -> str:
    """Text safe for XML 1.0 (characters XML cannot hold are written as ``\\xNN``; escaping is ElementTree's)."""
    return _XML_BAD.sub(lambda m: f"\\x{ord(m.group()):02x}", str(v))


def junit_xml(cmp: Any, *, suite_name: str | None = None) -> str:
    """JUnit XML of the budget checks of a comparison.

    One ``<testcase>`` per budget-checked tensor of each record (``classname`` = record, ``name`` = tensor)
    when it meets every budget that applies to it, and one failing ``<testcase>`` per violated budget
    (``name`` = ``tensor [budget]``, ``<failure>`` with the metric value, status and budget). Without
    budgets every tensor is a passing case and a property says so. With a baseline (``cmp.regressions``), a
    second suite has one failing case per regression.
    """
    import datetime as _dt
    import xml.etree.ElementTree as ET

    t = cmp.table
    name = suite_name or f"ivq-diff {Path(str(cmp.ref.path)).name} -> {Path(str(cmp.test.path)).name}"
    root = ET.Element("testsuites", name="ivq-debug")
    suite = ET.SubElement(root, "testsuite", name=_x(name))
    props = ET.SubElement(suite, "properties")
    info = cmp.test.backend_info or {}
    for k, v in (("reference", cmp.ref.path), ("test", cmp.test.path), ("reference_backend", cmp.ref.backend),
                 ("test_backend", cmp.test.backend), ("budgets", "; ".join(cmp.budgets.describe()) or "none"),
                 ("emulated", info.get("emulated")), ("label", info.get("label")),
                 ("unmatched_ref", cmp.unmatched["ref"]["count"]), ("unmatched_test", cmp.unmatched["test"]["count"])):
        if v is not None:
            ET.SubElement(props, "property", name=k, value=_x(v))
    tests = failures = 0
    for r in t.to_dict("records"):
        cls = _x(f"{r['part']}.step{int(r['step'])}" + (f".sample{int(r['sample'])}" if int(r["sample"]) else ""))
        checked = cmp.budgets.effective(r["ref_name"]) if cmp.budgets else []
        if cmp.budgets and not checked:
            continue
        metrics = {k: r.get(k) for k in ("sqnr_db", "cosine", "max_abs", "rel_l2", "status")}
        # the comparison's own verdicts: one failing case per entry of its `violations` column
        violated = [b for b in checked if b.describe() in set(r.get("violations") or [])]
        if not violated:
            tc = ET.SubElement(suite, "testcase", classname=cls, name=_x(r["ref_name"]), time="0")
            out = ET.SubElement(tc, "system-out")
            out.text = _x(json.dumps({k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                                      for k, v in metrics.items()}, default=str)
                          + ("" if cmp.budgets else " (no budgets given)"))
            tests += 1
            continue
        for b in violated:
            v = r.get(b.metric)
            vtxt = "undefined" if as_float(v) is None else f"{float(v):.6g}"
            tc = ET.SubElement(suite, "testcase", classname=cls, name=_x(f"{r['ref_name']} [{b.describe()}]"), time="0")
            fail = ET.SubElement(tc, "failure", type="budget",
                                 message=_x(f"{b.metric} = {vtxt} breaks {b.describe()} (status {r['status']})"))
            fail.text = _x(f"tensor: {r['ref_name']}\ntest tensor: {r['test_name']}\nrecord: {r['part']} step "
                           f"{int(r['step'])} sample {int(r['sample'])}\nop: {r.get('op_type')}\nmetrics: "
                           + json.dumps({k: (x if not isinstance(x, float) or math.isfinite(x) else str(x))
                                         for k, x in metrics.items()}, default=str))
            tests += 1
            failures += 1
    suite.set("tests", str(tests))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", "0")
    suite.set("time", "0")
    suite.set("timestamp", _dt.datetime.now(_dt.UTC).replace(microsecond=0, tzinfo=None).isoformat())
    total_t, total_f = tests, failures
    if cmp.regressions is not None:
        rs = ET.SubElement(root, "testsuite", name=_x(f"{name} (regressions vs baseline)"), tests=str(len(cmp.regressions)),
                           failures=str(len(cmp.regressions)), errors="0", skipped="0", time="0")
        for g in cmp.regressions:
            rec = g.get("record", {})
            tc = ET.SubElement(rs, "testcase", classname=_x(f"{rec.get('part')}.step{rec.get('step')}"),
                               name=_x(g.get("ref_name")), time="0")
            f = ET.SubElement(tc, "failure", type="regression", message=_x("; ".join(g.get("reasons", []))))
            f.text = _x(json.dumps({"baseline": g.get("baseline"), "current": g.get("current")}, default=str))
        total_t += len(cmp.regressions)
        total_f += len(cmp.regressions)
    root.set("tests", str(total_t))
    root.set("failures", str(total_f))
    root.set("errors", "0")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(cmp: Any, path: str | os.PathLike, *, suite_name: str | None = None, overwrite: bool = False) -> Path:
    """Write :func:`junit_xml` (atomic; no overwrite unless asked)."""
    return write_text(path, junit_xml(cmp, suite_name=suite_name), overwrite)
