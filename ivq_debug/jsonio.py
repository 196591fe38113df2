"""JSON in and out: decoding with bounded nesting (CPython's decoder recurses) and failures that name the
file, line and column; values made JSON-safe; a table cell or JSON field as a float.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from ivq_debug.errors import InputError
from ivq_debug.inputfiles import read_input_text

#: JSON nesting deeper than this is refused before decoding (real files nest < 10 levels)
MAX_JSON_DEPTH = 200


#: a JSON string, or an unterminated one running to the end of the text (never fails, so no rescans)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``text`` opens more than ``limit`` nested arrays / objects (strings are skipped).

    The strings go by one regular-expression pass, the brackets left are summed by numpy: the character loop
    it replaces took 70 ms on a QNN context cache entry's 0.7 MB ``meta.json``, read at every cache hit."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if len(brackets) <= limit:
        return False
    b = np.frombuffer(brackets.encode("ascii"), np.uint8)
    return bool(np.cumsum(np.where((b == 91) | (b == 123), 1, -1)).max() > limit)


def parse_json(text: str, source: str | os.PathLike | None = None, what: str = "JSON", *,
               depth_check: bool = True) -> Any:
    """Decode JSON text; one-line :class:`InputError` (naming ``source``, and ``what`` when given) for bad or
    too deeply nested JSON. ``depth_check=False`` skips the scan for deep nesting (a document this package
    wrote and checks by schema: the manifest); Python's own recursion limit still holds."""
    import json

    if depth_check and len(text) > 2 * MAX_JSON_DEPTH and json_depth_exceeds(text):
        raise InputError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep", source)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        named = "" if what == "JSON" else f"{what}: "
        raise InputError(f"{named}bad JSON at line {e.lineno} column {e.colno}: {e.msg}", source) from None
    except RecursionError:
        raise InputError(f"{what} is nested too deeply", source) from None


def load_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read a JSON input file: a regular file (:func:`open_input`), UTF-8, bounded nesting, valid JSON.

    A UTF-8 byte-order mark is skipped (some Windows editors write one).
    """
    text = read_input_text(path, what)
    return parse_json(text.removeprefix("\ufeff"), path, what)


def as_float(v: object) -> float | None:
    """``float(v)``, or None for None, NaN and values that are not numbers (table cells, JSON fields)."""
    if v is None:
        return None
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """A JSON document from a file (:func:`load_json`: a regular file, UTF-8 without NUL bytes, bounded
    nesting); one-line :class:`~ivq_debug.errors.InputError` naming it when it is missing, unreadable or not
    JSON (``what`` names the kind of file in the message)."""
    return load_json(path, what)


def json_safe(obj: Any) -> Any:
    """Replace non-finite floats by the strings ``"inf"``, ``"-inf"``, ``"nan"`` (strict JSON)."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, (np.floating,)):
        return json_safe(float(obj))
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
