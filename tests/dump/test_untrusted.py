"""Dumps are untrusted (issue 16): what the reader refuses before reading, and a full disk while writing.

Each case writes a real dump with :class:`DumpWriter`, breaks it with h5py the way a hostile file would, and
asserts the one-line :class:`InputError` (the CLI path of all of them is in ``tests/hostile``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.dump.format import escape_name
from ivq_debug.errors import InputError

REPO = Path(__file__).resolve().parents[2]
VALUES = np.arange(24, dtype=np.float32).reshape(2, 3, 4)


def _dump(tmp_path: Path, edit: Callable[[Any], None] | None = None) -> Path:
    p = tmp_path / "d.h5"
    with DumpWriter(p, backend="test", backend_info={"x": 1}) as w:
        w.begin_record(sample=0, part="model", step=0)
        w.add_tensor("a/b", VALUES)
        w.add_tensor("c", VALUES * 2)
    if edit is not None:
        with h5py.File(p, "r+") as f:
            edit(f)
    return p


def _replace(f: Any, data: Any = None, **kw: Any) -> None:
    path = f"records/r000000/t/{escape_name('a/b')}"
    del f[path]
    if data is not None:
        f.create_dataset(path, data=data, **kw)
    else:
        f[path] = kw["link"]


def _manifest(fn: Callable[[dict], None]) -> Callable[[Any], None]:
    def edit(f: Any) -> None:
        doc = json.loads(f["manifest"][()])
        fn(doc)
        del f["manifest"]
        f.create_dataset("manifest", data=json.dumps(doc))

    return edit


def test_a_valid_dump_reads_back(tmp_path: Path) -> None:
    with open_dump(_dump(tmp_path)) as d:
        assert np.array_equal(d.read("a/b"), VALUES)
        assert np.array_equal(np.concatenate(list(d.iter_flat(d.entry("c"), 5))), (VALUES * 2).reshape(-1))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f: f.attrs.__setitem__("backend_info", "[1, 2]"), "attribute: backend_info: must be an object"),
    (lambda f: f.attrs.__setitem__("backend", np.arange(3)), "attribute 'backend' must be a scalar"),
    (lambda f: f.attrs.__setitem__("model", "[" * 5000 + "]" * 5000), "nested more than 200 levels"),
    (lambda f: f["records/r000000"].attrs.__setitem__("step", "one"), "record 'r000000' step: must be an integer, got 'one'"),
    (_manifest(lambda d: d["rows"][0].__setitem__(10, [-1, 4])), "manifest row 0 shape[0]: -1 is out of range"),
    # the manifest is checked by column over distinct cells: the row named is the first bad one
    (_manifest(lambda d: d["rows"][1].__setitem__(d["columns"].index("order"), 2.5)),
     "manifest row 1 order: must be an integer, got 2.5"),
    (_manifest(lambda d: d["rows"][1].__setitem__(d["columns"].index("sample"), True)),
     "manifest row 1 sample: must be an integer, got True"),
    (_manifest(lambda d: d["rows"][1].__setitem__(d["columns"].index("encoding"), {"scale": {"x": 1}})),
     "manifest row 1 encoding.scale"),
    (_manifest(lambda d: d["rows"][1].__setitem__(d["columns"].index("min"), "low")),
     "manifest row 1 min: must be a number or null, got 'low'"),
    (_manifest(lambda d: d["rows"][1].__setitem__(d["columns"].index("key"), "")), "key '' is not one HDF5 link"),
    (_manifest(lambda d: d["columns"].__setitem__(d["columns"].index("layout"), "name")), "a column is listed twice"),
    (_manifest(lambda d: d["rows"][0].__setitem__(6, "../x")), "key '../x' is not one HDF5 link name"),
    (_manifest(lambda d: d["rows"][0].__setitem__(14, 7)), "nbytes 7 is not shape"),
    (_manifest(lambda d: d.__setitem__("rows", [[1, 2]])), "manifest row 0"),
    (_manifest(lambda d: d["rows"][0].__setitem__(d["columns"].index("qnn_name"), 5)),
     "manifest row 0 qnn_name: must be a string or null, got 5"),
])
def test_bad_attributes_and_manifests_are_refused_at_open(tmp_path: Path, edit: Any, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("(", r"\(")):
        open_dump(_dump(tmp_path, edit))


@pytest.mark.parametrize(("edit", "message"), [
    # the SIGSEGV of issue 16: a variable-length string dataset read through the raw preadv path
    (lambda f: _replace(f, np.full((2, 3, 4), "text", dtype=object).astype(h5py.string_dtype())),
     "has dtype object"),
    (lambda f: _replace(f, np.zeros((2, 3, 4), dtype=[("a", "<f4"), ("b", "<f4")])), "has dtype"),
    (lambda f: _replace(f, link=h5py.SoftLink("/records/r000000/t/c")), "is a soft link"),
    (lambda f: _replace(f, link=h5py.ExternalLink("other.h5", "/x")), "is an external link"),
    (lambda f: _replace(f, VALUES.astype(np.float64)), "the manifest says dtype float32, the data is float64"),
    (lambda f: _replace(f, VALUES[:1]), r"the manifest says shape \[2, 3, 4\], the data is \[1, 3, 4\]"),
])
def test_bad_datasets_are_refused_before_any_read(tmp_path: Path, edit: Any, message: str) -> None:
    with open_dump(_dump(tmp_path, edit)) as d:
        assert np.array_equal(d.read("c"), VALUES * 2)  # the other tensor is fine
        for read in (lambda: d.read("a/b"), lambda: list(d.iter_flat(d.entry("a/b"), 8))):
            with pytest.raises(InputError, match=message):
                read()


def test_a_checksum_failure_is_an_input_error(tmp_path: Path) -> None:
    p = _dump(tmp_path, lambda f: _replace(f, VALUES * 3, chunks=VALUES.shape, fletcher32=True))
    data = bytearray(p.read_bytes())
    at = data.rfind((VALUES * 3).tobytes())
    data[at + 5] ^= 0xFF
    p.write_bytes(bytes(data))
    with open_dump(p) as d, pytest.raises(InputError, match="cannot read 'a/b'"):
        d.read("a/b")


def test_a_fifo_is_refused_before_hdf5_opens_it(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "d.h5")
    with pytest.raises(InputError, match="dump is a FIFO"):
        open_dump(tmp_path / "d.h5")


_FULL_DISK = """
import resource, signal, sys
import numpy as np
from ivq_debug.dump import DumpWriter
from ivq_debug.errors import UsageError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    with DumpWriter(sys.argv[1], backend="test") as w:
        w.begin_record()
        for i in range(64):
            w.add_tensor(f"t{i}", np.full((64, 256), i, np.float32))
except UsageError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("limit", [8 << 10, 1 << 20, 3 << 20])
def test_a_full_disk_is_an_output_error_without_a_crash_or_a_file(tmp_path: Path, limit: int) -> None:
    """RLIMIT_FSIZE stands in for a full disk: before the space reservation HDF5 saw the failed write and the
    process died with SIGSEGV at close (or at exit) with a .partial file left behind."""
    out = tmp_path / "o.h5"
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, str(out), str(limit)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"refused: {out}: cannot write output (File too large)"
    assert r.stderr == ""  # nothing printed from h5py's deallocations
    assert os.listdir(tmp_path) == []


def test_a_finished_dump_has_no_reserved_tail(tmp_path: Path) -> None:
    p = _dump(tmp_path)
    with open(p, "rb") as f:
        head = f.read(48)
    assert head[8] in (2, 3) and int.from_bytes(head[28:36], "little") == p.stat().st_size
