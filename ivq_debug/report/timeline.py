"""The per-op profiling timeline of a test dump, joined to its tensors.

Source: the normalized profiling table stored in the dump (``Dump.table("profiling")``, see
:mod:`ivq_debug.qnn.profiling`). Each per-op row of one run becomes a :class:`TimelineOp` with a start and
a duration in µs and the dump tensors the op produces:

* **Join to tensors.** The capture joins the profile to the model it ran
  (:func:`ivq_debug.qnn.profiling.join_tensors`: each op's QDQ node unit -> the tensors it produces) and stores
  the joined table, so a report made elsewhere, without the ONNX file, keeps the join (``join == "capture"``).
  An explicit ``model`` re-joins (``"model"``). A table stored without the join falls back to the EP op trace
  stored in the dump (``/meta/qnn_op_trace``: each QNN op's source tensors that are tensors of the dump,
  ``"op_trace"``). A path named inside a dump is never opened.
* **Time basis.** QNN EP CSVs give per-op *cycles* without start times: the ops of a run are laid end to
  end in profile order and the timeline keeps cycles (:attr:`Timeline.unit` ``"cycles"``). The profile's
  own ratio ``Accelerator (execute) time [µs] / [cycles]`` of each run is kept in
  :attr:`Timeline.us_per_cycle` (under emulation it includes host overhead and varies from run to run).
  Sources with µs and start times (Chrome traces, ORT traces) keep them (``unit`` ``"us"``).
* **Parts.** A capture of several parts through one runner per part (a VLM's vision, prefill and decode) stores
  one table per part (``profiling.<part>``, :func:`ivq_debug.qnn.profiling.profiling_table`); a runner that
  captured records of several parts stores ``profiling``. :func:`build_timelines` gives one timeline per
  table, each saying the part it profiles. A ``profiling`` table of a dump of several parts whose runs are not
  one per record (written before per-part tables: the last part's runner won) is attributed to the part whose
  records hold the tensors its ops produce (:attr:`Timeline.part_inferred`).
* **Runs ↔ records.** When the profile holds exactly one run per record of its part, run *k* is the *k*-th
  record of that part (capture order); otherwise :attr:`Timeline.run_records` is empty and errors are taken
  from the worst record. Sources without run indices (a plain Chrome trace) are one run.

Emulated-HTP cycle counts measure the emulator on the host: use them for mapping and relative hot spots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ivq_debug.dump.format import part_rank
from ivq_debug.qnn.profiling import JOIN_COLUMNS, PROFILING_TABLE, join_tensors, profiling_tables

RecordKey = tuple[int, str, int]


@dataclass
class TimelineOp:
    """One profiled op of one run."""

    name: str
    op_id: int | None
    backend: str  # QNN | CPU | …
    graph: str | None
    run: int
    index: int  # position within the run
    start: float  # in the timeline's unit
    dur: float
    raw: float  # the profile's own value (cycles or µs)
    unit: str
    tensors: list[str] = field(default_factory=list)  # dump tensor names the op produces
    onnx_nodes: list[str] = field(default_factory=list)


@dataclass
class Timeline:
    """Timed ops of every run, with the basis of their times and the run → record map."""

    ops: list[TimelineOp]
    runs: list[int]
    run_records: dict[int, RecordKey]
    unit: str  # "cycles" | "us": the unit of every op's start and duration
    join: str  # "capture" | "model" | "op_trace" | "none"
    source: str
    emulated: bool | None
    totals: dict[int, float] = field(default_factory=dict)  # per run, in `unit`
    us_per_cycle: dict[int, float] = field(default_factory=dict)  # per run, from the profile
    part: str | None = None  # the part whose runs this profile times (None: the dump's only part, or unknown)
    table: str = PROFILING_TABLE  # the dump table it was read from
    part_inferred: bool = False  # the part was told from the tensors the ops produce (a table named "profiling")

    @property
    def unit_label(self) -> str:
        """``cycles`` or ``µs``."""
        return "µs" if self.unit == "us" else "cycles"

    @property
    def trace_us_per_cycle(self) -> float | None:
        """One µs/cycle ratio for a whole trace: the median of the runs' own ratios (``None`` without any)."""
        v = sorted(self.us_per_cycle.values())
        if not v:
            return None
        return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2

    def run_ops(self, run: int) -> list[TimelineOp]:
        """The ops of one run, in execution order."""
        return [o for o in self.ops if o.run == run]

    def tensor_latency(self) -> dict[tuple[int, str], float]:
        """Time (in :attr:`unit`) per (run, dump tensor): the summed durations of the ops producing it."""
        out: dict[tuple[int, str], float] = {}
        for o in self.ops:
            for t in o.tensors:
                out[(o.run, t)] = out.get((o.run, t), 0.0) + o.dur
        return out


