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
from typing import Any

from ivq_debug.comparator.comparison import SCHEMA as DIFF_SCHEMA
from ivq_debug.jsonio import load_json
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.outputs import check_outputs  # re-exported: the commands' output check lives with check_output
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
