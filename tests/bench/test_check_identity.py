"""bench/check_identity.py: equal dumps and diff results pass, and every kind of difference is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

from ivq_debug.dump import DumpWriter

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "check_identity.py"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=120)


def _dump(p: Path, scale: float = 1.0) -> None:
    rng = np.random.default_rng(0)
    with DumpWriter(p, backend="x", overwrite=True) as w:
        w.begin_record()
        for k in range(4):
            w.add_tensor(f"t{k}", (scale * rng.standard_normal((3, 40, 50))).astype(np.float32), op_type="Add",
                         order=k)


def test_identical_dumps_and_tables_pass_and_differences_fail(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.h5", tmp_path / "b.h5", tmp_path / "c.h5"
    _dump(a)
    _dump(b)  # the same capture again: other creation time and command, same content
    _dump(c, scale=1.0 + 1e-7)  # values that differ in the last bits
    ok = _check("dumps", str(a), str(b))
    assert ok.returncode == 0 and "IDENTICAL" in ok.stdout, ok.stdout + ok.stderr
    bad = _check("dumps", str(a), str(c))
    assert bad.returncode == 1 and "data differs" in bad.stdout
    with h5py.File(b, "r+") as f:  # same value, another HDF5 type: an int32 order attribute
        ds = f["records/r000000/t/t2"]
        order = int(ds.attrs["order"])
        del ds.attrs["order"]
        ds.attrs["order"] = np.int32(order)
    typed = _check("dumps", str(a), str(b))
    assert typed.returncode == 1 and "t2: attributes differ" in typed.stdout
    ta, tb, tc = (tmp_path / f"{x}.json" for x in "abc")
    for ref, test, out in ((a, a, ta), (a, b, tb), (a, c, tc)):
        r = _check("table", str(ref), str(test), "-o", str(out))
        assert r.returncode == 0, r.stderr
    same = _check("compare", str(ta), str(tb))
    assert same.returncode == 0 and "4 pairs" in same.stdout and "IDENTICAL" in same.stdout
    diff = _check("compare", str(ta), str(tc))
    assert diff.returncode == 1 and "sqnr_db" in diff.stdout
    td = tmp_path / "d.json"  # the same pairs with the sides swapped: finite values that moved slightly
    assert _check("table", str(c), str(a), "-o", str(td)).returncode == 0
    rel = _check("compare", str(tc), str(td), "--rel")  # per field: how many values differ and by how much
    assert rel.returncode == 1 and "by field (table rows):" in rel.stdout
    line = next(ln for ln in rel.stdout.splitlines() if ln.strip().startswith("sqnr_db:"))
    assert "4 values differ" in line and "relative difference max" in line, rel.stdout
