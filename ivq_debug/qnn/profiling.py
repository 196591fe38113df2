"""Profiling files → one normalized per-event table, and the join from profiled QNN ops to ONNX tensors.

Readers (each returns a DataFrame with :data:`COLUMNS`):

* :func:`read_qnn_ep_csv` — ONNX Runtime QNN EP ``profiling_file_path`` CSV (``basic`` / ``detailed``,
  with or without the ``ONNX Source Ops`` column of ``enable_framework_op_trace``; files appended by
  several runs or sessions);
* :func:`read_profile_viewer_text` — ``qnn-profile-viewer --input_log`` text (parsed defensively);
* :func:`read_chrome_trace` — Chrome-trace JSON (``traceEvents`` objects, qnn-profile-viewer optrace
  output, and ONNX Runtime's own ``enable_profiling`` trace, where a QNN partition is one node event and
  CPU nodes are separate events).

:func:`read_profile` picks the reader from the file's content. :func:`join_tensors` maps each profiled
op to the ONNX nodes of its QDQ node unit (the ``ONNX Source Ops``) and to the tensors those nodes
produce, named both as ONNX tensors and as golden-dump keys.

Emulated-HTP cycle counts are host-side and vary run to run: use them for mapping and relative hot spots.

Every file is untrusted: it must be a regular UTF-8 text file without NUL bytes (a FIFO, a device or a
binary log is refused before anything blocks or allocates); a CSV must end with a newline (QNN EP writes
whole rows: a cut last row means a cut file) and its fields fit the ``csv`` module's limit; times and
durations must be finite numbers (durations not negative). Failures are one-line ``InputError`` s naming
the file and the line.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ivq_debug.errors import InputError, UsageError
from ivq_debug.inputfiles import open_input, read_input_text
from ivq_debug.jsonio import parse_json
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.onnxgraph.sites import list_sites
from ivq_debug.qnn.names import NameMap

#: the normalized table's columns, in order
COLUMNS = (
    "source",  # qnn_ep_csv | profile_viewer | chrome_trace | ort_trace
    "graph",  # QNN graph / partition name when known
    "session",  # session index within an appended file (0-based)
    "run",  # execution index (0-based); -1 for init / finalize / de-init rows and aggregated statistics
    "exec_block",  # QNN EP CSV: index of the graph execution block (several per run with several graphs)
    "phase",  # init | compose | finalize | execute | deinit | load | other
    "stat",  # qnn-profile-viewer statistic: average | min | max | overall; None otherwise
    "message",  # event kind (CSV "Message", chrome "cat")
    "event_level",  # ROOT | SUB-EVENT | None
    "identifier",  # the event's full identifier / name
    "qnn_name",  # op name for per-op events (the part before ":OpId_N"), else None
    "op_id",  # N of "OpId_N", else None
    "value",  # float
    "unit",  # cycles | us | count | bytes | inf/sec | ...
    "is_op",  # True for per-op events
    "onnx_source_ops",  # list of ONNX node names of the op's QDQ node unit
    "backend",  # QNN | CPU | other provider name
    "timestamp",  # start time (us) when the source has one, else None
)

#: the dump table of a profile (``/tables/profiling``); a capture of several parts (a VLM's vision, prefill and
#: decode) stores one table per part, ``profiling.<part>`` (:func:`profiling_table`)
PROFILING_TABLE = "profiling"


def profiling_table(part: str | None) -> str:
    """The dump table holding the profile of one part's runs (``profiling`` for a whole model)."""
    return PROFILING_TABLE if part in (None, "", "model") else f"{PROFILING_TABLE}.{part}"


def profiling_tables(names: Iterable[str]) -> dict[str, str | None]:
    """Of a dump's table names, the profiles: table name → the part it profiles (``None``: not said, a table
    written by a single-part capture or before per-part tables existed)."""
    out: dict[str, str | None] = {}
    for n in names:
        if n == PROFILING_TABLE:
            out[n] = None
        elif n.startswith(PROFILING_TABLE + ".") and len(n) > len(PROFILING_TABLE) + 1:
            out[n] = n[len(PROFILING_TABLE) + 1:]
    return out


