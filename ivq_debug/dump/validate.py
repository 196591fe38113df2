"""A dump is untrusted: what the reader checks at open and before every read (issue 16).

Dumps come from other machines and CI artifacts. The reader (:mod:`ivq_debug.dump.reader`) calls these
helpers so that a hostile or broken file is one :class:`~ivq_debug.errors.InputError` (exit 3) naming the
file and the field, and so that no call reaches the HDF5 paths known to crash or to read elsewhere:

* **the file**: a regular file (a FIFO, socket, device, folder, symlink loop or too-long path is refused
  with ``stat``, before HDF5 opens it: HDF5 would block on a FIFO);
* **root attributes**: scalar strings / numbers / booleans (not arrays), ``backend_info`` and ``model``
  JSON objects, ``incomplete_reasons`` a JSON list of strings (:data:`ROOT_SCHEMA`, ``jsonschema``);
* **the manifest**: a scalar UTF-8 JSON string dataset reached by a hard link, whose rows match
  :data:`MANIFEST_COLUMN_TYPES` (types per column, non-negative integer shapes, known kinds and storage), with a
  ``key`` that is one HDF5 link name (no ``/``: never a path into another group), a ``rid`` that is a
  record, a dtype the reader knows and ``nbytes = prod(shape) * itemsize``; checked by column
  (:func:`check_columns`: each column's distinct cells against its JSON Schema, ``jsonschema``); a tensor stored
  as its integers only (``derived``, version 2) is a whole float32 tensor with raw integers and an encoding
  :func:`~ivq_debug.dump.quant.dequantize` can apply to its shape (:func:`~ivq_debug.dump.quant.encoding_problem`),
  and its integers (:func:`check_integers`) are of its shape and of an integer dtype of
  :data:`~ivq_debug.dump.quant.INTEGER_DTYPES`;
* **records**: groups reached by hard links, attributes ``sample`` / ``step`` integers, ``part`` a
  string, ``meta`` a JSON object (:data:`RECORD_SCHEMA`);
* **every dataset before it is read** (:func:`open_dataset`, :func:`check_data`): reached by a hard link
  (soft and external links are never followed), a dataset (not a group), neither virtual nor stored in
  external files, a numeric dtype (strings, variable-length, compound and object types are refused
  *before* any read: a variable-length string dataset read through the reader's ``os.preadv`` fast path
  filled an object array with file bytes, which crashed the process), and the manifest's shape and dtype;
* **HDF5 errors** while reading (a fletcher32 checksum failure, a truncated file) become one-line
  :class:`InputError` (:func:`reading`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.dump import format as fmt
from ivq_debug.dump.quant import INTEGER_DTYPES, encoding_problem
from ivq_debug.errors import InputError, one_line
from ivq_debug.inputfiles import regular_file
from ivq_debug.jsonio import parse_json
from ivq_debug.schema import check_schema, schema_error

#: dtype kinds a tensor dataset may have: bool, signed / unsigned integers, floats, complex
DATA_KINDS = "biufc"

#: the root attributes once decoded (JSON attributes parsed), checked with ``jsonschema``
ROOT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["backend", "backend_info", "model"],
    "properties": {
        "format_version": {"type": "integer", "minimum": 0},
        "finalized": {"type": "boolean"},
        "complete": {"type": "boolean"},
        "summary_only": {"type": "boolean"},
        "summary_samples": {"type": "integer", "minimum": 1},
        "n_records": {"type": "integer", "minimum": 0},
        "n_tensors": {"type": "integer", "minimum": 0},
        "backend": {"type": "string"},
        "backend_info": {"type": "object"},
        "model": {"type": "object"},
        "incomplete_reasons": {"type": "array", "items": {"type": "string"}},
        "created": {"type": "string"},
        "tool_version": {"type": "string"},
        "command": {"type": "string"},
        "host": {"type": "string"},
        "content_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    },
}

_STR = {"type": "string"}
_STR_OR_NULL = {"type": ["string", "null"]}
_COUNT = {"type": "integer", "minimum": 0}
_STAT = {"type": ["number", "null"]}
_SCALAR = {"type": ["number", "string", "boolean", "null"]}
_NUMBERS = {"anyOf": [{"type": ["number", "null"]}, {"type": "array", "items": {"type": "number"}}]}
_INT_OR_NULL = {"type": ["integer", "null"]}
#: the type of each manifest column (``docs/dump-format.md``); columns a newer writer appends are not checked
MANIFEST_COLUMN_TYPES: dict[str, dict[str, Any]] = {
    "rid": {"type": "string", "pattern": r"^r[0-9]{6,}$"},
    "sample": _COUNT,
    "part": _STR,
    "step": _COUNT,
    "kind": {"enum": list(fmt.KIND_GROUPS)},
    "name": _STR,
    "key": _STR,  # one HDF5 link name: checked with the other row rules
    "order": {"type": "integer"},
    "op_type": _STR_OR_NULL,
    "scope": _STR_OR_NULL,
    "shape": {"type": "array", "items": _COUNT},
    "dtype": _STR,
    "layout": _STR_OR_NULL,
    "stored": {"enum": ["full", "summary"]},
    "nbytes": _COUNT,
    "min": _STAT,
    "max": _STAT,
    "mean": _STAT,
    "std": _STAT,
    "nonfinite": {"type": ["integer", "null"], "minimum": 0},
    # an encoding: bitwidth, scale / zero point (a number or a flat list), axis, dtype, qmin / qmax, ...; the
    # fields the readers compute with are typed (a string scale was a ValueError, a bitwidth of 10^9 sized 2**bits)
    "encoding": {"type": ["object", "null"],
                 "properties": {"bitwidth": {"type": ["integer", "null"], "minimum": 1, "maximum": 64},
                                "scale": _NUMBERS, "zero_point": _NUMBERS, "offset": _NUMBERS,
                                "axis": {"type": ["integer", "null"]}, "qmin": _INT_OR_NULL,
                                "qmax": _INT_OR_NULL, "dtype": _STR_OR_NULL},
                 "additionalProperties": {"anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}]}},
    "has_raw": {"type": "boolean"},
    "qnn_name": _STR_OR_NULL,
    "source_file": _STR_OR_NULL,
    "derived": {"type": "boolean"},
}

_NODE = {"type": "object", "properties": {"name": _STR, "op_type": _STR_OR_NULL, "domain": _STR_OR_NULL,
                                          "ep": _STR_OR_NULL, "reason": _STR_OR_NULL, "io_offload": {"type": "boolean"}}}
#: ``/meta/<name>`` values a reader uses (:meth:`~ivq_debug.dump.reader.Dump.meta` checks them when read)
META_SCHEMAS: dict[str, dict[str, Any]] = {
    # a QNN capture's partition (``Partition.to_dict``): what diagnose's cpu_fallback and the report read
    "partition": {"type": "object", "properties": {
        "all_on_qnn": {"type": "boolean"}, "fallback_allowed": {"type": "boolean"},
        "counts": {"type": "object"}, "cpu_nodes": {"type": "array", "items": _NODE},
        "subgraphs": {"type": "array", "items": {"type": "object", "required": ["ep", "nodes"], "properties": {
            "ep": _STR, "nodes": {"type": "array", "items": {"type": "array", "items": _STR_OR_NULL}}}}},
        "rewritten": {"type": "object", "properties": {"added": {"type": "array", "items": _STR},
                                                       "removed": {"type": "array", "items": _STR}}}}},
    "kernels": {"type": "object", "properties": {"tensors": {"type": "object"}}},
}

#: one record group's attributes (``meta`` parsed), all records checked in one call
RECORD_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["sample", "part", "step", "meta"],
        "properties": {"sample": _COUNT, "part": _STR, "step": _COUNT, "meta": {"type": "object"}},
    },
}

#: a column of cells of one type (:data:`MANIFEST_COLUMN_TYPES`): what :func:`check_columns` validates
_COLUMN_SCHEMAS: dict[str, dict[str, Any]] = {c: {"type": "array", "items": t} for c, t in MANIFEST_COLUMN_TYPES.items()}


_STRUCTURAL = {"type", "items", "additionalProperties", "anyOf"}
_SCALAR_TYPES = {str, int, float, bool, type(None)}


def _structural(schema: Any) -> bool:
    """Whether only the JSON types of a cell (and of what it holds) decide it against ``schema``, not its values."""
    if not isinstance(schema, dict) or not set(schema) <= _STRUCTURAL:
        return False
    return all(_structural(x) for x in (schema.get("items"), schema.get("additionalProperties"),
                                         *schema.get("anyOf", [])) if x is not None)


def _signature(v: Any) -> Any:
    """The JSON types of a cell and of what it holds (an integral float apart: it is a JSON integer)."""
    if isinstance(v, float):
        return (float, v.is_integer())
    if isinstance(v, list):
        return (list, frozenset(map(_signature, v)))
    if isinstance(v, dict):
        return (dict, frozenset((k, _signature(x)) for k, x in v.items()))
    return type(v)


def _cell_key(v: Any) -> Any:
    """A hashable key of a cell under which equal cells of the same JSON types fall together."""
    if v is None or isinstance(v, str | int | float):
        return (type(v), v)
    if isinstance(v, list) and all(x is None or isinstance(x, str | int | float) for x in v):
        return (list, *zip(map(type, v), v, strict=True))
    try:
        return json.dumps(v, sort_keys=True)
    except (TypeError, ValueError):
        return (id(v),)  # validated on its own


def _first(keys: list[Any]) -> list[int] | None:
    """Positions of the first occurrence of each distinct key (None when a key is unhashable)."""
    try:
        first = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))  # the earliest wins
    except TypeError:
        return None
    return sorted(first.values())


def _distinct(col: tuple[Any, ...], schema: dict[str, Any]) -> list[int]:
    """Positions of the cells that stand for the whole column against ``schema`` (see :func:`check_columns`):
    the first of each JSON type signature when types are all the schema asks, else of each distinct value."""
    kinds = set(map(type, col))
    if _structural(schema):
        text = str(schema)
        if kinds <= _SCALAR_TYPES and not (float in kinds and "integer" in text and "number" not in text):
            types = list(map(type, col))
            return sorted(types.index(t) for t in kinds)
        return _first(list(map(_signature, col))) or []
    at = _first(list(col) if len(kinds) == 1 else list(zip(map(type, col), col, strict=True)))
    if at is None and kinds == {list}:  # lists of scalars (shapes): values and their item types
        try:
            at = _first(list(zip(map(tuple, col), map(tuple, map(map, [type] * len(col), col)), strict=True)))
        except TypeError:
            at = None
    return at if at is not None else _first([_cell_key(v) for v in col]) or []


def check_columns(columns: list[str], rows: list[Any], path: Path, what: str = "manifest") -> None:
    """Every row a list of one cell per column, and each known column's cells of its type
    (:data:`MANIFEST_COLUMN_TYPES`). One ``jsonschema`` validation per column over its *distinct* cells
    (by JSON type signature where types are all the schema asks): 20,000 rows in about 65 ms, as fast as
    the compiled row-by-row validator it replaced (``bench/bench_open.py``)."""
    n = len(columns)
    if set(map(type, rows)) - {list} or set(map(len, rows)) - {n}:
        i, r = next((i, r) for i, r in enumerate(rows) if not isinstance(r, list) or len(r) != n)
        got = f"{len(r)} cells" if isinstance(r, list) else f"a {type(r).__name__}"
        raise InputError(f"{what} row {i}: {got} for {n} columns", path)
    for c, col in zip(columns, zip(*rows, strict=True) if rows else [() for _ in columns], strict=True):
        schema = MANIFEST_COLUMN_TYPES.get(c)
        if schema is None:
            continue  # a column a newer writer appended
        try:
            at = _distinct(col, schema)
            err = schema_error([col[i] for i in at], _COLUMN_SCHEMAS[c])
        except RecursionError:
            raise InputError(f"{what} column {c!r}: a cell is nested too deeply", path) from None
        if err is not None:
            (k, *rest), msg = err
            raise InputError(f"{what} row {at[k]} {c}" + "".join(f"[{x}]" for x in rest) + f": {msg}", path)


def _check(doc: Any, schema: dict[str, Any], path: Path, where: Any) -> None:
    """Validate with ``jsonschema``; the error names the field through ``where(path parts)``."""
    err = schema_error(doc, schema)
    if err is not None:
        raise InputError(f"{where([str(p) for p in err[0]])}: {err[1]}", path)


# ============================================================================ the file and its root
def check_file(path: str | os.PathLike) -> Path:
    """The dump path, when it names a regular file (before HDF5 opens it)."""
    return regular_file(path, "dump")


def _attr(attrs: Any, name: str, path: Path) -> Any:
    """One root / record attribute as a Python value: a str, int, float, bool or None (absent)."""
    try:
        v = attrs.get(name)
    except (OSError, TypeError, ValueError, KeyError, RuntimeError) as e:
        raise InputError(f"attribute {name!r} is unreadable ({one_line(e, 120)})", path) from None
    if isinstance(v, np.ndarray):
        if v.ndim != 0:
            raise InputError(f"attribute {name!r} must be a scalar, got an array of shape {list(v.shape)}", path)
        v = v[()]
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"attribute {name!r} is not UTF-8 text", path) from None
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if v is None or isinstance(v, str | int | float | bool):
        return v
    raise InputError(f"attribute {name!r} has an unsupported type ({type(v).__name__})", path)


def _json_attr(attrs: Any, name: str, path: Path, default: str) -> Any:
    v = _attr(attrs, name, path)
    if v is None:
        v = default
    if not isinstance(v, str):
        raise InputError(f"attribute {name!r} must be a JSON string, got {one_line(repr(v), 60)}", path)
    return parse_json(v, path, f"attribute {name!r}")


def root_attributes(attrs: Any, path: Path) -> dict[str, Any]:
    """The root attributes decoded and checked (:data:`ROOT_SCHEMA`); ``format`` is checked by the caller."""
    out: dict[str, Any] = {}
    for k in ("format_version", "finalized", "complete", "summary_only", "summary_samples", "n_records",
              "n_tensors", "backend", "created", "tool_version", "command", "host", "content_sha256"):
        v = _attr(attrs, k, path)
        if v is not None:
            out[k] = v
    for k in ("finalized", "complete", "summary_only"):  # h5py stores a bool as an enum, older writers as int
        if isinstance(out.get(k), int) and out[k] in (0, 1):
            out[k] = bool(out[k])
    for k, default in (("backend_info", "{}"), ("model", "{}"), ("incomplete_reasons", "[]")):
        if k in ("backend_info", "model") and _attr(attrs, k, path) is None:
            continue  # required: the schema names it
        out[k] = _json_attr(attrs, k, path, default)
    check_schema(out, ROOT_SCHEMA, path, "attribute")
    return out


# ============================================================================ links and JSON datasets
def _link_kind(group: Any, name: str) -> str | None:
    """``hard``, ``soft``, ``external`` (or another link class), or None when there is no such link (``group``: an
    h5py group or its low-level id)."""
    import h5py

    gid = group.id if hasattr(group, "attrs") else group  # (a low-level id's .id is its integer handle)
    try:
        t = gid.links.get_info(name.encode("utf-8", "surrogateescape")).type
    except (KeyError, RuntimeError, ValueError):
        return None
    return {h5py.h5l.TYPE_HARD: "hard", h5py.h5l.TYPE_SOFT: "soft", h5py.h5l.TYPE_EXTERNAL: "external"}.get(
        t, "user-defined")


def _object_kind(group: Any, name: str) -> str:
    import h5py

    t = h5py.h5o.get_info(group.id if hasattr(group, "attrs") else group, name.encode("utf-8", "surrogateescape")).type
    return {h5py.h5o.TYPE_GROUP: "group", h5py.h5o.TYPE_DATASET: "dataset"}.get(t, "named datatype")


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def member(group: Any, name: str, kind: str, what: str, path: Path, required: bool = True) -> Any:
    """``group[name]`` when it is a hard link to an object of ``kind`` (``group`` or ``dataset``); a soft,
    external or user-defined link is never followed. None when absent and not ``required``."""
    link = _link_kind(group, name)
    if link is None:
        if required:
            raise InputError(f"{what} is missing", path)
        return None
    if link != "hard":
        raise InputError(f"{what} is {_article(link)} {link} link (links are never followed)", path)
    try:
        got = _object_kind(group, name)
    except (KeyError, RuntimeError, ValueError, OSError) as e:
        raise InputError(f"{what} is unreadable ({one_line(e, 120)})", path) from None
    if got != kind:
        raise InputError(f"{what} is a {got}, not a {kind}", path)
    return group[name]


def json_dataset(group: Any, name: str, what: str, path: Path, depth_check: bool = True) -> Any:
    """A JSON document stored as a scalar string dataset (the manifest, a table, a meta value)."""
    import h5py

    ds = member(group, name, "dataset", what, path)
    if ds.shape != () or h5py.check_string_dtype(ds.dtype) is None:
        raise InputError(f"{what} is not a JSON string (dtype {ds.dtype}, shape {ds.shape})", path)
    with reading(what, path):
        raw = ds[()]
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as e:
        raise InputError(f"{what} is not UTF-8 text (byte {e.start})", path) from None
    return parse_json(text, path, what, depth_check=depth_check)


# ============================================================================ manifest and records
def manifest(f: Any, records: set[str], path: Path) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` of the manifest, checked (:func:`check_columns` and the row rules above)."""
    doc = json_dataset(f, fmt.MANIFEST, "manifest", path, depth_check=False)
    if not isinstance(doc, dict) or not isinstance(doc.get("columns"), list):
        raise InputError("manifest must be an object with 'columns' and 'rows'", path)
    cols = doc["columns"]
    if not all(isinstance(c, str) for c in cols):
        raise InputError("manifest: columns must be strings", path)
    if len(set(cols)) != len(cols):
        raise InputError("manifest: a column is listed twice", path)
    missing = [c for c in fmt.MANIFEST_COLUMNS if c not in cols and c not in fmt.OPTIONAL_COLUMNS]
    if missing:
        raise InputError(f"manifest: missing column(s) {missing}", path)
    if not isinstance(doc.get("rows"), list):
        raise InputError("manifest: rows must be a list", path)
    check_columns(cols, doc["rows"], path)
    c = {n: i for i, n in enumerate(cols)}
    ci = [c[n] for n in ("rid", "kind", "name", "key", "dtype", "shape", "nbytes", "stored")]
    di = c.get("derived")
    for i, r in enumerate(doc["rows"]):
        rid, kind, name, k, dtype, shape, nbytes, stored = (r[j] for j in ci)
        if di is not None and r[di]:
            derived_row(i, r, c, path)
        if rid not in records:
            raise InputError(f"manifest row {i}: rid {rid!r} is not a record of the dump", path)
        if "/" in k or "\x00" in k or k in ("", ".", ".."):
            raise InputError(f"manifest row {i}: key {k!r} is not one HDF5 link name", path)
        item = stored_dtype(dtype, path, f"manifest row {i}").itemsize
        if nbytes != math.prod(shape) * item:
            raise InputError(f"manifest row {i} ({name!r}): nbytes {nbytes} is not shape {shape} x {item} bytes",
                             path)
        if stored == "summary" and kind != "tensor":
            raise InputError(f"manifest row {i}: only tensors are stored summary-only", path)
    return cols, doc["rows"]


