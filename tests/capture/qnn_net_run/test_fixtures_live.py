"""Regenerate the fixtures on the QNN HTP emulator: tensor files are byte-identical, graph JSON is identical
up to QNN's tensor ids."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.qnn_fixtures import FIX

pytestmark = [pytest.mark.qnn, pytest.mark.slow]
SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "make_qnn_fixtures.py"


def _ids(doc: Any) -> list[int]:
    if isinstance(doc, dict):
        own = [doc["id"]] if isinstance(doc.get("id"), int) else []
        return own + [i for v in doc.values() for i in _ids(v)]
    if isinstance(doc, list):
        return [i for v in doc for i in _ids(v)]
    return []


def _renumber(doc: Any, rank: dict[int, int]) -> Any:
    if isinstance(doc, dict):
        return {k: (rank[v] if k == "id" and isinstance(v, int) else _renumber(v, rank)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_renumber(v, rank) for v in doc]
    return doc


def canonical_json(path: Path) -> Any:
    """A graph JSON document with QNN tensor ids replaced by their rank.

    QNN numbers tensors from a process-wide counter, so the ids depend on how many graphs the process built
    before; their order (and everything else) must not change.
    """
    doc = json.loads(path.read_text())
    return _renumber(doc, {v: i for i, v in enumerate(sorted(set(_ids(doc))))})


def test_canonical_json_keeps_order_and_content(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps({"t": [{"id": 27, "n": "x"}, {"id": 29, "n": "y"}]}))
    b.write_text(json.dumps({"t": [{"id": 40717, "n": "x"}, {"id": 40719, "n": "y"}]}))
    c.write_text(json.dumps({"t": [{"id": 40719, "n": "x"}, {"id": 40717, "n": "y"}]}))
    assert canonical_json(a) == canonical_json(b)
    assert canonical_json(a) != canonical_json(c)


def test_fixtures_regenerate_bit_identically(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_qnn")
    spec = importlib.util.spec_from_file_location("make_qnn_fixtures", SCRIPT)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["make_qnn_fixtures"] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    out = tmp_path / "qnn"
    assert mod.main(["--out", str(out)]) == 0
    tensors = [p.relative_to(FIX) for p in FIX.rglob("*") if p.is_file() and p.suffix in (".raw", ".onnx", ".npz")]
    graphs = [p.relative_to(FIX) for p in FIX.rglob("*.json") if p.name.endswith("_net.json")
              or p.parent.name == "context" or p.name == "ort_dump_json_qnn_graph.json"]
    assert len(tensors) > 100 and len(graphs) == 6
    assert [str(r) for r in tensors if (out / r).read_bytes() != (FIX / r).read_bytes()] == []
    assert [str(r) for r in graphs if canonical_json(out / r) != canonical_json(FIX / r)] == []
