"""A capture held in memory: the record sink a runner writes into when nobody reads the dump afterwards.

A tune trial (:meth:`ivq_debug.tune.verify.Tuner.trial`) compares each evaluation sample with the cached
reference as soon as it ran and keeps only the metrics: it captures into a :class:`MemorySink`, one record at a
time, and hands :meth:`MemorySink.take` (a :class:`MemoryDump`, a read-only :class:`~ivq_debug.dump.reader.Dump`
over the arrays) to the comparator. Nothing is compressed, hashed, written or read back; what the comparator
reads is what the HDF5 writer would have stored (the same values and dtypes, encodings and tables through the
same JSON the manifest uses, blocks cut the same way by :meth:`MemoryDump.iter_flat`), so every metric is the
same to the bit as a capture to a file compared afterwards (``tests/tune/test_trial.py``). Raw quantized
integers and per-tensor statistics are not kept (the comparison reads neither).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.dump import format as fmt
from ivq_debug.dump.contract import INPUTS_META, input_fact
from ivq_debug.dump.reader import Dump, DumpSize, Entry, block_slices, logical
from ivq_debug.dump.stats import STAT_FIELDS, sample_indices
from ivq_debug.dump.writer import _ENTRY_FIELDS, RecordBook, table_payload, to_numpy
from ivq_debug.errors import UsageError


def _as_json(value: Any) -> Any:
    """``value`` as a dump reader gets it back (the manifest's and the tables' JSON)."""
    return json.loads(fmt.to_json(value))


class MemorySink(RecordBook):
    """A :class:`~ivq_debug.capture.base.RecordSink` keeping the records it is given in memory.

    Args:
        backend: the runner's backend name (what a dump would record).
        backend_info: the runner's info.
        path: a name for messages (no file is made).
    """

    def __init__(self, backend: str, backend_info: dict[str, Any] | None = None, *,
                 path: str | Path = "<memory>") -> None:
        self.path = Path(path)
        self.backend = backend
        self.backend_info = dict(backend_info or {})
        self.meta: dict[str, Any] = {}
        self.tables: dict[str, Any] = {}
        self._book_init()
        self._rows: list[Entry] = []
        self._arrays: dict[tuple[str, str, str], np.ndarray] = {}
        #: id(encoding given) -> (that object, its JSON form): a runner hands the same encoding object for a tensor
        #: in every record; its JSON round trip was 2.1 of a 26 s PP-OCRv4 trial (4,488 tensors)
        self._encodings: dict[int, tuple[Any, Any]] = {}

    # ---------------------------------------------------------------- the RecordSink protocol
    def begin_record(self, sample: int = 0, part: str = "model", step: int = 0, **meta: Any) -> str:
        """Start a record (as :meth:`~ivq_debug.dump.writer.DumpWriter.begin_record`)."""
        return self._open_record(sample, part, step, dict(meta))["rid"]

    def add_input(self, name: str, value: Any, *, role: str | None = None, reason: str | None = None,
                  **kw: Any) -> None:
        """One model input of the open record and its contract fact."""
        arr, dtype_name = self._add("input", name, value, **kw)
        rec = self._record()
        rec["meta"].setdefault(INPUTS_META, {})[name] = input_fact(name, arr, dtype_name, role, reason)

    def add_tensor(self, name: str, value: Any, **facts: Any) -> None:
        """One captured tensor of the open record (the keywords of ``DumpWriter.add_tensor``)."""
        self._add("tensor", name, value, **facts)

    def update_record_meta(self, **meta: Any) -> None:
        """Add keys to the open record's ``meta``."""
        self._record()["meta"].update(meta)

    def update_backend_info(self, **info: Any) -> None:
        """Merge keys into the backend info."""
        self.backend_info.update(_as_json(info))

    def set_meta(self, name: str, value: Any) -> None:
        """A ``/meta`` value."""
        self.meta[name] = _as_json(value)

    def add_table(self, name: str, table: Any) -> None:
        """A small table (replacing one of that name), kept as the dump would store it."""
        self.tables[name] = _as_json(table_payload(table))

    def mark_incomplete(self, reason: str) -> None:
        """(A dump would record it; a comparison in memory has no reader to tell.)"""

    def _record(self) -> dict[str, Any]:
        if self._cur is None:
            self.begin_record()
        assert self._cur is not None
        return self._cur

    def _add(self, kind: str, name: str, value: Any, **fields: Any) -> tuple[np.ndarray, str]:
        unknown = set(fields) - set(_ENTRY_FIELDS)
        if unknown:
            raise TypeError(f"unknown entry field(s) {sorted(unknown)}")
        rec = self._record()
        rid = rec["rid"]
        self._take_name(rid, kind, name)
        arr, dtype_name = to_numpy(value)
        order = self._next_order(rid, fields.get("order"))
        enc = fields.get("encoding")
        key = fmt.escape_name(name)
        self._arrays[(rid, kind, key)] = arr
        self._rows.append(Entry(
            rid=rid, sample=rec["sample"], part=rec["part"], step=rec["step"], kind=kind, name=name, key=key,
            order=int(order), op_type=fields.get("op_type"), scope=fields.get("scope"), shape=tuple(arr.shape),
            dtype=dtype_name, layout=fields.get("layout"), stored="full", nbytes=int(arr.nbytes),
            encoding=None if enc is None else self._encoding(enc), has_raw=False, stats=dict.fromkeys(STAT_FIELDS),
            qnn_name=fields.get("qnn_name"), source_file=fields.get("source_file")))
        return arr, dtype_name

    def _encoding(self, enc: Any) -> Any:
        """``enc`` as a dump reader gets it back, once per encoding object (kept alive here, so its id is its own;
        an equal copy is what the manifest's JSON gives anyway)."""
        got = self._encodings.get(id(enc))
        if got is None or got[0] is not enc:
            got = (enc, _as_json(enc))
            self._encodings[id(enc)] = got
        return got[1]

    # ---------------------------------------------------------------- handing over
    def record(self, runner: Any, feeds: Any, sample: int = 0, part: str = "model", step: int = 0) -> MemoryDump:
        """One run of ``runner`` on ``feeds`` as record (``sample``, ``part``, ``step``), taken (:meth:`take`)."""
        self.begin_record(sample=sample, part=part, step=step)
        runner.run(feeds, self)
        return self.take()

    def take(self) -> MemoryDump:
        """The records so far as a :class:`MemoryDump`; the sink starts empty again (the tables, ``/meta`` and
        backend info stay: a runner writes them once per capture)."""
        d = MemoryDump(self)
        self._rows, self._arrays = [], {}
        self._book_init()
        return d


