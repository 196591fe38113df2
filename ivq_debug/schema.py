"""JSON Schema checks (Draft 2020-12, ``jsonschema``, the package's one schema engine): the most relevant
violation as one short line naming the field.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

from ivq_debug.errors import InputError, one_line

_VALIDATORS: dict[int, Any] = {}


_TYPE_WORDS = {"number": "a number", "integer": "an integer", "array": "a list", "object": "an object",
               "string": "a string", "boolean": "true or false", "null": "null"}


def _short(v: Any) -> str:
    if isinstance(v, dict):
        return f"an object ({len(v)} keys)"
    if isinstance(v, list):
        return f"a list of {len(v)}"
    return one_line(repr(v), 60)


def _where(path: Iterable[Any]) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if str(k).isidentifier() else f"[{k!r}]")
    return out.lstrip(".")


def schema_message(err: Any) -> str:
    """A short message for a ``jsonschema`` error: ``missing 'bitwidth'``, ``must be a number, got 'abc'``,
    or the schema's own ``x-message`` (a key the validator ignores) for combined rules."""
    e = err
    while e is not None:
        if isinstance(e.schema, dict) and e.schema.get("x-message"):
            return f"{e.schema['x-message']}, got {_short(e.instance)}"
        e = e.parent
    kw, value, inst = err.validator, err.validator_value, err.instance
    if kw == "required" and isinstance(inst, dict):
        return "missing " + ", ".join(repr(k) for k in value if k not in inst)
    if kw == "type":
        want = value if isinstance(value, list) else [value]
        return f"must be {' or '.join(_TYPE_WORDS.get(w, w) for w in want)}, got {_short(inst)}"
    if kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return f"{_short(inst)} is out of range ({kw} {value})"
    if kw == "minItems":
        return "must not be empty" if value == 1 else f"needs at least {value} items"
    if kw == "additionalProperties" and isinstance(inst, dict):
        allowed = set(err.schema.get("properties", {}))
        return "unknown key(s) " + ", ".join(repr(k) for k in inst if k not in allowed)
    if kw in ("const", "enum"):
        return f"must be {value!r}" if kw == "const" else f"must be one of {value!r}, got {_short(inst)}"
    return one_line(err.message, 160)


def _validator_class() -> Any:
    """Draft 2020-12 with the project's number keywords (JSON Schema has none for them):

    * ``"x-finite": true``: a number that is not NaN nor ±inf (Python's ``json`` reads ``NaN`` and ``Infinity``);
      ``"x-finite": "not-nan"``: ±inf allowed (an empty accumulator's min / max), NaN not.
    * ``"x-ordered": [[a, b], ...]``: on an object, the number ``a`` is at most the number ``b`` (``min`` ≤ ``max``).
    """
    global _VALIDATOR_CLS
    if _VALIDATOR_CLS is None:
        from jsonschema import Draft202012Validator, ValidationError, validators

        def finite(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
            if isinstance(instance, float) and value and (
                    math.isnan(instance) if value == "not-nan" else not math.isfinite(instance)):
                yield ValidationError(f"must be {'a number, not NaN' if value == 'not-nan' else 'a finite number'}, "
                                      f"got {instance!r}")

        def ordered(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
            if not isinstance(instance, dict):
                return
            for a, b in value:
                x, y = instance.get(a), instance.get(b)
                if (isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool)
                        and not isinstance(y, bool) and x > y):
                    yield ValidationError(f"{a} {x!r} is above {b} {y!r}")

        _VALIDATOR_CLS = validators.extend(Draft202012Validator, {"x-finite": finite, "x-ordered": ordered})
    return _VALIDATOR_CLS


_VALIDATOR_CLS: Any = None


def check_schema(doc: Any, schema: dict[str, Any], source: str | os.PathLike | None = None,
                 what: str = "") -> None:
    """Validate a loaded document against a JSON Schema (Draft 2020-12, ``jsonschema``).

    Raises:
        InputError: the most relevant violation on one line, naming ``source`` and the field:
            ``ov.json: activation_encodings['x'][0].scale: must be a number, got 'abc'`` (``what`` is
            prefixed when given, e.g. ``tensor 't'``).
    """
    err = schema_error(doc, schema)
    if err is not None:
        head = ": ".join(x for x in (what, _where(err[0])) if x) or "document"
        raise InputError(f"{head}: {err[1]}", source)


def schema_error(doc: Any, schema: dict[str, Any]) -> tuple[list[Any], str] | None:
    """The most relevant violation of ``schema`` (Draft 2020-12, ``jsonschema``) by ``doc``: the path to the
    field (keys and list indices) and a short message (:func:`schema_message`); None when ``doc`` is valid.

    Validators are cached by the schema's ``id``: pass module-level schemas only."""
    v = _VALIDATORS.get(id(schema))
    if v is None:
        v = _VALIDATORS[id(schema)] = _validator_class()(schema)
    from jsonschema.exceptions import best_match

    err = best_match(v.iter_errors(doc))
    return None if err is None else (list(err.absolute_path), schema_message(err))