def _op_trace_tensors(dump: Any) -> dict[str, list[str]]:
    """QNN op name → source TENSOR names, from the EP op trace stored in the dump."""
    trace = dump.meta("qnn_op_trace")
    out: dict[str, list[str]] = {}
    if not isinstance(trace, dict):
        return out
    for sg in trace.get("subgraph_traces") or []:
        for m in (sg or {}).get("op_mappings") or []:
            name = m.get("dst_name")
            if not name:
                continue
            ts = [s.get("name") for s in m.get("sources") or [] if s.get("type") == "TENSOR" and s.get("name")]
            out.setdefault(name, []).extend(ts)
    return out


def _int(v: Any) -> int | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else int(f)


def _text(v: Any) -> str | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return str(v) or None


def _us_per_cycle(rows: Any) -> float | None:
    """µs per cycle of one run, from the accelerator execute time in µs and in cycles."""
    us = cyc = None
    for r in rows.itertuples(index=False):
        ident = str(r.identifier or "")
        if ident.startswith("Accelerator (execute) time"):
            if r.unit == "cycles":
                cyc = r.value
            elif r.unit == "us":
                us = r.value
    return us / cyc if us is not None and cyc else None


def build_timelines(dump: Any, model: Any = None) -> list[Timeline]:
    """One timeline per profile the dump carries (per part; see the module docstring), vision → decode.

    Args:
        dump: the test :class:`~ivq_debug.dump.Dump`.
        model: the profiled ONNX model (path or ``ModelProto``) to re-join ops to tensors; default: the join
            stored with each table at capture time, else the stored op trace. Only for a dump with one profile
            (one model is one part).
    """
    tables = profiling_tables(dump.table_names())
    out = [tl for name, part in tables.items()
           if (tl := _build(dump, name, part, model if len(tables) == 1 else None)) is not None]
    return sorted(out, key=lambda t: (part_rank(t.part), str(t.part)))


def build_timeline(dump: Any, model: Any = None) -> Timeline | None:
    """The timeline of a dump's main profile: the ``profiling`` table, else the first part's (vision →
    decode); ``None`` when the dump has no profile with op rows (:func:`build_timelines` gives every one)."""
    tls = build_timelines(dump, model)
    return next((t for t in tls if t.table == PROFILING_TABLE), tls[0] if tls else None)


def _infer_part(dump: Any, ops_tensors: list[list[str]]) -> str | None:
    """The part whose records hold the most of the tensors the profiled ops produce."""
    names = {t for ts in ops_tensors for t in ts}
    if not names:
        return None
    counts: dict[str, int] = {}
    for part, _ in {(str(e.part), e.name) for e in dump.entries if e.kind == "tensor" and e.name in names}:
        counts[part] = counts.get(part, 0) + 1
    return max(counts, key=lambda p: counts[p]) if counts else None


