"""``arrays.read_arrays``: the one loader of user ``.npz`` / ``.npy`` files (inputs, calibration)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ivq_debug.arrays import read_arrays
from ivq_debug.errors import EXIT_INPUT, InputError


def test_reads_npz_and_npy(tmp_path: Path) -> None:
    np.savez(tmp_path / "x.npz", a=np.arange(3, dtype=np.float16), b=np.ones((2, 2), np.int64))
    np.save(tmp_path / "pixel_values.npy", np.full((1, 3), 2.5, np.float32))
    got = read_arrays(tmp_path / "x.npz")
    assert sorted(got) == ["a", "b"] and got["a"].dtype == np.float16 and got["b"].shape == (2, 2)
    one = read_arrays(tmp_path / "pixel_values.npy")
    assert list(one) == ["pixel_values"] and one["pixel_values"].tolist() == [[2.5, 2.5, 2.5]]


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "no such inputs file"),
    (lambda p: p.mkdir(), "inputs file is a directory"),
    (lambda p: p.write_text("x"), "not an .npz archive"),
    (lambda p: np.savez(p, a=np.array([{"k": 1}], dtype=object)), "object arrays (pickles are never loaded)"),
    (lambda p: np.save(p, np.array([{"k": 1}], dtype=object), allow_pickle=True), "object arrays"),
])
def test_bad_files_give_one_line_input_errors(tmp_path: Path, make, message: str) -> None:
    p = tmp_path / "in.npz"
    make(p)
    if not p.exists() and (tmp_path / "in.npz.npy").exists():
        (tmp_path / "in.npz.npy").rename(p)
    with pytest.raises(InputError) as e:
        read_arrays(p)
    assert message in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)
    assert e.value.exit_code == EXIT_INPUT


def test_truncated_npz_is_an_input_error(tmp_path: Path) -> None:
    p = tmp_path / "t.npz"
    np.savez(p, a=np.zeros(1000, np.float32))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"t\.npz: not"):
        read_arrays(p)