_CSV_HEADER = ("Msg Timestamp", "Message", "Time", "Unit of Measurement", "Timing Source", "Event Level",
               "Event Identifier")
_SOURCE_OPS = "ONNX Source Ops"
_UNITS = {"US": "us", "CYCLES": "cycles", "COUNT": "count", "BYTES": "bytes", "OBJECT": "object",
          "BACKEND": "backend", "MS": "ms", "MICROSEC": "us"}
_OP_RE = re.compile(r"^(?P<name>.*)OpId_(?P<id>\d+)(?:\s*\((?P<unit>[^)]*)\))?\s*$")
_PHASE_MSG = {"INIT": "init", "FINALIZE": "finalize", "DE-INIT": "deinit", "DEINIT": "deinit"}


def _frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    df = pd.DataFrame(rows, columns=list(COLUMNS))
    df["run"] = df["run"].astype("int64")
    df["session"] = df["session"].astype("int64")
    df["value"] = df["value"].astype("float64")
    for c in ("op_id", "exec_block"):  # ints or None (JSON-clean for DumpWriter.add_table)
        df[c] = pd.Series([None if v is None or v != v else int(v) for v in df[c]], index=df.index, dtype=object)
    df["is_op"] = df["is_op"].astype(bool)
    for c in ("source", "graph", "phase", "stat", "message", "event_level", "identifier", "qnn_name", "unit", "backend"):
        df[c] = df[c].astype(object).where(df[c].notna(), None)
    return df


def split_op_identifier(identifier: str) -> tuple[str | None, int | None]:
    """``"ln1:OpId_182 (cycles)"`` → ``("ln1", 182)``; ``"Input OpId_2 (cycles)"`` → ``("Input", 2)``."""
    m = _OP_RE.match(identifier.strip())
    if not m:
        return None, None
    name = m.group("name")
    if name.endswith(":"):
        name = name[:-1]
    return name.strip(), int(m.group("id"))


def _row(**kw: Any) -> dict[str, Any]:
    r = dict.fromkeys(COLUMNS)
    r.update(session=0, run=-1, exec_block=None, is_op=False, onnx_source_ops=[])
    r.update(kw)
    return r


# ============================================================================ ORT QNN EP CSV
def read_qnn_ep_csv(
    path: str | os.PathLike,
    graph: str | Sequence[str] | None = None,
    graphs_per_run: int | None = None,
) -> Any:
    """Parse the QNN EP profiling CSV (ORT ``profiling_level`` + ``profiling_file_path``).

    Rows are grouped into *execution blocks* (one QNN graph execution: a span in which each ROOT event
    appears once). The CSV does not name graphs: when a session holds several QNN partitions, each
    inference writes one block per partition, in partition order, so pass ``graphs_per_run`` (or a list
    of graph names as ``graph``) to fold blocks into runs. A ``FINALIZE`` / ``INIT`` row after executions
    starts a new session (the file is appended to; the header is written once).

    Args:
        path: the CSV.
        graph: the graph name of every row, or one name per partition (sets ``graphs_per_run``).
        graphs_per_run: QNN graph executions per inference (default 1, or ``len(graph)``).

    Raises:
        InputError: missing / empty file, wrong header, a row with too few fields (truncated file), a
            non-numeric ``Time``.
    """
    p = Path(path)
    text = _read_text(p)
    lines = text.splitlines()
    if not lines:
        raise InputError("empty profiling CSV", p)
    try:
        df = _parse_qnn_ep_csv(text, p, graph, graphs_per_run)
    except csv.Error as e:
        raise InputError(f"not a readable CSV ({e})", p) from None
    if not text.endswith(("\n", "\r")):  # QNN EP writes whole rows: a cut last row means a cut file
        raise InputError(f"line {len(lines)} is cut (no end of line): truncated file?", p)
    return df