def derived_row(i: int, row: list[Any], c: dict[str, int], path: Path) -> None:
    """A manifest row of a tensor stored as its integers only: a whole float32 tensor with raw integers and an
    encoding :func:`~ivq_debug.dump.quant.dequantize` can apply to its shape."""
    name = row[c["name"]]
    what = f"manifest row {i} ({name!r}), stored as its integers only"
    if row[c["kind"]] != "tensor" or row[c["stored"]] != "full" or row[c["dtype"]] != "float32":
        raise InputError(f"{what}: must be a whole float32 tensor, not {row[c['kind']]} {row[c['stored']]} "
                         f"{row[c['dtype']]}", path)
    if not row[c["has_raw"]]:
        raise InputError(f"{what}: has_raw is false", path)
    problem = encoding_problem(row[c["encoding"]], tuple(row[c["shape"]]))
    if problem is not None:
        raise InputError(f"{what}: its encoding cannot rebuild the values ({problem})", path)


def check_integers(ds: Any, entry: Any, path: Path) -> None:
    """The raw integers of a tensor (``q/<key>``): of the tensor's shape and an integer dtype; for a tensor stored
    as its integers only (``entry.derived``), one of :data:`~ivq_debug.dump.quant.INTEGER_DTYPES`."""
    what = f"the integers of {entry.name!r}"
    if tuple(ds.shape) != tuple(entry.shape):
        raise InputError(f"{what}: shape {list(ds.shape)}, the manifest says {list(entry.shape)}", path)
    dt = ds.dtype
    if dt.kind not in "iu" or (entry.derived and dt.name not in INTEGER_DTYPES):
        allowed = ", ".join(INTEGER_DTYPES) if entry.derived else "integers"
        raise InputError(f"{what}: dtype {dt}, expected {allowed}", path)


