"""Checks at the command boundary, one function per kind of user input (issue 16).

The commands call these before any work, so that a bad input is one line on stderr with its exit code
(``docs/input-formats.md``) and nothing is written:

* :func:`check_outputs`: no output replaces an input (real path or inode, even with ``--force``), and no two
  outputs of one command name the same file (exit 2).
* :func:`read_name_map` / :func:`read_baseline`: the ``--map`` and ``--baseline`` JSON files of ``ivq-diff``
  and ``ivq report``, checked against :data:`MAP_SCHEMA` / :data:`BASELINE_SCHEMA` (exit 3).
* :func:`check_feeds`: each ``--inputs`` sample against the model's graph inputs (names, dtype, rank, static
  dims; exit 3 naming the file), before a session runs.
* :func:`check_model`: an ONNX model given only for its graph (``ivq report --model``) is read now, not when
  an export first needs it.

Readers of the file formats validate themselves (``util.read_arrays``, ``qnn.encodings``, ``qnn.netjson``,
``qnn.profiling``, ``onnxgraph.load``, the dump reader); this module holds the checks that belong to no
reader.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ivq_debug.comparator.comparison import SCHEMA as DIFF_SCHEMA
from ivq_debug.errors import InputError, UsageError
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.qnn.quantize import InputSpec, model_inputs
from ivq_debug.util import check_output, check_schema, load_json

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
_POS_INT = {"type": "integer", "minimum": 1}
_THETA = {"type": "number", "exclusiveMinimum": 0}
_ROPE_PARAMS = {"type": ["object", "null"], "properties": {
    "rope_theta": _THETA, "rope_type": {"type": "string"}, "type": {"type": "string"},
    "factor": {"type": ["number", "null"], "exclusiveMinimum": 0},
    "partial_rotary_factor": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "mrope_section": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}}}}
_TEXT_CONFIG_FIELDS = {
    "rope_theta": _THETA, "head_dim": {"type": ["integer", "null"], "minimum": 1}, "hidden_size": _POS_INT,
    "num_attention_heads": _POS_INT, "partial_rotary_factor": _ROPE_PARAMS["properties"]["partial_rotary_factor"],
    "rope_parameters": _ROPE_PARAMS, "rope_scaling": _ROPE_PARAMS,
    "image_token_id": {"type": ["integer", "null"], "minimum": 0}}
#: the fields of a Hugging Face ``config.json`` that ivq-debug reads (the position checks, ``ivq reference``):
#: types and ranges only; every other field is the model's business and passes
HF_CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {**_TEXT_CONFIG_FIELDS,
                   "text_config": {"type": ["object", "null"], "properties": _TEXT_CONFIG_FIELDS},
                   "llm_config": {"type": ["object", "null"], "properties": _TEXT_CONFIG_FIELDS},
                   "vision_config": {"type": ["object", "null"], "properties": {"spatial_merge_size": _POS_INT}}},
}


def check_hf_config(doc: Any, source: PathLike | str | None = None) -> dict[str, Any]:
    """``doc`` when it is a Hugging Face ``config.json`` as far as ivq-debug reads one (:data:`HF_CONFIG_SCHEMA`:
    an object; ``rope_theta`` a positive number, ``head_dim`` a positive integer, ``rope_scaling`` an object,
    ``mrope_section`` integers, ``text_config`` an object, ...).

    Raises:
        InputError: the first field of the wrong type or range, naming ``source``.
    """
    check_schema(doc, HF_CONFIG_SCHEMA, source, "config.json")
    return doc


def check_outputs(outputs: Iterable[PathLike | None], inputs: Iterable[PathLike | None],
                  overwrite: bool = False, *, folders_exist: bool = True) -> None:
    """:func:`~ivq_debug.util.check_output` for every output (``None`` and ``"-"``, stdout, are skipped),
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


def check_feeds(samples: Sequence[Mapping[str, np.ndarray]], model: Any, sources: Sequence[PathLike]) -> None:
    """Every sample holds exactly the model's graph inputs, each with the input's dtype, rank and static
    dimensions (what ONNX Runtime would refuse mid-run, said up front and naming the file).

    Args:
        samples: one ``name -> array`` mapping per ``--inputs`` file.
        model: the ``onnx.ModelProto`` (or a path) the samples feed.
        sources: the file each sample came from (named in the error).

    Raises:
        InputError: a missing or extra array, another dtype, rank or static dimension (exit 3).
    """
    m = load_model(model)
    want = {s.name: s for s in model_inputs(m)}
    # what the graph declares: a tensor element type (0: not a tensor / unknown) and a shape (absent: any rank)
    declared = {vi.name: (vi.type.tensor_type.elem_type, vi.type.tensor_type.HasField("shape")) for vi in m.graph.input}
    for feeds, src in zip(samples, sources, strict=True):
        missing = [n for n in want if n not in feeds]
        if missing:
            raise InputError(f"missing model input(s) {missing} (the model's inputs: {list(want)})", src)
        extra = [n for n in feeds if n not in want]
        if extra:
            raise InputError(f"array(s) {extra} are not inputs of the model (its inputs: {list(want)})", src)
        for name, arr in feeds.items():
            elem, ranked = declared.get(name, (0, False))
            _check_feed(name, np.asarray(arr), want[name], src, typed=elem != 0, ranked=ranked)


def _check_feed(name: str, a: np.ndarray, spec: InputSpec, src: PathLike, *, typed: bool, ranked: bool) -> None:
    if typed and a.dtype != spec.dtype:
        raise InputError(f"input {name!r} is {a.dtype}, the model expects {spec.dtype}", src)
    if not ranked:
        return
    if len(spec.shape) != a.ndim:
        raise InputError(f"input {name!r} has rank {a.ndim} (shape {list(a.shape)}), the model expects rank "
                         f"{len(spec.shape)} {_dims(spec.shape)}", src)
    for i, (have, dim) in enumerate(zip(a.shape, spec.shape, strict=True)):
        if dim is not None and dim > 0 and have != dim:
            raise InputError(f"input {name!r}: dimension {i} is {have}, the model expects {dim} "
                             f"{_dims(spec.shape)}", src)


def _dims(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None or d <= 0 else str(d) for d in shape) + "]"


__all__ = ["BASELINE_SCHEMA", "MAP_SCHEMA", "check_feeds", "check_model", "check_outputs",
           "read_baseline", "read_name_map"]