def _parse_qnn_ep_csv(text: str, p: Path, graph: str | Sequence[str] | None, graphs_per_run: int | None) -> Any:
    reader = csv.reader(io.StringIO(text))
    header = next(reader)
    if tuple(h.strip() for h in header[: len(_CSV_HEADER)]) != _CSV_HEADER:
        raise InputError(f"not a QNN EP profiling CSV (header starts {','.join(header[:3])!r})", p)
    has_ops = len(header) > len(_CSV_HEADER) and header[len(_CSV_HEADER)].strip() == _SOURCE_OPS
    ncols = len(_CSV_HEADER) + (1 if has_ops else 0)
    names = [graph] if isinstance(graph, str) or graph is None else list(graph)
    k = graphs_per_run or (len(names) if len(names) > 1 else 1)
    if k < 1 or (len(names) > 1 and len(names) != k):
        raise UsageError(f"graphs_per_run={graphs_per_run} does not match {len(names)} graph names")
    rows: list[dict[str, Any]] = []
    run, session, phase = 0, 0, "execute"
    seen_roots: set[str] = set()
    run_has_rows = executed_in_session = force_new_run = False
    for lineno, rec in enumerate(reader, start=2):
        if not rec or all(not c.strip() for c in rec):
            continue
        if tuple(c.strip() for c in rec[: len(_CSV_HEADER)]) == _CSV_HEADER:
            continue  # a repeated header (another writer appended with a header)
        if len(rec) < ncols:
            raise InputError(f"line {lineno} has {len(rec)} fields, expected {ncols} (truncated file?)", p)
        ts, msg, tval, unit, _src, level = (c.strip() for c in rec[:6])
        if has_ops:
            ident, ops_cell = ",".join(rec[6:-1]).strip(), rec[-1].strip()
        else:
            ident, ops_cell = ",".join(rec[6:]).strip(), ""
        # QNN EP writes identifiers unquoted: more fields than the header are a node name holding commas, and
        # then the rejoined identifier is still "<name>:OpId_<n> (cycles)"; anything else is a foreign row
        if len(rec) > ncols and (msg.strip().upper() != "NODE" or split_op_identifier(ident)[1] is None):
            raise InputError(f"line {lineno} has {len(rec)} fields, the header {ncols} (not a QNN EP row)", p)
        try:
            value = float(tval)
        except ValueError:
            raise InputError(f"line {lineno}: Time {tval[:40]!r} is not a number (truncated or corrupt file?)",
                             p) from None
        if not math.isfinite(value):
            raise InputError(f"line {lineno}: Time {tval[:40]!r} is not a finite number", p)
        msg_u, lvl = msg.upper(), level.upper()
        # a session loaded from an EPContext model writes "BACKEND ... Accelerator (load binary) time" before its
        # "INIT ... QNN (load binary) time": both belong to the init phase
        load = lvl == "ROOT" and "(load binary)" in ident.lower()
        if (msg_u in _PHASE_MSG or load) and lvl == "ROOT":
            if (msg_u in ("INIT", "FINALIZE") or load) and executed_in_session:
                session += 1
                executed_in_session = False
            force_new_run = True
            phase = _PHASE_MSG.get(msg_u, "init")
        elif lvl == "SUB-EVENT" and phase != "execute" and msg_u != "NODE":
            pass  # a sub-stage of the current init / finalize / de-init
        else:
            if lvl == "ROOT" or phase != "execute":
                # a run is a span in which every ROOT event appears once
                if force_new_run or ident in seen_roots:
                    if run_has_rows:
                        run += 1
                    seen_roots, force_new_run, run_has_rows = set(), False, False
                seen_roots.add(ident)
            phase = "execute"
            executed_in_session = run_has_rows = True
        name, op_id = split_op_identifier(ident) if msg_u == "NODE" else (None, None)
        ex = phase == "execute"
        rows.append(_row(
            source="qnn_ep_csv", graph=(names[run % k] if len(names) > 1 else names[0]) if ex else None,
            session=session, run=run // k if ex else -1, exec_block=run if ex else None,
            phase=phase, message=msg, event_level=level or None, identifier=ident,
            qnn_name=name, op_id=op_id, value=value, unit=_UNITS.get(unit.upper(), unit.lower()),
            is_op=msg_u == "NODE" and name is not None,
            onnx_source_ops=[x for x in ops_cell.split(";") if x] if ops_cell else [],
            backend="QNN", timestamp=_num_or_none(ts),
        ))
    if not rows:
        raise InputError("profiling CSV has a header but no rows", p)
    return _frame(rows)


