"""Streaming, atomic writer of golden dumps.

A tensor goes to disk when it is added; only the small manifest row stays in memory. The file is
written under a hidden temporary name in the destination folder and renamed to its final name by
:meth:`DumpWriter.close`, after the manifest is written and ``finalized`` is set. A capture that is
killed leaves only ``.<name>.partial-<pid>``; one that raises removes its temporary file.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import math
import os
import socket
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import __version__, defaults, interrupt
from ivq_debug.dump import format as fmt
from ivq_debug.dump.contract import INPUTS_META, input_digest, input_fact
from ivq_debug.dump.digest import ATTR as DIGEST_ATTR
from ivq_debug.dump.digest import ContentDigest
from ivq_debug.dump.guard import WriteGuard, guarded, trim
from ivq_debug.dump.quant import INTEGER_DTYPES, dequantize, encoding_problem, same_bits
from ivq_debug.dump.reader import logical
from ivq_debug.dump.stats import STAT_FIELDS, sample_indices, tensor_stats
from ivq_debug.errors import InputError, UsageError
from ivq_debug.outputs import current_umask


def _tool_version() -> str:

    return __version__


def to_numpy(value: Any) -> tuple[np.ndarray, str]:
    """Convert a numpy array, torch tensor or scalar to ``(array_to_store, original_dtype_name)``.

    bfloat16 / float8 tensors are stored as same-width integer views (numpy has no such dtype); the
    original dtype name is kept so that readers can reinterpret them.
    """
    if hasattr(value, "detach") and hasattr(value, "dtype"):  # torch.Tensor without importing torch
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        dname = str(t.dtype).replace("torch.", "")
        if dname in fmt.VIEW_DTYPES:
            import torch

            view = {"bfloat16": torch.int16, "float8_e4m3fn": torch.uint8, "float8_e5m2": torch.uint8}[dname]
            arr = t.contiguous().view(view).numpy().view(fmt.VIEW_DTYPES[dname])
            return arr, dname
        if dname == "bool":
            return t.numpy(), "bool"
        return t.contiguous().numpy(), np.dtype(t.numpy().dtype).name
    arr = np.asarray(value)
    if arr.dtype == object:
        raise UsageError(f"cannot store an object array (got {type(value).__name__})")
    return arr, arr.dtype.name


#: the keywords of :meth:`DumpWriter.add_tensor` beside the name and the value
_ENTRY_FIELDS = ("op_type", "order", "scope", "layout", "encoding", "raw", "qnn_name", "source_file", "owned")
#: where a manifest row holds its statistics (:data:`~ivq_debug.dump.stats.STAT_FIELDS`, in that order)
_STATS_AT = fmt.MANIFEST_COLUMNS.index(STAT_FIELDS[0])


def _stats_and_digest(values: np.ndarray, kept: np.ndarray, dtype_name: str) -> tuple[dict[str, Any], str]:
    """A tensor's statistics (of its values) and the content digest of what is kept (the writer's thread)."""
    return tensor_stats(values), input_digest(kept, dtype_name)


def _chunk_shape(shape: tuple[int, ...], itemsize: int, target: int) -> tuple[int, ...]:
    """Chunk shape of about ``target`` bytes: trailing axes kept whole, leading axes cut.

    The cut axis is split into equal runs (``ceil(n / ceil(n / run))``): HDF5 stores an edge chunk at full
    size, so a run of 170 rows over 197 would store 340 (ViT fc1 outputs [1, 197, 1536]: 22 % of
    the float dump's 1,301 MB were edge-chunk padding); balanced runs of 99 store 198.
    """
    chunk = [max(1, s) for s in shape]
    nbytes = math.prod(chunk) * itemsize
    for i in range(len(chunk)):
        if nbytes <= target:
            break
        inner = nbytes // chunk[i]
        run = max(1, target // max(inner, 1))
        pieces = -(-chunk[i] // run)
        chunk[i] = -(-chunk[i] // pieces)
        nbytes = math.prod(chunk) * itemsize
    return tuple(chunk)


class _AttrWriter:
    """Writes the scalar attributes of a new HDF5 object with the datatypes h5py's ``attrs[k] = v`` gives them
    (a str: variable-length UTF-8; an int: its numpy dtype; a bool: h5py's enum), without its per-call
    type inference, property lists and existence checks (the object is new). Measured on a QDQ capture of
    2,080 tensors × ~6 attributes, profiled at load 10–15: 380 → 140 µs per attribute."""

    def __init__(self) -> None:
        import h5py

        self._h5a, self._h5s, self._h5t = h5py.h5a, h5py.h5s, h5py.h5t
        self._str = h5py.string_dtype()
        self._scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        self._types: dict[str, tuple[Any, Any, np.dtype]] = {}

    def _type(self, value: Any) -> tuple[Any, Any, np.dtype] | None:
        if isinstance(value, str):
            key, dt = "str", self._str
        elif isinstance(value, (bool, int, np.bool_, np.integer)):
            dt = np.asarray(value).dtype
            key = dt.str
        else:
            return None
        t = self._types.get(key)
        if t is None:
            t = self._types[key] = (self._h5t.py_create(dt, logical=True), self._h5t.py_create(dt), dt)
        return t

    def write(self, obj: Any, items: list[tuple[str, Any]]) -> None:
        """Create the attributes ``items`` on ``obj`` (an h5py object, or the low-level id of one, without them)."""
        import h5py

        oid = obj.id if hasattr(obj, "attrs") else obj  # (a high-level object has .attrs; a low-level id not)
        for name, value in items:
            t = self._type(value)
            if t is None:
                h5py.AttributeManager(oid)[name] = value
                continue
            htype, mtype, dt = t
            attr = self._h5a.create(oid, name.encode(), htype, self._scalar)
            try:
                attr.write(np.asarray(value, dtype=dt), mtype=mtype)
            finally:
                attr.close()


class _ContiguousWriter:
    """Creates an uncompressed (contiguous) dataset of a numeric array as ``group.create_dataset(name, data=arr)``
    does (the same datatype, dataspace and creation properties: no modification times, no fill value set), through
    h5py's low-level calls, without its per-call argument checks, property-list building and high-level wrapper.
    Measured on the 4,164 datasets of a 12-block ViT QDQ capture (956 MiB, load 15): 1.0 s of CPU with
    ``create_dataset``, 0.6 s here (1.2 s when they were cut into 1 MiB chunks)."""

    def __init__(self) -> None:
        import h5py

        self._h5d, self._h5s, self._h5t = h5py.h5d, h5py.h5s, h5py.h5t
        self._dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        self._dcpl.set_obj_track_times(False)
        self._types: dict[str, Any] = {}

    def create(self, gid: Any, name: str, arr: np.ndarray) -> Any:
        """The new dataset ``name`` in the group ``gid`` (a low-level id) holding ``arr``; its low-level id."""
        t = self._types.get(arr.dtype.str)
        if t is None:
            t = self._types[arr.dtype.str] = self._h5t.py_create(arr.dtype, logical=True)
        # a 0-d array is contiguous already (np.ascontiguousarray would make it 1-d: shape [1])
        data = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        space = self._h5s.create_simple(data.shape) if data.ndim else self._h5s.create(self._h5s.SCALAR)
        try:
            bname = name.encode("ascii")
        except UnicodeEncodeError:
            bname = name.encode("utf8")
        dsid = self._h5d.create(gid, bname, t, space, dcpl=self._dcpl)
        dsid.write(self._h5s.ALL, self._h5s.ALL, data)
        return dsid


def table_payload(table: Any) -> dict[str, Any]:
    """A small table (a pandas DataFrame or a list of dicts) as a dump stores it: ``{"columns", "rows"}``."""
    if hasattr(table, "to_dict"):
        return {"columns": [str(c) for c in table.columns], "rows": table.astype(object).values.tolist()}
    rows = list(table)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return {"columns": cols, "rows": [[r.get(c) for c in cols] for r in rows]}


class RecordBook:
    """The records of a capture being written and the open one: keys, ids, names taken, execution order. What
    a sink keeps whether its tensors go to a file (:class:`DumpWriter`) or stay in memory
    (:class:`~ivq_debug.dump.memory.MemorySink`)."""

    def _book_init(self) -> None:
        self._records: list[dict[str, Any]] = []
        self._cur: dict[str, Any] | None = None
        self._order: dict[str, int] = {}
        self._names: dict[tuple[str, str], set[str]] = {}

    def _open_record(self, sample: int, part: str, step: int, meta: dict[str, Any]) -> dict[str, Any]:
        """A new record (``rid``, key, ``meta``), made the open one; a key given twice is a :class:`UsageError`."""
        key = (int(sample), str(part), int(step))
        for r in self._records:
            if (r["sample"], r["part"], r["step"]) == key:
                raise UsageError(f"record sample={sample} part={part!r} step={step} already exists")
        rec = {"rid": fmt.record_id(len(self._records)), "sample": key[0], "part": key[1], "step": key[2],
               "meta": meta}
        self._records.append(rec)
        self._cur = rec
        self._order[rec["rid"]] = 0
        return rec

    def _take_name(self, rid: str, kind: str, name: str) -> None:
        seen = self._names.setdefault((rid, kind), set())
        if name in seen:
            raise UsageError(f"{kind} {name!r} added twice to record {rid}")
        seen.add(name)

    def _next_order(self, rid: str, order: int | None) -> int:
        """The entry's execution order (default: after the last one) and the record's next default."""
        if order is None:
            order = self._order[rid]
        self._order[rid] = max(self._order[rid], order + 1)
        return order

    @property
    def current_record(self) -> str | None:
        """Id of the record tensors are currently added to."""
        return self._cur["rid"] if self._cur else None

    @property
    def current_key(self) -> tuple[int, str, int] | None:
        """``(sample, part, step)`` of the open record (``None`` before the first)."""
        return (self._cur["sample"], self._cur["part"], self._cur["step"]) if self._cur else None

    def has(self, name: str, kind: str = "tensor") -> bool:
        """True when the current record already holds a tensor (or input) of that name."""
        rec = self._cur
        return rec is not None and name in self._names.get((rec["rid"], kind), set())


class DumpWriter(RecordBook):
    """Write one golden dump (one capture) to ``path``, streaming tensors as they are added.

    Usage::

        with DumpWriter("golden/ref.h5", backend="torch", model={"path": "..."}) as w:
            w.begin_record(sample=0, part="vision", step=0)
            w.add_input("pixel_values", pv)
            w.add_tensor("model.vision_tower.encoder.layer.0", h, op_type="InternVLVisionLayer")
        # the file appears as golden/ref.h5 only here, complete

    Args:
        path: final file name.
        backend: capture backend (``torch``, ``onnxruntime-cpu``, ``onnxruntime-cpu-qdq``, ``qnn-htp``,
            ``qnn-net-run``, …).
        backend_info: library versions, providers, optimization level, soc_model, htp_arch, emulated, …
        model: model identity (path, sha256, part, …).
        command: the command line that produced the dump (defaults to ``sys.argv``).
        overwrite: replace an existing file at ``path``; otherwise an existing file is an error.
        compression: ``"auto"``, ``"lzf"``, ``"gzip"`` or ``None`` (default from :mod:`ivq_debug.defaults`).
        summary_only: store statistics and ``summary_samples`` strided values instead of whole tensors.
        integers_only: store a quantized tensor given with its raw integers as the integers alone when
            :func:`~ivq_debug.dump.quant.dequantize` of them gives its values bit for bit (checked here, per
            tensor; otherwise both are stored); the dump is then format version 2 (``docs/dump-format.md``,
            "Integers only"). Default from :data:`ivq_debug.defaults.DUMP_INTEGERS_ONLY` (``$IVQ_DUMP_INTEGERS_ONLY``).
        stats_thread: make the statistics and content digest of a tensor the caller hands over
            (``add_tensor(..., owned=True)``) in one thread of the writer while the caller goes on; they are
            collected in the order the tensors came, before the manifest is written (the same figures as in the
            caller's thread). Default :data:`ivq_debug.defaults.DUMP_STATS_THREAD`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        backend: str,
        backend_info: dict[str, Any] | None = None,
        model: dict[str, Any] | None = None,
        command: str | None = None,
        overwrite: bool = False,
        compression: str | type[Ellipsis] | None = ...,
        summary_only: bool = False,
        summary_samples: int = 4096,
        integers_only: bool | None = None,
        stats_thread: bool | None = None,
    ) -> None:
        import h5py

        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise UsageError("output exists; pass overwrite=True (CLI: --force) to replace it", self.path)
        if not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.overwrite = overwrite
        self.compression = defaults.DUMP_COMPRESSION if compression is ... else compression
        self.summary_only = summary_only
        self.summary_samples = summary_samples
        self.integers_only = defaults.dump_integers_only() if integers_only is None else bool(integers_only)
        self._derived = 0  # tensors stored as their integers only (the dump is version 2 when any)
        self.stats_thread = defaults.DUMP_STATS_THREAD if stats_thread is None else bool(stats_thread)
        self._pool: ThreadPoolExecutor | None = None
        #: handed-over tensors whose statistics are being made: (future, manifest row, record, name, bytes held)
        self._pending: deque[tuple[Future, list[Any], tuple[int, str, int], str, int]] = deque()
        self._pending_bytes = 0
        self._tmp = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        interrupt.register(self._tmp)  # (removed by the CLI if a signal lands before the try below owns it)
        self._guard = WriteGuard(self._tmp, self.path)  # a full disk: the file is discarded, exit 2 (guard.py)
        try:
            with self._guard.writing():
                self._f = self._guard.file = h5py.File(self._tmp, "w", libver="latest")
        except BaseException:  # (Ctrl-C / SIGTERM as the file appears: no .partial left behind)
            self._guard.discard()
            interrupt.unregister(self._tmp)
            raise
        self._rows: list[list[Any]] = []
        self._book_init()
        self._incomplete: list[str] = []
        self._groups: dict[tuple[str, str], Any] = {}  # (rid, group name) -> h5py group, made on first use
        self._attrs = _AttrWriter()
        self._contiguous = _ContiguousWriter()
        self._digest = ContentDigest()
        self._closed = False
        try:
            self._start(backend, backend_info, model, command)
        except BaseException:  # (Ctrl-C / SIGTERM while the header is written: no .partial left behind)
            self.abort()
            raise

    @guarded
    def _start(self, backend: str, backend_info: Any, model: Any, command: str | None) -> None:
        self._guard.reserve(0)
        a = self._f.attrs
        a["format"] = fmt.FORMAT
        a["format_version"] = fmt.FORMAT_VERSION_VALUES  # (2 at close when a tensor is stored as integers only)
        a["finalized"] = False
        a["backend"] = backend
        a["backend_info"] = fmt.to_json(backend_info or {})
        a["model"] = fmt.to_json(model or {})
        a["created"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        a["tool_version"] = _tool_version()
        a["command"] = command if command is not None else " ".join(sys.argv)
        a["host"] = f"{getpass.getuser()}@{socket.gethostname()}"
        a["summary_only"] = self.summary_only
        a["summary_samples"] = self.summary_samples
        self._f.create_group(fmt.RECORDS)

    # ---------------------------------------------------------------- records
    @guarded
    def begin_record(self, sample: int = 0, part: str = "model", step: int = 0, **meta: Any) -> str:
        """Start a record (one forward call of one part for one sample); later tensors go into it.

        ``step`` is the generation step: 0 for a single forward or a prefill, ``k >= 1`` for the k-th
        decode call. Extra keyword arguments (e.g. ``position_ids`` summary, ``cache_len``) are stored as
        JSON in the record's ``meta``. Returns the record id.
        """
        self._check_open()
        self._guard.reserve(4096)
        rec = self._open_record(sample, part, step, meta)
        rid = rec["rid"]
        g = self._f[fmt.RECORDS].create_group(rid)
        g.attrs["sample"], g.attrs["part"], g.attrs["step"] = rec["sample"], rec["part"], rec["step"]
        g.attrs["meta"] = fmt.to_json(meta)
        self._groups = {(rid, ""): g}  # tensors go to the current record only: earlier groups can close
        return rid

    @guarded
    def update_record_meta(self, **meta: Any) -> None:
        """Add keys to the current record's ``meta`` (e.g. the chosen token after the forward)."""
        rec = self._require_record()
        rec["meta"].update(meta)
        self._group(rec["rid"]).attrs["meta"] = fmt.to_json(rec["meta"])

    # ---------------------------------------------------------------- tensors
    def add_input(self, name: str, value: Any, *, role: str | None = None, reason: str | None = None,
                  **kw: Any) -> None:
        """Store one model input of the current record (always stored whole) and its contract fact.

        ``role`` (``external``, ``derived``, ``carried``, ``recomputed``; default by name,
        :func:`ivq_debug.dump.contract.default_role`) and ``reason`` go with the input's SHA-256 into the
        record's ``meta["inputs"]`` (:mod:`ivq_debug.dump.contract`). Other keywords are those of
        :meth:`add_tensor` (an ingest passes ``qnn_name`` and ``source_file``).
        """
        arr, dtype_name = self._add("input", name, value, **kw)
        rec = self._require_record()
        rec["meta"].setdefault(INPUTS_META, {})[name] = input_fact(name, arr, dtype_name, role, reason)
        self._group(rec["rid"]).attrs["meta"] = fmt.to_json(rec["meta"])

    def add_tensor(
        self,
        name: str,
        value: Any,
        *,
        op_type: str | None = None,
        order: int | None = None,
        scope: str | None = None,
        layout: str | None = None,
        encoding: dict[str, Any] | None = None,
        raw: Any | None = None,
        qnn_name: str | None = None,
        source_file: str | None = None,
        owned: bool = False,
    ) -> None:
        """Store one captured tensor of the current record.

        Args:
            name: framework-native name (torch module path with ``[i]``/``.key``/``#k`` suffixes, ONNX
                tensor name, …).
            op_type: ONNX op type or torch module class.
            order: execution order within the record (default: the order of ``add_tensor`` calls).
            scope: module path the tensor belongs to (ONNX tensors: from exporter scopes / metadata).
            layout: ``"NCHW"``, ``"NHWC"``, … when known.
            encoding: quantization encoding (``bitwidth``, ``scale``, ``zero_point`` in the ONNX
                convention, ``axis``, ``dtype``, ``symmetric``), see ``docs/dump-format.md``.
            raw: the raw quantized integers the backend produced: stored beside the float values, or in their
                place when ``integers_only`` and ``dequantize(raw, encoding)`` is ``value`` bit for bit.
            qnn_name: the tensor's name on the device (an ingested qnn-net-run file's sanitized QNN name).
            source_file: the file the values were read from (ingests); provenance, never opened again.
            owned: the caller hands ``value`` and ``raw`` over: nothing changes them after this call (a runner's
                own outputs), so their statistics and digest may be made in the writer's thread
                (``stats_thread``) after it returns. A caller whose arrays are views of live buffers (a torch
                hook's activations) leaves it False.
        """
        self._add(
            "tensor", name, value, op_type=op_type, order=order, scope=scope, layout=layout,
            encoding=encoding, raw=raw, qnn_name=qnn_name, source_file=source_file, owned=owned,
        )

    @guarded
    def _add(self, kind: str, name: str, value: Any, **fields: Any) -> tuple[np.ndarray, str]:
        """Store one entry; ``fields`` are :meth:`add_tensor`'s keywords (absent: None)."""
        unknown = set(fields) - set(_ENTRY_FIELDS)
        if unknown:
            raise TypeError(f"unknown entry field(s) {sorted(unknown)}")
        op_type, order, scope, layout, encoding, raw, qnn_name, source_file, owned = (
            fields.get(k) for k in _ENTRY_FIELDS)
        rec = self._require_record()
        rid = rec["rid"]
        self._take_name(rid, kind, name)
        arr, dtype_name = to_numpy(value)
        raw_arr = None if raw is None else to_numpy(raw)[0]
        enc_text = None if encoding is None else fmt.to_json(encoding)
        # decided on the encoding as the manifest gives it back to a reader (JSON: numpy values made plain)
        derived = kind == "tensor" and enc_text is not None and self._derivable(arr, dtype_name, enc_text, raw_arr)
        # before HDF5 writes (guard.py)
        self._guard.reserve((0 if derived else arr.nbytes) + (0 if raw_arr is None else raw_arr.nbytes) + 4096)
        later = bool(owned) and kind == "tensor" and self.stats_thread  # statistics and digest in the writer's thread
        stats = dict.fromkeys(STAT_FIELDS) if later else tensor_stats(self._logical(arr, dtype_name))
        key = fmt.escape_name(name)
        stored = "full"
        attrs: list[tuple[str, Any]] = []
        if derived:  # the values are the integers' dequantization: the integers alone, the entry's attributes on them
            assert raw_arr is not None
            kept = arr
            ds = self._create(self._group(rid, fmt.RAW_GROUP), key, raw_arr, quantized=True)  # ("auto": lzf too)
            attrs.append(("derived", True))
            self._derived += 1
        elif kind == "tensor" and self.summary_only and arr.size > self.summary_samples:
            grp = self._group(rid, fmt.KIND_GROUPS[kind])
            stored = "summary"
            idx = sample_indices(arr.size, self.summary_samples)
            kept = arr.reshape(-1)[idx]
            self._group(rid, fmt.SAMPLE_GROUP).create_dataset(key, data=kept)
            ds = grp.create_dataset(key, shape=arr.shape, dtype=arr.dtype)  # shape only, no data written
            attrs.append(("summary_only", True))
        else:
            kept = arr
            ds = self._create(self._group(rid, fmt.KIND_GROUPS[kind]), key, arr, quantized=encoding is not None)
        # one SHA-256 pass over the values kept (dump/digest.py), here or in the writer's thread
        record = (rec["sample"], rec["part"], rec["step"])
        if not later:
            self._digest.add(record, kind, name, logical(kept, dtype_name), dtype_name)
        order = self._next_order(rid, order)
        attrs += [("name", name), ("dtype", dtype_name), ("order", order)]
        attrs += [(attr, val) for attr, val in (("op_type", op_type), ("scope", scope), ("layout", layout),
                                                ("qnn_name", qnn_name), ("source_file", source_file))
                  if val is not None]
        if enc_text is not None:
            attrs.append(("encoding", enc_text))
        self._attrs.write(ds, attrs)
        del ds  # closes the dataset
        has_raw = raw_arr is not None
        if has_raw and not derived:
            self._create(self._group(rid, fmt.RAW_GROUP), key, raw_arr)
        row = [
            rid, rec["sample"], rec["part"], rec["step"], kind, name, key, order, op_type, scope,
            list(arr.shape), dtype_name, layout, stored, int(arr.nbytes), stats["min"], stats["max"],
            stats["mean"], stats["std"], stats["nonfinite"], encoding, has_raw, qnn_name, source_file, derived,
        ]
        self._rows.append(row)
        if later:
            self._defer(row, record, name, self._logical(arr, dtype_name), logical(kept, dtype_name), dtype_name)
        return arr, dtype_name

    def _defer(self, row: list[Any], record: tuple[int, str, int], name: str, values: np.ndarray, kept: np.ndarray,
               dtype_name: str) -> None:
        """A handed-over tensor's statistics and digest, made in the writer's thread (:func:`_stats_and_digest`);
        past ``DUMP_STATS_PENDING_BYTES`` of arrays waiting, the oldest are collected first."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ivq-dump-stats")
        held = values.nbytes + (0 if kept is values else kept.nbytes)
        self._pending.append((self._pool.submit(_stats_and_digest, values, kept, dtype_name), row, record, name, held))
        self._pending_bytes += held
        while self._pending_bytes > defaults.DUMP_STATS_PENDING_BYTES:
            self._collect_one()

    def _collect_one(self) -> None:
        """The oldest pending tensor's statistics into its manifest row, its digest into the dump's."""
        fut, row, record, name, held = self._pending.popleft()
        stats, digest = fut.result()
        row[_STATS_AT:_STATS_AT + len(STAT_FIELDS)] = [stats[k] for k in STAT_FIELDS]
        self._digest.add_digest(record, "tensor", name, digest)
        self._pending_bytes -= held

    def _stop_thread(self) -> None:
        """The writer's thread stopped (what it had not started is dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()
        self._pending_bytes = 0

    def _derivable(self, arr: np.ndarray, dtype_name: str, enc_text: str, raw: np.ndarray | None) -> bool:
        """Whether a tensor may be stored as its integers only: asked for, a whole float32 tensor, integers of a
        dtype the format allows and of its shape, an encoding the reader can apply, and ``dequantize(raw,
        encoding)`` equal to the values bit for bit (one dequantization and one comparison: a backend whose
        dequantization differs keeps its values)."""
        if (not self.integers_only or raw is None or dtype_name != "float32"
                or raw.dtype.name not in INTEGER_DTYPES or raw.shape != arr.shape
                or (self.summary_only and arr.size > self.summary_samples)):
            return False
        encoding = json.loads(enc_text)
        return encoding_problem(encoding, arr.shape) is None and same_bits(dequantize(raw, encoding), arr)

    @staticmethod
    def _logical(arr: np.ndarray, dtype_name: str) -> np.ndarray:
        if dtype_name == "bfloat16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        if dtype_name.startswith("float8"):
            return arr.astype(np.float32) * np.nan  # statistics of fp8 views are not defined
        return arr

    def _create(self, grp: Any, key: str, arr: np.ndarray, quantized: bool = False) -> Any:
        """A new dataset ``key`` in ``grp`` holding ``arr``: the low-level id of a contiguous one, or the h5py
        dataset of a chunked, compressed one."""
        comp = self.compression
        if comp == "auto":
            comp = "lzf" if quantized else None
        if not comp or arr.ndim == 0 or arr.nbytes < defaults.DUMP_MIN_CHUNKED_BYTES:
            if arr.dtype.kind in "biuf":
                return self._contiguous.create(grp.id, key, arr)
            return grp.create_dataset(key, data=arr)
        kw: dict[str, Any] = {"chunks": _chunk_shape(arr.shape, arr.itemsize, defaults.DUMP_CHUNK_BYTES)}
        if comp == "gzip":
            kw.update(compression="gzip", compression_opts=defaults.DUMP_COMPRESSION_LEVEL, shuffle=True)
        else:
            kw["compression"] = comp
        return grp.create_dataset(key, data=arr, **kw)

    # ---------------------------------------------------------------- extras
    @guarded
    def add_table(self, name: str, table: Any) -> None:
        """Store a small table (a pandas DataFrame or a list of dicts) as JSON, e.g. a profiling table."""
        self._check_open()
        self._json_dataset(fmt.TABLES, name, table_payload(table))

    @guarded
    def set_meta(self, name: str, value: Any) -> None:
        """Store a JSON value under ``/meta/<name>`` (e.g. the partition of a QNN capture)."""
        self._check_open()
        self._json_dataset(fmt.META, name, value)

    def _json_dataset(self, group: str, name: str, value: Any) -> None:
        """``value`` as a JSON string dataset ``/<group>/<name>`` (replacing one of that name)."""
        text = fmt.to_json(value)
        self._guard.reserve(len(text) + 4096)
        grp = self._f.require_group(group)
        if name in grp:
            del grp[name]
        grp.create_dataset(name, data=text)

    @guarded
    def update_backend_info(self, **info: Any) -> None:
        """Merge keys into the root ``backend_info`` (e.g. versions known only after the session starts)."""
        import json

        cur = json.loads(self._f.attrs["backend_info"])
        cur.update(info)
        text = fmt.to_json(cur)
        self._guard.reserve(len(text) + 4096)
        self._f.attrs["backend_info"] = text

    def mark_incomplete(self, reason: str) -> None:
        """Record that the dump is knowingly partial (e.g. an ingest with missing files); readers see it."""
        self._incomplete.append(reason)

    # ---------------------------------------------------------------- lifecycle
    @guarded
    def close(self) -> Path:
        """Write the manifest, mark the file finalized and move it to its final name. Returns the path."""
        if self._closed:
            return self.path
        try:
            interrupt.raise_if_signalled()  # (a SIGINT / SIGTERM whose exception was lost: never finalize)
            while self._pending:  # the statistics and digests still made in the writer's thread
                self._collect_one()
            self._stop_thread()
        except BaseException:
            self.abort()
            raise
        f = self._f
        cols, rows = list(fmt.MANIFEST_COLUMNS), self._rows
        if not self._derived:  # a version-1 dump: the manifest of version 1, without the column ``derived``
            cols, rows = cols[:-1], [r[:-1] for r in rows]
        text = fmt.to_json({"columns": cols, "rows": rows})
        self._guard.reserve(len(text.encode()) + 4096)
        f.create_dataset(fmt.MANIFEST, data=text)
        f.attrs["n_records"] = len(self._records)
        f.attrs["n_tensors"] = len(self._rows)
        f.attrs["complete"] = not self._incomplete
        f.attrs["incomplete_reasons"] = fmt.to_json(self._incomplete)
        f.attrs[DIGEST_ATTR] = self._digest.hexdigest()
        if self._derived:  # (a dump without tensors stored as integers only stays readable by version-1 readers)
            f.attrs["format_version"] = fmt.FORMAT_VERSION_INTEGERS_ONLY
        f.attrs["finalized"] = True
        f.flush()
        f.close()
        self._guard.file = None
        self._closed = True
        self._guard.release()
        trim(self._tmp)  # the space reserved ahead of HDF5 and not used
        fd = os.open(self._tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if self.path.exists() and not self.overwrite:
            os.unlink(self._tmp)
            raise UsageError("output appeared while capturing; not overwritten", self.path)

        os.chmod(self._tmp, 0o666 & ~current_umask())
        os.replace(self._tmp, self.path)
        interrupt.unregister(self._tmp)
        return self.path

    def abort(self) -> None:
        """Discard the temporary file (nothing appears under the final name)."""
        if not self._closed:
            self._closed = True
        self._stop_thread()
        self._guard.discard()  # closed with its descriptor on /dev/null: no flush can fail or crash
        interrupt.unregister(self._tmp)

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ---------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("dump writer is closed", self.path)

    def _group(self, rid: str, name: str = "") -> Any:
        """The group of record ``rid`` (``name=""``) or its subgroup ``name``, created on first use."""
        g = self._groups.get((rid, name))
        if g is None:
            g = self._groups.get((rid, ""))
            if g is None:
                g = self._groups[(rid, "")] = self._f[fmt.RECORDS][rid]
            if name:
                g = self._groups[(rid, name)] = g.require_group(name)
        return g

    def _require_record(self) -> dict[str, Any]:
        self._check_open()
        if self._cur is None:
            self.begin_record()
        assert self._cur is not None
        return self._cur


def check_writable(path: str | os.PathLike, overwrite: bool) -> None:
    """Fail early (before any capture work) when ``path`` exists and may not be overwritten."""
    p = Path(path)
    if p.exists() and not overwrite:
        raise UsageError("output exists; pass --force to replace it", p)
    if p.is_dir():
        raise InputError("output path is a directory", p)
