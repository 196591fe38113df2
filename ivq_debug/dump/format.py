"""Layout constants and small helpers of the HDF5 golden-dump format (see ``docs/dump-format.md``)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ivq_debug.defaults import DUMP_FORMAT, DUMP_FORMAT_VERSION

FORMAT = DUMP_FORMAT
FORMAT_VERSION = DUMP_FORMAT_VERSION  # the newest version the readers read
#: the version a writer writes: 1, or 2 once a tensor is stored as its integers only (manifest column ``derived``)
FORMAT_VERSION_VALUES = 1
FORMAT_VERSION_INTEGERS_ONLY = 2

RECORDS = "records"
MANIFEST = "manifest"
TABLES = "tables"
META = "meta"

#: groups inside a record
KIND_GROUPS = {"input": "in", "tensor": "t"}
RAW_GROUP = "q"  # raw quantized integers of a tensor (same key as the tensor)
SAMPLE_GROUP = "s"  # sampled values of a tensor stored summary-only

#: manifest columns, in order
MANIFEST_COLUMNS = (
    "rid",
    "sample",
    "part",
    "step",
    "kind",
    "name",
    "key",
    "order",
    "op_type",
    "scope",
    "shape",
    "dtype",
    "layout",
    "stored",
    "nbytes",
    "min",
    "max",
    "mean",
    "std",
    "nonfinite",
    "encoding",
    "has_raw",
    "qnn_name",
    "source_file",
    "derived",
)
#: manifest columns added after version 1 was fixed (optional: older dumps lack them, readers give ``None``;
#: ``derived``: false)
OPTIONAL_COLUMNS = ("qnn_name", "source_file", "derived")

#: dtypes numpy cannot hold natively: stored as a same-width integer view, named in the ``dtype`` attribute
#: the order of a record's parts wherever records are listed (a VLM: vision, then the language model's prefill and
#: decode steps; ``model`` for a single-part capture); other part names come after them (:func:`part_rank`)
PART_ORDER: dict[str, int] = {"vision": 0, "model": 1, "prefill": 2, "decode": 3}


def part_rank(part: object) -> int:
    """The sort rank of a part name (:data:`PART_ORDER`; unknown names after the known ones)."""
    return PART_ORDER.get(str(part), len(PART_ORDER))


VIEW_DTYPES = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


def escape_name(name: str) -> str:
    """Make a tensor name usable as one HDF5 link name (reversible: see :func:`unescape_name`)."""
    if not name:
        return "%00"
    out = name.replace("%", "%25").replace("/", "%2F")
    if out in (".", ".."):
        out = out.replace(".", "%2E")
    return out


def unescape_name(key: str) -> str:
    """Inverse of :func:`escape_name`."""
    if key == "%00":
        return ""
    return key.replace("%2E", ".").replace("%2F", "/").replace("%25", "%")


def record_id(index: int) -> str:
    """HDF5 group name of the ``index``-th record."""
    return f"r{index:06d}"


def to_json(value: Any) -> str:
    """JSON with numpy scalars and arrays converted; non-finite floats become strings."""

    def default(o: Any) -> Any:
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, (set, tuple)):
            return list(o)
        return str(o)

    return json.dumps(value, default=default, allow_nan=True, separators=(",", ":"))
