"""Lazy reader of golden dumps: the manifest is read at open, tensor data only on request."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivq_debug.dump import digest
from ivq_debug.dump import format as fmt
from ivq_debug.dump import validate as dv
from ivq_debug.dump.quant import dequantize
from ivq_debug.dump.stats import STAT_FIELDS, sample_indices
from ivq_debug.errors import InputError, UsageError
from ivq_debug.schema import check_schema

RecordKey = tuple[int, str, int]


@dataclass(frozen=True)
class Entry:
    """One tensor or input of one record, as listed in the manifest."""

    rid: str
    sample: int
    part: str
    step: int
    kind: str
    name: str
    key: str
    order: int
    op_type: str | None
    scope: str | None
    shape: tuple[int, ...]
    dtype: str
    layout: str | None
    stored: str
    nbytes: int
    encoding: dict[str, Any] | None
    has_raw: bool
    stats: dict[str, Any]
    qnn_name: str | None = None  # ingests: the device's (sanitized QNN) name of the tensor
    source_file: str | None = None  # ingests: the file it was read from
    derived: bool = False  # stored as its raw integers only: the values are their dequantization (version 2)

    @property
    def record(self) -> RecordKey:
        """The (sample, part, step) key of the record."""
        return (self.sample, self.part, self.step)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class DumpSize:
    """A dump's size: the file on disk against the bytes it holds (from the manifest; no tensor is read)."""

    file: int  #: bytes of the file on disk
    tensors: int  #: the tensors' values stored whole (their original dtype)
    inputs: int  #: the records' inputs
    raw: int  #: the raw integers of quantized tensors (beside their values, or in their place)
    summarized: int  #: tensors kept as statistics and samples only (summary-only captures), their full size
    derived: int = 0  #: tensors stored as their integers only (format version 2), their values' size

    @property
    def data(self) -> int:
        """The bytes of values the file stores whole (tensors, inputs, raw integers)."""
        return self.tensors + self.inputs + self.raw

    def to_json(self) -> dict[str, int]:
        """Every field in bytes (``data`` included)."""
        return {"file": self.file, "data": self.data, "tensors": self.tensors, "inputs": self.inputs,
                "raw": self.raw, "summarized": self.summarized, "derived": self.derived}


def _raw_itemsize(encoding: Any) -> int:
    """Bytes per raw integer of a quantized tensor (its encoding's dtype; else the bitwidth's container)."""
    try:
        return np.dtype(str(encoding.get("dtype"))).itemsize
    except (TypeError, ValueError, AttributeError):
        bits = encoding.get("bitwidth") if isinstance(encoding, dict) else None
        return 1 if not isinstance(bits, int) or bits <= 8 else 2 if bits <= 16 else 4


