"""Shared fixtures of the QNN format tests (committed files under ``tests/fixtures/qnn``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.dump.format import unescape_name

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "qnn"
MODEL = FIX / "model.qdq.onnx"
FLOAT_MODEL = FIX / "model.onnx"
SINGLE = FIX / "net_run" / "single"
MULTI = FIX / "net_run" / "multi"
PROF = FIX / "profiling"


@pytest.fixture(scope="session")
def ref() -> dict[tuple[str, int, str], np.ndarray]:
    """The direct QNN EP capture: ``(group, sample, onnx name) → array``."""
    out = {}
    with np.load(FIX / "reference.npz", allow_pickle=False) as z:
        for k in z.files:
            group, sample, name = k.split("|", 2)
            out[(group, int(sample), unescape_name(name))] = z[k]
    return out


@pytest.fixture(scope="session")
def sites() -> dict:
    """ONNX output name → capture site (key, encoding) of the QDQ model, as the ORT capture lists them."""
    import onnx

    from ivq_debug.capture.onnxruntime import list_sites

    return {s.output: s for s in list_sites(onnx.load(MODEL), "qdq")}


@pytest.fixture()
def single_copy(tmp_path: Path) -> Path:
    """A writable copy of the single-graph net-run fixture (``<copy>/output``, ``<copy>/model_net.json``)."""
    dst = tmp_path / "single"
    shutil.copytree(SINGLE, dst)
    return dst


def one_line(err: BaseException) -> str:
    s = str(err)
    assert "\n" not in s, s
    return s