def _build(dump: Any, table: str, part: str | None, model: Any) -> Timeline | None:
    """The timeline of one profiling table (``None`` without op rows)."""
    df = dump.table(table)
    if df.empty or not bool(df["is_op"].astype(bool).any()):
        return None
    tensor_names = {e.name for e in dump.entries if e.kind == "tensor"}
    join = "none"
    tensors_col: list[list[str]] | None = None
    nodes_col: list[list[str]] | None = None
    if model is not None:
        df = join_tensors(df.drop(columns=[c for c in JOIN_COLUMNS if c in df.columns]), model)
        join = "model"
    elif all(c in df.columns for c in JOIN_COLUMNS):
        join = "capture"
    if join != "none":
        tensors_col = [list(x) if isinstance(x, list | tuple) else [] for x in df["dump_tensors"]]
        nodes_col = [list(x) if isinstance(x, list | tuple) else [] for x in df["onnx_nodes"]]
    if tensors_col is None:
        by_op = _op_trace_tensors(dump)
        if by_op:
            join = "op_trace"
        tensors_col = []
        for q in df["qnn_name"]:
            ts = [t for t in by_op.get(q, []) if t in tensor_names] if q else []
            tensors_col.append(list(dict.fromkeys(ts)))
        nodes_col = [list(x) if isinstance(x, list | tuple) else [] for x in df["onnx_source_ops"]]
    df = df.assign(j_tensors=tensors_col, j_nodes=nodes_col)
    ops_df = df[df["is_op"].astype(bool) & (df["phase"] == "execute")]
    if len(ops_df) and not (ops_df["run"] >= 0).any():
        # sources without run indices (a plain Chrome trace, qnn-profile-viewer output): one run
        df = df.assign(run=df["run"].where(~(df["is_op"].astype(bool) & (df["phase"] == "execute")), 0))
        ops_df = df[df["is_op"].astype(bool) & (df["phase"] == "execute")]
    runs = sorted(int(r) for r in ops_df["run"].unique() if int(r) >= 0)
    if not runs:
        return None
    units = {str(u) for u in ops_df["unit"]}
    unit = "cycles" if units == {"cycles"} else "us"
    ops: list[TimelineOp] = []
    totals: dict[int, float] = {}
    ratios: dict[int, float] = {}
    for run in runs:
        rr = _us_per_cycle(df[(df["run"] == run) & ~df["is_op"].astype(bool)])
        if rr is not None:
            ratios[run] = rr
    fallback = sorted(ratios.values())[len(ratios) // 2] if ratios else 1e-3  # 1 cycle drawn as 1 ns
    for run in runs:
        rows = ops_df[ops_df["run"] == run]
        t = 0.0
        t_first = None
        for i, r in enumerate(rows.itertuples(index=False)):
            v = float(r.value) if r.value is not None and not math.isnan(float(r.value)) else 0.0
            if unit == "cycles":
                dur = v
            elif r.unit == "cycles":
                dur = v * ratios.get(run, fallback)
            elif r.unit == "ms":
                dur = v * 1e3
            else:
                dur = v
            ts = r.timestamp
            if unit == "us" and ts is not None and not math.isnan(float(ts)) and (float(ts) > 0 or t_first is not None):
                t_first = float(ts) if t_first is None else t_first
                start = float(ts) - t_first
            else:
                start = t
            t = max(t, start + max(dur, 0.0))
            ops.append(TimelineOp(
                name=str(_text(r.qnn_name) or _text(r.identifier) or "?"), op_id=_int(r.op_id),
                backend=_text(r.backend) or "QNN", graph=_text(r.graph), run=run, index=i, start=start,
                dur=max(dur, 0.0), raw=v, unit=str(r.unit), tensors=list(r.j_tensors), onnx_nodes=list(r.j_nodes),
            ))
        totals[run] = t
    parts = {k[1] for k in dump.record_keys()}
    inferred = False
    if part is None and len(parts) > 1 and len(runs) != len(dump.record_keys()):  # not one run per record
        part = _infer_part(dump, [o.tensors for o in ops])
        inferred = part is not None
    elif part is None and len(parts) == 1:
        part = next(iter(parts))
    recs = sorted(((k, rid) for k, rid in dump.record_keys().items() if part is None or k[1] == part),
                  key=lambda kv: kv[1])  # capture order (rid)
    run_records = {run: recs[k][0] for k, run in enumerate(runs)} if len(recs) == len(runs) else {}
    src = str(ops_df["source"].iloc[0])
    return Timeline(ops, runs, run_records, unit, join, src, (dump.backend_info or {}).get("emulated"), totals,
                    ratios, part, table, inferred)