def _num_or_none(s: str) -> float | None:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def _read_text(p: Path) -> str:
    """A profiling file's text (a regular UTF-8 file without NUL bytes)."""
    try:
        return read_input_text(p, "profiling file")
    except InputError as e:
        if "UTF-8" in e.message or "NUL" in e.message:
            raise InputError(f"{e.message} (binary profiling logs need qnn-profile-viewer first)", p) from None
        raise


# ============================================================================ qnn-profile-viewer text
_VIEWER_VALUE = re.compile(
    r"^\s*(?P<ident>.+?):\s+(?P<val>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(?P<unit>us|ms|cycles|count|bytes|inf/sec)\s*$"
)
_VIEWER_GRAPH = re.compile(r"^\s*Graph\s+(?P<idx>\d+)\s+\((?P<name>.*)\):\s*$")
_VIEWER_SECTION = re.compile(r"^\s*(?P<title>[A-Za-z][^:]*?)\s*:\s*$")
_SECTION_PHASE = (
    ("de-init", "deinit"), ("deinit", "deinit"), ("init", "init"), ("compose", "compose"),
    ("finalize", "finalize"), ("execute", "execute"), ("load", "load"),
)


def read_profile_viewer_text(path: str | os.PathLike) -> Any:
    """Parse ``qnn-profile-viewer --input_log …`` text output.

    Sections are tracked from header lines (``Init Stats:``, ``Execute Stats (Average):``,
    ``Graph 0 (model):``); dashed rules and unknown lines are skipped; values come from lines
    ``<identifier>: <number> <unit>``. ``Backend (<x>)`` wrappers are removed from identifiers; per-op
    lines (``<name>:OpId_<n> (cycles)``) become op rows.

    Raises:
        InputError: no value lines at all, or a cut last line.
    """
    p = Path(path)
    text = _read_text(p)
    rows: list[dict[str, Any]] = []
    phase, stat, graph = "other", None, None
    last_nonblank = ""
    for line in text.splitlines():
        s = line.rstrip()
        if not s.strip():
            continue
        last_nonblank = s
        if set(s.strip()) <= {"-", "="}:
            continue
        if s.strip().startswith("Input Log File Location:"):
            continue
        mg = _VIEWER_GRAPH.match(s)
        if mg:
            graph = mg.group("name")
            continue
        mv = _VIEWER_VALUE.match(s)
        if mv:
            ident = mv.group("ident").strip()
            origin = None
            mb = re.match(r"^(Backend|NetRun)\s*\((.*)\)$", ident)
            if mb:
                origin, ident = mb.group(1), mb.group(2).strip()
            elif ident.startswith(("NetRun", "Backend")):
                origin = ident.split()[0]
            name, op_id = split_op_identifier(ident)
            rows.append(_row(
                source="profile_viewer", graph=graph, run=-1, phase=phase, stat=stat,
                message=origin, identifier=ident, qnn_name=name, op_id=op_id,
                value=float(mv.group("val")), unit=mv.group("unit"), is_op=name is not None,
                backend="QNN",
            ))
            continue
        ms = _VIEWER_SECTION.match(s)
        if ms and "stats" in ms.group("title").lower():
            title = ms.group("title").lower()
            graph = None
            phase = next((ph for key, ph in _SECTION_PHASE if key in title), "other")
            m = re.search(r"\((\w+)\)", title)
            stat = m.group(1) if (m and phase == "execute") else None
    if not rows:
        raise InputError("no profiling values found (not qnn-profile-viewer text output?)", p)
    if not text.endswith("\n") and not _VIEWER_VALUE.match(last_nonblank) and not _VIEWER_SECTION.match(last_nonblank):
        raise InputError(f"last line is cut: {last_nonblank.strip()[:60]!r} (truncated file)", p)
    return _frame(rows)


