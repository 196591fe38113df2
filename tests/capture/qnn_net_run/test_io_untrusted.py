"""Output folders are untrusted: Result_N gaps, symlinks leaving the folder (opt-in), loops (issue 16)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from ivq_debug.capture.qnn_net_run.outputs import ingest_output
from tests.support.qnn_fixtures import MODEL, SINGLE

RAW = "_attn_Softmax_output_0_QuantizeLinear_Output.raw"


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(SINGLE, tmp_path / "single")
    return tmp_path / "single" / "output"


def _fatal(ing) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(p.kind, p.message) for p in ing.problems if p.fatal]


def test_a_gap_in_the_result_folders_is_lost_data(tmp_path: Path) -> None:
    out = _copy(tmp_path)
    (out / "Result_1").rename(out / "Result_2")
    ing = ingest_output(out, SINGLE / "model_net.json", model=MODEL, strict=False)
    assert not ing.complete and _fatal(ing) == [("missing_file", "missing folder Result_1 (graph 'model')")]


def test_symlinks_leaving_the_folder_are_refused_unless_allowed(tmp_path: Path) -> None:
    out = _copy(tmp_path)
    f = out / "Result_1" / RAW
    moved = tmp_path / "elsewhere.raw"
    shutil.move(f, moved)
    os.symlink(moved, f)
    ing = ingest_output(out, SINGLE / "model_net.json", model=MODEL, strict=False)
    kinds = [k for k, _ in _fatal(ing)]
    assert "unreadable" in kinds and not ing.complete
    assert any("outside" in m and "--allow-outside-inputs" in m for _, m in _fatal(ing))
    ok = ingest_output(out, SINGLE / "model_net.json", model=MODEL, strict=False, allow_outside=True)
    assert ok.complete
    t = next(t for t in ok.tensors if t.result == 1 and t.float_file == f)
    assert np.array_equal(t.read().values.reshape(-1), np.fromfile(moved, "<f4"))


def test_a_symlink_loop_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    out = _copy(tmp_path)
    f = out / "Result_1" / RAW
    f.unlink()
    os.symlink(f.name, f)
    ing = ingest_output(out, SINGLE / "model_net.json", model=MODEL, strict=False)
    assert ("unreadable", "raw file is a symlink loop") in _fatal(ing)
