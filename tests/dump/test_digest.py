"""The dump's content digest (ivq_debug/dump/digest.py): stored by the writer, the same when computed on read,
shared by two captures of the same data (files that differ), changed by one changed value."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.dump.digest import ATTR
from ivq_debug.errors import InputError
from ivq_debug.inputfiles import sha256_file

RNG = np.random.default_rng(11)
X = RNG.standard_normal((3, 64)).astype(np.float32)
IDS = np.arange(12, dtype=np.int64)


def _write(p: Path, *, x: np.ndarray = X, command: str = "a", summary_only: bool = False,
           compression: str | None = None, order: tuple[str, ...] = ("x", "h")) -> Path:
    with DumpWriter(p, backend="test", command=command, summary_only=summary_only, summary_samples=32,
                    compression=compression) as w:
        for step in (0, 1):
            w.begin_record(sample=0, part="prefill" if step == 0 else "decode", step=step)
            w.add_input("ids", IDS + step)
            for name in order:
                w.add_tensor(name, x * (step + 1) if name == "x" else np.tanh(x) + step)
    return p


def _computed(p: Path) -> str:
    with open_dump(p) as d:
        d._content_sha256 = None  # as a dump written without the attribute
        return d.content_digest()


@pytest.mark.parametrize("summary_only", [False, True])
def test_stored_digest_is_the_one_computed_on_read(tmp_path: Path, summary_only: bool) -> None:
    p = _write(tmp_path / "a.h5", summary_only=summary_only)
    with open_dump(p) as d:
        stored = d.attrs[ATTR]
        assert d.content_digest() == stored and len(stored) == 64
    assert _computed(p) == stored


def test_a_recapture_of_the_same_data_keeps_the_digest(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.h5", command="first")
    b = _write(tmp_path / "b.h5", command="second", compression="gzip", order=("h", "x"))
    assert sha256_file(a) != sha256_file(b)  # the files differ (provenance, layout, write order)
    with open_dump(a) as da, open_dump(b) as db:
        assert da.content_digest() == db.content_digest()
    x = X.copy()
    x[2, 5] = np.nextafter(x[2, 5], np.float32(np.inf))  # one value, one ulp
    with open_dump(_write(tmp_path / "c.h5", x=x)) as dc, open_dump(a) as da:
        assert dc.content_digest() != da.content_digest()


def test_an_older_dump_without_the_attribute_gets_it_computed(tmp_path: Path) -> None:
    p = _write(tmp_path / "a.h5")
    with open_dump(p) as d:
        want = d.content_digest()
    with h5py.File(p, "r+") as f:
        del f.attrs[ATTR]
    with open_dump(p) as d:
        assert d.content_digest() == want


def test_a_malformed_digest_attribute_is_refused(tmp_path: Path) -> None:
    p = _write(tmp_path / "a.h5")
    with h5py.File(p, "r+") as f:
        f.attrs[ATTR] = "../not-a-digest"
    with pytest.raises(InputError, match="content_sha256"):
        open_dump(p)
