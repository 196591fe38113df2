"""The layer view behind the report: one row per aligned tensor pair, joined with precision, the other
comparisons, the introduced-vs-inherited replay and the profiled latency.

Rows keep the primary comparison's order and index (``row`` = position in ``Comparison.table``), so
``#L<row>`` anchors are stable across every section of a report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ivq_debug.jsonio import as_float

RecordKey = tuple[int, str, int]

_SHORT_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64",
                 "int32": "i32", "int8": "i8", "uint8": "u8", "int16": "i16", "uint16": "u16", "bool": "bool"}


def precision_label(dtype: str | None, encoding: dict[str, Any] | None) -> str:
    """Short precision text: ``u8`` / ``i16/ch`` for quantized tensors (bitwidth, per-channel), else the dtype."""
    if encoding:
        bits = encoding.get("bitwidth")
        edt = str(encoding.get("dtype") or "")
        sign = "i" if edt.startswith("int") else "u"
        per_ch = encoding.get("axis") is not None or isinstance(encoding.get("scale"), list)
        if bits:
            return f"{sign}{int(bits)}{'/ch' if per_ch else ''}"
    if not dtype:
        return "–"
    return _SHORT_DTYPES.get(str(dtype), str(dtype))


@dataclass
class Labeled:
    """A comparison with its display label."""

    label: str
    cmp: Any


@dataclass
class LayerView:
    """Rows of the primary comparison plus joined columns (see the module docstring).

    Attributes:
        rows: one dict per aligned pair, in execution order, with the ``Comparison.table`` columns and
            ``row``, ``record``, ``precision``, ``ref_precision``, ``encoding``, ``extras`` (label → dict of
            ``sqnr_db``/``status``/``passed``), ``intro_sqnr_db``, ``inherited_share``, ``latency_us``,
            ``ops`` (profiled op names).
        extra_labels: labels of the other comparisons, in the given order.
        has_replay / has_latency: whether those columns carry data.
    """

    rows: list[dict[str, Any]]
    extra_labels: list[str] = field(default_factory=list)
    has_replay: bool = False
    has_latency: bool = False
    latency_note: str = ""
    latency_unit: str = ""

    _index: dict[tuple[RecordKey, str], int] | None = field(default=None, repr=False)

    def index(self) -> dict[tuple[RecordKey, str], int]:
        """(record, ref name) → row, and (record, test name) → row when not already taken (cached)."""
        if self._index is None:
            out: dict[tuple[RecordKey, str], int] = {}
            for r in self.rows:
                out.setdefault((r["record"], r["ref_name"]), r["row"])
            for r in self.rows:
                out.setdefault((r["record"], r["test_name"]), r["row"])
            self._index = out
        return self._index

    def find(self, record: Any, name: str | None) -> int | None:
        """Row of a tensor in a record (``record`` as dict or tuple; ``None`` record: first match)."""
        if not name:
            return None
        if isinstance(record, dict):
            record = (int(record.get("sample", 0)), str(record.get("part")), int(record.get("step", 0)))
        if record is not None:
            return self.index().get((tuple(record), name))  # type: ignore[arg-type]
        for r in self.rows:
            if name in (r["ref_name"], r["test_name"]):
                return r["row"]
        return None


def _encodings(dump: Any) -> dict[tuple[RecordKey, str], tuple[str, dict[str, Any] | None]]:
    return {(e.record, e.name): (e.dtype, e.encoding) for e in dump.entries if e.kind == "tensor"}


def build_layers(cmp: Any, *, extras: list[Labeled] | None = None, replay: Any = None, timeline: Any = None) -> LayerView:
    """Join the primary comparison with precision, other comparisons, replay and latency (``timeline``: one
    :class:`~ivq_debug.report.timeline.Timeline` or a list, one per profiled part)."""
    t = cmp.table
    test_enc = _encodings(cmp.test)
    ref_enc = _encodings(cmp.ref)
    rows: list[dict[str, Any]] = []
    for i, rec in enumerate(t.to_dict("records")):
        key: RecordKey = (int(rec["sample"]), str(rec["part"]), int(rec["step"]))
        tdt, tenc = test_enc.get((key, rec["test_name"]), (rec.get("test_dtype"), None))
        rdt, renc = ref_enc.get((key, rec["ref_name"]), (rec.get("ref_dtype"), None))
        for k, v in list(rec.items()):
            if isinstance(v, float) and math.isnan(v):
                rec[k] = None
        rec.update(row=i, record=key, precision=precision_label(tdt, tenc), ref_precision=precision_label(rdt, renc),
                   encoding=tenc, extras={}, intro_sqnr_db=None, intro_status=None, inherited_share=None,
                   latency=None, ops=[])
        rows.append(rec)
    view = LayerView(rows)
    # ---- other comparisons: joined by (record, ref name), then (record, test name)
    for ex in extras or []:
        view.extra_labels.append(ex.label)
        by: dict[tuple[RecordKey, str], dict[str, Any]] = {}
        for r in ex.cmp.table.to_dict("records"):
            k: RecordKey = (int(r["sample"]), str(r["part"]), int(r["step"]))
            val = {"sqnr_db": as_float(r["sqnr_db"]), "max_abs": as_float(r["max_abs"]), "status": r["status"],
                   "passed": bool(r["passed"])}
            by.setdefault((k, r["ref_name"]), val)
            by.setdefault((k, r["test_name"]), val)
        for row in rows:
            hit = by.get((row["record"], row["ref_name"])) or by.get((row["record"], row["test_name"]))
            if hit is not None:
                row["extras"][ex.label] = hit
    # ---- replay (one record): introduced error per unit output
    if replay is not None and len(replay.table):
        rr = replay.record
        rkey: RecordKey = (int(rr["sample"]), str(rr["part"]), int(rr["step"]))
        by_t = {r["tensor"]: r for r in replay.table.to_dict("records")}
        for row in rows:
            if row["record"] != rkey:
                continue
            hit = by_t.get(row["ref_name"]) or by_t.get(row["test_name"])
            if hit is None:
                continue
            view.has_replay = True
            row["intro_sqnr_db"] = as_float(hit.get("intro_sqnr_db"))
            row["intro_status"] = hit.get("intro_status")
            row["inherited_share"] = as_float(hit.get("inherited_share"))
    # ---- latency: ops of the run mapped to the row's record (or, unmapped, of the first run), per part's profile
    timelines = [timeline] if timeline is not None and not isinstance(timeline, list | tuple) else list(timeline or [])
    notes = []
    for tl in timelines:
        lat = tl.tensor_latency()
        ops_of: dict[tuple[int, str], list[str]] = {}
        for o in tl.ops:
            for tn in o.tensors:
                ops_of.setdefault((o.run, tn), []).append(o.name)
        rec_run = {v: k for k, v in tl.run_records.items()}
        first = tl.runs[0] if tl.runs else None
        for row in rows:
            if tl.part is not None and row["record"][1] != tl.part:
                continue
            run = rec_run.get(row["record"], None if tl.run_records else first)
            if run is None:
                continue
            v = lat.get((run, row["test_name"]))
            if v is not None:
                view.has_latency = True
                row["latency"] = v
                row["ops"] = ops_of.get((run, row["test_name"]), [])
        view.latency_unit = tl.unit_label
        what = f"{tl.part}: " if tl.part and len(timelines) > 1 else ""
        notes.append(what + ("latency of the profiled run of the same record" if tl.run_records
                             else f"latency of profiled run {first} (runs do not map one to one to records)"))
    view.latency_note = "; ".join(notes)
    return view
