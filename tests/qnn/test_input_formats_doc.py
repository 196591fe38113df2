"""docs/input-formats.md lists exactly the keys the JSON Schemas in the code check (docs match code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ivq_debug.qnn.encodings import SCHEMAS
from ivq_debug.qnn.netjson import NODE_SCHEMA, TENSOR_SCHEMA

DOC = Path(__file__).resolve().parents[2] / "docs" / "input-formats.md"


def _table_keys(title: str) -> set[str]:
    """Backticked first-column keys of the table whose header cell is ``key (<title>)``."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| key ({title})"))
    keys = set()
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        m = re.match(r"\|\s*`([^`]+)`", ln)
        assert m, ln
        keys.add(m.group(1))
    return keys


@pytest.mark.parametrize(("title", "props"), [
    ("legacy entry", SCHEMAS["legacy"]["properties"]["activation_encodings"]["additionalProperties"]["items"]),
    ("1.0.0 entry", SCHEMAS["1.0.0"]["properties"]["activation_encodings"]["items"]),
    ("AIMET 2 entry", SCHEMAS["aimet2"]["properties"]["activation_encodings"]["items"]),
    ("ORT entry", SCHEMAS["ort"]["additionalProperties"]["anyOf"][0]),
    ("tensor", TENSOR_SCHEMA),
    ("op", NODE_SCHEMA),
])
def test_documented_keys_are_the_schema_keys(title: str, props: dict) -> None:
    assert _table_keys(title) == set(props["properties"])


def test_documented_shard_keys_are_the_schema_keys() -> None:
    """docs/input-formats.md "Job shards": the tables list exactly the keys each shard kind's schema checks."""
    from ivq_debug.calib_stats import SHARD_RESULT_SCHEMA as CALIB
    from ivq_debug.diagnose.jobs import _METRIC_STATE
    from ivq_debug.tune.sweep import RESULT_SCHEMA as SWEEP

    props = CALIB["properties"]
    assert _table_keys("calib-stats shard tensor") == set(props["tensors"]["additionalProperties"]["properties"])
    assert _table_keys("calib-stats shard fit") == set(props["fits"]["additionalProperties"]["properties"])
    assert _table_keys("replay shard metric") == set(_METRIC_STATE["properties"])
    assert _table_keys("sweep shard result") == set(SWEEP["properties"])
