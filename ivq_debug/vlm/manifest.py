"""The manifest (``export.json``) of a VLM export folder: its name and reader.

It sits below :mod:`ivq_debug.vlm.export` (which writes it) and :mod:`ivq_debug.vlm.scheduler` (which
reads it), so the exporter can build its example feeds with the scheduler without an import cycle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ivq_debug.errors import InputError

#: manifest file name inside an export folder
MANIFEST = "export.json"
#: schema of the fixed-cache split export
SCHEMA = "ivq-vlm-export/1"
#: the HF model config an export folder carries (``model.config.to_json_string()``)
CONFIG_FILE = "config.json"
#: manifest facts a capture through the export records in its dump's model attributes
ATTR_KEYS = ("model", "family", "exporter", "deepstack", "mrope_layout", "num_layers", "image_token_id")


def load_manifest(folder: str | os.PathLike, schema: str = SCHEMA) -> dict[str, Any]:
    """Read ``export.json`` of an export folder (InputError when missing, malformed or of another ``schema``)."""

    p = Path(folder) / MANIFEST
    if not p.is_file():
        raise InputError("not an ivq VLM export folder (no export.json)", folder)
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"bad JSON: {e}", p) from e
    if m.get("schema") != schema:
        raise InputError(f"unknown export schema {m.get('schema')!r}", p)
    return m


def model_attrs(folder: str | os.PathLike, schema: str = SCHEMA) -> dict[str, Any]:
    """Dump model attributes of a capture through an export folder: the HF ``config`` (a dict, what the
    diagnostics read RoPE, M-RoPE layout and DeepStack facts from), its source and the manifest's facts
    (:data:`ATTR_KEYS`) under ``export``. An export without a ``config.json`` gives no ``config``."""
    folder = Path(folder)
    m = load_manifest(folder, schema)
    attrs: dict[str, Any] = {"export": {k: m[k] for k in ATTR_KEYS if k in m}}
    cfg = folder / CONFIG_FILE
    if cfg.is_file():
        try:
            attrs["config"] = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"bad JSON: {e}", cfg) from e
        attrs["config_source"] = str(cfg.resolve())
    return attrs