def _decode(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


class Dump:
    """A golden dump opened for reading. Use :func:`open_dump`.

    Attributes:
        path: the file.
        backend: capture backend name.
        backend_info: dict of library versions, providers, soc_model/htp_arch, emulated, …
        model: dict describing the captured model.
        manifest: pandas DataFrame, one row per (record, tensor), with statistics.
        records: pandas DataFrame, one row per record (rid, sample, part, step, meta).
        complete: False when the producer marked the dump partial (see ``incomplete_reasons``).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        import h5py

        self.path = dv.check_file(path)  # a regular file: HDF5 would block on a FIFO
        try:
            self._f = h5py.File(self.path, "r")
        except (OSError, RuntimeError, ValueError) as e:
            msg = str(e).split("(")[-1].rstrip(")") if "(" in str(e) else str(e)
            raise InputError(f"not a readable HDF5 dump ({msg.strip()})", self.path) from None
        try:
            self._load()
        except InputError:
            self._f.close()
            raise
        except (KeyError, ValueError, OSError, RuntimeError, TypeError, json.JSONDecodeError) as e:
            self._f.close()
            raise InputError(f"corrupt dump ({type(e).__name__}: {e})", self.path) from None

    def _load(self) -> None:
        a = self._f.attrs
        if dv._attr(a, "format", self.path) != fmt.FORMAT:
            raise InputError("not an ivq-debug dump (HDF5 file without format='ivq-dump')", self.path)
        v = dv._attr(a, "format_version", self.path)
        if not isinstance(v, int | None) or isinstance(v, bool):
            raise InputError(f"attribute 'format_version' must be an integer, got {v!r}", self.path)
        self.format_version = v or 0
        if self.format_version > fmt.FORMAT_VERSION:
            raise InputError(
                f"dump format version {self.format_version} is newer than this ivq-debug reads "
                f"({fmt.FORMAT_VERSION}); upgrade ivq-debug",
                self.path,
            )
        if dv._attr(a, "finalized", self.path) not in (True, 1) or dv.member(
                self._f, fmt.MANIFEST, "dataset", "manifest", self.path, required=False) is None:
            raise InputError("capture did not finish (the dump was never finalized)", self.path)
        r = dv.root_attributes(a, self.path)  # types checked before any use (dump/validate.py)
        self.backend = r["backend"]
        self.backend_info = r["backend_info"]
        self.model = r["model"]
        self.created = r.get("created", "")
        self.tool_version = r.get("tool_version", "")
        self.command = r.get("command", "")
        self.complete = r.get("complete", True)
        self.incomplete_reasons = r["incomplete_reasons"]
        self.summary_only = r.get("summary_only", False)
        self._summary_samples = r.get("summary_samples", 4096)
        self._content_sha256: str | None = r.get(digest.ATTR)
        recs = dv.records(self._f, self.path)
        self._columns, self._rows = dv.manifest(self._f, {x["rid"] for x in recs}, self.path)
        self._records = sorted(recs, key=lambda r: r["rid"])
        self._entries: list[Entry] | None = None
        self._manifest = None
        self._fd: int | None = None
        self._layouts: dict[tuple[str, str, str], RawLayout | None] = {}
        self._datasets: dict[tuple[str, str, str], Any] = {}
        self._ids: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._dtypes: dict[tuple[str, str, str], np.dtype] = {}
        self._groups: dict[tuple[str, str], Any] = {}
        self._dapl: Any = None
        self._sorted: dict[tuple[str, str], list[Entry]] | None = None
        self._by_name: dict[tuple[str, str], list[Entry]] | None = None

    def content_digest(self) -> str:
        """The SHA-256 of the dump's content (:mod:`ivq_debug.dump.digest`): stored by the writer, computed
        (one pass over every tensor) for a dump written without it."""
        if self._content_sha256 is None:
            self._content_sha256 = digest.compute(self.entries, lambda e: self.read_any(e)[0])
        return self._content_sha256

    # ---------------------------------------------------------------- listing
    @property
    def attrs(self) -> dict[str, Any]:
        """Root attributes (provenance), decoded."""
        return {k: _decode(v) for k, v in self._f.attrs.items()}

    @property
    def entries(self) -> list[Entry]:
        """All manifest rows as :class:`Entry` objects (inputs and tensors)."""
        if self._entries is None:
            c = {n: i for i, n in enumerate(self._columns)}
            self._entries = [
                Entry(
                    rid=r[c["rid"]], sample=r[c["sample"]], part=r[c["part"]], step=r[c["step"]],
                    kind=r[c["kind"]], name=r[c["name"]], key=r[c["key"]], order=r[c["order"]],
                    op_type=r[c["op_type"]], scope=r[c["scope"]], shape=tuple(r[c["shape"]]),
                    dtype=r[c["dtype"]], layout=r[c["layout"]], stored=r[c["stored"]], nbytes=r[c["nbytes"]],
                    encoding=r[c["encoding"]], has_raw=bool(r[c["has_raw"]]),
                    stats={k: r[c[k]] for k in STAT_FIELDS},
                    **{k: r[c[k]] for k in fmt.OPTIONAL_COLUMNS if k in c},
                )
                for r in self._rows
            ]
        return self._entries

    def tensors(self, record: Any = None, kind: str = "tensor") -> list[Entry]:
        """Entries of one kind (``tensor`` or ``input``), optionally of one record, in execution order."""
        rid = self._rid(record) if record is not None else None
        if self._sorted is None:  # sorted once: callers list one record after the other
            index: dict[tuple[str, str], list[Entry]] = {}
            for e in sorted(self.entries, key=lambda e: (e.rid, e.order)):
                index.setdefault((e.kind, ""), []).append(e)
                index.setdefault((e.kind, e.rid), []).append(e)
            self._sorted = index  # published whole: a second thread never sees a half-filled index
        return list(self._sorted.get((kind, rid or ""), []))

    def size(self) -> DumpSize:
        """The file's size on disk and the bytes of values it holds, by kind (from the manifest)."""
        n = {"tensor": 0, "input": 0, "raw": 0, "summarized": 0, "derived": 0}
        for e in self.entries:
            if e.stored != "full":
                n["summarized"] += int(e.nbytes)
                continue
            n["derived" if e.derived else e.kind] += int(e.nbytes)
            if e.has_raw:
                n["raw"] += e.size * _raw_itemsize(e.encoding)
        return DumpSize(os.stat(self.path).st_size, n["tensor"], n["input"], n["raw"], n["summarized"], n["derived"])

    @property
    def manifest(self):
        """The manifest as a pandas DataFrame (no tensor data is read)."""
        if self._manifest is None:
            import pandas as pd

            df = pd.DataFrame(self._rows, columns=self._columns)
            df["shape"] = df["shape"].map(tuple)
            self._manifest = df
        return self._manifest

    @property
    def records(self):
        """One row per record: rid, sample, part, step, meta."""
        import pandas as pd

        return pd.DataFrame(self._records, columns=["rid", "sample", "part", "step", "meta"])

    def record_keys(self) -> dict[RecordKey, str]:
        """Map (sample, part, step) → rid."""
        return {(r["sample"], r["part"], r["step"]): r["rid"] for r in self._records}

    def record_meta(self, record: Any) -> dict[str, Any]:
        """The ``meta`` dict of a record."""
        rid = self._rid(record)
        return next(r["meta"] for r in self._records if r["rid"] == rid)

    def _rid(self, record: Any) -> str:
        if record is None:
            if len(self._records) != 1:
                raise UsageError(f"dump has {len(self._records)} records; name one", self.path)
            return self._records[0]["rid"]
        if isinstance(record, str):
            if any(r["rid"] == record for r in self._records):
                return record
            raise UsageError(f"no record {record!r}", self.path)
        if isinstance(record, tuple):
            rid = self.record_keys().get(tuple(record))  # type: ignore[arg-type]
            if rid is None:
                raise UsageError(f"no record {record}", self.path)
            return rid
        raise UsageError(f"bad record selector {record!r}")

    def entry(self, name: str, record: Any = None, kind: str = "tensor") -> Entry:
        """The manifest entry of one tensor."""
        rid = self._rid(record) if record is not None or len(self._records) == 1 else None
        if self._by_name is None:
            idx: dict[tuple[str, str], list[Entry]] = {}
            for e in self.entries:
                idx.setdefault((e.name, e.kind), []).append(e)
            self._by_name = idx
        hits = [e for e in self._by_name.get((name, kind), []) if rid is None or e.rid == rid]
        if not hits:
            raise UsageError(f"no {kind} named {name!r}" + (f" in record {rid}" if rid else ""), self.path)
        if len(hits) > 1:
            raise UsageError(f"{kind} {name!r} is in {len(hits)} records; name one (record=…)", self.path)
        return hits[0]

    # ---------------------------------------------------------------- data
    def dataset(self, entry: Entry):
        """The h5py dataset behind an entry (for block-wise reads; a tensor stored as its integers only: the
        dataset of its integers, checked, see :meth:`read_raw`); opened once, relative to its record's
        group (the groups are looked up once per record and kind), without an HDF5 chunk cache: datasets stay
        open for the life of the Dump, and with the default 1 MiB cache each compressed one kept its decoded
        chunks (ivq-diff of an lzf QDQ dump of 2,080 tensors: peak RSS 0.92 GiB; raw reads never use it)."""
        if entry.derived:
            return self._raw_dataset(entry)
        return self._high((entry.rid, entry.kind, entry.key), self._value_id(entry)[0])

    def _high(self, k: tuple[str, str, str], dsid: Any) -> Any:
        """The high-level h5py dataset of the low-level ``dsid`` (opened and checked), made once per key."""
        ds = self._datasets.get(k)
        if ds is None:
            import h5py

            ds = self._datasets[k] = h5py.Dataset(dsid, readonly=True)
        return ds

    def _value_id(self, entry: Entry) -> tuple[Any, Any]:
        """The low-level ``(DatasetID, creation property list)`` of an entry's values (``t/`` or ``in/``), opened
        once and checked (dump/validate.py: a hard link to a numeric dataset, neither virtual nor external; a
        whole tensor's shape and dtype as the manifest says). The streaming reads need only its dtype, shape and
        file offset, so no high-level dataset is made for them (:meth:`dataset` makes one on demand)."""
        k = (entry.rid, entry.kind, entry.key)
        got = self._ids.get(k)
        if got is None:
            import h5py

            if self._dapl is None:  # no HDF5 chunk cache: an open dataset holds no decoded chunks
                self._dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
                self._dapl.set_chunk_cache(521, 0, 1.0)
            got = self._open_id(entry, fmt.KIND_GROUPS[entry.kind], self._dapl)
            if entry.stored == "full":
                dv.check_data(got[0], entry.shape, entry.dtype, repr(entry.name), self.path)
            self._ids[k] = got
        return got

    def _raw_id(self, entry: Entry) -> tuple[Any, Any]:
        """The low-level ``(DatasetID, creation property list)`` of a tensor's raw integers (``q/<key>``), opened
        once and checked: the tensor's shape, an integer dtype (one of :data:`~ivq_debug.dump.quant.INTEGER_DTYPES`
        when the values derive from it)."""
        k = (entry.rid, fmt.RAW_GROUP, entry.key)
        got = self._ids.get(k)
        if got is None:
            got = self._open_id(entry, fmt.RAW_GROUP)
            dv.check_integers(got[0], entry, self.path)
            self._ids[k] = got
        return got

    def _stored_id(self, entry: Entry) -> tuple[Any, Any]:
        """The low-level dataset :meth:`dataset` wraps (a tensor stored as its integers only: its integers')."""
        return self._raw_id(entry) if entry.derived else self._value_id(entry)

    def _group_id(self, entry: Entry, group: str) -> Any:
        """The low-level id of ``entry``'s record's ``group`` (``t``, ``in``, ``q``, ``s``), looked up and checked
        once per record and group."""
        gk = (entry.rid, group)
        grp = self._groups.get(gk)
        if grp is None:
            rec = self._groups.get((entry.rid, ""))
            if rec is None:
                recs = dv.member(self._f, fmt.RECORDS, "group", "records", self.path)
                rec = self._groups[(entry.rid, "")] = dv.member(recs, entry.rid, "group", f"record {entry.rid!r}",
                                                                self.path)
            grp = self._groups[gk] = dv.member(rec, group, "group", f"record {entry.rid!r} group {group!r}",
                                               self.path)
        return grp.id

    def _open_id(self, entry: Entry, group: str, dapl: Any = None) -> tuple[Any, Any]:
        """A dataset of ``entry`` in its record's ``group``, checked before any read
        (:func:`~ivq_debug.dump.validate.open_dataset_id`): low-level ``(DatasetID, creation property list)``."""
        return dv.open_dataset_id(self._group_id(entry, group), entry.key, repr(entry.name), self.path, dapl)

    def _open(self, entry: Entry, group: str, dapl: Any = None) -> Any:
        """:meth:`_open_id` as an h5py dataset."""
        import h5py

        return h5py.Dataset(self._open_id(entry, group, dapl)[0], readonly=True)

    def _raw_dataset(self, entry: Entry) -> Any:
        """The h5py dataset of a tensor's raw integers (:meth:`_raw_id`)."""
        return self._high((entry.rid, fmt.RAW_GROUP, entry.key), self._raw_id(entry)[0])

    def stored_dtype(self, entry: Entry) -> np.dtype:
        """The numpy dtype the entry's data is stored in (a bfloat16 tensor: ``uint16``; a tensor stored as its
        integers only: its values' float32); read once."""
        if entry.derived:
            return np.dtype(np.float32)
        k = (entry.rid, entry.kind, entry.key)
        dt = self._dtypes.get(k)
        if dt is None:
            dt = self._dtypes[k] = np.dtype(self._value_id(entry)[0].dtype)
        return dt

    def read(self, name: str | Entry, record: Any = None, kind: str = "tensor") -> np.ndarray:
        """Read one tensor in its stored dtype (bfloat16 is returned as float32)."""
        e = name if isinstance(name, Entry) else self.entry(name, record, kind)
        if e.stored != "full":
            raise UsageError(f"{e.name!r} was stored summary-only; use read_sample()", self.path)
        ds = self.dataset(e)
        with dv.reading(repr(e.name), self.path):
            arr = ds[()]
        if e.derived:
            return dequantize(np.asarray(arr), e.encoding)  # type: ignore[arg-type]
        return logical(np.asarray(arr), e.dtype)

    def read_sample(self, entry: Entry) -> np.ndarray:
        """The strided sample of a summary-only tensor (or the same sample taken from a full tensor)."""

        k = self._summary_samples
        if entry.stored == "summary":
            self.dataset(entry)  # the shape-only dataset exists and is a dataset
            ds = self._open(entry, fmt.SAMPLE_GROUP)
            dv.check_data(ds, (min(k, entry.size),), entry.dtype, f"sample of {entry.name!r}", self.path)
            with dv.reading(f"the sample of {entry.name!r}", self.path):
                arr = ds[()]
            return logical(np.asarray(arr), entry.dtype)
        ds = self.dataset(entry)
        idx = sample_indices(entry.size, k)
        with dv.reading(repr(entry.name), self.path):
            flat = np.asarray(ds[()]).reshape(-1)[idx]
        if entry.derived:
            return dequantize(flat, entry.encoding, entry.shape, idx)  # type: ignore[arg-type]
        return logical(flat, entry.dtype)

    def read_any(self, entry: Entry) -> tuple[np.ndarray, bool]:
        """The whole tensor, or its strided sample when it was stored summary-only: ``(values, sampled)``."""
        if entry.stored == "full":
            return self.read(entry), False
        return self.read_sample(entry), True

    def head(self, entry: Entry, n: int) -> tuple[np.ndarray, bool]:
        """The first ``n`` values in C order, reading about ``n`` values (a chunk of a compressed dataset), not
        the declared size: ``(values, sampled)`` (``sampled``: from the strided sample of a summary-only
        tensor). ``ivq show --values 5`` of a tensor that declares 1 TiB reads 5 values."""
        if entry.stored != "full":
            return self.read_sample(entry)[:n], True
        if n <= 0 or entry.size == 0:
            return logical(np.empty(0, dtype=self.stored_dtype(entry)), entry.dtype), False
        return np.array(next(iter(self.iter_flat(entry, min(n, entry.size))))), False

    def read_raw(self, entry: Entry) -> np.ndarray | None:
        """The raw quantized integers stored beside a tensor, if any."""
        if not entry.has_raw:
            return None
        ds = self._raw_dataset(entry)
        with dv.reading(f"the raw integers of {entry.name!r}", self.path):
            return ds[()]

    def iter_blocks(self, entry: Entry, block_bytes: int) -> Iterator[np.ndarray]:
        """Yield the tensor in blocks of about ``block_bytes`` (C order), each in its logical dtype."""
        if not entry.derived:
            yield from (logical(b, entry.dtype) for b in self._read_blocks(entry, self.dataset(entry), block_bytes))
            return
        at = 0  # the blocks are consecutive runs in C order: each one's first flat index
        for sl in block_slices(entry.shape, np.dtype(np.float32).itemsize, block_bytes):  # cut as the values' blocks
            with dv.reading(repr(entry.name), self.path):
                q = np.asarray(self.dataset(entry)[sl])
            yield dequantize(q.reshape(-1), entry.encoding, entry.shape, at).reshape(q.shape)  # type: ignore[arg-type]
            at += q.size

    def raw_layout(self, entry: Entry) -> RawLayout | None:
        """Where an uncompressed tensor lies in the file (None: compressed or not C-contiguous chunks, or a
        tensor stored as its integers only: its values are not in the file)."""
        return None if entry.derived else self._stored_layout(entry)

    def _stored_layout(self, entry: Entry) -> RawLayout | None:
        """The :class:`RawLayout` of what :meth:`dataset` opens (a derived tensor: its integers)."""
        key = (entry.rid, fmt.RAW_GROUP if entry.derived else entry.kind, entry.key)
        if key not in self._layouts:
            dsid, dcpl = self._stored_id(entry)
            self._layouts[key] = id_layout(dsid, dcpl, entry.shape)  # (shape checked when opened)
        return self._layouts[key]

    def iter_flat(self, entry: Entry, block_elems: int, reuse: bool = False) -> Iterator[np.ndarray]:
        """Yield the tensor's values in C order, ``block_elems`` at a time (the last block may be shorter).

        Uncompressed datasets are read with ``os.pread`` straight from their file offsets: no HDF5 call,
        no h5py lock, the GIL released during I/O, so several tensors can be read in parallel threads.
        Compressed datasets go through h5py. Either way one block is in memory at a time; with ``reuse``
        every block is read into the same buffer (valid until the next one is yielded).
        """
        if entry.derived:  # the integers' blocks, each dequantized (into one reused float32 buffer with ``reuse``)
            vals = np.empty(min(block_elems, entry.size), np.float32) if reuse else None
            start = 0
            for q in self._iter_stored(entry, block_elems, reuse):
                yield dequantize(q, entry.encoding, entry.shape, start,  # type: ignore[arg-type]
                                 None if vals is None else vals[:q.size])
                start += q.size
            return
        for block in self._iter_stored(entry, block_elems, reuse):
            yield logical(block, entry.dtype)

    def _iter_stored(self, entry: Entry, block_elems: int, reuse: bool) -> Iterator[np.ndarray]:
        """:meth:`iter_flat`'s blocks as stored (a bfloat16 tensor: its integer view; a derived one: its
        integers)."""
        n = entry.size
        layout = self._stored_layout(entry)
        dt = np.dtype(self._raw_id(entry)[0].dtype) if entry.derived else self.stored_dtype(entry)
        if layout is not None:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            buf = np.empty(min(block_elems, n), dtype=dt) if reuse else None
            for start in range(0, n, block_elems):
                count = min(block_elems, n - start)
                out = buf[:count] if buf is not None else None
                with dv.reading(repr(entry.name), self.path):  # a short read: the file was cut
                    block = layout.read(self._fd, start, count, dt, out)
                yield block
            return
        if 0 < n <= block_elems and entry.shape:  # one block: one HDF5 read of the whole dataset, no selection
            import h5py

            ds = self.dataset(entry)
            out = np.empty(entry.shape, dtype=dt)
            with dv.reading(repr(entry.name), self.path):
                ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
            yield out.reshape(-1)
            return
        # compressed: read at least a chunk per HDF5 call (no chunk cache: a smaller block would decompress
        # the same chunk again for every block), then cut into blocks of the size asked
        ds = self.dataset(entry)
        chunk_bytes = math.prod(ds.chunks) * dt.itemsize if ds.chunks else 0
        block_bytes = max(block_elems * dt.itemsize, chunk_bytes)
        yield from rebuffer(self._read_blocks(entry, ds, block_bytes), block_elems)

    def _read_blocks(self, entry: Entry, ds: Any, block_bytes: int) -> Iterator[np.ndarray]:
        """``ds`` (the entry's dataset as :meth:`dataset` opens it) in blocks of about ``block_bytes``, as stored."""
        for sl in block_slices(entry.shape, ds.dtype.itemsize, block_bytes):
            with dv.reading(repr(entry.name), self.path):
                block = np.asarray(ds[sl])
            yield block

    def table(self, name: str):
        """A stored table (e.g. ``profiling``) as a pandas DataFrame."""
        import pandas as pd

        if name not in self.table_names():
            raise UsageError(f"dump has no table {name!r}", self.path)
        grp = dv.member(self._f, fmt.TABLES, "group", "tables", self.path)
        p = dv.table(dv.json_dataset(grp, name, f"table {name!r}", self.path), f"table {name!r}", self.path)
        return pd.DataFrame(p["rows"], columns=p["columns"])

    def table_names(self) -> list[str]:
        """Names of the stored tables."""
        grp = dv.member(self._f, fmt.TABLES, "group", "tables", self.path, required=False)
        return list(grp.keys()) if grp is not None else []

    def meta(self, name: str, default: Any = None) -> Any:
        """A JSON value stored under ``/meta/<name>``."""
        grp = dv.member(self._f, fmt.META, "group", "meta", self.path, required=False)
        if grp is None or name not in grp:
            return default
        doc = dv.json_dataset(grp, name, f"meta {name!r}", self.path)
        if name in dv.META_SCHEMAS:  # the values a reader uses: typed before it uses them
            check_schema(doc, dv.META_SCHEMAS[name], self.path, f"meta {name!r}")
        return doc

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self._f.close()
        except Exception:
            pass

    def __enter__(self) -> Dump:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Dump({str(self.path)!r}, backend={self.backend!r}, records={len(self._records)}, "
            f"tensors={len(self._rows)})"
        )


def logical(arr: np.ndarray, dtype_name: str) -> np.ndarray:
    """Reinterpret stored integer views (bfloat16) as numbers numpy can hold."""
    if dtype_name == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def block_slices(shape: tuple[int, ...], itemsize: int, block_bytes: int) -> Iterator[tuple[slice | int, ...]]:
    """Index tuples that cover an array of ``shape`` in C order, each about ``block_bytes``.

    Trailing axes are kept whole; the first axis whose inner size fits is cut into runs; the axes
    before it are iterated one index at a time.
    """
    if len(shape) == 0:
        yield ()
        return
    if math.prod(shape) == 0:
        yield tuple(slice(None) for _ in shape)
        return
    inner = itemsize
    k = len(shape)
    # find the smallest k such that prod(shape[k:]) * itemsize <= block_bytes
    while k > 0 and inner * shape[k - 1] <= block_bytes:
        inner *= shape[k - 1]
        k -= 1
    if k == 0:
        yield tuple(slice(None) for _ in shape)
        return
    axis = k - 1  # cut this axis into runs of `run` indices
    run = max(1, block_bytes // inner)
    outer = shape[:axis]
    for idx in np.ndindex(*outer) if outer else [()]:
        for start in range(0, shape[axis], run):
            yield (*idx, slice(start, min(start + run, shape[axis])), *(slice(None),) * (len(shape) - axis - 1))


class RawLayout:
    """An uncompressed dataset as contiguous byte segments of the file, in C order of its elements."""

    def __init__(self, starts: list[int], lengths: list[int], offsets: list[int], itemsize: int) -> None:
        self.starts, self.lengths, self.offsets, self.itemsize = starts, lengths, offsets, itemsize

    def read(self, fd: int, start: int, count: int, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``[start, start + count)`` read with ``os.preadv`` (into ``out`` when given)."""
        import bisect

        if out is None:
            out = np.empty(count, dtype=dtype)
        buf = memoryview(out).cast("B")
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        pos, end, filled = start, start + count, 0
        while pos < end:
            s0, ln, off = self.starts[i], self.lengths[i], self.offsets[i]
            take = min(end, s0 + ln) - pos
            nbytes = take * self.itemsize
            got = os.preadv(fd, [buf[filled : filled + nbytes]], off + (pos - s0) * self.itemsize)
            if got != nbytes:
                raise OSError(f"short read ({got} of {nbytes} bytes)")
            filled += nbytes
            pos += take
            i += 1
        return out


def raw_layout(ds: Any, shape: tuple[int, ...]) -> RawLayout | None:
    """The :class:`RawLayout` of an h5py dataset, or None when it must be read through HDF5 (:func:`id_layout`)."""
    return id_layout(ds.id, ds.id.get_create_plist(), shape)


def id_layout(dsid: Any, dcpl: Any, shape: tuple[int, ...]) -> RawLayout | None:
    """The :class:`RawLayout` of a low-level dataset (its ``DatasetID`` and creation property list), or None when
    it must be read through HDF5.

    Contiguous datasets are one segment. Chunked ones qualify when unfiltered and each chunk is a C-order
    run of the array (leading chunk dims 1, one cut axis, trailing dims whole), as the writer makes them.
    """
    import h5py

    try:
        if dcpl.get_nfilters() != 0 or not shape or math.prod(shape) == 0:
            return None
        itemsize = dsid.dtype.itemsize
        if dcpl.get_layout() != h5py.h5d.CHUNKED:
            off = dsid.get_offset()
            return None if off is None else RawLayout([0], [math.prod(shape)], [off], itemsize)
        ch = dcpl.get_chunk()
        k = next((i for i, c in enumerate(ch) if c != 1), len(ch) - 1)
        if any(c != s for c, s in zip(ch[k + 1 :], shape[k + 1 :], strict=True)):
            return None
        inner = math.prod(shape[k + 1 :])
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        segs: list[tuple[int, int, int]] = []

        def visit(si: Any) -> None:
            c = si.chunk_offset
            flat = sum(ci * st for ci, st in zip(c, strides, strict=True))
            segs.append((flat, min(ch[k], shape[k] - c[k]) * inner, si.byte_offset))

        dsid.chunk_iter(visit)
        segs.sort()
        if sum(s[1] for s in segs) != math.prod(shape):
            return None  # unwritten chunks: let HDF5 supply fill values
        return RawLayout([s[0] for s in segs], [s[1] for s in segs], [s[2] for s in segs], itemsize)
    except (AttributeError, OSError, ValueError):
        return None


def rebuffer(blocks: Iterator[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """Re-cut a stream of arrays into flat pieces of exactly ``size`` elements (the last may be shorter)."""
    pending: list[np.ndarray] = []
    have = 0
    for b in blocks:
        flat = np.asarray(b).reshape(-1)
        while flat.size:
            take = min(size - have, flat.size)
            pending.append(flat[:take])
            have += take
            flat = flat[take:]
            if have == size:
                yield pending[0] if len(pending) == 1 else np.concatenate(pending)
                pending, have = [], 0
    if have:
        yield pending[0] if len(pending) == 1 else np.concatenate(pending)


def open_dump(path: str | os.PathLike) -> Dump:
    """Open a golden dump for reading (raises :class:`~ivq_debug.errors.InputError` on a bad file)."""
    return Dump(path)