def records(f: Any, path: Path) -> list[dict[str, Any]]:
    """The records (``rid``, ``sample``, ``part``, ``step``, ``meta``), checked (:data:`RECORD_SCHEMA`)."""
    grp = member(f, fmt.RECORDS, "group", "records", path)
    out = []
    for rid in grp:
        g = member(grp, rid, "group", f"record {rid!r}", path)
        a = g.attrs
        out.append({"rid": rid, "sample": _attr(a, "sample", path), "part": _attr(a, "part", path),
                    "step": _attr(a, "step", path), "meta": _json_attr(a, "meta", path, "{}")})

    def where(parts: list[str]) -> str:
        if parts and parts[0].isdigit() and int(parts[0]) < len(out):
            return f"record {out[int(parts[0])]['rid']!r} " + ".".join(parts[1:])
        return "records"

    _check(out, RECORD_SCHEMA, path, where)
    return out


#: a stored table (``/tables/<name>``): ``{"columns": [str, ...], "rows": [[...], ...]}``
TABLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["columns", "rows"],
    "properties": {"columns": {"type": "array", "items": {"type": "string"}},
                   "rows": {"type": "array", "items": {"type": "array"}}},
}


def table(doc: Any, what: str, path: Path) -> dict[str, Any]:
    """A stored table checked (:data:`TABLE_SCHEMA`, every row as long as the columns)."""
    _check(doc, TABLE_SCHEMA, path, lambda parts: what + "".join(f"[{p}]" for p in parts))
    n = len(doc["columns"])
    bad = next((i for i, r in enumerate(doc["rows"]) if len(r) != n), None)
    if bad is not None:
        raise InputError(f"{what}: row {bad} has {len(doc['rows'][bad])} cells for {n} columns", path)
    return doc