# ============================================================================ chrome trace JSON
def _backend_of(provider: str | None) -> str:
    if not provider:
        return "QNN"
    if provider.startswith("QNN"):
        return "QNN"
    if provider.startswith("CPU"):
        return "CPU"
    return provider.replace("ExecutionProvider", "")


def read_chrome_trace(path: str | os.PathLike) -> Any:
    """Parse Chrome-trace JSON: a ``{"traceEvents": [...]}`` object or a bare event list.

    ``X`` events give durations; ``B``/``E`` pairs are matched per (pid, tid, name). ONNX Runtime's
    ``enable_profiling`` file is recognised by its ``Node``/``Session`` categories: node events
    (``<node>_kernel_time``) become op rows, with ``backend`` from ``args.provider`` and the run taken
    from the enclosing ``model_run`` event; a QNN partition is a single op row named after the QNN graph.

    Raises:
        InputError: missing file, bad JSON (including a truncated file), no events.
    """
    p = Path(path)
    try:
        d = parse_json(_read_text(p), p, "Chrome trace")
    except InputError as e:
        if "bad JSON" in e.message:
            raise InputError(f"{e.message} (truncated file?)", p) from None
        raise
    events = d.get("traceEvents") if isinstance(d, dict) else d
    if not isinstance(events, list):
        raise InputError("not a Chrome trace (no traceEvents list)", p)
    events = [e for e in events if isinstance(e, dict)]
    for i, e in enumerate(events):
        for k in ("ts", "dur"):
            v = e.get(k)
            if _is_num(v) and not math.isfinite(v):
                raise InputError(f"event {i}: {k} {v!r} is not a finite number", p)
        if e.get("ph") == "X" and _is_num(e.get("dur")) and e["dur"] < 0:
            raise InputError(f"event {i} ({str(e.get('name'))[:60]!r}): negative duration {e['dur']}", p)
    spans = _spans(events)
    if not spans:
        raise InputError("Chrome trace holds no duration events", p)
    is_ort = any(e.get("cat") == "Node" for e in spans) and any(e.get("cat") == "Session" for e in spans)
    runs = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in spans
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    rows = []
    for e in spans:
        args = _args(e)
        ts, dur = float(e["ts"]), float(e["dur"])
        name = str(e.get("name", ""))
        cat = e.get("cat")
        if is_ort:
            run = next((i for i, (a, b) in enumerate(runs) if a <= ts <= b), -1)
            if cat == "Node":
                if not name.endswith("_kernel_time"):
                    continue  # fence_before / fence_after
                node = name[: -len("_kernel_time")]
                backend = _backend_of(args.get("provider"))
                rows.append(_row(
                    source="ort_trace", graph=node if backend == "QNN" else None, run=run, phase="execute",
                    message=cat, identifier=name, qnn_name=node, value=dur, unit="us", is_op=True,
                    onnx_source_ops=[] if backend == "QNN" else [node], backend=backend, timestamp=ts,
                ))
            else:
                phase = "execute" if run >= 0 else "init"
                rows.append(_row(
                    source="ort_trace", run=run if phase == "execute" else -1, phase=phase, message=cat,
                    identifier=name, value=dur, unit="us", backend=None, timestamp=ts,
                ))
            continue
        qname, op_id = split_op_identifier(name)
        src_ops = args.get("onnx_source_ops") or args.get("ONNX Source Ops") or []
        if isinstance(src_ops, str):
            src_ops = [s for s in src_ops.split(";") if s]
        rows.append(_row(
            source="chrome_trace", graph=args.get("graph") or args.get("graph_name"), run=-1, phase="execute",
            message=cat, identifier=name, qnn_name=qname or name, op_id=op_id if op_id is not None else args.get("op_id"),
            value=dur, unit="us", is_op=True, onnx_source_ops=list(src_ops), backend=_backend_of(args.get("provider")),
            timestamp=ts,
        ))
    return _frame(rows)


