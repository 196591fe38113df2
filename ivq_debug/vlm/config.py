"""A Hugging Face ``config.json`` as far as ivq-debug reads one (the position checks, ``ivq reference``, a session
dump's stored config): checked against :data:`HF_CONFIG_SCHEMA` before any field is used (``docs/input-formats.md``).
"""

from __future__ import annotations

import os
from typing import Any

from ivq_debug.schema import check_schema

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


def check_hf_config(doc: Any, source: str | os.PathLike | None = None) -> dict[str, Any]:
    """``doc`` when it is a Hugging Face ``config.json`` as far as ivq-debug reads one (:data:`HF_CONFIG_SCHEMA`:
    an object; ``rope_theta`` a positive number, ``head_dim`` a positive integer, ``rope_scaling`` an object,
    ``mrope_section`` integers, ``text_config`` an object, ...).

    Raises:
        InputError: the first field of the wrong type or range, naming ``source``.
    """
    check_schema(doc, HF_CONFIG_SCHEMA, source, "config.json")
    return doc