class MemoryDump(Dump):
    """A :class:`~ivq_debug.dump.reader.Dump` over arrays in memory (:meth:`MemorySink.take`); :meth:`close`
    drops the arrays (the listing stays)."""

    def __init__(self, sink: MemorySink) -> None:
        self.path = sink.path
        self.format_version = fmt.FORMAT_VERSION_VALUES
        self.backend = sink.backend
        self.backend_info = dict(sink.backend_info)
        self.model: dict[str, Any] = {}
        self.created = self.tool_version = self.command = ""
        self.complete, self.incomplete_reasons = True, []
        self.summary_only, self._summary_samples = False, 4096
        self._content_sha256 = None
        self._records = sorted(sink._records, key=lambda r: r["rid"])
        self._entries = list(sink._rows)
        self._arrays = sink._arrays
        self._tables = dict(sink.tables)
        self._meta = dict(sink.meta)
        self._columns, self._rows = list(fmt.MANIFEST_COLUMNS), []
        self._manifest = None
        self._sorted = None
        self._by_name = None
        self._fd = None

    @property
    def attrs(self) -> dict[str, Any]:
        """What a file's root attributes would say."""
        return {"format": fmt.FORMAT, "format_version": self.format_version, "backend": self.backend,
                "finalized": True, "summary_only": False}

    @property
    def entries(self) -> list[Entry]:
        """Every entry (inputs and tensors)."""
        return list(self._entries)

    def size(self) -> DumpSize:
        """The bytes of values held (no file: ``file`` is 0)."""
        n = {"tensor": 0, "input": 0}
        for e in self._entries:
            n[e.kind] += int(e.nbytes)
        return DumpSize(0, n["tensor"], n["input"], 0, 0)

    @property
    def manifest(self):
        """The listing as a pandas DataFrame (statistics are not kept: None)."""
        if self._manifest is None:
            import pandas as pd

            self._manifest = pd.DataFrame(
                [[e.rid, e.sample, e.part, e.step, e.kind, e.name, e.key, e.order, e.op_type, e.scope, e.shape,
                  e.dtype, e.layout, e.stored, e.nbytes, *(e.stats[k] for k in STAT_FIELDS), e.encoding, e.has_raw,
                  e.qnn_name, e.source_file, e.derived] for e in self._entries], columns=list(fmt.MANIFEST_COLUMNS))
        return self._manifest

    def _array(self, entry: Entry) -> np.ndarray:
        arr = self._arrays.get((entry.rid, entry.kind, entry.key))
        if arr is None:
            raise UsageError(f"{entry.name!r}: the values of an in-memory capture are gone once it is closed",
                             self.path)
        return arr

    def dataset(self, entry: Entry):
        """The array behind an entry (what a file's dataset would hold)."""
        return self._array(entry)

    def stored_dtype(self, entry: Entry) -> np.dtype:
        """The stored dtype."""
        return self._array(entry).dtype

    def read(self, name: str | Entry, record: Any = None, kind: str = "tensor") -> np.ndarray:
        """One tensor (its logical dtype)."""
        e = name if isinstance(name, Entry) else self.entry(name, record, kind)
        return logical(self._array(e), e.dtype)

    def read_sample(self, entry: Entry) -> np.ndarray:
        """The strided sample a summary-only capture would keep."""
        return logical(self._array(entry).reshape(-1)[sample_indices(entry.size, self._summary_samples)],
                       entry.dtype)

    def read_raw(self, entry: Entry) -> np.ndarray | None:
        """Raw integers are not kept in memory."""
        return None

    def raw_layout(self, entry: Entry) -> None:
        """No file offsets."""
        return None

    def iter_blocks(self, entry: Entry, block_bytes: int) -> Iterator[np.ndarray]:
        """The tensor in blocks of about ``block_bytes`` (C order), as a file's reader cuts them."""
        arr = self._array(entry)
        for sl in block_slices(entry.shape, arr.dtype.itemsize, block_bytes):
            yield logical(np.asarray(arr[sl]), entry.dtype)

    def iter_flat(self, entry: Entry, block_elems: int, reuse: bool = False) -> Iterator[np.ndarray]:
        """The values in C order, ``block_elems`` at a time (the blocks a file's reader yields)."""
        flat = self._array(entry).reshape(-1)
        n = math.prod(entry.shape)
        for start in range(0, n, max(1, block_elems)):
            yield logical(flat[start:start + block_elems], entry.dtype)

    def table(self, name: str):
        """A table as a pandas DataFrame."""
        import pandas as pd

        if name not in self._tables:
            raise UsageError(f"dump has no table {name!r}", self.path)
        p = self._tables[name]
        return pd.DataFrame(p["rows"], columns=p["columns"])

    def table_names(self) -> list[str]:
        """The tables' names."""
        return list(self._tables)

    def meta(self, name: str, default: Any = None) -> Any:
        """A ``/meta`` value."""
        return self._meta.get(name, default)

    def close(self) -> None:
        """Drop the arrays."""
        self._arrays = {}

    def __repr__(self) -> str:
        return f"MemoryDump({self.backend}, {len(self._records)} record(s), {len(self._entries)} entries)"