def _spans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    stacks: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        ph = e.get("ph")
        if ph == "X" and _is_num(e.get("ts")) and _is_num(e.get("dur")):
            out.append(e)
        elif ph == "B" and _is_num(e.get("ts")):
            stacks.setdefault((e.get("pid"), e.get("tid"), e.get("name")), []).append(e)
        elif ph == "E" and _is_num(e.get("ts")):
            st = stacks.get((e.get("pid"), e.get("tid"), e.get("name"))) or stacks.get((e.get("pid"), e.get("tid"), None))
            if st:
                b = st.pop()
                out.append({**b, "ph": "X", "dur": float(e["ts"]) - float(b["ts"]), "args": {**_args(b), **_args(e)}})
    return sorted(out, key=lambda e: float(e["ts"]))


def _args(e: Mapping[str, Any]) -> dict[str, Any]:
    """A trace event's ``args`` when it is an object (a list or a string there is ignored, as an absent one)."""
    a = e.get("args")
    return a if isinstance(a, dict) else {}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ============================================================================ dispatch
def read_profile(path: str | os.PathLike, graph: str | Sequence[str] | None = None,
                 graphs_per_run: int | None = None) -> Any:
    """Read any supported profiling file (detected from its first bytes); ``graph`` / ``graphs_per_run``
    apply to QNN EP CSVs (see :func:`read_qnn_ep_csv`)."""
    p = Path(path)
    with open_input(p, "profiling file") as f:
        head = f.read(256)
    h = head.lstrip()
    if h.startswith((b"{", b"[")):
        return read_chrome_trace(p)
    if head.startswith(b"Msg Timestamp"):
        return read_qnn_ep_csv(p, graph, graphs_per_run)
    if b"\x00" in head:
        raise InputError("binary profiling log: convert it with qnn-profile-viewer --input_log first", p)
    return read_profile_viewer_text(p)


# ============================================================================ join to tensors
_DUP_RE = re.compile(r"/duplicated(?:_token_\d+)?$")
_TOKEN_RE = re.compile(r"_token_\d+$")


def _resolve_node(name: str, nodes: dict[str, Any], name_map: Any) -> str | None:
    cands = [name]
    s = _DUP_RE.sub("", name)
    cands.append(s)
    cands.append(_TOKEN_RE.sub("", s))
    for c in cands:
        if c in nodes:
            return c
    hit = name_map.lookup_node(name) if name_map is not None else None
    return hit


#: the columns :func:`join_tensors` adds (a stored table that has them was joined at capture time)
JOIN_COLUMNS = ("onnx_nodes", "unresolved_ops", "tensors", "dump_tensors")


def join_tensors(df: Any, model: Any) -> Any:
    """Add the ONNX side to per-op rows of a normalized profiling table.

    For each op row, the ``ONNX Source Ops`` (or, without them, the op's own name) are resolved to nodes
    of ``model`` (QNN EP suffixes ``/duplicated…`` and ``_token_N`` are stripped; QNN-sanitized names
    are resolved through :class:`~ivq_debug.qnn.names.NameMap`). The tensors the unit *produces* are
    its nodes' outputs not consumed inside the unit (the outputs of its weight / input
    ``DequantizeLinear`` nodes are left out unless the unit has nothing else).

    Added columns: ``onnx_nodes`` (resolved), ``unresolved_ops``, ``tensors`` (ONNX tensor names) and
    ``dump_tensors`` (one to one with ``tensors``: the names golden dumps key them by: a QDQ ``QuantizeLinear`` output under
    its float name, see :func:`ivq_debug.onnxgraph.sites.list_sites`).

    Args:
        df: a table from one of the readers.
        model: the ONNX model that was profiled (path or ``ModelProto``).
    """

    return TensorJoin(model)(df)