# ============================================================================ tensor datasets
def stored_dtype(name: str, path: Path, where: str) -> np.dtype:
    """The numpy dtype a tensor of manifest dtype ``name`` is stored in (bfloat16 / float8: an integer view)."""
    view = fmt.VIEW_DTYPES.get(name)
    if view is not None:
        return np.dtype(view)
    try:
        dt = np.dtype(name)
    except TypeError:
        raise InputError(f"{where}: unknown dtype {name!r}", path) from None
    if dt.kind not in DATA_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise InputError(f"{where}: dtype {name!r} is not a numeric tensor type", path)
    return dt


def open_dataset(group: Any, key: str, what: str, path: Path, dapl: Any = None) -> Any:
    """The dataset ``group/key`` checked before anything reads it (:func:`open_dataset_id`), as an h5py dataset."""
    import h5py

    return h5py.Dataset(open_dataset_id(group.id, key, what, path, dapl)[0], readonly=True)


def open_dataset_id(gid: Any, key: str, what: str, path: Path, dapl: Any = None) -> tuple[Any, Any]:
    """The dataset ``key`` of the group ``gid`` (a low-level group id) checked before anything reads it: a hard link
    to a dataset, not virtual, not in external files, of a numeric dtype (:data:`DATA_KINDS`, no strings /
    variable-length / compound / object types), with a dataspace. Returns h5py's low-level ``(DatasetID, its
    creation property list)``: a reader that needs only the dtype, shape and file offset of many small tensors
    makes no high-level ``Dataset`` (``ivq-diff`` of a 12-block ViT opens 3,872 datasets: 207 -> ~100 µs each)."""
    import h5py

    link = _link_kind(gid, key)
    if link is None:
        raise InputError(f"manifest lists {what} but its data is missing", path)
    if link != "hard":
        raise InputError(f"{what} is {_article(link)} {link} link (links are never followed)", path)
    try:
        dsid = h5py.h5d.open(gid, key.encode("utf-8", "surrogateescape"), dapl)
    except (KeyError, ValueError, RuntimeError, OSError) as e:
        try:
            kind = _object_kind(gid, key)
        except (KeyError, ValueError, RuntimeError, OSError):  # a corrupt object header (its checksum) too
            raise InputError(f"{what} is unreadable ({one_line(e, 120)})", path) from None
        raise InputError(f"{what} is a {kind}, not a dataset", path) from None
    dcpl = dsid.get_create_plist()
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        raise InputError(f"{what} is a virtual dataset (its data lives in other files; never read)", path)
    if dcpl.get_external_count():
        raise InputError(f"{what} is stored in external files (never read)", path)
    dt = dsid.dtype
    if (dt.kind not in DATA_KINDS or dt.fields is not None or dt.subdtype is not None
            or h5py.check_vlen_dtype(dt) is not None or h5py.check_string_dtype(dt) is not None):
        raise InputError(f"{what} has dtype {dt} (a tensor is numeric; strings, variable-length and compound "
                         "types are never read)", path)
    if dsid.shape is None:
        raise InputError(f"{what} has no dataspace (a null dataset)", path)
    return dsid, dcpl


def check_data(ds: Any, shape: tuple[int, ...], dtype: str, what: str, path: Path) -> None:
    """The dataset (an h5py dataset or its low-level id) holds what the manifest says: its shape and (stored)
    dtype."""
    if tuple(ds.shape) != tuple(shape):
        raise InputError(f"{what}: the manifest says shape {list(shape)}, the data is {list(ds.shape)}", path)
    want = stored_dtype(dtype, path, what)
    got = ds.dtype
    if (got.kind, got.itemsize) != (want.kind, want.itemsize):
        raise InputError(f"{what}: the manifest says dtype {dtype}, the data is {got}", path)


@contextmanager
def reading(what: str, path: Path) -> Iterator[None]:
    """HDF5 / h5py errors while reading (a fletcher32 checksum failure, a cut file) as one-line InputErrors."""
    try:
        yield
    except InputError:
        raise
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as e:
        raise InputError(f"cannot read {what} ({one_line(e, 200)})", path) from None
