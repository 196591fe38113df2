"""Regenerate the fixtures on the QNN HTP emulator: tensor files and graph JSON are byte-identical."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from .conftest import FIX

pytestmark = [pytest.mark.qnn, pytest.mark.slow]
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_qnn_fixtures.py"


def test_fixtures_regenerate_bit_identically(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_qnn")
    spec = importlib.util.spec_from_file_location("make_qnn_fixtures", SCRIPT)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["make_qnn_fixtures"] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    out = tmp_path / "qnn"
    assert mod.main(["--out", str(out)]) == 0
    stable = [p.relative_to(FIX) for p in FIX.rglob("*") if p.is_file() and (
        p.suffix in (".raw", ".onnx", ".npz") or p.name.endswith("_net.json") or p.parent.name == "context"
        or p.name == "ort_dump_json_qnn_graph.json")]
    assert len(stable) > 100
    different = [str(r) for r in stable if (out / r).read_bytes() != (FIX / r).read_bytes()]
    assert different == []
