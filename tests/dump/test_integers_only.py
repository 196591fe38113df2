"""Integers-only storage of quantized tensors (format version 2): what the writer leaves out, when it may, and
every reader path giving back the values bit for bit; an untrusted version-2 dump is checked before any use.

The real captures (ORT QDQ and QNN HTP through the CLI, version 1 against version 2) are in
``test_writer_identity.py``; here the writer is fed directly, with integers and encodings of the dtypes and
layouts captures produce (uint8 / int8 / uint16 / int16 / int32, per tensor and per channel).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from ivq_debug import defaults
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.dump.digest import compute
from ivq_debug.dump.quant import dequantize
from ivq_debug.dump.stats import sample_indices
from ivq_debug.errors import InputError
from ivq_debug.qnn.netjson import QnnQuant

REPO = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(7)


def _tensors() -> list[tuple[str, np.ndarray, dict[str, Any]]]:
    """(name, integers, encoding) of each dtype the format allows, per tensor and per channel (axis 1 and -1)."""
    out = []
    for dt in ("uint8", "int8", "uint16", "int16", "int32"):
        info = np.iinfo(dt)
        lo, hi = (info.min, info.max) if dt != "int32" else (-(1 << 30), 1 << 30)
        q = RNG.integers(lo, hi, (2, 5, 37), endpoint=True, dtype=dt)
        zp = int(RNG.integers(lo, hi)) if dt.startswith("u") else 0
        out.append((f"{dt}/tensor", q, {"bitwidth": info.bits, "dtype": dt, "scale": 0.0123, "zero_point": zp,
                                        "axis": None}))
        out.append((f"{dt}/channel", q, {"bitwidth": info.bits, "dtype": dt, "axis": 1,
                                         "scale": [float(s) for s in RNG.random(5).astype(np.float32) * 0.01 + 1e-4],
                                         "zero_point": [int(z) for z in RNG.integers(lo // 2, hi // 2, 5)]}))
    q = RNG.integers(0, 255, (3, 4, 6), endpoint=True, dtype=np.uint8)  # the last axis, written -1
    out.append(("uint8/last", q, {"scale": [0.5, 0.25, 0.125, 1.0, 2.0, 0.1], "zero_point": 128, "axis": -1}))
    out.append(("uint8/scalar", np.asarray(np.uint8(200)), {"scale": 0.02, "zero_point": 3}))
    return out


def _write(p: Path, tensors: list[tuple[str, np.ndarray, dict[str, Any]]], **kw: Any) -> None:
    with DumpWriter(p, backend="onnxruntime-cpu-qdq", **kw) as w:
        w.begin_record(sample=0, part="model", step=0)
        w.add_input("x", np.arange(12, dtype=np.float32).reshape(3, 4))
        for name, q, enc in tensors:
            w.add_tensor(name, dequantize(q, enc), encoding=enc, raw=q, op_type="QuantizeLinear")
        w.add_tensor("float", np.random.default_rng(1).standard_normal((4, 9)).astype(np.float32))  # its values
        w.begin_record(sample=1, part="model", step=0)
        for name, q, enc in tensors[:2]:
            w.add_tensor(name, dequantize(q[::-1].copy(), enc), encoding=enc, raw=q[::-1].copy())


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def test_every_reader_path_gives_the_values_of_version_1(tmp_path: Path) -> None:
    tensors = _tensors()
    _write(tmp_path / "v1.h5", tensors, integers_only=False)
    _write(tmp_path / "v2.h5", tensors)  # the default
    with open_dump(tmp_path / "v1.h5") as a, open_dump(tmp_path / "v2.h5") as b:
        assert (a.format_version, b.format_version) == (1, 2)
        assert not any(e.derived for e in a.entries)
        derived = [e for e in b.entries if e.derived]
        assert len(derived) == len(tensors) + 2  # every quantized tensor; not the float one, not the input
        assert {e.name for e in b.entries if not e.derived} == {"x", "float"}
        # statistics, nbytes, digest: over the values
        assert a.manifest.equals(b.manifest.drop(columns="derived"))
        assert a.content_digest() == b.content_digest() == compute(b.entries, lambda e: b.read(e))
        b._summary_samples = a._summary_samples = 17
        for ea in a.entries:
            eb = b.entry(ea.name, ea.rid, ea.kind)
            v = a.read(ea)
            assert _bits(b.read(eb)) == _bits(v) and b.read(eb).dtype == v.dtype, ea.name
            np.testing.assert_array_equal(b.read_raw(eb), a.read_raw(ea))
            flat = v.reshape(-1)
            for n in (1, 7, 64, 10_000):
                got = np.concatenate([x.copy() for x in b.iter_flat(eb, n, reuse=True)])
                assert _bits(got) == _bits(flat), (ea.name, n)
            assert _bits(np.concatenate(list(b.iter_flat(eb, 13)))) == _bits(flat)
            for nbytes in (4, 60, 1 << 20):
                blocks = list(b.iter_blocks(eb, nbytes))
                assert _bits(np.concatenate([x.reshape(-1) for x in blocks])) == _bits(flat), (ea.name, nbytes)
            assert _bits(b.read_sample(eb)) == _bits(flat[sample_indices(ea.size, 17)])
            assert _bits(b.head(eb, 5)[0]) == _bits(flat[:5])
            assert b.stored_dtype(eb) == np.dtype(np.float32) or not eb.derived
        sa, sb = a.size(), b.size()
        assert sb.derived == sum(e.nbytes for e in derived) and sb.raw == sa.raw
        assert sb.tensors == sa.tensors - sb.derived and sb.file < sa.file
    with h5py.File(tmp_path / "v2.h5") as f:  # the integers alone, with the tensor's attributes and `derived`
        g = f["records/r000000"]
        assert "uint8%2Ftensor" not in g["t"] and "float" in g["t"]
        attrs = dict(g["q/uint8%2Ftensor"].attrs)
        assert attrs["derived"] and attrs["name"] == "uint8/tensor" and attrs["dtype"] == "float32"
        assert json.loads(attrs["encoding"])["zero_point"] == tensors[0][2]["zero_point"]


def test_the_check_identity_tool_agrees_across_versions_and_catches_a_changed_integer(tmp_path: Path) -> None:
    tensors = _tensors()[:4]
    _write(tmp_path / "v1.h5", tensors, integers_only=False)
    _write(tmp_path / "v2.h5", tensors)
    check = [sys.executable, str(REPO / "bench" / "check_identity.py"), "dumps"]
    ok = subprocess.run([*check, str(tmp_path / "v1.h5"), str(tmp_path / "v2.h5")], capture_output=True, text=True)
    assert ok.returncode == 0 and "IDENTICAL" in ok.stdout, ok.stdout + ok.stderr
    with h5py.File(tmp_path / "v2.h5", "r+") as f:  # one integer moved by one step: the rebuilt values differ
        ds = f["records/r000000/q/int8%2Fchannel"]
        q = ds[()]
        q.flat[3] = q.flat[3] + 1 if q.flat[3] < 127 else q.flat[3] - 1
        ds[...] = q
    bad = subprocess.run([*check, str(tmp_path / "v1.h5"), str(tmp_path / "v2.h5")], capture_output=True, text=True)
    assert bad.returncode == 1 and "the values rebuilt from records/r000000/q/int8%2Fchannel differ" in bad.stdout


def test_values_another_dequantization_gave_are_stored_as_values(tmp_path: Path) -> None:
    """qnn-net-run dequantizes in float64 (``QnnQuant.dequantize``): on int32 integers beyond float32's 24 bits
    that rounds differently from ONNX's float32 formula, so the writer keeps those values (and their integers);
    on 8 bits the two agree and the integers alone are stored. One changed bit is enough to keep the values."""
    q32 = RNG.integers(-(1 << 30), 1 << 30, (4, 300), dtype=np.int32)
    q8 = RNG.integers(0, 255, (4, 300), endpoint=True, dtype=np.uint8)
    enc32 = {"scale": 0.0007, "zero_point": 5, "dtype": "int32", "bitwidth": 32}
    enc8 = {"scale": 0.0123, "zero_point": 128, "dtype": "uint8", "bitwidth": 8}

    def htp_like(q: np.ndarray, enc: dict[str, Any]) -> np.ndarray:
        return QnnQuant("scale_offset", np.asarray([enc["scale"]]), np.asarray([-enc["zero_point"]])).dequantize(q)

    v32 = htp_like(q32, enc32)
    assert _bits(v32) != _bits(dequantize(q32, enc32))  # the two definitions do differ here
    v8 = htp_like(q8, enc8)
    assert _bits(v8) == _bits(dequantize(q8, enc8))
    one_bit = dequantize(q8, enc8)
    one_bit.view(np.uint32)[2, 7] ^= 1
    with DumpWriter(tmp_path / "d.h5", backend="qnn-net-run") as w:
        w.add_tensor("i32", v32, encoding=enc32, raw=q32)
        w.add_tensor("u8", v8, encoding=enc8, raw=q8)
        w.add_tensor("one_bit", one_bit, encoding=enc8, raw=q8)
        w.add_tensor("bf16_like", v8.astype(np.float16), encoding=enc8, raw=q8)  # not float32: its values
    with open_dump(tmp_path / "d.h5") as d:
        assert d.format_version == 2
        assert {e.name: e.derived for e in d.entries} == {"i32": False, "u8": True, "one_bit": False,
                                                          "bf16_like": False}
        for name, want in (("i32", v32), ("u8", v8), ("one_bit", one_bit)):
            assert _bits(d.read(name)) == _bits(want)
            assert d.entry(name).has_raw


def test_the_opt_out_writes_version_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _tensors()[:2]
    monkeypatch.setenv(defaults.DUMP_INTEGERS_ONLY_ENV, "0")
    _write(tmp_path / "env.h5", tensors)
    _write(tmp_path / "arg.h5", tensors, integers_only=True)  # the argument wins over the environment
    monkeypatch.delenv(defaults.DUMP_INTEGERS_ONLY_ENV)
    monkeypatch.setattr(defaults, "DUMP_INTEGERS_ONLY", False)
    _write(tmp_path / "default.h5", tensors)
    for name, version in (("env", 1), ("arg", 2), ("default", 1)):
        with open_dump(tmp_path / f"{name}.h5") as d:
            assert d.format_version == version, name
        with h5py.File(tmp_path / f"{name}.h5") as f:  # version 1: the manifest of version 1, no `derived` column
            assert ("derived" in json.loads(f["manifest"][()])["columns"]) == (version == 2)


def test_summary_only_and_compressed_captures(tmp_path: Path) -> None:
    """Summary-only tensors keep their sample (never derived); "auto" compresses the integers stored alone."""
    q = RNG.integers(0, 4, (64, 1024), dtype=np.uint8)  # few levels: compresses
    enc = {"scale": 0.5, "zero_point": 1}
    with DumpWriter(tmp_path / "s.h5", backend="x", summary_only=True, summary_samples=16) as w:
        w.add_tensor("big", dequantize(q, enc), encoding=enc, raw=q)
        w.add_tensor("small", dequantize(q[0, :8], enc), encoding=enc, raw=q[0, :8])
    with open_dump(tmp_path / "s.h5") as d:
        assert not d.entry("big").derived and d.entry("big").stored == "summary" and d.entry("small").derived
        assert _bits(d.read("small")) == _bits(dequantize(q[0, :8], enc))
    with DumpWriter(tmp_path / "a.h5", backend="x", compression="auto") as w:
        w.add_tensor("t", dequantize(q, enc), encoding=enc, raw=q)
    with open_dump(tmp_path / "a.h5") as d, h5py.File(tmp_path / "a.h5") as f:
        assert f["records/r000000/q/t"].compression == "lzf" and d.entry("t").derived
        e = d.entry("t")
        assert _bits(np.concatenate([x.copy() for x in d.iter_flat(e, 5000, reuse=True)])) == _bits(dequantize(q, enc))


# ---------------------------------------------------------------------------- untrusted version-2 dumps
def _v2(tmp_path: Path, edit: Any) -> Path:
    p = tmp_path / "d.h5"
    q = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    enc = {"scale": [0.1, 0.2, 0.3], "zero_point": [1, 2, 3], "axis": 1, "dtype": "uint8"}
    with DumpWriter(p, backend="x") as w:
        w.add_tensor("a", dequantize(q, enc), encoding=enc, raw=q)
    with h5py.File(p, "r+") as f:
        edit(f)
    return p


def _row(**changes: Any) -> Any:
    def edit(f: Any) -> None:
        doc = json.loads(f["manifest"][()])
        c = {n: i for i, n in enumerate(doc["columns"])}
        for k, v in changes.items():
            doc["rows"][0][c[k]] = v
        del f["manifest"]
        f.create_dataset("manifest", data=json.dumps(doc))
    return edit


def _q(data: Any = None) -> Any:
    def edit(f: Any) -> None:
        del f["records/r000000/q/a"]
        if data is not None:
            f["records/r000000/q/a"] = data
    return edit


MANIFEST_CASES = [
    (_row(encoding=None), "its encoding cannot rebuild the values (the encoding is not an object)"),
    (_row(encoding={"scale": [0.1, 0.2], "zero_point": [1, 2], "axis": 1}),
     "2 scales along axis 1 of length 3"),
    (_row(encoding={"scale": [0.1, 0.2, 0.3], "zero_point": 0, "axis": 7}),
     "per-channel scales with axis 7 for a tensor of 3 dimensions"),
    (_row(encoding={"scale": "0.1", "zero_point": 0}), "encoding[scale]: '0.1' is not valid"),
    (_row(encoding={"scale": float("nan"), "zero_point": 0}), "its scale is 'nan', not a finite number"),
    (_row(encoding={"scale": [0.1, float("inf"), 0.3], "zero_point": 0, "axis": 1}), "not a finite number"),
    (_row(encoding={"scale": 0.1}), "its zero point is 'None', not an integer"),
    (_row(encoding={"scale": 0.1, "zero_point": 0.5}), "its zero point is '0.5', not an integer"),
    (_row(encoding={"scale": [0.1, 0.2, 0.3], "zero_point": [1, 2], "axis": 1}), "2 zero points for 3 scales"),
    (_row(has_raw=False), "has_raw is false"),
    (_row(dtype="float16", nbytes=48), "must be a whole float32 tensor"),
    (_row(derived="yes"), "manifest row 0 derived: must be true or false, got 'yes'"),
]
DATA_CASES = [
    (_q(), "manifest lists 'a' but its data is missing"),
    (_q(np.zeros((2, 3), np.uint8)), "the integers of 'a': shape [2, 3], the manifest says [2, 3, 4]"),
    (_q(np.zeros((2, 3, 4), np.float32)), "the integers of 'a': dtype float32, expected uint8, int8"),
    (_q(np.zeros((2, 3, 4), np.int64)), "the integers of 'a': dtype int64, expected"),
    (_q(h5py.SoftLink("/manifest")), "is a soft link"),
]


@pytest.mark.parametrize(("edit", "message"), MANIFEST_CASES)
def test_a_bad_derived_row_is_refused_at_open(tmp_path: Path, edit: Any, message: str) -> None:
    with pytest.raises(InputError) as e:
        open_dump(_v2(tmp_path, edit))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("edit", "message"), DATA_CASES)
def test_bad_integers_are_refused_before_any_read(tmp_path: Path, edit: Any, message: str) -> None:
    p = _v2(tmp_path, edit)
    with open_dump(p) as d:
        e = d.entry("a")
        for read in (d.read, lambda e: next(iter(d.iter_flat(e, 4))), lambda e: next(iter(d.iter_blocks(e, 8))),
                     d.read_sample, d.read_raw, d.dataset):
            with pytest.raises(InputError) as err:
                read(e)
            assert message in str(err.value) and "\n" not in str(err.value)


def test_the_cli_refuses_a_bad_version_2_dump_in_one_line(tmp_path: Path) -> None:
    p = _v2(tmp_path, _q(np.zeros((2, 3, 4), np.float32)))
    r = subprocess.run([sys.executable, "-m", "ivq_debug.cli.main", "show", str(p), "a", "--values", "3"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and "dtype float32" in r.stderr, r.stderr
    ok = subprocess.run([sys.executable, "-m", "ivq_debug.cli.main", "show", str(_v2(tmp_path / "ok", lambda f: None)),
                         "a", "--values", "5"], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
