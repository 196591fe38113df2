"""Checks at the command boundary, one function per kind of user input (issue 16).

The commands call these before any work, so that a bad input is one line on stderr with its exit code
(``docs/input-formats.md``) and nothing is written:

* :func:`check_outputs`: no output replaces an input (real path or inode, even with ``--force``), and no two
  outputs of one command name the same file (exit 2).
* :func:`read_name_map` / :func:`read_baseline`: the ``--map`` and ``--baseline`` JSON files of ``ivq-diff``
  and ``ivq report``, checked against :data:`MAP_SCHEMA` / :data:`BASELINE_SCHEMA` (exit 3).
* :func:`check_model`: an ONNX model given only for its graph (``ivq report --model``) is read now, not when
  an export first needs it.

Readers of the file formats validate themselves (``arrays.read_arrays``, ``qnn.encodings``, ``qnn.netjson``,
``qnn.profiling``, ``onnxgraph.load``, the dump reader); this module holds the checks that belong to no
reader. The feeds of a model are checked by :func:`ivq_debug.onnxgraph.inputs.check_feeds`, a Hugging Face
``config.json`` by :func:`ivq_debug.vlm.config.check_hf_config`: beside what they check, so that capture
modules import neither the comparator nor the quantizer through this one.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from typing import Any

from ivq_debug.comparator.comparison import SCHEMA as DIFF_SCHEMA
from ivq_debug.errors import UsageError
from ivq_debug.jsonio import load_json
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.outputs import check_output
from ivq_debug.schema import check_schema

PathLike = str | os.PathLike

#: ``--map``: ``{ref_name: test_name}``
MAP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"type": "string"},
}

_METRIC_VALUE = {
    "anyOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}, {"type": "null"}],
    "x-message": "must be a number, 'inf', '-inf', 'nan' or null",
}

#: ``--baseline``: an ``ivq-diff/1`` document; only what :func:`~ivq_debug.comparator.regressions_against` and
#: ``--fail-on`` (its findings) read
BASELINE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema", "layers"],
    "properties": {
        "schema": {"const": DIFF_SCHEMA},
        "layers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["ref_name", "record", "metrics", "status"],
                "properties": {
                    "ref_name": {"type": "string"},
                    "record": {
                        "type": "object",
                        "required": ["sample", "part", "step"],
                        "properties": {"sample": {"type": "integer"}, "part": {"type": "string"},
                                       "step": {"type": "integer"}},
                    },
                    "metrics": {"type": "object", "additionalProperties": _METRIC_VALUE},
                    "status": {"type": "string"},
                    "violations": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
        # what ivq-diff --fail-on reads (cli.diff.failing_findings: kind, tensor, node, record)
        "findings": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"type": "string"},
                    "where": {
                        "type": ["object", "null"],
                        "properties": {"tensor": {"type": ["string", "null"]}, "node": {"type": ["string", "null"]}},
                    },
                },
            },
        },
    },
}


# ============================================================================ outputs
def check_outputs(outputs: Iterable[PathLike | None], inputs: Iterable[PathLike | None],
                  overwrite: bool = False, *, folders_exist: bool = True) -> None:
    """:func:`~ivq_debug.outputs.check_output` for every output (``None`` and ``"-"``, stdout, are skipped),
    then refuse two outputs that are one file (same real path, or the same inode when both exist).

    With ``folders_exist`` (the default: outputs a user named, ``-o missing/x.h5``), an output whose folder does not
    exist is refused too, rather than the folder made silently; a command that owns a folder it creates (``ivq
    tune``'s workdir) passes False.

    Raises:
        UsageError: an output would replace an input or another output, exists without ``overwrite``, or its folder
            does not exist.
    """
    ins = [i for i in inputs if i is not None]
    seen: list[tuple[str, tuple[int, int] | None, PathLike]] = []
    for out in outputs:
        if out is None or os.fspath(out) == "-":
            continue
        check_output(out, ins, overwrite)
        parent = os.path.dirname(os.fspath(out)) or "."
        if folders_exist and not os.path.isdir(parent):
            raise UsageError(f"the output folder {parent!r} does not exist (create it first)", out)
        real = os.path.realpath(out)
        try:
            st = os.stat(out)
            ino: tuple[int, int] | None = (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None
        except OSError:
            ino = None
        for other_real, other_ino, other in seen:
            if real == other_real or (ino is not None and ino == other_ino):
                raise UsageError(f"two outputs name the same file ({os.fspath(other)!r})", out)
        seen.append((real, ino, out))


# ============================================================================ ivq-diff JSON inputs
def read_name_map(path: PathLike) -> dict[str, str]:
    """The ``--map`` file: a JSON object of ``ref_name: test_name`` strings (:data:`MAP_SCHEMA`)."""
    doc = load_json(path, "mapping file")
    check_schema(doc, MAP_SCHEMA, path)
    return doc


def read_baseline(path: PathLike) -> dict[str, Any]:
    """The ``--baseline`` file: an ``ivq-diff/1`` result with typed layers (:data:`BASELINE_SCHEMA`)."""
    doc = load_json(path, "baseline file")
    check_schema(doc, BASELINE_SCHEMA, path)
    return doc


# ============================================================================ model inputs
def check_model(path: PathLike | None) -> Any:
    """Load an ONNX model given for its graph only (``None`` passes); :class:`InputError` when unreadable."""
    return None if path is None else load_model(path)


__all__ = ["BASELINE_SCHEMA", "MAP_SCHEMA", "check_model", "check_outputs",
           "read_baseline", "read_name_map"]
