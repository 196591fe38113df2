"""Issue 15 on the embedded reference, from the CLI a user takes: ``ivq diagnose`` of the demo's QDQ models (the LM
prefill on CPU-QDQ, the vision part on emulated QNN HTP) with ``--executor local --workers 2`` and ``--executor
ray`` writes the JSON of today's sequential replay, every number to the bit; a rerun on the kept shards redoes
nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import ivq_cli

pytestmark = pytest.mark.slow
#: what differs between an in-process replay and its jobs: the wall time, and the sessions (one per job)
RUN_FIELDS = ("seconds", "sessions")


def diagnose(demo: Any, out: Path, *args: str, expect: int = 0) -> dict[str, Any]:
    code = ivq_cli("diagnose", demo.dumps["ort-fp32"], *args, "--no-lift", "--json", out, "--force")
    doc = json.loads(out.read_text())
    # the demo's a8w8 units stay within the budget; the prefill's output does not (exit 1, accumulated_error)
    assert code == expect and (doc["accumulation"] is not None) == (expect == 1), (code, doc["accumulation"])
    for f in RUN_FIELDS:
        doc.pop(f)
    return doc


@pytest.mark.parametrize("part,backend,test,record,expect", [
    ("prefill", "cpu", "cpu-qdq-a8w8", "0/prefill/0", 1),
    ("vision", "qnn", "htp-a8w8", "0/vision/0", 0),
])
def test_executors_give_the_sequential_replay_of_the_demo(demo: Any, work: Path, tmp_path: Path, part: str,
                                                         backend: str, test: str, record: str, expect: int) -> None:
    pytest.importorskip("ray")
    args = (str(demo.dumps[test]), "--model", str(work / f"{part}.a8w8.qdq.onnx"), "--backend", backend,
            "--record", record)
    seq = diagnose(demo, tmp_path / "seq.json", *args, expect=expect)
    assert len(seq["units"]) > 50 and seq["backend"] in ("onnxruntime-cpu-qdq", "qnn-htp")
    shards = tmp_path / "shards"
    pool = diagnose(demo, tmp_path / "pool.json", *args, "--executor", "local", "--workers", "2", "--shards",
                    str(shards), expect=expect)
    assert pool == seq
    n = len(list(shards.glob("*.json")))
    assert n >= 2
    ray = diagnose(demo, tmp_path / "ray.json", *args, "--executor", "ray", expect=expect)
    assert ray == seq
    # resumed: every shard is there, nothing runs again, the same document
    stamps = {p: p.stat().st_mtime_ns for p in shards.glob("*.json")}
    assert diagnose(demo, tmp_path / "again.json", *args, "--workers", "2", "--shards", str(shards),
                    expect=expect) == seq
    assert {p: p.stat().st_mtime_ns for p in shards.glob("*.json")} == stamps