class TensorJoin:
    """:func:`join_tensors` for one model, its model side built once: a capture joins its growing profile after
    every run (46 joins in ``ivq demo``), and the rows of one op repeat in every run, so each distinct
    ``(source ops, QNN name)`` is resolved once."""

    def __init__(self, model: Any) -> None:
        m = load_model(model)
        self.nodes = {n.name: n for n in m.graph.node if n.name}
        self.inits = {i.name for i in m.graph.initializer}
        self.name_map = NameMap.from_onnx(m)
        try:
            self.dump_key = {s.output: s.name for s in list_sites(m, "auto")}
        except Exception:  # a model list_sites cannot walk: keep ONNX names
            self.dump_key = {}
        self._memo: dict[tuple[tuple[str, ...], str | None], tuple[list[str], list[str], list[str], list[str]]] = {}

    def _op(self, ops: tuple[str, ...], qname: str | None) -> tuple[list[str], list[str], list[str], list[str]]:
        hit = self._memo.get((ops, qname))
        if hit is None:
            names = list(ops) if ops else ([qname] if qname else [])
            resolved: list[str] = []
            unresolved: list[str] = []
            for n in names:
                r = _resolve_node(n, self.nodes, self.name_map)
                if r is None:
                    unresolved.append(n)
                elif r not in resolved:
                    resolved.append(r)
            tensors = _produced(resolved, self.nodes, self.inits)
            hit = self._memo[(ops, qname)] = (resolved, unresolved, tensors,
                                              [self.dump_key.get(t, t) for t in tensors])
        return hit

    def __call__(self, df: Any) -> Any:
        """``df`` with the columns of :data:`JOIN_COLUMNS` added (each row's lists its own copies)."""
        out = df.copy()
        cols: tuple[list[Any], ...] = ([], [], [], [])
        for ops, is_op, qname in zip(out["onnx_source_ops"], out["is_op"], out["qnn_name"], strict=True):
            row = self._op(tuple(ops or ()), qname) if is_op else ([], [], [], [])
            for col, v in zip(cols, row, strict=True):
                col.append(list(v))
        for name, col in zip(JOIN_COLUMNS, cols, strict=True):
            out[name] = col
        return out


def _produced(unit: list[str], nodes: dict[str, Any], inits: set[str]) -> list[str]:
    unit_nodes = [nodes[n] for n in unit]
    consumed = {i for n in unit_nodes for i in n.input}
    main, dq = [], []
    for n in unit_nodes:
        for o in n.output:
            if not o or o in consumed:
                continue
            if n.op_type == "DequantizeLinear":
                if n.input and n.input[0] not in inits:
                    dq.append(o)
            else:
                main.append(o)
    return list(dict.fromkeys(main or dq))


def tensor_timings(df: Any, model: Any, runs: Iterable[int] | None = None) -> Any:
    """One row per (profiled op row, produced tensor): ``dump_tensor``, ``tensor``, ``qnn_name``,
    ``op_id``, ``run``, ``value``, ``unit``, ``backend``. Ops that produce no resolvable tensor are left out.
    """
    import pandas as pd

    j = join_tensors(df, model)
    j = j[j["is_op"]]
    if runs is not None:
        j = j[j["run"].isin(list(runs))]
    rows = []
    for r in j.itertuples(index=False):
        for t, dk in zip(r.tensors, r.dump_tensors, strict=True):
            rows.append({"dump_tensor": dk, "tensor": t, "qnn_name": r.qnn_name, "op_id": r.op_id, "run": r.run,
                         "value": r.value, "unit": r.unit, "backend": r.backend, "source": r.source})
    return pd.DataFrame(rows, columns=["dump_tensor", "tensor", "qnn_name", "op_id", "run", "value", "unit",
                                       "backend", "source"])

