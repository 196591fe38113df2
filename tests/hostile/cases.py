"""The hostile-input catalog: every input format, broken in the ways files from devices, colleagues and CI
artifacts break, run against every command that reads it (issue 16).

Each generator returns :class:`~tests.hostile.harness.Case` objects. A case's ``build`` copies valid
inputs from the session corpus (:mod:`tests.hostile.corpus`) into its folder, breaks one of them, and
returns the argv. Expected outcomes are those of the contract (README "Exit codes", ``docs/cli.md``,
issue 16): 3 for an unreadable or corrupt input (special files included), 2 for usage errors (an output
that would replace an input, even with ``--force``; an output that cannot be written: read-only folder,
full disk), 1 for an ingest with missing or wrong-size files (an incomplete dump is written), 0 when
the input is valid however odd (hostile names are data: shown escaped). Where the effect of a change
cannot be known in advance (a flipped bit in unchecksummed tensor data is just another number), the
case allows the codes that are all correct.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.hostile.harness import Case, Workspace

#: the tensor the data-level dump mutations break (float.h5: (1, 16, 16) float32)
T = "/attn/Softmax_output_0"
T_OTHER = "/relu/Relu_output_0"  # (1, 8, 4, 4)
#: a tensor qdq.h5 stores as its integers only (format version 2: ``q/<key>``, no ``t/<key>``; uint16)
TQ = "/attn/kT/Transpose_output_0"
RID = "r000000"

#: hostile strings used as names (tensor names, file names)
NAMES = {
    "ansi": "\x1b[31mred\x1b[0m\x1b]0;pwned\x07\x1b[2J",
    "markup": "[bold red]x[/] [link=https://evil.example]click[/link]",
    "html": "<img src=x onerror=alert(1)></script><script>alert(1)</script>",
    "surrogate": "lone\udc80surrogate",
    "newline": "two\nlines\rand\x0bmore",
    "bidi": "abc\u202egnp.exe",
    "long": "x" * 5000,
}
HTML_PAYLOADS = ("<img src=x onerror=alert(1)>", "</script><script>alert(1)")


# ============================================================================ helpers
def _h5(path: Path, fn: Callable[[Any], None]) -> None:
    import h5py

    with h5py.File(path, "r+") as f:
        fn(f)


def _manifest(f: Any) -> dict:
    raw = f["manifest"][()]
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def _set_manifest(f: Any, data: Any) -> None:
    del f["manifest"]
    f.create_dataset("manifest", data=data)


def _edit_manifest(fn: Callable[[dict], None]) -> Callable[[Any], None]:
    def edit(f: Any) -> None:
        doc = _manifest(f)
        fn(doc)
        _set_manifest(f, json.dumps(doc))

    return edit


def _edit_row(tensor: str, **changes: Any) -> Callable[[Any], None]:
    def edit(doc: dict) -> None:
        c = {n: i for i, n in enumerate(doc["columns"])}
        for r in doc["rows"]:
            if r[c["name"]] == tensor:
                for k, v in changes.items():
                    r[c[k]] = v

    return _edit_manifest(edit)


def _tpath(name: str = T, rid: str = RID) -> str:
    from ivq_debug.dump.format import escape_name

    return f"records/{rid}/t/{escape_name(name)}"


def _replace_ds(name: str = T, **create: Any) -> Callable[[Any], None]:
    def edit(f: Any) -> None:
        p = _tpath(name)
        attrs = dict(f[p].attrs)
        del f[p]
        ds = f.create_dataset(p, **create)
        for k, v in attrs.items():
            ds.attrs[k] = v

    return edit


def _link(name: str, link: Any) -> Callable[[Any], None]:
    def edit(f: Any) -> None:
        p = _tpath(name)
        del f[p]
        f[p] = link

    return edit


def _bytes_edit(fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def edit(p: Path) -> None:
        p.write_bytes(fn(p.read_bytes()))

    return edit


def _flip_at(data: bytes, offset: int) -> bytes:
    b = bytearray(data)
    b[offset] ^= 0xFF
    return bytes(b)


def _t_values(ws: Workspace) -> np.ndarray:
    from ivq_debug.dump import open_dump

    with open_dump(ws.corpus["float.h5"]) as d:
        return d.read(T)


# ============================================================================ dumps
#: file-level breakage: every command that opens the dump must refuse it (exit 3)
def _dump_file_mutations() -> dict[str, Callable[[Workspace, Path], None]]:
    import h5py

    def h5(fn: Callable[[Any], None]) -> Callable[[Workspace, Path], None]:
        return lambda ws, p: _h5(p, fn)

    def raw(fn: Callable[[bytes], bytes]) -> Callable[[Workspace, Path], None]:
        return lambda ws, p: _bytes_edit(fn)(p)

    def not_a_dump(ws: Workspace, p: Path) -> None:
        p.unlink()
        with h5py.File(p, "w") as f:
            f.create_dataset("x", data=np.arange(4))

    def manifest_group(f: Any) -> None:
        del f["manifest"]
        f.create_group("manifest")

    def records_dataset(f: Any) -> None:
        del f["records"]
        f.create_dataset("records", data=np.arange(3))

    def record_dataset(f: Any) -> None:
        del f[f"records/{RID}"]
        f.create_dataset(f"records/{RID}", data=np.arange(3))

    def no_records(f: Any) -> None:
        del f["records"]

    def rows(fn: Callable[[dict], None]) -> Callable[[Workspace, Path], None]:
        return h5(_edit_manifest(fn))

    def drop_column(col: str) -> Callable[[dict], None]:
        def edit(doc: dict) -> None:
            i = doc["columns"].index(col)
            doc["columns"].pop(i)
            for r in doc["rows"]:
                r.pop(i)

        return edit

    def set_all(col: str, value: Any) -> Callable[[dict], None]:
        def edit(doc: dict) -> None:
            i = doc["columns"].index(col)
            for r in doc["rows"]:
                r[i] = value

        return edit

    def short_row(doc: dict) -> None:
        doc["rows"][3] = doc["rows"][3][:3]

    def attr(name: str, value: Any) -> Callable[[Workspace, Path], None]:
        return h5(lambda f: f.attrs.__setitem__(name, value))

    def del_attr(name: str) -> Callable[[Workspace, Path], None]:
        return h5(lambda f: f.attrs.__delitem__(name))

    return {
        "truncated-half": raw(lambda b: b[: len(b) // 2]),
        "truncated-head": raw(lambda b: b[:800]),
        "empty": raw(lambda b: b""),
        "text": raw(lambda b: b"hello, not hdf5\n"),
        "zip": raw(lambda b: b"PK\x03\x04" + b"\x00" * 64),
        "superblock-flip": raw(lambda b: _flip_at(b, 9)),
        "hdf5-not-a-dump": not_a_dump,
        "not-finalized": attr("finalized", False),
        "format-missing": del_attr("format"),
        "format-version-future": attr("format_version", 99),
        "format-version-string": attr("format_version", "one"),
        "backend-info-list": attr("backend_info", "[1, 2]"),
        "backend-info-string": attr("backend_info", '"qnn"'),
        "backend-info-bad-json": attr("backend_info", "{"),
        "backend-info-deep": attr("backend_info", "[" * 50000 + "]" * 50000),
        "model-list": attr("model", "[]"),
        "model-null": attr("model", "null"),
        "backend-array": attr("backend", np.arange(3)),
        "incomplete-reasons-number": attr("incomplete_reasons", "5"),
        "manifest-array": h5(lambda f: _set_manifest(f, "[1, 2, 3]")),
        "manifest-null": h5(lambda f: _set_manifest(f, "null")),
        "manifest-number": h5(lambda f: _set_manifest(f, "42")),
        "manifest-bad-json": h5(lambda f: _set_manifest(f, '{"columns": [')),
        "manifest-not-utf8": h5(lambda f: _set_manifest(f, np.void(b"\xff\xfe{}"))),
        "manifest-int-dataset": h5(lambda f: _set_manifest(f, np.arange(5))),
        "manifest-group": h5(manifest_group),
        "manifest-deep": h5(lambda f: _set_manifest(f, "[" * 100000 + "]" * 100000)),
        "manifest-no-columns": h5(lambda f: _set_manifest(f, '{"rows": []}')),
        "manifest-rows-ints": rows(lambda d: d.__setitem__("rows", [1, 2, 3])),
        "manifest-rows-dict": rows(lambda d: d.__setitem__("rows", {"a": 1})),
        "manifest-row-short": rows(short_row),
        "manifest-no-name-column": rows(drop_column("name")),
        "manifest-no-shape-column": rows(drop_column("shape")),
        "manifest-shape-string": rows(set_all("shape", "abc")),
        "manifest-shape-null": rows(set_all("shape", None)),
        "manifest-shape-negative": rows(set_all("shape", [-4, 2])),
        "manifest-shape-float": rows(set_all("shape", [2.5, 4])),
        "manifest-shape-nested": rows(set_all("shape", [[1], [2]])),
        "manifest-name-int": rows(set_all("name", 7)),
        "manifest-rid-int": rows(set_all("rid", 5)),
        "manifest-kind-unknown": rows(set_all("kind", "weird")),
        "manifest-encoding-string": rows(set_all("encoding", "u8")),
        "manifest-stats-strings": rows(set_all("min", "low")),
        "manifest-order-string": rows(set_all("order", "first")),
        "records-dataset": h5(records_dataset),
        "record-dataset": h5(record_dataset),
        "records-missing": h5(no_records),
        "record-sample-string": h5(lambda f: f[f"records/{RID}"].attrs.__setitem__("sample", "zero")),
        "record-meta-bad-json": h5(lambda f: f[f"records/{RID}"].attrs.__setitem__("meta", "{")),
        "record-meta-list": h5(lambda f: f[f"records/{RID}"].attrs.__setitem__("meta", "[]")),
    }


#: data-level breakage of tensor T: ``ls`` lists the manifest without reading data (exit 0, or 3 when the
#: reader checks datasets against the manifest at open); every command that reads T must refuse (exit 3)
def _dump_data_mutations() -> dict[str, Callable[[Workspace, Path], None]]:
    import h5py

    def h5(fn: Callable[[Any], None]) -> Callable[[Workspace, Path], None]:
        return lambda ws, p: _h5(p, fn)

    def group(f: Any) -> None:
        p = _tpath()
        del f[p]
        f.create_group(p)

    def external_link(ws: Workspace, p: Path) -> None:
        src = ws.outside / "other.h5"
        with h5py.File(src, "w") as g:
            g.create_dataset("data", data=_t_values(ws))
        _h5(p, _link(T, h5py.ExternalLink(str(src), "/data")))

    def external_storage(ws: Workspace, p: Path) -> None:
        v = _t_values(ws)
        src = ws.secret("storage.raw", v.tobytes())
        _h5(p, _replace_ds(T, shape=v.shape, dtype=v.dtype, external=[(str(src), 0, v.nbytes)]))

    def virtual(ws: Workspace, p: Path) -> None:
        v = _t_values(ws)
        src = ws.outside / "vsrc.h5"
        with h5py.File(src, "w") as g:
            g.create_dataset("data", data=v)
        layout = h5py.VirtualLayout(shape=v.shape, dtype=v.dtype)
        layout[...] = h5py.VirtualSource(str(src), "data", shape=v.shape)

        def edit(f: Any) -> None:
            path = _tpath()
            attrs = dict(f[path].attrs)
            del f[path]
            ds = f.create_virtual_dataset(path, layout)
            for k, val in attrs.items():
                ds.attrs[k] = val

        _h5(p, edit)

    def fletcher(ws: Workspace, p: Path) -> None:
        v = _t_values(ws)
        _h5(p, _replace_ds(T, data=v, chunks=v.shape, fletcher32=True))
        data = p.read_bytes()
        at = data.rfind(v.tobytes())  # the new chunk (the old copy stays in the file, unlinked)
        assert at > 0, "fletcher32 chunk not found"
        p.write_bytes(_flip_at(data, at + 100))

    def values(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Workspace, Path], None]:
        return lambda ws, p: _h5(p, _replace_ds(T, data=fn(_t_values(ws))))

    def shape(new: Any) -> Callable[[Workspace, Path], None]:
        return h5(_edit_row(T, shape=new))

    s = (1, 16, 16)
    return {
        "dataset-is-group": h5(group),
        "dataset-missing": h5(lambda f: f.__delitem__(_tpath())),
        "string-dtype": values(lambda v: np.full(v.shape, "text", dtype=object).astype(h5py.string_dtype())),
        "fixed-string-dtype": values(lambda v: np.full(v.shape, b"abcd", dtype="S4")),
        "compound-dtype": values(lambda v: np.zeros(v.shape, dtype=[("a", "<f4"), ("b", "<f4")])),
        "vlen-int-dtype": h5(_replace_ds(T, shape=s, dtype=h5py.vlen_dtype(np.int32))),
        "dtype-lie-float64": values(lambda v: v.astype(np.float64)),
        "dtype-lie-int32": values(lambda v: (v * 100).astype(np.int32)),
        "shape-lie-bigger": shape([1, 16, 64]),
        "shape-lie-smaller": shape([1, 4, 4]),
        "shape-lie-rank0": shape([]),
        "shape-lie-huge": shape([1 << 20, 1 << 20]),
        "data-shape-scalar": values(lambda v: np.float32(1.0)),
        "data-shape-empty": values(lambda v: np.zeros((0,), np.float32)),
        "data-shape-other": values(lambda v: v.reshape(16, 16)[:8]),
        "soft-link": h5(_link(T, h5py.SoftLink("/" + _tpath(T_OTHER)))),
        "soft-link-dangling": h5(_link(T, h5py.SoftLink("/nowhere/at/all"))),
        "soft-link-loop": h5(_link(T, h5py.SoftLink("/" + _tpath()))),
        "external-link": external_link,
        "external-storage": external_storage,
        "virtual-dataset": virtual,
        "fletcher32-flip": fletcher,
    }


def _dump_cases() -> list[Case]:
    out: list[Case] = []

    def bad_copy(mut: Callable[[Workspace, Path], None]) -> Callable[[Workspace], str]:
        def make(ws: Workspace) -> str:
            rel = ws.copy("float.h5", "bad.h5")
            mut(ws, ws.work / rel)
            return rel

        return make

    file_cmds: dict[str, tuple[str, Callable[[Workspace, str], list[str]]]] = {
        "ls": ("ivq", lambda ws, b: ["ls", b]),
        "diff": ("ivq-diff", lambda ws, b: [ws.copy("qdq.h5"), b, "-q"]),
        "report": ("ivq", lambda ws, b: ["report", b, ws.copy("qdq.h5"), "-o", "r.html"]),
    }
    for i, (what, mut) in enumerate(_dump_file_mutations().items()):
        for cmd, (prog, argv) in file_cmds.items():
            if cmd == "report" and i % 3:
                continue  # the report opens dumps as diff does: every third mutation is enough
            out.append(Case(f"dump/{what}/{cmd}", "dump", _argv(bad_copy(mut), argv), 3, prog=prog))
    for what in ("manifest-array", "backend-info-list", "manifest-shape-string", "truncated-half"):
        mut = _dump_file_mutations()[what]
        out.append(Case(f"dump/{what}/diagnose", "dump", _argv(bad_copy(mut), lambda ws, b: [
            "diagnose", b, ws.copy("qdq.h5"), "--model", ws.copy("model.qdq.onnx"), "--budget-sqnr", "-1000"]), 3))
        out.append(Case(f"dump/{what}/show", "dump", _argv(bad_copy(mut), lambda ws, b: ["show", b, T]), 3))

    data_cmds: dict[str, tuple[str, Callable[[Workspace, str], list[str]], int | tuple[int, ...]]] = {
        "ls": ("ivq", lambda ws, b: ["ls", b], (0, 3)),
        "show": ("ivq", lambda ws, b: ["show", b, T, "--values", "4"], 3),
        "diff": ("ivq-diff", lambda ws, b: [ws.copy("float.h5"), b, "-q"], 3),
        "report": ("ivq", lambda ws, b: ["report", ws.copy("float.h5"), b, "-o", "r.html"], 3),
    }
    for what, mut in _dump_data_mutations().items():
        for cmd, (prog, argv, code) in data_cmds.items():
            out.append(Case(f"dump/{what}/{cmd}", "dump", _argv(bad_copy(mut), argv), code, prog=prog))
    for what in ("string-dtype", "shape-lie-bigger", "soft-link", "external-storage", "fletcher32-flip"):
        mut = _dump_data_mutations()[what]
        out.append(Case(f"dump/{what}/diagnose", "dump", _argv(bad_copy(mut), lambda ws, b: [
            "diagnose", b, ws.copy("qdq.h5"), "--model", ws.copy("model.qdq.onnx"), "--budget-sqnr", "-1000"]), 3))

    # value-level: still a valid dump
    def nan_values(ws: Workspace, p: Path) -> None:
        v = _t_values(ws).copy()
        v.reshape(-1)[::3] = np.nan
        v.reshape(-1)[1::7] = np.inf
        _h5(p, _replace_ds(T, data=v))

    def data_flip(ws: Workspace, p: Path) -> None:
        v = _t_values(ws)
        data = p.read_bytes()
        at = data.find(v.tobytes())
        assert at > 0
        p.write_bytes(_flip_at(data, at + 101))

    # a path named inside a dump is never opened: the report uses what the dump stores
    def model_path_outside(ws: Workspace) -> str:
        shutil.copyfile(ws.corpus["model.qdq.onnx"], ws.outside / "model.qdq.onnx")
        rel = ws.copy("ingest.h5")

        def edit(f: Any) -> None:
            info = json.loads(f.attrs["backend_info"])
            info["model_path"] = str(ws.outside / "model.qdq.onnx")
            f.attrs["backend_info"] = json.dumps(info)
            f.attrs["model"] = json.dumps({"path": str(ws.outside / "model.qdq.onnx")})

        return _h5_then(ws, rel, edit)

    out.append(Case("dump/model-path-outside/report", "dump", lambda ws: [
        "report", ws.copy("qdq.h5"), model_path_outside(ws), "-o", "r.html"], 0, creates=("r.html",)))
    out.append(Case("dump/model-path-outside/report-exports", "dump", lambda ws: [
        "report", ws.copy("qdq.h5"), model_path_outside(ws), "-o", "r.html", "--perfetto", "t.json",
        "--model-explorer", "m.json"], 0, creates=("r.html", "t.json", "m.json")))
    for what, mut in (("nan-inf-values", nan_values), ("data-bit-flip", data_flip)):
        out.append(Case(f"dump/{what}/diff", "dump", _argv(bad_copy(mut), lambda ws, b: [
            ws.copy("float.h5"), b, "-q"]), 0, prog="ivq-diff"))
        out.append(Case(f"dump/{what}/show", "dump", _argv(bad_copy(mut), lambda ws, b: ["show", b, T, "--values", "8"]), 0))
    return out


def _argv(make: Callable[[Workspace], str], argv: Callable[[Workspace, str], list[str]]) -> Callable[[Workspace], list[str]]:
    return lambda ws: argv(ws, make(ws))


# ============================================================================ hostile names in dumps
def _renamed(ws: Workspace, name: str, as_: str) -> str:
    rel = ws.copy("float.h5", as_)
    _h5(ws.work / rel, _edit_row(T, name=name))
    return rel


def _name_cases() -> list[Case]:
    out: list[Case] = []
    for what, name in NAMES.items():
        out.append(Case(f"names/tensor-{what}/ls", "names", lambda ws, n=name: ["ls", _renamed(ws, n, "a.h5")], 0))
        out.append(Case(f"names/tensor-{what}/show", "names",
                        lambda ws, n=name: ["show", _renamed(ws, n, "a.h5"), n, "--values", "3"], 0))
        out.append(Case(f"names/tensor-{what}/diff", "names", lambda ws, n=name: [
            _renamed(ws, n, "a.h5"), _renamed(ws, n, "b.h5"), "--json", "d.json", "--top", "30"], 0,
            prog="ivq-diff", creates=("d.json",), scan=("d.json",)))
        out.append(Case(f"names/tensor-{what}/report", "names", lambda ws, n=name: [
            "report", _renamed(ws, n, "a.h5"), _renamed(ws, n, "b.h5"), "-o", "r.html"], 0,
            creates=("r.html",), scan=("r.html",), payloads=HTML_PAYLOADS))
    out.append(Case("names/tensor-nul/ls", "names", lambda ws: ["ls", _renamed(ws, "a\x00b", "a.h5")], 0))
    out.append(Case("names/op-type-ansi/ls", "names", lambda ws: [
        "ls", _h5_then(ws, ws.copy("float.h5", "a.h5"), _edit_row(T, op_type=NAMES["ansi"]))], 0))
    out.append(Case("names/backend-html/report", "names", lambda ws: [
        "report", ws.copy("float.h5"), _h5_then(ws, ws.copy("qdq.h5", "b.h5"), lambda f: f.attrs.__setitem__(
            "backend", NAMES["html"])), "-o", "r.html"], 0, creates=("r.html",), scan=("r.html",),
        payloads=HTML_PAYLOADS))
    out.append(Case("names/backend-ansi/diff", "names", lambda ws: [
        ws.copy("float.h5"), _h5_then(ws, ws.copy("qdq.h5", "b.h5"), lambda f: f.attrs.__setitem__(
            "backend", NAMES["ansi"]))], 0, prog="ivq-diff"))
    out.append(Case("names/incomplete-reason-ansi/ls", "names", lambda ws: [
        "ls", _h5_then(ws, ws.copy("float.h5", "a.h5"), lambda f: (
            f.attrs.__setitem__("complete", False),
            f.attrs.__setitem__("incomplete_reasons", json.dumps([NAMES["ansi"]]))))], 0))
    # file names
    odd = {"ansi": NAMES["ansi"] + ".h5", "newline": "two\nlines.h5", "markup": "[red]x[/red].h5",
           "non-utf8": os.fsdecode(b"\xff\xfe-bytes.h5"), "html": "<script>alert(1)<\\script>.h5"}
    for what, fname in odd.items():
        out.append(Case(f"names/file-{what}/ls", "names", lambda ws, f=fname: ["ls", ws.copy("float.h5", f)], 0))
        out.append(Case(f"names/missing-file-{what}/ls", "names", lambda ws, f=fname: ["ls", f], 3))
        out.append(Case(f"names/missing-file-{what}/diff", "names", lambda ws, f=fname: [ws.copy("float.h5"), f],
                        3, prog="ivq-diff"))
        out.append(Case(f"names/missing-model-{what}/capture", "names", lambda ws, f=fname: [
            "capture", "onnx", f + ".onnx", "--inputs", ws.copy("x.npz"), "-o", "o.h5"], 3))
        out.append(Case(f"names/missing-overrides-{what}/quantize", "names", lambda ws, f=fname: [
            "quantize", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz"), "-o", "q.onnx",
            "--overrides", f + ".json"], 3))
        out.append(Case(f"names/missing-graph-{what}/ingest", "names", lambda ws, f=fname: [
            "ingest", "qnn-net-run", ws.copy("netrun") + "/output", "--graph", f + ".json", "-o", "o.h5"], 3))
    out.append(Case("names/file-html/report", "names", lambda ws: [
        "report", ws.copy("float.h5", "<img src=x onerror=alert(1)>.h5"), ws.copy("qdq.h5"), "-o", "r.html"], 0,
        creates=("r.html",), scan=("r.html",), payloads=("<img src=x onerror=alert(1)>",)))
    out.append(Case("names/path-too-long/ls", "names", lambda ws: ["ls", "d/" + "x" * 300 + ".h5"], 3))
    out.append(Case("names/path-too-long/diff", "names", lambda ws: [ws.copy("float.h5"), "x" * 5000], 3,
                    prog="ivq-diff"))
    out.append(Case("names/path-too-long/quantize", "names", lambda ws: [
        "quantize", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz"), "-o", "q.onnx",
        "--overrides", "y" * 300 + ".json"], 3))
    return out


def _h5_then(ws: Workspace, rel: str, fn: Callable[[Any], Any]) -> str:
    _h5(ws.work / rel, fn)
    return rel


# ============================================================================ .npz inputs
def _npy_bytes(header: dict | str | bytes, data: bytes = b"", magic: bytes = b"\x93NUMPY\x01\x00") -> bytes:
    if isinstance(header, dict):
        header = repr(header)
    h = header.encode("latin1") if isinstance(header, str) else header
    pad = 64 - (len(magic) + 2 + len(h) + 1) % 64
    h = h + b" " * pad + b"\n"
    return magic + struct.pack("<H", len(h)) + h + data


def _npz_with(ws: Workspace, rel: str, members: dict[str, bytes], keep: bool = True) -> str:
    """An .npz holding the valid inputs (``keep``) plus/overridden by raw ``members``."""
    p = ws.work / rel
    with zipfile.ZipFile(p, "w") as z:
        if keep:
            with np.load(ws.corpus["x.npz"], allow_pickle=False) as src:
                for k in src.files:
                    if f"{k}.npy" not in members:
                        import io

                        buf = io.BytesIO()
                        np.save(buf, src[k])
                        z.writestr(f"{k}.npy", buf.getvalue())
        for name, data in members.items():
            z.writestr(name, data)
    return rel


def _npz_mutations() -> dict[str, tuple[Callable[[Workspace], str], int]]:
    good = {"descr": "<f4", "fortran_order": False, "shape": (1, 3, 8, 8)}
    data = np.zeros((1, 3, 8, 8), np.float32).tobytes()

    def member(header: Any, payload: bytes = data, **kw: Any) -> Callable[[Workspace], str]:
        return lambda ws: _npz_with(ws, "x.npz", {"input.1.npy": _npy_bytes(header, payload, **kw)})

    def arrays(**arrs: np.ndarray) -> Callable[[Workspace], str]:
        def make(ws: Workspace) -> str:
            with np.load(ws.corpus["x.npz"], allow_pickle=False) as z:
                d = {k: z[k] for k in z.files}
            d.update(arrs)
            for k in [k for k, v in arrs.items() if v is None]:
                d.pop(k)
            np.savez(ws.work / "x.npz", **d)
            return "x.npz"

        return make

    def raw(data: bytes, name: str = "x.npz") -> Callable[[Workspace], str]:
        return lambda ws: ws.write(name, data)

    def pickled(ws: Workspace) -> str:
        np.save(ws.work / "x.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
        return "x.npy"

    def truncated(ws: Workspace) -> str:
        b = ws.corpus["x.npz"].read_bytes()
        return ws.write("x.npz", b[: len(b) // 2])

    def zip_member_not_npy(ws: Workspace) -> str:
        return _npz_with(ws, "x.npz", {"input.1.npy": b"hello, I am text"})

    def zip_extra_member(ws: Workspace) -> str:
        return _npz_with(ws, "x.npz", {"../../outside/evil.npy": _npy_bytes(good, data)})

    def zip_ansi_member(ws: Workspace) -> str:
        return _npz_with(ws, "x.npz", {"\x1b[31mred.npy": _npy_bytes(good, data)})

    return {
        "not-a-zip": (raw(b"hello, not numpy\n"), 3),
        "empty": (raw(b""), 3),
        "truncated": (truncated, 3),
        "member-not-npy": (zip_member_not_npy, 3),
        "member-bad-magic": (member(good, magic=b"\x93NUMPX\x01\x00"), 3),
        "member-bad-version": (member(good, magic=b"\x93NUMPY\x09\x00"), 3),
        "member-header-not-dict": (member("[1, 2, 3]"), 3),
        "member-header-garbage": (member("{'descr': <f4 !!!"), 3),
        "member-header-huge": (lambda ws: _npz_with(ws, "x.npz", {"input.1.npy": b"\x93NUMPY\x02\x00"
                                                                  + struct.pack("<I", 0xFFFFFF) + b"{" * 64}), 3),
        "member-shape-negative": (member({**good, "shape": (-1, 3)}), 3),
        "member-shape-huge": (member({**good, "shape": (1 << 40,)}, data[:64]), 3),
        "member-shape-string": (member({**good, "shape": "big"}), 3),
        "member-descr-object": (member({**good, "descr": "|O"}), 3),
        "member-descr-unknown": (member({**good, "descr": "<x9"}), 3),
        "member-descr-structured": (member({**good, "descr": [("a", "<f4"), ("b", "<f4")], "shape": (1, 3, 8, 4)}), 3),
        "member-fortran-string": (member({**good, "fortran_order": "yes"}), 3),
        "member-data-short": (member(good, data[:10]), 3),
        "member-traversal-name": (zip_extra_member, 3),
        "member-ansi-name": (zip_ansi_member, 3),
        "pickled-npy": (pickled, 3),
        "wrong-dtype": (arrays(**{"input.1": np.zeros((1, 3, 8, 8), np.int64)}), 3),
        "wrong-shape": (arrays(**{"input.1": np.zeros((2, 3), np.float32)}), 3),
        "missing-input": (arrays(**{"text.embeds": None}), 3),
        "extra-input": (arrays(zzz=np.zeros(3, np.float32)), 3),
        "string-array": (arrays(**{"input.1": np.array(["a", "b"])}), 3),
        "complex-array": (arrays(**{"input.1": np.zeros((1, 3, 8, 8), np.complex64)}), 3),
        "nan-values": (arrays(**{"input.1": np.full((1, 3, 8, 8), np.nan, np.float32)}), 0),
    }


def _npz_cases() -> list[Case]:
    out = []
    #: ``ivq quantize`` casts calibration arrays to the model's input types (docs): int64 data is valid there
    quantize_code = {"wrong-dtype": 0}
    for what, (make, code) in _npz_mutations().items():
        out.append(Case(f"npz/{what}/capture", "npz", lambda ws, m=make: [
            "capture", "onnx", ws.copy("model.onnx"), "--inputs", m(ws), "-o", "o.h5"], code,
            creates=("o.h5",) if code == 0 else ()))
        if code == 0:
            continue
        q = quantize_code.get(what, code)
        out.append(Case(f"npz/{what}/quantize", "npz", lambda ws, m=make: [
            "quantize", ws.copy("model.onnx"), "--calibration", m(ws), "-o", "q.onnx"], q,
            creates=("q.onnx",) if q == 0 else ()))
    for what in ("not-a-zip", "member-shape-huge", "member-descr-unknown"):
        make = _npz_mutations()[what][0]
        out.append(Case(f"npz/{what}/tune", "npz", lambda ws, m=make: [
            "tune", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz", "calib.npz"), "--inputs", m(ws),
            "-o", "wd"], 3))
        out.append(Case(f"npz/{what}/capture-qnn", "npz", lambda ws, m=make: [
            "capture", "qnn", ws.copy("model.qdq.onnx"), "--inputs", m(ws), "-o", "o.h5"], 3))
    return out


# ============================================================================ overrides / encodings JSON
def _json_edit(src: str, fn: Callable[[Any], Any]) -> Callable[[Workspace], str]:
    def make(ws: Workspace) -> str:
        doc = json.loads(ws.corpus[src].read_text())
        new = fn(doc)
        doc = doc if new is None else new
        return ws.write("ov.json", json.dumps(doc, allow_nan=True))

    return make


def _first_act(doc: dict) -> Any:
    sec = doc["activation_encodings"]
    return sec[next(iter(sec))] if isinstance(sec, dict) else sec[0]


def _first_param(doc: dict, per_channel: bool = True) -> Any:
    sec = doc["param_encodings"]
    if isinstance(sec, dict):
        return next(v for v in sec.values() if (len(v) > 1) == per_channel)
    return next(v for v in sec if (len(v.get("scale", [])) > 1) == per_channel)


def _set(path_fn: Callable[[Any], Any], key: str, value: Any) -> Callable[[Any], None]:
    def edit(doc: Any) -> None:
        obj = path_fn(doc)
        (obj[0] if isinstance(obj, list) else obj)[key] = value

    return edit


def _overrides_mutations() -> dict[str, tuple[Callable[[Workspace], str], int]]:
    raw = lambda data: (lambda ws: ws.write("ov.json", data))  # noqa: E731
    leg, v1, ort, a2 = "legacy.json", "v1.json", "ort.json", "aimet2.json"

    def first_ort(doc: dict) -> dict:
        return doc[next(iter(doc))][0]

    def with_sidecar(body: bytes) -> Callable[[Workspace], str]:
        def make(ws: Workspace) -> str:
            ws.write("ov.json.nodes_to_exclude.json", body)  # qnn.quantize.EXCLUDE_SUFFIX
            return ws.write("ov.json", ws.corpus[ort].read_bytes())

        return make

    def add_act(name: str) -> Callable[[Any], None]:
        def edit(doc: dict) -> None:
            doc["activation_encodings"][name] = _first_act(doc)

        return edit

    def drop_channels(doc: dict) -> None:
        enc = _first_param(doc)
        del enc[3:]

    def v1_pc_bw(bw: Any) -> Callable[[Any], None]:
        def edit(doc: dict) -> None:
            e = next(x for x in doc["param_encodings"] if x["enc_type"] == "PER_CHANNEL")
            e["bw"] = bw

        return edit

    def ort_entries(value: Any) -> Callable[[Any], None]:
        def edit(doc: dict) -> None:
            doc[next(iter(doc))] = value

        return edit

    return {
        # the valid files themselves
        "legacy-valid": (lambda ws: ws.copy(leg, "ov.json"), 0),
        "v1-valid": (lambda ws: ws.copy(v1, "ov.json"), 0),
        "ort-valid": (lambda ws: ws.copy(ort, "ov.json"), 0),
        "aimet2-valid": (lambda ws: ws.copy(a2, "ov.json"), 0),
        "empty-object": (raw("{}"), 0),
        # legacy
        "legacy-scale-string": (_json_edit(leg, _set(_first_act, "scale", "0.1")), 3),
        "legacy-scale-list": (_json_edit(leg, _set(_first_act, "scale", [0.1])), 3),
        "legacy-scale-zero": (_json_edit(leg, _set(_first_act, "scale", 0)), 3),
        "legacy-scale-negative": (_json_edit(leg, _set(_first_act, "scale", -0.5)), 3),
        "legacy-scale-nan": (_json_edit(leg, _set(_first_act, "scale", float("nan"))), 3),
        "legacy-scale-inf": (_json_edit(leg, _set(_first_act, "scale", float("inf"))), 3),
        "legacy-bitwidth-1e9": (_json_edit(leg, _set(_first_act, "bitwidth", 1e9)), 3),
        "legacy-bitwidth-zero": (_json_edit(leg, _set(_first_act, "bitwidth", 0)), 3),
        "legacy-bitwidth-negative": (_json_edit(leg, _set(_first_act, "bitwidth", -8)), 3),
        "legacy-bitwidth-string": (_json_edit(leg, _set(_first_act, "bitwidth", "8")), 3),
        "legacy-bitwidth-fraction": (_json_edit(leg, _set(_first_act, "bitwidth", 8.5)), 3),
        "legacy-bitwidth-bool": (_json_edit(leg, _set(_first_act, "bitwidth", True)), 3),
        "legacy-bitwidth-bigint": (_json_edit(leg, _set(_first_act, "bitwidth", 10 ** 400)), 3),
        "legacy-offset-huge": (_json_edit(leg, _set(_first_act, "offset", -10 ** 12)), 3),
        "legacy-min-gt-max": (_json_edit(leg, lambda d: (_set(_first_act, "min", 5.0)(d),
                                                         _set(_first_act, "max", -5.0)(d))), 3),
        "legacy-symmetric-maybe": (_json_edit(leg, _set(_first_act, "is_symmetric", "maybe")), 3),
        "legacy-dtype-complex": (_json_edit(leg, _set(_first_act, "dtype", "complex")), 3),
        "legacy-entries-dict": (_json_edit(leg, lambda d: d["activation_encodings"].__setitem__(
            next(iter(d["activation_encodings"])), {"bitwidth": 8})), 3),
        "legacy-entries-empty": (_json_edit(leg, lambda d: d["activation_encodings"].__setitem__(
            next(iter(d["activation_encodings"])), [])), 3),
        "legacy-section-string": (_json_edit(leg, lambda d: d.__setitem__("param_encodings", "all")), 3),
        "legacy-per-channel-count": (_json_edit(leg, drop_channels), 3),
        "legacy-unknown-tensor": (_json_edit(leg, add_act("no/such/tensor")), 3),
        "legacy-unknown-tensor-ansi": (_json_edit(leg, add_act(NAMES["ansi"])), 3),
        # 1.0.0
        "v1-bw-string": (_json_edit(v1, _set(lambda d: d["activation_encodings"], "bw", "8")), 3),
        "v1-enc-type-unknown": (_json_edit(v1, _set(lambda d: d["activation_encodings"], "enc_type", "GALAXY")), 3),
        "v1-scale-strings": (_json_edit(v1, _set(lambda d: d["activation_encodings"], "scale", ["a"])), 3),
        "v1-scale-number": (_json_edit(v1, _set(lambda d: d["activation_encodings"], "scale", 0.1)), 3),
        "v1-offset-length": (_json_edit(v1, _set(lambda d: d["activation_encodings"], "offset", [0, 0])), 3),
        "v1-is-sym-maybe": (_json_edit(v1, _set(lambda d: d["activation_encodings"], "is_sym", "maybe")), 3),
        "v1-per-channel-bw-negative": (_json_edit(v1, v1_pc_bw(-9)), 3),
        "v1-per-channel-bw-huge": (_json_edit(v1, v1_pc_bw(10 ** 18)), 3),
        "v1-sections-objects": (_json_edit(v1, lambda d: d.__setitem__("activation_encodings", {"a": 1})), 3),
        "v1-entry-no-name": (_json_edit(v1, lambda d: d["activation_encodings"][0].pop("name")), 3),
        "v1-entry-not-object": (_json_edit(v1, lambda d: d["activation_encodings"].__setitem__(0, 42)), 3),
        # ORT
        "ort-quant-type-unknown": (_json_edit(ort, lambda d: first_ort(d).__setitem__("quant_type", "QUInt7")), 3),
        "ort-scale-string": (_json_edit(ort, lambda d: first_ort(d).__setitem__("scale", "abc")), 3),
        "ort-zero-point-huge": (_json_edit(ort, lambda d: first_ort(d).__setitem__("zero_point", 10 ** 30)), 3),
        "ort-rmin-gt-rmax": (_json_edit(ort, ort_entries([{"quant_type": "QUInt8", "rmin": 1.0, "rmax": -1.0}])), 3),
        "ort-axis-string": (_json_edit(ort, lambda d: first_ort(d).__setitem__("axis", "x")), 3),
        "ort-entries-numbers": (_json_edit(ort, ort_entries([1, 2])), 3),
        "ort-entries-empty": (_json_edit(ort, ort_entries([])), 3),
        "ort-symmetric-string": (_json_edit(ort, ort_entries([{"quant_type": "QUInt8", "symmetric": "yes"}])), 3),
        "ort-unknown-key": (_json_edit(ort, lambda d: first_ort(d).__setitem__("launch", "missiles")), 3),
        # AIMET 2.x
        "aimet2-y-scale-string": (_json_edit(a2, _set(lambda d: d["activation_encodings"], "y_scale", "x")), 3),
        "aimet2-dtype-unknown": (_json_edit(a2, _set(lambda d: d["activation_encodings"], "output_dtype", "int7")), 3),
        # any JSON
        "top-level-array": (raw("[]"), 3),
        "top-level-null": (raw("null"), 3),
        "top-level-number": (raw("42"), 3),
        "deep-nesting": (raw("[" * 100000 + "]" * 100000), 3),
        "deep-nesting-object": (raw('{"a":' * 50000 + "1" + "}" * 50000), 3),
        "not-json": (raw("activation_encodings: yes\n"), 3),
        "nul-bytes": (raw('{"activation_encodings": {}\x00}'), 3),
        "not-utf8": (raw(b'{"activation_encodings": {"\xff": []}}'), 3),
        "bom": (raw(b"\xef\xbb\xbf{}"), 0),  # a UTF-8 byte-order mark (Windows editors) is skipped
        "truncated": (lambda ws: ws.write("ov.json", ws.corpus[leg].read_bytes()[:500]), 3),
        # the ORT file's sidecar of the nodes left float (what ivq tune delivers for fp16)
        "ort-exclude-sidecar-list": (with_sidecar(b'["v_proj"]'), 3),
        "ort-exclude-sidecar-not-list": (with_sidecar(b'{"nodes_to_exclude": "v_proj"}'), 3),
        "ort-exclude-sidecar-not-json": (with_sidecar(b"nodes_to_exclude: [v_proj]"), 3),
    }


def _overrides_cases() -> list[Case]:
    out = []
    for what, (make, code) in _overrides_mutations().items():
        out.append(Case(f"overrides/{what}/quantize", "overrides", lambda ws, m=make: [
            "quantize", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz"), "-o", "q.onnx",
            "--overrides", m(ws)], code, creates=("q.onnx",) if code == 0 else ()))
    for what in ("legacy-scale-string", "deep-nesting"):
        make = _overrides_mutations()[what][0]
        out.append(Case(f"overrides/{what}/tune", "overrides", lambda ws, m=make: [
            "tune", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz", "calib.npz"), "--inputs",
            ws.copy("x.npz"), "--overrides", m(ws), "-o", "wd"], 3, timeout=120))
    return out


# ============================================================================ converter / graph JSON
def _netjson_mutations() -> dict[str, tuple[Callable[[Any], Any] | bytes, int]]:
    def tensors(fn: Callable[[dict], None]) -> Callable[[Any], None]:
        return lambda d: fn(d["graph"]["tensors"])

    def first(fn: Callable[[dict], None], name: str = "_attn_Softmax_output_0_QuantizeLinear_Output") -> Callable:
        return tensors(lambda ts: fn(ts[name]))

    def qp(key: str, value: Any) -> Callable:
        return first(lambda t: t["quant_params"]["scale_offset"].__setitem__(key, value))

    def per_channel(fn: Callable[[dict], None]) -> Callable:
        return first(lambda t: fn(t["quant_params"]), "conv1_weight_quantized")

    def conv_axis(value: Any) -> Callable:
        return tensors(lambda ts: ts["_conv1_Conv_output_0_QuantizeLinear_Output"]["quant_params"].update(
            {"encoding": 1, "axis_scale_offset": {"axis": value, "num_scale_offsets": 8, "scale_offsets": [
                {"scale": 0.1, "offset": -32768}] * 8}}))

    return {
        "top-level-array": (lambda d: [d], 3),
        "top-level-null": (lambda d: None, 3),
        "graph-string": (lambda d: d.__setitem__("graph", "g"), 3),
        "tensors-list": (lambda d: d["graph"].__setitem__("tensors", list(d["graph"]["tensors"].values())), 3),
        "nodes-list": (lambda d: d["graph"].__setitem__("nodes", list(d["graph"]["nodes"].values())), 3),
        "nodes-string": (lambda d: d["graph"].__setitem__("nodes", "none"), 3),
        "node-not-object": (lambda d: d["graph"]["nodes"].__setitem__("_attn_Softmax", 5), 3),
        "node-outputs-int": (lambda d: d["graph"]["nodes"]["_attn_Softmax"].__setitem__("output_names", 5), 3),
        "tensor-not-object": (tensors(lambda ts: ts.__setitem__("_attn_Softmax_output_0_QuantizeLinear_Output", [1])), 3),
        "data-type-string": (first(lambda t: t.__setitem__("data_type", "banana")), 3),
        # a STRING tensor is valid QNN, but its raw file cannot be read: a fatal ingest problem
        "data-type-qnn-string": (first(lambda t: t.__setitem__("data_type", "QNN_DATATYPE_STRING")), 1),
        "data-type-huge": (first(lambda t: t.__setitem__("data_type", 10 ** 30)), 3),
        "dims-negative": (first(lambda t: t.__setitem__("dims", [1, -16, 16])), 3),
        "dims-float": (first(lambda t: t.__setitem__("dims", [1, 16.5, 16])), 3),
        "dims-string": (first(lambda t: t.__setitem__("dims", "1x16x16")), 3),
        "dims-huge": (first(lambda t: t.__setitem__("dims", [1 << 40, 1 << 40])), 3),  # QNN dims are uint32
        "scale-string": (qp("scale", "abc"), 3),
        "scale-nan": (qp("scale", float("nan")), 3),
        "scale-negative": (qp("scale", -1.0), 3),
        "offset-huge": (qp("offset", 10 ** 30), 3),
        "offset-string": (qp("offset", "zero"), 3),
        "quant-params-list": (first(lambda t: t.__setitem__("quant_params", [1, 2])), 3),
        "scale-offsets-numbers": (per_channel(lambda q: q["axis_scale_offset"].__setitem__("scale_offsets", [1, 2])), 3),
        "scale-offsets-strings": (per_channel(lambda q: q["axis_scale_offset"].__setitem__("scale_offsets",
                                                                                            [{"scale": "a"}])), 3),
        "axis-out-of-range": (conv_axis(9), 3),
        "axis-string": (conv_axis("x"), 3),
        "permute-bad": (first(lambda t: t.__setitem__("permute_order_to_src", [0, 0, 1])), 3),
        "permute-strings": (first(lambda t: t.__setitem__("permute_order_to_src", ["a", "b", "c"])), 3),
        "deep-nesting": (b"[" * 100000 + b"]" * 100000, 3),
        "not-utf8": (b'{"graph": {"tensors": {"\xff": {}}}}', 3),
        "nul-bytes": (b'{"graph": \x00}', 3),
        "truncated": (None, 3),
    }


def _netjson_cases() -> list[Case]:
    out = []
    for what, (edit, code) in _netjson_mutations().items():
        def make(ws: Workspace, e: Any = edit, w: str = what) -> str:
            d = ws.copy("netrun")
            p = ws.work / d / "model_net.json"
            if isinstance(e, bytes):
                p.write_bytes(e)
            elif w == "truncated":
                p.write_bytes(p.read_bytes()[:3000])
            else:
                doc = json.loads(p.read_text())
                new = e(doc)
                p.write_text(json.dumps(doc if new is None and not w.startswith("top-level") else new))
            return d

        out.append(Case(f"netjson/{what}/ingest", "netjson", lambda ws, m=make: [
            "ingest", "qnn-net-run", (d := m(ws)) + "/output", "--graph", d + "/model_net.json",
            "--model", ws.copy("model.qdq.onnx"), "-o", "o.h5"], code, creates=("o.h5",) if code == 1 else ()))
    # context-binary JSON
    ctx = Path(__file__).resolve().parents[1] / "fixtures" / "qnn" / "context" / "context_plain.json"
    for what, edit in {
        "context-graphs-dict": lambda d: d.__setitem__("graphs", {"a": 1}),
        "context-inputs-dict": lambda d: d["graphs"][0].__setitem__("graphInputs", {"a": 1}),
        "context-dims-string": lambda d: d["graphs"][0]["graphOutputs"][0].__setitem__("dimensions", "big"),
    }.items():
        def make_ctx(ws: Workspace, e: Any = edit) -> str:
            doc = json.loads(ctx.read_text())
            e(doc)
            return ws.write("ctx.json", json.dumps(doc))

        out.append(Case(f"netjson/{what}/ingest", "netjson", lambda ws, m=make_ctx: [
            "ingest", "qnn-net-run", ws.copy("netrun") + "/output", "--graph", m(ws), "-o", "o.h5"], 3))
    return out


# ============================================================================ qnn-net-run folders
RESULT = "netrun/output/Result_1"
OUT_RAW = "logits.raw"  # a FLOAT_32 graph output (checked for size, then dropped as a duplicate of its Q output)
READ_RAW = "_attn_Softmax_output_0_QuantizeLinear_Output.raw"  # a tensor file the ingest reads


def _netrun_cases() -> list[Case]:
    def ingest(edit: Callable[[Workspace], None], code: int, extra: tuple[str, ...] = (),
               creates: tuple[str, ...] | None = None) -> Callable[[Workspace], list[str]]:
        def build(ws: Workspace) -> list[str]:
            ws.copy("netrun")
            edit(ws)
            return ["ingest", "qnn-net-run", "netrun/output", "--graph", "netrun/model_net.json", "--model",
                    ws.copy("model.qdq.onnx"), "-o", "o.h5", *extra]

        return build

    def rm(rel: str) -> Callable[[Workspace], None]:
        return lambda ws: (ws.work / rel).unlink()

    def resize(rel: str, n: int) -> Callable[[Workspace], None]:
        def edit(ws: Workspace) -> None:
            p = ws.work / rel
            b = p.read_bytes()
            p.write_bytes(b[:n] if n <= len(b) else b + b"\x00" * (n - len(b)))

        return edit

    def replace_with(rel: str, kind: str) -> Callable[[Workspace], None]:
        def edit(ws: Workspace) -> None:
            p = ws.work / rel
            size = p.stat().st_size
            p.unlink()
            if kind == "dir":
                p.mkdir()
            elif kind == "fifo":
                os.mkfifo(p)
            elif kind == "loop":
                os.symlink(p.name, p)
            elif kind == "outside":
                os.symlink(ws.secret("secret.raw", b"\x00" * size), p)
            elif kind == "outside-rel":
                ws.secret("secret.raw", b"\x00" * size)
                os.symlink(os.path.relpath(ws.outside / "secret.raw", p.parent), p)

        return edit

    def gap(ws: Workspace) -> None:
        (ws.work / RESULT).rename(ws.work / "netrun/output/Result_2")

    def result_outside(ws: Workspace) -> None:
        src = ws.work / RESULT
        shutil.move(str(src), ws.outside / "Result_1")
        os.symlink(ws.outside / "Result_1", src)

    def put(rel: str, data: bytes | str) -> Callable[[Workspace], None]:
        return lambda ws: ws.write(rel, data)

    def nan_raw(ws: Workspace) -> None:
        p = ws.work / RESULT / OUT_RAW
        p.write_bytes(np.full(p.stat().st_size // 4, np.nan, np.float32).tobytes())

    def input_list(line: Callable[[Workspace], str]) -> Callable[[Workspace], None]:
        def edit(ws: Workspace) -> None:
            ws.secret("secret.raw", b"\x00" * 768)
            ws.write("netrun/input_list.txt", line(ws) + "\n")
            ws.write("netrun/output/input_list.txt", line(ws) + "\n")

        return edit

    inc = ("o.h5",)
    specs: dict[str, tuple[Callable[[Workspace], None], int | tuple[int, ...], tuple[str, ...], tuple[str, ...]]] = {
        "valid": (lambda ws: None, 0, (), inc),
        "missing-output-raw": (rm(f"{RESULT}/{OUT_RAW}"), 1, (), inc),
        "missing-output-raw-strict": (rm(f"{RESULT}/{OUT_RAW}"), 3, ("--strict",), ()),
        "missing-result-folder": (gap, 1, (), inc),
        "raw-short": (resize(f"{RESULT}/{OUT_RAW}", 10), 1, (), inc),
        "raw-long": (resize(f"{RESULT}/{OUT_RAW}", 100000), 1, (), inc),
        "raw-empty": (resize(f"{RESULT}/{OUT_RAW}", 0), 1, (), inc),
        "raw-short-strict": (resize(f"{RESULT}/{OUT_RAW}", 10), 3, ("--strict",), ()),
        "raw-is-dir": (replace_with(f"{RESULT}/{OUT_RAW}", "dir"), 1, (), inc),
        "raw-is-fifo": (replace_with(f"{RESULT}/{OUT_RAW}", "fifo"), 1, (), inc),
        "raw-symlink-loop": (replace_with(f"{RESULT}/{OUT_RAW}", "loop"), 1, (), inc),
        "raw-symlink-outside": (replace_with(f"{RESULT}/{READ_RAW}", "outside"), (1, 3), (), inc),
        "raw-symlink-outside-relative": (replace_with(f"{RESULT}/{READ_RAW}", "outside-rel"), (1, 3), (), inc),
        "result-symlink-outside": (result_outside, (1, 3), (), inc),
        "unknown-raw": (put(f"{RESULT}/zzz_not_a_tensor.raw", b"\x00" * 16), 1, (), inc),
        "unknown-raw-ansi": (put(f"{RESULT}/{NAMES['ansi']}.raw", b"\x00" * 16), 1, (), inc),
        "nan-values": (nan_raw, 0, (), inc),
        "input-list-traversal": (input_list(lambda ws: "input_1:=../../outside/secret.raw"), 0, (), inc),
        "input-list-absolute": (input_list(lambda ws: f"input_1:={ws.outside / 'secret.raw'}"), 0, (), inc),
    }
    out = [Case(f"netrun/{what}/ingest", "netrun", ingest(edit, code, extra), code, creates=cr)
           for what, (edit, code, extra, cr) in specs.items()]
    # issue 31: an index is a number from a folder name; it must not size the gap scan (it once grew to 17.7 GB)
    out.append(Case("netrun/result-index-huge/ingest", "netrun", ingest(
        lambda ws: shutil.copytree(ws.work / RESULT, ws.work / "netrun/output/Result_99999999999999999999999"), 3),
        3, memory=2 << 30, timeout=5))
    out.append(Case("netrun/output-dir-is-file/ingest", "netrun", lambda ws: [
        "ingest", "qnn-net-run", ws.copy("x.npz"), "--graph", ws.copy("netrun") + "/model_net.json", "-o", "o.h5"], 3))
    out.append(Case("netrun/output-dir-missing/ingest", "netrun", lambda ws: [
        "ingest", "qnn-net-run", "nowhere", "--graph", ws.copy("netrun") + "/model_net.json", "-o", "o.h5"], 3))
    out.append(Case("netrun/no-result-folders/ingest", "netrun", lambda ws: [
        "ingest", "qnn-net-run", (ws.copy("netrun"), "netrun")[1], "--graph", "netrun/model_net.json", "-o", "o.h5"], 3))
    return out


# ============================================================================ profiling files
def _profiling_cases() -> list[Case]:
    csv_, viewer, trace = "qnn_ep_detailed.csv", "viewer_basic.txt", "ort_trace.json"

    def edit(src: str, fn: Callable[[bytes], bytes], name: str | None = None) -> Callable[[Workspace], str]:
        def make(ws: Workspace) -> str:
            return ws.write(name or src, fn(ws.corpus[src].read_bytes()))

        return make

    def insert(at_line: int, text: bytes) -> Callable[[bytes], bytes]:
        def fn(b: bytes) -> bytes:
            lines = b.split(b"\n")
            lines.insert(at_line, text)
            return b"\n".join(lines)

        return fn

    def cut(frac: float) -> Callable[[bytes], bytes]:
        def fn(b: bytes) -> bytes:
            n = int(len(b) * frac)
            while b[n - 1 : n] == b"\n":
                n -= 1
            return b[:n]

        return fn

    def trace_edit(fn: Callable[[Any], Any]) -> Callable[[bytes], bytes]:
        def f(b: bytes) -> bytes:
            d = json.loads(b)
            new = fn(d)
            return json.dumps(d if new is None else new).encode()

        return f

    def evs(fn: Callable[[dict], None]) -> Callable[[Any], None]:
        def f(d: Any) -> None:
            for e in (d["traceEvents"] if isinstance(d, dict) else d):
                fn(e)

        return f

    valid_row = b"0,NODE,1,CYCLES,BACKEND,SUB-EVENT,x:OpId_1 (cycles),"
    specs: dict[str, tuple[Callable[[Workspace], str], int]] = {
        "csv-valid": (lambda ws: ws.copy(csv_), 0),
        "csv-truncated-mid-row": (edit(csv_, cut(0.6)), 3),
        "csv-nul-byte": (edit(csv_, insert(5, b"0,NODE,1,CYCLES,BACKEND,SUB-EVENT,x\x00y:OpId_1 (cycles),")), 3),
        "csv-huge-field": (edit(csv_, insert(5, b'0,NODE,1,CYCLES,BACKEND,SUB-EVENT,"' + b"x" * 200000 + b'",')), 3),
        "csv-huge-time": (edit(csv_, insert(5, b"0,NODE," + b"9" * 5000 + b",CYCLES,BACKEND,SUB-EVENT,x:OpId_1 (cycles),")), 3),
        "csv-time-nan": (edit(csv_, insert(5, b"0,NODE,nan,CYCLES,BACKEND,SUB-EVENT,x:OpId_1 (cycles),")), 3),
        "csv-header-only": (edit(csv_, lambda b: b.split(b"\n")[0] + b"\n"), 3),
        "csv-short-row": (edit(csv_, insert(5, b"0,NODE,1")), 3),
        "csv-time-word": (edit(csv_, insert(5, valid_row.replace(b",1,", b",fast,"))), 3),
        "csv-not-utf8": (edit(csv_, insert(5, valid_row.replace(b"x:", b"\xff\xfe:"))), 3),
        "csv-empty": (lambda ws: ws.write(csv_, b""), 3),
        "viewer-valid": (lambda ws: ws.copy(viewer), 0),
        "viewer-truncated-mid-line": (edit(viewer, cut(0.55)), 3),
        "viewer-nul-late": (edit(viewer, insert(20, b"\x00\x00\x00")), 3),
        "viewer-huge-line": (edit(viewer, insert(8, b"Backend (" + b"(" * 100000 + b")")), 0),
        "trace-valid": (lambda ws: ws.copy(trace), 0),
        "trace-truncated": (edit(trace, lambda b: b[: len(b) // 2]), 3),
        "trace-events-dict": (edit(trace, trace_edit(lambda d: {"traceEvents": {"a": 1}})), 3),
        "trace-ts-strings": (edit(trace, trace_edit(evs(lambda e: e.__setitem__("ts", "soon")))), 3),
        "trace-dur-negative": (edit(trace, trace_edit(evs(lambda e: e.__setitem__("dur", -5)))), 3),
        "trace-ts-inf": (edit(trace, trace_edit(evs(lambda e: e.__setitem__("ts", float("inf"))))), 3),
        "trace-args-list": (edit(trace, trace_edit(evs(lambda e: e.__setitem__("args", [1])))), 0),
        "trace-deep": (lambda ws: ws.write(trace, b"[" * 100000 + b"]" * 100000), 3),
        # issue 31: B/E pairs whose args are lists (their merge was a TypeError); rows a QNN EP never writes
        "trace-begin-end-args-list": (edit(trace, trace_edit(lambda d: [
            x for e in d for x in ({**e, "ph": "B", "args": [1]},
                                   {**e, "ph": "E", "ts": e["ts"] + e["dur"], "args": ["x"]})])), 0),
        "csv-extra-fields": (edit(csv_, insert(5, valid_row + b"junk,more")), 3),
        "csv-root-extra-field": (edit(csv_, insert(5, b"0,EXECUTE,5,US,BACKEND,ROOT,QNN execute time,,extra")), 3),
        "csv-node-name-with-commas": (edit(csv_, insert(5, b"0,NODE,1,CYCLES,BACKEND,SUB-EVENT,a,b:OpId_1 (cycles),")),
                                      0),
        "binary-log": (lambda ws: ws.write("p.log", b"\x00\x01QNNPROF" + bytes(range(256)) * 4), 3),
    }
    out = []
    for what, (make, code) in specs.items():
        out.append(Case(f"profiling/{what}/ingest", "profiling", lambda ws, m=make: [
            "ingest", "qnn-net-run", ws.copy("netrun") + "/output", "--graph", "netrun/model_net.json",
            "--model", ws.copy("model.qdq.onnx"), "--profiling", m(ws), "-o", "o.h5"], code,
            creates=("o.h5",) if code == 0 else ()))
    return out


# ============================================================================ ONNX models
def _onnx_mutations() -> dict[str, tuple[Callable[[Workspace], str], int]]:
    def model_edit(fn: Callable[[Any, Workspace], None]) -> Callable[[Workspace], str]:
        def make(ws: Workspace) -> str:
            import onnx

            m = onnx.load(str(ws.corpus["model.onnx"]))
            fn(m, ws)
            onnx.save(m, str(ws.work / "model.onnx"))
            return "model.onnx"

        return make

    def external(location: Callable[[Workspace], str], length_extra: int = 0,
                 write: Callable[[Workspace, bytes], None] | None = None) -> Callable[[Workspace], str]:
        def fn(m: Any, ws: Workspace) -> None:
            from onnx import TensorProto

            init = max(m.graph.initializer, key=lambda i: len(i.raw_data) or 0)
            data = init.raw_data
            if write is not None:
                write(ws, data)
            init.ClearField("raw_data")
            init.data_location = TensorProto.EXTERNAL
            for k, v in (("location", location(ws)), ("offset", "0"), ("length", str(len(data) + length_extra))):
                e = init.external_data.add()
                e.key, e.value = k, v

        return model_edit(fn)

    def put_outside(ws: Workspace, data: bytes) -> None:
        ws.secret("weights.bin", data)

    def put_inside(ws: Workspace, data: bytes) -> None:
        ws.write("weights.bin", data)

    def fifo_inside(ws: Workspace, data: bytes) -> None:
        ws.fifo("weights.bin")

    def raw(data: bytes) -> Callable[[Workspace], str]:
        return lambda ws: ws.write("model.onnx", data)

    def unknown_op(m: Any, ws: Workspace) -> None:
        m.graph.node[1].op_type = "LaunchMissiles"
        m.graph.node[1].domain = "evil.example"

    def opset(m: Any, ws: Workspace) -> None:
        m.opset_import[0].version = 999

    def init_lie(m: Any, ws: Workspace) -> None:
        init = max(m.graph.initializer, key=lambda i: len(i.raw_data) or 0)
        init.raw_data = init.raw_data[:4]

    def cycle(m: Any, ws: Workspace) -> None:
        n0, n1 = m.graph.node[0], m.graph.node[1]
        n0.input[0] = n1.output[0]

    return {
        "text": (raw(b"this is not protobuf\n"), 3),
        "empty": (raw(b""), 3),
        "truncated": (lambda ws: ws.write("model.onnx", ws.corpus["model.onnx"].read_bytes()[:2000]), 3),
        "external-data-outside": (external(lambda ws: "../outside/weights.bin", write=put_outside), 3),
        "external-data-absolute": (external(lambda ws: str(ws.outside / "weights.bin"), write=put_outside), 3),
        "external-data-fifo": (external(lambda ws: "weights.bin", write=fifo_inside), 3),
        "external-data-dev-zero": (external(lambda ws: "/dev/zero"), 3),
        "external-data-length-lie": (external(lambda ws: "weights.bin", length_extra=4096, write=put_inside), 3),
        "external-data-missing": (external(lambda ws: "nowhere.bin"), 3),
        "unknown-op": (model_edit(unknown_op), 3),
        "opset-999": (model_edit(opset), 3),
        "initializer-size-lie": (model_edit(init_lie), 3),
        "graph-cycle": (model_edit(cycle), 3),
    }


def _onnx_cases() -> list[Case]:
    out = []
    for what, (make, code) in _onnx_mutations().items():
        out.append(Case(f"onnx/{what}/capture", "onnx", lambda ws, m=make: [
            "capture", "onnx", m(ws), "--inputs", ws.copy("x.npz"), "-o", "o.h5"], code))
        out.append(Case(f"onnx/{what}/quantize", "onnx", lambda ws, m=make: [
            "quantize", m(ws), "--calibration", ws.copy("x.npz"), "-o", "q.onnx"], code))
    def zero_nodes(ws: Workspace) -> str:  # a graph that passes its input through: no node at all
        import onnx
        from onnx import TensorProto, helper

        x = helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 3, 8, 8])  # the dumps' input
        onnx.save(helper.make_model(helper.make_graph([], "g", [x], [x]), opset_imports=[helper.make_opsetid("", 17)]),
                  str(ws.work / "zero.onnx"))
        return "zero.onnx"

    # issue 31: "0 units replayed", exit 0
    for what, make in (("empty", _onnx_mutations()["empty"][0]), ("zero-nodes", zero_nodes)):
        out.append(Case(f"onnx/{what}/diagnose", "onnx", lambda ws, m=make: [
            "diagnose", ws.copy("float.h5"), ws.copy("qdq.h5"), "--model", m(ws), "--budget-sqnr", "-1000"], 3))
        out.append(Case(f"onnx/{what}/report-replay", "onnx", lambda ws, m=make: [
            "report", ws.copy("float.h5"), ws.copy("qdq.h5"), "-o", "r.html", "--replay", m(ws)], 3))
    for what in ("text", "truncated", "external-data-outside", "external-data-fifo"):
        make = _onnx_mutations()[what][0]
        # report and ingest read the graph only (names, nodes), never the weights: external data is not read
        graph_only = 0 if what.startswith("external") else 3
        out.append(Case(f"onnx/{what}/report", "onnx", lambda ws, m=make: [
            "report", ws.copy("float.h5"), ws.copy("qdq.h5"), "-o", "r.html", "--model", m(ws)], graph_only,
            creates=("r.html",) if graph_only == 0 else ()))
        out.append(Case(f"onnx/{what}/diagnose", "onnx", lambda ws, m=make: [
            "diagnose", ws.copy("float.h5"), ws.copy("qdq.h5"), "--model", m(ws), "--budget-sqnr", "-1000"], 3))
        out.append(Case(f"onnx/{what}/ingest", "onnx", lambda ws, m=make: [
            "ingest", "qnn-net-run", ws.copy("netrun") + "/output", "--graph", "netrun/model_net.json",
            "--model", m(ws), "-o", "o.h5"], graph_only, creates=("o.h5",) if graph_only == 0 else ()))
    return out


# ============================================================================ special files as inputs
SPECIAL_KINDS = ("fifo", "socket", "stdin", "loop", "dir", "devzero")


def _special(ws: Workspace, kind: str, name: str) -> str:
    if kind == "fifo":
        return ws.fifo(name)
    if kind == "socket":
        return ws.socket(name)
    if kind == "stdin":
        return "/dev/stdin"
    if kind == "loop":
        ws.symlink(name + ".b", name)
        return ws.symlink(name, name + ".b")
    if kind == "dir":
        (ws.work / name).mkdir()
        return name
    if kind == "devzero":
        return "/dev/zero"
    raise ValueError(kind)


def _special_slots() -> dict[str, Callable[[Workspace, str], list[str]]]:
    def dump_pair(ws: Workspace) -> tuple[str, str]:
        return ws.copy("float.h5"), ws.copy("qdq.h5")

    def ing(ws: Workspace, **over: str) -> list[str]:
        ws.copy("netrun")
        a = {"out": "netrun/output", "graph": "netrun/model_net.json", "model": ws.copy("model.qdq.onnx")}
        a.update(over)
        argv = ["ingest", "qnn-net-run", a["out"], "--graph", a["graph"], "--model", a["model"], "-o", "o.h5"]
        return argv + (["--profiling", a["profiling"]] if "profiling" in a else [])

    def slots(ws: Workspace, corpus_files: dict[str, str], over: dict[str, str]) -> dict[str, str]:
        """Each slot's path: the hostile file where given, else a copy of the corpus file of that name."""
        return {k: over[k] if k in over else ws.copy(name) for k, name in corpus_files.items()}

    def q(ws: Workspace, **over: str) -> list[str]:
        a = slots(ws, {"model": "model.onnx", "calib": "x.npz", "ov": "ort.json"}, over)
        return ["quantize", a["model"], "--calibration", a["calib"], "-o", "q.onnx", "--overrides", a["ov"]]

    def tune(ws: Workspace, **over: str) -> list[str]:
        a = {"model": "model.onnx", "calib": "calib.npz", "inputs": "x.npz"}
        a.update(over)
        if "model" not in over:
            ws.copy("model.onnx")
        if "calib" not in over:
            ws.copy("x.npz", "calib.npz")
        if "inputs" not in over:
            ws.copy("x.npz")
        return ["tune", a["model"], "--calibration", a["calib"], "--inputs", a["inputs"], "-o", "wd"]

    def cstats(ws: Workspace, **over: str) -> list[str]:
        a = slots(ws, {"model": "model.onnx", "calib": "x.npz", "enc": "model.qdq.onnx"}, over)
        return ["calib-stats", a["model"], "--calibration", a["calib"], "--encodings", a["enc"], "-o", "s.json"]

    return {
        "ls-dump": lambda ws, s: ["ls", s],
        "show-dump": lambda ws, s: ["show", s, T],
        "diff-ref": lambda ws, s: ["diff", s, ws.copy("qdq.h5")],
        "diff-test": lambda ws, s: ["diff", ws.copy("float.h5"), s],
        "diff-map": lambda ws, s: ["diff", *dump_pair(ws), "--map", s],
        "diff-baseline": lambda ws, s: ["diff", *dump_pair(ws), "--baseline", s],
        "report-test": lambda ws, s: ["report", ws.copy("float.h5"), s, "-o", "r.html"],
        "report-model": lambda ws, s: ["report", *dump_pair(ws), "-o", "r.html", "--model", s],
        "report-map": lambda ws, s: ["report", *dump_pair(ws), "-o", "r.html", "--map", s],
        "diagnose-ref": lambda ws, s: ["diagnose", s, ws.copy("qdq.h5"), "--model", ws.copy("model.qdq.onnx")],
        "diagnose-model": lambda ws, s: ["diagnose", *dump_pair(ws), "--model", s],
        "capture-model": lambda ws, s: ["capture", "onnx", s, "--inputs", ws.copy("x.npz"), "-o", "o.h5"],
        "capture-inputs": lambda ws, s: ["capture", "onnx", ws.copy("model.onnx"), "--inputs", s, "-o", "o.h5"],
        "quantize-model": lambda ws, s: q(ws, model=s),
        "quantize-calibration": lambda ws, s: q(ws, calib=s),
        "quantize-overrides": lambda ws, s: q(ws, ov=s),
        "ingest-output-dir": lambda ws, s: ing(ws, out=s),
        "ingest-graph": lambda ws, s: ing(ws, graph=s),
        "ingest-model": lambda ws, s: ing(ws, model=s),
        "ingest-profiling": lambda ws, s: ing(ws, profiling=s),
        "tune-model": lambda ws, s: tune(ws, model=s),
        "tune-calibration": lambda ws, s: tune(ws, calib=s),
        "tune-inputs": lambda ws, s: tune(ws, inputs=s),
        "calib-stats-model": lambda ws, s: cstats(ws, model=s),
        "calib-stats-calibration": lambda ws, s: cstats(ws, calib=s),
        "calib-stats-encodings": lambda ws, s: cstats(ws, enc=s),
    }


def _special_cases() -> list[Case]:
    out = []
    for slot, argv in _special_slots().items():
        for kind in SPECIAL_KINDS:
            if kind == "dir" and slot in ("ingest-output-dir", "quantize-calibration", "tune-calibration",
                                          "calib-stats-calibration"):
                continue  # folders are valid there
            if kind == "devzero" and not slot.startswith(("diff-map", "diff-baseline", "quantize-overrides",
                                                          "ingest-graph", "ingest-profiling", "capture-inputs",
                                                          "ls-dump", "capture-model")):
                continue  # /dev/zero reads until memory runs out: only where a read_text-style loader sits
            out.append(Case(f"special/{kind}/{slot}", "special",
                            lambda ws, a=argv, k=kind, s=slot: a(ws, _special(ws, k, "in." + s.split("-")[-1])),
                            3, stdin="pipe" if kind == "stdin" else "devnull", timeout=20,
                            memory=256 << 20 if kind == "devzero" else None))
    return out


# ============================================================================ outputs that are inputs
def _output_pairs() -> dict[str, tuple[Callable[[Workspace], tuple[list[str], str]], str]]:
    """command → (argv builder returning (argv without the output option, input the output aliases),
    output option)."""

    def diff(alias: str) -> Callable[[Workspace], tuple[list[str], str]]:
        def b(ws: Workspace) -> tuple[list[str], str]:
            r, t = ws.copy("float.h5"), ws.copy("qdq.h5")
            extra: list[str] = []
            target = {"ref": r, "test": t}.get(alias)
            if alias == "baseline":
                target = ws.copy("baseline.json")
                extra = ["--baseline", target]
            if alias == "map":
                target = ws.copy("map.json")
                extra = ["--map", target]
            return ["diff", r, t, "-q", *extra], target

        return b

    def report(alias: str) -> Callable[[Workspace], tuple[list[str], str]]:
        def b(ws: Workspace) -> tuple[list[str], str]:
            r, t = ws.copy("float.h5"), ws.copy("qdq.h5")
            if alias == "model":
                m = ws.copy("model.qdq.onnx")
                return ["report", r, t, "-o", "r.html", "--model", m], m
            if alias == "ref":
                return ["report", r, t], r
            return ["report", r, t, "-o", "r.html"], t

        return b

    def capture(alias: str) -> Callable[[Workspace], tuple[list[str], str]]:
        def b(ws: Workspace) -> tuple[list[str], str]:
            m, x = ws.copy("model.onnx"), ws.copy("x.npz")
            return ["capture", "onnx", m, "--inputs", x], {"model": m, "inputs": x}[alias]

        return b

    def ingest(alias: str) -> Callable[[Workspace], tuple[list[str], str]]:
        def b(ws: Workspace) -> tuple[list[str], str]:
            ws.copy("netrun")
            m, p = ws.copy("model.qdq.onnx"), ws.copy("qnn_ep_detailed.csv")
            target = {"graph": "netrun/model_net.json", "model": m, "profiling": p,
                      "raw": "netrun/output/Result_0/logits.raw"}[alias]
            return ["ingest", "qnn-net-run", "netrun/output", "--graph", "netrun/model_net.json", "--model", m,
                    "--profiling", p], target

        return b

    def quantize(alias: str) -> Callable[[Workspace], tuple[list[str], str]]:
        def b(ws: Workspace) -> tuple[list[str], str]:
            m, x, ov = ws.copy("model.onnx"), ws.copy("x.npz"), ws.copy("ort.json")
            return ["quantize", m, "--calibration", x, "--overrides", ov], {"model": m, "calibration": x,
                                                                             "overrides": ov}[alias]

        return b

    def diagnose(alias: str) -> Callable[[Workspace], tuple[list[str], str]]:
        def b(ws: Workspace) -> tuple[list[str], str]:
            r, t, m = ws.copy("float.h5"), ws.copy("qdq.h5"), ws.copy("model.qdq.onnx")
            return ["diagnose", r, t, "--model", m, "--budget-sqnr", "-1000"], {"ref": r, "model": m}[alias]

        return b

    def reference(alias: str) -> Callable[[Workspace], tuple[list[str], str]]:
        def b(ws: Workspace) -> tuple[list[str], str]:
            s = ws.copy("session.h5")
            ws.copy("parts")
            argv = ["reference", s, "--model-dir", "parts"]
            if alias == "session":
                return argv, s
            if alias == "config":
                cfg = ws.write("cfg.json", "{}\n")
                return [*argv, "--config", cfg], cfg
            decode = sorted((ws.work / "parts").glob("*decode*.onnx"))[0]
            if alias == "decode-model":
                dm = ws.write("dm.onnx", decode.read_bytes())
                return [*argv, "--decode-model", dm], dm
            return argv, os.path.relpath(decode, ws.work)  # a file inside --model-dir

        return b

    def diagnose_shards(ws: Workspace) -> tuple[list[str], str]:
        r, t, m = ws.copy("float.h5"), ws.copy("qdq.h5"), ws.copy("model.qdq.onnx")
        ws.copy("replay-shards", "ds")
        shard = os.path.relpath(sorted((ws.work / "ds").glob("*.json"))[0], ws.work)
        return ["diagnose", r, t, "--model", m, "--shards", "ds", "--budget-sqnr", "-1000"], shard

    def dynamic(ws: Workspace) -> tuple[list[str], str]:
        m = ws.copy("model.onnx")
        return ["quantize", m, "--dynamic"], m

    return {
        # issue 31: the writers that once had no check (ivq reference, a shard of diagnose's own --shards, --dynamic)
        "reference-o-session": (reference("session"), "-o"),
        "reference-o-config": (reference("config"), "-o"),
        "reference-o-decode-model": (reference("decode-model"), "-o"),
        "reference-o-model-dir-file": (reference("model-dir-file"), "-o"),
        "diagnose-json-shards": (diagnose_shards, "--json"),
        "quantize-dynamic-o-model": (dynamic, "-o"),
        "diff-json-ref": (diff("ref"), "--json"),
        "diff-report-test": (diff("test"), "--report"),
        "diff-json-baseline": (diff("baseline"), "--json"),
        "diff-json-map": (diff("map"), "--json"),
        "report-o-ref": (report("ref"), "-o"),
        "report-junit-test": (report("test"), "--junit"),
        "report-explorer-model": (report("model"), "--model-explorer"),
        "capture-o-model": (capture("model"), "-o"),
        "capture-o-inputs": (capture("inputs"), "-o"),
        "ingest-o-graph": (ingest("graph"), "-o"),
        "ingest-o-model": (ingest("model"), "-o"),
        "ingest-o-profiling": (ingest("profiling"), "-o"),
        "ingest-o-raw": (ingest("raw"), "-o"),
        "quantize-o-model": (quantize("model"), "-o"),
        "quantize-o-calibration": (quantize("calibration"), "-o"),
        "quantize-o-overrides": (quantize("overrides"), "-o"),
        "diagnose-json-ref": (diagnose("ref"), "--json"),
        "diagnose-json-model": (diagnose("model"), "--json"),
    }


def _output_cases() -> list[Case]:
    out = []
    for what, (build, opt) in _output_pairs().items():
        for spelling in ("same", "dot", "symlink", "hardlink"):
            for force in (True, False) if spelling == "same" else (True,):
                def make(ws: Workspace, b: Any = build, o: str = opt, sp: str = spelling, f: bool = force) -> list[str]:
                    argv, target = b(ws)
                    if sp == "same":
                        dest = target
                    elif sp == "dot":
                        dest = f"./sub/../{target}"
                        (ws.work / "sub").mkdir(exist_ok=True)
                    elif sp == "symlink":
                        dest = ws.symlink("alias.out", target)
                    else:
                        dest = "alias.out"
                        os.link(ws.work / target, ws.work / dest)
                    return [*argv, o, dest, *(["--force"] if f else [])]

                out.append(Case(f"outputs/{what}/{spelling}{'-force' if force else ''}", "outputs", make, 2))
    out.append(Case("outputs/tune-workdir-holds-inputs/force", "outputs", lambda ws: [
        "tune", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz", "calib.npz"), "--inputs",
        ws.copy("x.npz"), "--overrides", ws.copy("ort.json", "overrides.json"), "-o", ".", "--force"], 2,
        timeout=120))
    out.append(Case("outputs/tune-workdir-is-file/force", "outputs", lambda ws: [
        "tune", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz", "calib.npz"), "--inputs",
        ws.copy("x.npz"), "-o", ws.write("notes.txt", "mine\n"), "--force"], 2))
    out.append(Case("outputs/report-two-outputs-one-file/force", "outputs", lambda ws: [
        "report", ws.copy("float.h5"), ws.copy("qdq.h5"), "-o", "r.html", "--junit", "./r.html", "--force"], 2))
    return out


# ============================================================================ full disk, read-only folder
def _disk_cases() -> list[Case]:
    writers: dict[str, Callable[[Workspace], list[str]]] = {
        "capture": lambda ws: ["capture", "onnx", ws.copy("model.onnx"), "--inputs", ws.copy("x.npz"), "-o",
                               "out/o.h5"],
        "ingest": lambda ws: ["ingest", "qnn-net-run", ws.copy("netrun") + "/output", "--graph",
                              "netrun/model_net.json", "--model", ws.copy("model.qdq.onnx"), "-o", "out/o.h5"],
        "diff-json": lambda ws: ["diff", ws.copy("float.h5"), ws.copy("qdq.h5"), "-q", "--json", "out/d.json"],
        "diff-report": lambda ws: ["diff", ws.copy("float.h5"), ws.copy("qdq.h5"), "-q", "--report", "out/r.html"],
        "diff-models-json": lambda ws: ["diff", ws.copy("model.onnx"), ws.copy("model.qdq.onnx"), "--inputs",
                                        ws.copy("x.npz"), "-q", "--json", "out/d.json"],
        "report": lambda ws: ["report", ws.copy("float.h5"), ws.copy("qdq.h5"), "-o", "out/r.html"],
        "quantize": lambda ws: ["quantize", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz"), "-o",
                                "out/q.onnx"],
        "diagnose-json": lambda ws: ["diagnose", ws.copy("float.h5"), ws.copy("qdq.h5"), "--model",
                                     ws.copy("model.qdq.onnx"), "--budget-sqnr", "-1000", "--json", "out/d.json"],
    }
    out = []
    for what, build in writers.items():
        out.append(Case(f"disk/fsize/{what}", "disk", build, 2, fsize=8192, creates=("out",)))
        out.append(Case(f"disk/tmpfs-full/{what}", "disk", build, 2, tmpfs="out", tmpfs_size=4096, creates=("out",)))
        out.append(Case(f"disk/readonly/{what}", "disk", build, 2, readonly="out", creates=("out",)))
    return out


# ============================================================================ --map / --baseline JSON
def _diff_json_cases() -> list[Case]:
    def base(fn: Callable[[dict], Any]) -> Callable[[Workspace], str]:
        def make(ws: Workspace) -> str:
            d = json.loads(ws.corpus["baseline.json"].read_text())
            new = fn(d)
            return ws.write("b.json", json.dumps(d if new is None else new))

        return make

    def layers(fn: Callable[[dict], None]) -> Callable[[dict], None]:
        def edit(d: dict) -> None:
            for layer in d["layers"]:
                fn(layer)

        return edit

    raw = lambda data: (lambda ws: ws.write("b.json", data))  # noqa: E731
    specs: dict[str, tuple[str, Callable[[Workspace], str], int]] = {
        "map-list": ("--map", raw('[["a", "b"]]'), 3),
        "map-values-ints": ("--map", raw('{"/attn/Softmax_output_0": 5}'), 3),
        "map-nested": ("--map", raw('{"a": {"b": "c"}}'), 3),
        "map-null": ("--map", raw("null"), 3),
        "map-deep": ("--map", raw("[" * 100000 + "]" * 100000), 3),
        "baseline-valid": ("--baseline", lambda ws: ws.copy("baseline.json", "b.json"), 0),
        "baseline-list": ("--baseline", raw("[]"), 3),
        "baseline-empty-object": ("--baseline", raw("{}"), 3),
        "baseline-schema-other": ("--baseline", base(lambda d: d.__setitem__("schema", "ivq-diff/99")), 3),
        "baseline-layers-string": ("--baseline", base(lambda d: d.__setitem__("layers", "all")), 3),
        "baseline-layers-ints": ("--baseline", base(lambda d: d.__setitem__("layers", [1, 2])), 3),
        "baseline-metrics-strings": ("--baseline", base(layers(lambda lr: lr["metrics"].__setitem__("sqnr_db", "high"))), 3),
        "baseline-metrics-missing": ("--baseline", base(layers(lambda lr: lr.pop("metrics"))), 3),
        "baseline-record-string": ("--baseline", base(layers(lambda lr: lr.__setitem__("record", "0/model/0"))), 3),
        "baseline-findings-ints": ("--baseline", base(lambda d: d.__setitem__("findings", [1, 2])), 3),
        "baseline-finding-where-list": ("--baseline", base(lambda d: d.__setitem__(
            "findings", [{"kind": "x", "severity": "error", "where": ["t"]}])), 3),
        "baseline-deep": ("--baseline", raw('{"a":' * 50000 + "1" + "}" * 50000), 3),
        "baseline-truncated": ("--baseline", lambda ws: ws.write("b.json", ws.corpus["baseline.json"].read_bytes()[:700]), 3),
        "baseline-not-utf8": ("--baseline", raw(b'{"schema": "\xff"}'), 3),
    }
    return [Case(f"diffjson/{what}/diff", "diffjson", lambda ws, o=opt, m=make: [
        ws.copy("float.h5"), ws.copy("qdq.h5"), "-q", o, m(ws)], code, prog="ivq-diff")
        for what, (opt, make, code) in specs.items()]


# ============================================================================ device sessions (ingest session)
SESS_ARGS = ["--vision", "phone/vision", "--prefill", "phone/prefill", "--decode", "phone/decode"]
DEC = "phone/decode"  # one decode folder (5 calls)
DEC_RES = f"{DEC}/output/Result_0"
DEC_IN = f"{DEC}/inputs/0"


def _session_copy(ws: Workspace) -> None:
    ws.copy("parts")
    ws.copy("phone")


def _folder_edits() -> dict[str, tuple[Callable[[Workspace], None], int]]:
    """Edits of a session's qnn-net-run folders (after :func:`_session_copy`) → the exit code of a reader
    that fails on any problem (``ingest session``, ``ingest qnn-net-run --model``)."""

    def rm(rel: str) -> Callable[[Workspace], None]:
        return lambda ws: (ws.work / rel).unlink()

    def rmtree(rel: str) -> Callable[[Workspace], None]:
        return lambda ws: shutil.rmtree(ws.work / rel)

    def cut(rel: str, n: int) -> Callable[[Workspace], None]:
        return lambda ws: _bytes_edit(lambda b: b[:n])(ws.work / rel)

    def put(rel: str, data: bytes | str) -> Callable[[Workspace], None]:
        return lambda ws: ws.write(rel, data)

    def link_out(rel: str, relative: bool = False) -> Callable[[Workspace], None]:
        def edit(ws: Workspace) -> None:
            p = ws.work / rel
            secret = ws.secret(p.name, p.read_bytes()) if p.is_file() else None
            if p.is_dir():
                shutil.move(str(p), ws.outside / p.name)
                secret = ws.outside / p.name
            else:
                p.unlink()
            os.symlink(os.path.relpath(secret, p.parent) if relative else secret, p)

        return edit

    def special(rel: str, kind: str) -> Callable[[Workspace], None]:
        def edit(ws: Workspace) -> None:
            p = ws.work / rel
            p.unlink()
            if kind == "fifo":
                os.mkfifo(p)
            elif kind == "dir":
                p.mkdir()
            else:
                os.symlink(p.name, p)

        return edit

    def lst(fn: Callable[[Workspace, list[str]], list[str]]) -> Callable[[Workspace], None]:
        def edit(ws: Workspace) -> None:
            p = ws.work / DEC / "input_list.txt"
            p.write_text("\n".join(fn(ws, p.read_text().splitlines())) + "\n")

        return edit

    def line(i: int, fn: Callable[[Workspace, str], str]) -> Callable[[Workspace], None]:
        def edit(ws: Workspace, lines: list[str]) -> list[str]:
            ws.secret("secret.raw", (ws.work / DEC_IN / "attention_mask.raw").read_bytes())
            lines[i] = fn(ws, lines[i])
            return lines

        return lst(edit)

    am = "inputs/1/attention_mask.raw"
    return {
        "missing-input-raw": (rm(f"{DEC}/inputs/1/attention_mask.raw"), 3),
        "missing-output-raw": (rm(f"{DEC_RES}/logits.raw"), 3),
        "missing-result-folder": (rmtree(f"{DEC}/output/Result_4"), 3),
        "no-output-folder": (rmtree(f"{DEC}/output"), 3),
        "extra-raw": (put(f"{DEC_RES}/zzz_debug.raw", b"\x00" * 16), 0),
        "extra-raw-ansi-name": (put(f"{DEC_RES}/{NAMES['ansi']}.raw", b"\x00" * 16), 0),
        "extra-result-folder": (lambda ws: shutil.copytree(ws.work / DEC / "output/Result_4",
                                                           ws.work / DEC / "output/Result_5"), 3),
        "raw-short": (cut(f"{DEC_IN}/inputs_embeds.raw", 100), 3),
        "raw-not-whole-values": (cut(f"{DEC_IN}/inputs_embeds.raw", 255), 3),
        "raw-empty": (cut(f"{DEC_RES}/logits.raw", 0), 3),
        "raw-no-axis-fits": (cut(f"{DEC_RES}/present_0_key.raw", 20 * 2 * 16 * 4), 3),
        "raw-prime-size": (cut(f"{DEC_IN}/past_key_values_0_key.raw", 4 * 7), 3),
        "raw-non-integer-mask": (lambda ws: _bytes_edit(lambda b: np.full(len(b) // 4, 0.5, "<f4").tobytes())(
            ws.work / DEC_IN / "attention_mask.raw"), 3),
        "raw-nan-values": (lambda ws: _bytes_edit(lambda b: np.full(len(b) // 4, np.nan, "<f4").tobytes())(
            ws.work / DEC_RES / "logits.raw"), 0),
        "raw-is-fifo": (special(f"{DEC_IN}/inputs_embeds.raw", "fifo"), 3),
        "raw-is-dir": (special(f"{DEC_RES}/logits.raw", "dir"), 3),
        "raw-symlink-loop": (special(f"{DEC_RES}/logits.raw", "loop"), 3),
        "input-raw-symlink-outside": (link_out(f"{DEC_IN}/inputs_embeds.raw"), 3),
        "input-raw-symlink-outside-relative": (link_out(f"{DEC_IN}/attention_mask.raw", True), 3),
        "output-raw-symlink-outside": (link_out(f"{DEC_RES}/logits.raw"), 3),
        "result-symlink-outside": (link_out(DEC_RES), 3),
        "inputs-folder-symlink-outside": (link_out(DEC_IN), 3),
        "input-list-traversal": (line(2, lambda ws, s: s.replace(am, "../../outside/secret.raw")), 3),
        "input-list-absolute-outside": (line(2, lambda ws, s: s.replace(am, str(ws.outside / "secret.raw"))), 3),
        "input-list-nul-bytes": (line(2, lambda ws, s: s[:40] + "\x00" * 8 + s[40:]), 3),
        "input-list-token-without-path": (line(2, lambda ws, s: s.replace(am, "")), 3),
        "input-list-late-header": (line(3, lambda ws, s: "#late\n" + s), 3),
        "input-list-unknown-name": (line(2, lambda ws, s: s + " zzz:=" + am), 3),
        "input-list-ansi-name": (line(2, lambda ws, s: s + f" {NAMES['ansi']}:=" + am), 3),
        "input-list-bare-paths": (line(2, lambda ws, s: " ".join(t.split(":=")[1] for t in s.split())), (0, 3)),
        "input-list-dropped-line": (lst(lambda ws, ls: ls[:-1]), 3),
        "input-list-empty": (lst(lambda ws, ls: []), 3),
        "input-list-missing": (rm(f"{DEC}/input_list.txt"), 3),
        "input-list-not-utf8": (put(f"{DEC}/input_list.txt", b"inputs_embeds:=\xff\xfe.raw\n"), 3),
        "input-list-is-fifo": (special(f"{DEC}/input_list.txt", "fifo"), 3),
        "input-list-huge-line": (put(f"{DEC}/input_list.txt", "x" * 3_000_000 + "\n"), 3),
    }


def _part_edits() -> dict[str, tuple[Callable[[Workspace], None], int]]:
    """Edits of the parts folder (``--model-dir parts``) → exit code."""

    def export_json(fn: Callable[[dict], Any]) -> Callable[[Workspace], None]:
        def edit(ws: Workspace) -> None:
            p = ws.work / "parts/export.json"
            d = json.loads(p.read_text())
            new = fn(d)
            p.write_text(json.dumps(d if new is None else new))

        return edit

    def part_path(path: Callable[[Workspace], str]) -> Callable[[Workspace], None]:
        def edit(ws: Workspace) -> None:
            shutil.copyfile(ws.work / "parts/decode.onnx", ws.outside / "decode.onnx")
            export_json(lambda d: [p.__setitem__("path", path(ws)) for p in d["parts"] if p.get("part") == "decode"]
                        and None)(ws)

        return edit

    return {
        "part-missing": (lambda ws: (ws.work / "parts/decode.onnx").unlink(), 3),
        "part-truncated": (lambda ws: _bytes_edit(lambda b: b[: len(b) // 2])(ws.work / "parts/decode.onnx"), 3),
        "part-text": (lambda ws: ws.write("parts/decode.onnx", "not a model\n"), 3),
        "part-is-dir": (lambda ws: ((ws.work / "parts/decode.onnx").unlink(), (ws.work / "parts/decode.onnx").mkdir()), 3),
        "part-wrong-graph": (lambda ws: shutil.copyfile(ws.work / "parts/prefill.onnx", ws.work / "parts/decode.onnx"), 3),
        "part-symlink-outside": (lambda ws: (shutil.move(str(ws.work / "parts/decode.onnx"), ws.outside / "decode.onnx"),
                                             os.symlink(ws.outside / "decode.onnx", ws.work / "parts/decode.onnx")), 3),
        "export-json-not-json": (lambda ws: ws.write("parts/export.json", "{not json"), 3),
        "export-json-parts-string": (export_json(lambda d: d.__setitem__("parts", "decode.onnx")), 3),
        "export-json-part-path-int": (export_json(lambda d: [p.__setitem__("path", 5) for p in d["parts"]] and None), 3),
        "export-json-path-traversal": (part_path(lambda ws: "../../outside/decode.onnx"), 3),
        "export-json-path-absolute": (part_path(lambda ws: str(ws.outside / "decode.onnx")), 3),
        "export-json-deep": (lambda ws: ws.write("parts/export.json", "[" * 100000 + "]" * 100000), 3),
        "export-json-fifo": (lambda ws: ((ws.work / "parts/export.json").unlink(), ws.fifo("parts/export.json")), 3),
        "no-parts": (lambda ws: [p.unlink() for p in (ws.work / "parts").glob("*.onnx")] and None, 3),
        "no-parts-no-manifest": (lambda ws: [p.unlink() for p in (ws.work / "parts").glob("*.[oj]*")] and None, 2),
    }


#: HF config.json replacements → exit code (``--config c.json``)
CONFIGS: dict[str, tuple[bytes | str, int]] = {
    "config-list": ("[1, 2]", 3),
    "config-not-json": ("{rope_theta: 1}", 3),
    "config-empty": ("", 3),
    "config-theta-string": ('{"rope_theta": "abc", "head_dim": 16}', 3),
    "config-theta-negative": ('{"rope_theta": -5, "head_dim": 16}', 3),
    "config-text-config-string": ('{"text_config": "llm", "rope_theta": 10000}', 3),
    "config-rope-scaling-list": ('{"rope_theta": 10000, "rope_scaling": [1, 2]}', 3),
    "config-head-dim-string": ('{"rope_theta": 10000, "head_dim": "sixteen"}', 3),
    "config-mrope-section-strings": ('{"rope_theta": 10000, "rope_scaling": {"mrope_section": ["a"]}}', 3),
    "config-image-token-string": ('{"rope_theta": 10000, "image_token_id": "six"}', 3),
    "config-deep": ('{"a":' * 50000 + "1" + "}" * 50000, 3),
    "config-nul": ('{"rope_theta": 10000}\x00\x00', 3),
}


def _session_cases() -> list[Case]:
    out: list[Case] = []

    def ingest(edit: Callable[[Workspace], None], extra: tuple[str, ...] = ()) -> Callable[[Workspace], list[str]]:
        def build(ws: Workspace) -> list[str]:
            _session_copy(ws)
            edit(ws)
            return ["ingest", "session", *SESS_ARGS, "--model-dir", "parts", "-o", "o.h5", *extra]

        return build

    for what, (edit, code) in {**_folder_edits(), **_part_edits()}.items():
        out.append(Case(f"session/{what}/ingest-session", "session", ingest(edit), code,
                        creates=("o.h5",) if 0 in (code if isinstance(code, tuple) else (code,)) else ()))
    for what, (data, code) in CONFIGS.items():
        out.append(Case(f"session/{what}/ingest-session", "session",
                        ingest(lambda ws, d=data: ws.write("c.json", d), ("--config", "c.json")), code))

    # the spec file (ivq-session/1): paths relative to it, checked against SPEC_FIELDS, never leaving its folder
    good = {"schema": "ivq-session/1", "model_dir": "parts", "vision": "phone/vision", "prefill": "phone/prefill",
            "decode": ["phone/decode"]}

    def spec(doc: Callable[[Workspace], Any], extra: tuple[str, ...] = ()) -> Callable[[Workspace], list[str]]:
        def build(ws: Workspace) -> list[str]:
            _session_copy(ws)
            d = doc(ws)
            ws.write("session.json", d if isinstance(d, (str, bytes)) else json.dumps(d))
            return ["ingest", "session", "--spec", "session.json", "-o", "o.h5", *extra]

        return build

    def with_(**kw: Any) -> Callable[[Workspace], dict]:
        return lambda ws: {**good, **kw}

    def without(key: str) -> Callable[[Workspace], dict]:
        return lambda ws: {k: v for k, v in good.items() if k != key}

    def outside(key: str, folder: str, allow: bool = False, relative: bool = False) -> Callable[[Workspace], dict]:
        def doc(ws: Workspace) -> dict:
            shutil.copytree(ws.work / folder, ws.outside / Path(folder).name)
            target = (f"../outside/{Path(folder).name}" if relative else str(ws.outside / Path(folder).name))
            d = {**good, key: target}
            if allow:
                d["allow_outside_inputs"] = True
            return d

        return doc

    def cfg_outside(ws: Workspace) -> dict:
        shutil.copyfile(ws.work / "parts/config.json", ws.outside / "config.json")
        return {**good, "config": str(ws.outside / "config.json")}

    def model_outside(ws: Workspace) -> dict:
        shutil.copyfile(ws.work / "parts/decode.onnx", ws.outside / "decode.onnx")
        return {**good, "models": {"decode": str(ws.outside / "decode.onnx")}}

    specs: dict[str, tuple[Callable[[Workspace], Any], int]] = {
        "spec-valid": (with_(), 0),
        "spec-not-json": (lambda ws: "{schema: ivq-session/1}", 3),
        "spec-empty": (lambda ws: "", 3),
        "spec-array": (lambda ws: [good], 3),
        "spec-null": (lambda ws: "null", 3),
        "spec-schema-other": (with_(schema="ivq-session/9"), 3),
        "spec-schema-missing": (without("schema"), 3),
        "spec-unknown-field": (with_(zzz=1), 3),
        "spec-prefill-missing": (without("prefill"), 3),
        "spec-prefill-int": (with_(prefill=3), 3),
        "spec-prefill-empty-list": (with_(prefill=[]), 3),
        "spec-decode-list-of-ints": (with_(decode=[1, 2]), 3),
        "spec-model-dir-list": (with_(model_dir=["parts"]), 3),
        "spec-models-unknown-part": (with_(models={"encoder": "parts/decode.onnx"}), 3),
        "spec-native-inputs-string": (with_(native_inputs="yes"), 3),
        "spec-dims-negative": (with_(dims={"batch_size": -1}), 3),
        "spec-dims-bool": (with_(dims={"batch_size": True}), 3),
        "spec-dims-huge": (with_(dims={"batch_size": 10**30}), 3),
        "spec-deep": (lambda ws: '{"a":' * 50000 + "1" + "}" * 50000, 3),
        "spec-nul-bytes": (lambda ws: json.dumps(good) + "\x00" * 16, 3),
        "spec-not-utf8": (lambda ws: b'{"schema": "\xff"}', 3),
        "spec-folder-missing": (with_(prefill="phone/nowhere"), 3),
        "spec-folder-is-file": (with_(prefill="parts/config.json"), 3),
        "spec-absolute-outside": (outside("prefill", "phone/prefill"), 3),
        "spec-relative-outside": (outside("decode", "phone/decode", relative=True), 3),
        "spec-outside-self-allowed": (outside("prefill", "phone/prefill", allow=True), 3),
        "spec-model-dir-outside": (outside("model_dir", "parts"), 3),
        "spec-config-outside": (cfg_outside, 3),
        "spec-models-outside": (model_outside, 3),
    }
    for what, (doc, code) in specs.items():
        out.append(Case(f"session/{what}/ingest-session", "session", spec(doc), code,
                        creates=("o.h5",) if code == 0 else ()))
    # a spec in a sub folder naming ../phone: outside its folder (refused), read with the command line's flag
    def sub_spec(extra: tuple[str, ...]) -> Callable[[Workspace], list[str]]:
        def build(ws: Workspace) -> list[str]:
            _session_copy(ws)
            ws.write("specs/session.json", json.dumps({k: v if k == "schema" else
                                                       ([f"../{x}" for x in v] if isinstance(v, list) else f"../{v}")
                                                       for k, v in good.items()}))
            return ["ingest", "session", "--spec", "specs/session.json", "-o", "o.h5", *extra]

        return build

    out.append(Case("session/spec-parent-folder/ingest-session", "session", sub_spec(()), 3))
    out.append(Case("session/valid/ingest-session", "session", ingest(lambda ws: None), 0, creates=("o.h5",)))
    out.append(Case("session/spec-parent-folder-allowed-by-flag/ingest-session", "session",
                    sub_spec(("--allow-outside-inputs",)), 0, creates=("o.h5",)))
    return out


# ============================================================================ qnn-net-run folder + ONNX graph only
def _netrun_model_cases() -> list[Case]:
    def ingest(edit: Callable[[Workspace], None], extra: tuple[str, ...] = ()) -> Callable[[Workspace], list[str]]:
        def build(ws: Workspace) -> list[str]:
            _session_copy(ws)
            edit(ws)
            return ["ingest", "qnn-net-run", DEC, "--model", "parts/decode.onnx", "--as-steps", "--part", "decode",
                    "-o", "o.h5", *extra]

        return build

    out = []
    # without an input list the folder's outputs alone are ingested (a session needs its inputs: exit 3 there)
    edits = {**_folder_edits(), "input-list-missing": (lambda ws: (ws.work / DEC / "input_list.txt").unlink(), 0)}
    for what, (edit, code) in edits.items():
        out.append(Case(f"netrun-model/{what}/ingest", "netrun-model", ingest(edit), code,
                        creates=("o.h5",) if 0 in (code if isinstance(code, tuple) else (code,)) else ()))
    flags: dict[str, tuple[tuple[str, ...], int]] = {
        "decode-at-step-0": (("--first-step", "0"), 2),
        "first-step-negative": (("--first-step", "-3"), 2),
        "dim-negative": (("--dim", "past_sequence_length=-1"), 2),
        "dim-not-int": (("--dim", "past_sequence_length=abc"), 2),
    }
    for what, (extra, code) in flags.items():
        out.append(Case(f"netrun-model/{what}/ingest", "netrun-model", ingest(lambda ws: None, extra), code))
    out.append(Case("netrun-model/valid/ingest", "netrun-model", ingest(lambda ws: None), 0, creates=("o.h5",)))
    for what, (edit, code) in _part_edits().items():
        if what.startswith("part-") and what not in ("part-missing", "part-symlink-outside"):  # --model names a file
            out.append(Case(f"netrun-model/{what}/ingest", "netrun-model", ingest(edit), code))
    return out


# ============================================================================ ivq reference
def _reference_cases() -> list[Case]:
    def ref(edit: Callable[[Workspace], None] = lambda ws: None, session: Callable[[Workspace], str] | None = None,
            extra: tuple[str, ...] = ()) -> Callable[[Workspace], list[str]]:
        def build(ws: Workspace) -> list[str]:
            ws.copy("parts")
            edit(ws)
            s = session(ws) if session else ws.copy("session.h5")
            return ["reference", s, "--model-dir", "parts", "-o", "r.h5", *extra]

        return build

    def bad_session(mut: Callable[[Workspace, Path], None]) -> Callable[[Workspace], str]:
        def make(ws: Workspace) -> str:
            rel = ws.copy("session.h5", "bad.h5")
            mut(ws, ws.work / rel)
            return rel

        return make

    def record_attr(of: str, at: int, **attrs: Any) -> Callable[[Workspace, Path], None]:
        def mut(ws: Workspace, p: Path) -> None:
            def edit(f: Any) -> None:
                for g in f["records"].values():
                    if g.attrs["part"] == of and int(g.attrs["step"]) == at:
                        for k, v in attrs.items():
                            g.attrs[k] = v
                        return

            _h5(p, edit)

        return mut

    def drop_records(part: str) -> Callable[[Workspace, Path], None]:
        def mut(ws: Workspace, p: Path) -> None:
            def edit(f: Any) -> None:
                gone = [k for k, g in f["records"].items() if g.attrs["part"] == part]
                for k in gone:
                    del f["records"][k]
                doc = _manifest(f)
                c = doc["columns"].index("rid")
                doc["rows"] = [r for r in doc["rows"] if r[c] not in gone]
                _set_manifest(f, json.dumps(doc))

            _h5(p, edit)

        return mut

    def model_attr(value: Any) -> Callable[[Workspace, Path], None]:
        return lambda ws, p: _h5(p, lambda f: f.attrs.__setitem__("model", json.dumps(value)))

    out = []
    for what, mut in _dump_file_mutations().items():
        out.append(Case(f"reference/dump-{what}/reference", "reference", ref(session=bad_session(mut)), 3))
    dumps: dict[str, tuple[Callable[[Workspace, Path], None], int]] = {
        "dump-decode-at-step-0": (record_attr("decode", 1, step=0), 3),
        "dump-step-negative": (record_attr("decode", 2, step=-4), 3),
        "dump-part-unknown": (record_attr("decode", 3, part="encoder"), (0, 3)),
        "dump-no-prefill": (drop_records("prefill"), 3),
        "dump-config-attr-string": (model_attr({"config": {"rope_theta": "abc"}}), 3),
        "dump-config-attr-text-config-list": (model_attr({"config": {"text_config": [1]}}), 3),
        "dump-config-attr-list": (model_attr({"config": [1, 2]}), 3),  # issue 31: once read as "none"
    }
    for what, (mut, code) in dumps.items():
        out.append(Case(f"reference/{what}/reference", "reference", ref(session=bad_session(mut),
                                                                          edit=lambda ws: (ws.work / "parts/config.json").unlink()),
                        code, creates=("r.h5",) if code == 0 else ()))
    out.append(Case("reference/dump-not-a-session/reference", "reference", ref(session=lambda ws: ws.copy("float.h5")), 3))
    for what, (edit, code) in _part_edits().items():
        out.append(Case(f"reference/{what}/reference", "reference", ref(edit), code))
    out.append(Case("reference/model-dir-missing/reference", "reference", lambda ws: [
        "reference", ws.copy("session.h5"), "--model-dir", "nowhere", "-o", "r.h5"], 3))
    out.append(Case("reference/model-dir-is-file/reference", "reference", lambda ws: [
        "reference", ws.copy("session.h5"), "--model-dir", ws.copy("x.npz"), "-o", "r.h5"], 3))
    for what, (data, code) in CONFIGS.items():
        out.append(Case(f"reference/{what}/reference", "reference",
                        ref(lambda ws, d=data: ws.write("c.json", d), extra=("--config", "c.json")), code))
    out.append(Case("reference/valid/reference", "reference", ref(), 0, creates=("r.h5",)))
    return out


# ============================================================================ ivq quantize --dynamic
def _dynamic_cases() -> list[Case]:
    def q(*extra: str, model: str = "model.onnx") -> Callable[[Workspace], list[str]]:
        return lambda ws: ["quantize", ws.copy(model), "-o", "q.onnx", "--dynamic", *extra]

    specs: dict[str, tuple[Callable[[Workspace], list[str]], int]] = {
        "op-types-unknown": (q("--op-types", "NoSuchOp"), 2),
        "op-types-ansi": (q("--op-types", NAMES["ansi"]), 2),
        "op-types-not-quantizable": (q("--op-types", "Relu"), 2),
        "exclude-nodes-missing": (q("--exclude-nodes", "no/such/node"), 2),
        "exclude-nodes-ansi": (q("--exclude-nodes", NAMES["ansi"]), 2),
        "with-calibration": (lambda ws: [*q()(ws), "--calibration", ws.copy("x.npz")], 2),
        "with-overrides": (lambda ws: [*q()(ws), "--overrides", ws.copy("ort.json")], 2),
        "model-truncated": (lambda ws: ["quantize", ws.write("m.onnx", ws.corpus["model.onnx"].read_bytes()[:500]),
                                        "-o", "q.onnx", "--dynamic"], 3),
        "model-already-qdq": (q(model="model.qdq.onnx"), (0, 2)),
        "valid": (q(), 0),
    }
    out = [Case(f"dynamic/{what}/quantize", "dynamic", build, code, creates=("q.onnx",) if code in (0, (0, 2)) else ())
           for what, (build, code) in specs.items()]
    return out


# ============================================================================ ivq capture qnn --qnn-cache
def _qnn_cache_cases() -> list[Case]:
    def cap(edit: Callable[[Workspace, Path], None], cache: str = "cache") -> Callable[[Workspace], list[str]]:
        def build(ws: Workspace) -> list[str]:
            ws.copy("qnncache", "cache")
            entry = next(p for p in (ws.work / "cache").iterdir() if p.is_dir())
            edit(ws, entry)
            return ["capture", "qnn", ws.copy("model.qdq.onnx"), "--inputs", ws.copy("x.npz"), "-o", "o.h5",
                    "--qnn-cache", cache]

        return build

    def garble(name: str, fn: Callable[[bytes], bytes]) -> Callable[[Workspace, Path], None]:
        return lambda ws, e: _bytes_edit(fn)(next(e.glob(name)))

    def replace(name: str, kind: str) -> Callable[[Workspace, Path], None]:
        def edit(ws: Workspace, e: Path) -> None:
            p = next(e.glob(name))
            data = p.read_bytes()
            p.unlink()
            if kind == "fifo":
                os.mkfifo(p)
            elif kind == "dir":
                p.mkdir()
            elif kind == "outside":
                os.symlink(ws.secret(p.name, data), p)

        return edit

    def entry_outside(ws: Workspace, e: Path) -> None:
        shutil.move(str(e), ws.outside / e.name)
        os.symlink(ws.outside / e.name, e)

    edits: dict[str, Callable[[Workspace, Path], None]] = {
        "meta-not-json": garble("meta.json", lambda b: b"{not json"),
        "meta-array": garble("meta.json", lambda b: b"[1, 2]"),
        "meta-empty": garble("meta.json", lambda b: b""),
        "meta-deep": garble("meta.json", lambda b: b"[" * 100000 + b"]" * 100000),
        "meta-key-mismatch": garble("meta.json", lambda b: json.dumps({**json.loads(b), "key": "0" * 64}).encode()),
        "meta-is-fifo": replace("meta.json", "fifo"),
        "context-bin-truncated": garble("*.bin", lambda b: b[: len(b) // 2]),
        "context-bin-flipped": garble("*.bin", lambda b: _flip_at(b, len(b) // 2)),
        "context-bin-empty": garble("*.bin", lambda b: b""),
        "context-bin-is-dir": replace("*.bin", "dir"),
        "context-bin-is-fifo": replace("*.bin", "fifo"),
        "context-bin-symlink-outside": replace("*.bin", "outside"),
        "ctx-onnx-truncated": garble("ctx.onnx", lambda b: b[: len(b) // 2]),
        "ctx-onnx-text": garble("ctx.onnx", lambda b: b"not onnx\n"),
        "ctx-onnx-missing": lambda ws, e: (e / "ctx.onnx").unlink(),
        "entry-symlink-outside": entry_outside,
        "entry-is-file": lambda ws, e: (shutil.rmtree(e), e.write_bytes(b"x")),
        "stray-files": lambda ws, e: (ws.write("cache/zzz.tmp", b"x"), ws.write("cache/" + NAMES["ansi"], b"y")),
        "valid": lambda ws, e: None,
    }
    out = [Case(f"qnncache/{what}/capture", "qnncache", cap(edit), 0, creates=("o.h5", "cache"), timeout=120)
           for what, edit in edits.items()]
    out.append(Case("qnncache/cache-is-file/capture", "qnncache", lambda ws: [
        "capture", "qnn", ws.copy("model.qdq.onnx"), "--inputs", ws.copy("x.npz"), "-o", "o.h5", "--qnn-cache",
        ws.write("cache", b"not a folder")], 2, timeout=120))
    out.append(Case("qnncache/cache-is-fifo/capture", "qnncache", lambda ws: [
        "capture", "qnn", ws.copy("model.qdq.onnx"), "--inputs", ws.copy("x.npz"), "-o", "o.h5", "--qnn-cache",
        ws.fifo("cache")], 2, timeout=60))
    return out


# ============================================================================ ivq tune: checkpoint, task metric
def _tune_cases() -> list[Case]:
    def tune(*extra: str, prep: Callable[[Workspace], None] = lambda ws: None) -> Callable[[Workspace], list[str]]:
        def build(ws: Workspace) -> list[str]:
            prep(ws)
            return ["tune", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz", "calib.npz"), "--inputs",
                    ws.copy("x.npz"), "-o", "wd", "--backend", "cpu", *extra]

        return build

    def ckpt(data: Callable[[Workspace], Any]) -> Callable[[Workspace], None]:
        def prep(ws: Workspace) -> None:
            d = data(ws)
            ws.write("wd/trials/checkpoint.json", d if isinstance(d, (str, bytes)) else json.dumps(d))

        return prep

    def trial(**entry: Any) -> Callable[[Workspace], dict]:
        def doc(ws: Workspace) -> dict:
            ws.secret("t.h5", ws.corpus["qdq.h5"].read_bytes())
            base = {"label": "before", "suggestions": [], "qdq_model": "wd/trials/before.qdq.onnx",
                    "dump": "wd/trials/before.h5"}
            return {"version": 1, "trials": {"0" * 16: {**base, **{k: (v(ws) if callable(v) else v)
                                                                   for k, v in entry.items()}}}}

        return doc

    def special_ckpt(kind: str) -> Callable[[Workspace], None]:
        def prep(ws: Workspace) -> None:
            (ws.work / "wd/trials").mkdir(parents=True)
            _special(ws, kind, "wd/trials/checkpoint.json")

        return prep

    resume = ("--resume",)
    specs: dict[str, tuple[Callable[[Workspace], list[str]], int]] = {
        "checkpoint-not-json": (tune(*resume, prep=ckpt(lambda ws: "{trials: ")), 3),
        "checkpoint-empty": (tune(*resume, prep=ckpt(lambda ws: "")), 3),
        "checkpoint-array": (tune(*resume, prep=ckpt(lambda ws: [1, 2])), 3),
        "checkpoint-trials-list": (tune(*resume, prep=ckpt(lambda ws: {"version": 1, "trials": []})), 3),
        "checkpoint-version-other": (tune(*resume, prep=ckpt(lambda ws: {"version": 9, "trials": {}})), 3),
        "checkpoint-trial-string": (tune(*resume, prep=ckpt(lambda ws: {"version": 1, "trials": {"k": "x"}})), 3),
        "checkpoint-trial-dump-int": (tune(*resume, prep=ckpt(trial(dump=5))), 3),
        "checkpoint-trial-dump-outside": (tune(*resume, prep=ckpt(trial(dump=lambda ws: str(ws.outside / "t.h5")))), 3),
        "checkpoint-trial-dump-traversal": (tune(*resume, prep=ckpt(trial(dump="../outside/t.h5"))), 3),
        "checkpoint-trial-seconds-string": (tune(*resume, prep=ckpt(trial(seconds="slow"))), 3),
        "checkpoint-deep": (tune(*resume, prep=ckpt(lambda ws: '{"a":' * 50000 + "1" + "}" * 50000)), 3),
        "checkpoint-nul": (tune(*resume, prep=ckpt(lambda ws: '{"version": 1, "trials": {}}' + "\x00" * 8)), 3),
        "checkpoint-not-utf8": (tune(*resume, prep=ckpt(lambda ws: b'{"version": "\xff"}')), 3),
        "checkpoint-is-fifo": (tune(*resume, prep=special_ckpt("fifo")), 3),
        "checkpoint-is-dir": (tune(*resume, prep=special_ckpt("dir")), 3),
        "checkpoint-symlink-loop": (tune(*resume, prep=special_ckpt("loop")), 3),
    }
    metrics: dict[str, tuple[str | None, str, int]] = {
        "metric-missing-file": (None, "nowhere.py:score", 3),
        "metric-not-py": ("def score(o):\n    return 1.0\n", "metric.txt:score", 2),
        "metric-raises-on-import": ("raise RuntimeError('broken metric')\n", "metric.py:score", 3),
        "metric-syntax-error": ("def score(o)\n    return 1\n", "metric.py:score", 3),
        "metric-exits-on-import": ("import sys\nsys.exit(0)\n", "metric.py:score", 3),
        "metric-no-function": ("x = 1\n", "metric.py:score", 3),
        "metric-not-callable": ("score = 1\n", "metric.py:score", 3),
        "metric-no-colon": ("def score(o):\n    return 1\n", "metric.py", 2),
        "metric-module-missing": (None, "no_such_module_zz:score", 2),
        "metric-is-fifo": ("fifo", "metric.py:score", 3),
        "metric-is-dir": ("dir", "metric.py:score", 3),
    }
    for what, (src, spec, code) in metrics.items():
        def prep(ws: Workspace, s: Any = src, sp: str = spec) -> None:
            name = sp.rsplit(":", 1)[0] if ":" in sp else sp
            if s in ("fifo", "dir"):
                _special(ws, s, name)
            elif s is not None:
                ws.write(name, s)

        specs[what] = (tune("--task-metric", spec, prep=prep), code)
    return [Case(f"tune/{what}/tune", "tune", build, code, timeout=60) for what, (build, code) in specs.items()]


# ============================================================================ ivq-diff --expected
def _expected_cases() -> list[Case]:
    out = []

    def bad_copy(mut: Callable[[Workspace, Path], None]) -> Callable[[Workspace], str]:
        def make(ws: Workspace) -> str:
            rel = ws.copy("float.h5", "bad.h5")  # the data mutations break float.h5's tensors
            mut(ws, ws.work / rel)
            return rel

        return make

    def diff(make: Callable[[Workspace], str]) -> Callable[[Workspace], list[str]]:
        return lambda ws: [ws.copy("float.h5"), ws.copy("qdq.h5", "test.h5"), "-q", "--expected", make(ws)]

    for i, (what, mut) in enumerate(_dump_file_mutations().items()):
        if i % 2 == 0:
            out.append(Case(f"dump/{what}/diff-expected", "dump", diff(bad_copy(mut)), 3, prog="ivq-diff"))
    for what in ("string-dtype", "soft-link", "external-link", "shape-lie-bigger", "dtype-lie-float64",
                 "fletcher32-flip", "dataset-is-group"):
        mut = _dump_data_mutations()[what]
        out.append(Case(f"dump/{what}/diff-expected", "dump", diff(bad_copy(mut)), 3, prog="ivq-diff"))
    def other_model(f: Any) -> None:  # the same inputs, every computed tensor another model's name
        from ivq_debug.dump.format import escape_name

        doc = _manifest(f)
        c = {n: i for i, n in enumerate(doc["columns"])}
        for r in doc["rows"]:
            if r[c["kind"]] != "input":
                old, new = r[c["name"]], "other_model/" + r[c["name"]]
                for g in ("t", "q"):  # (a tensor stored as its integers only has no t/<key>)
                    src, dst = f"records/{r[c['rid']]}/{g}/{escape_name(old)}", f"records/{r[c['rid']]}/{g}/{escape_name(new)}"
                    if src in f:
                        f.move(src, dst)
                        f[dst].attrs["name"] = new
                r[c["name"]], r[c["key"]] = new, escape_name(new)
        _set_manifest(f, json.dumps(doc))

    # issue 31: a CI job wired to another model's dump once compared nothing and passed (three_way pairs 0, exit 0)
    out.append(Case("dump/expected-other-model/diff-expected", "dump", lambda ws: [
        ws.copy("float.h5"), ws.copy("qdq.h5"), "-q", "--expected", _h5_then(ws, ws.copy("qdq.h5", "e.h5"),
                                                                              other_model)], 4, prog="ivq-diff"))
    out.append(Case("dump/expected-other-inputs/diff-expected", "dump", lambda ws: [
        ws.copy("float.h5"), ws.copy("qdq.h5"), "-q", "--expected", ws.copy("ingest.h5")], (0, 1, 3, 6), prog="ivq-diff"))
    for kind in SPECIAL_KINDS:
        if kind != "devzero":
            out.append(Case(f"special/{kind}/diff-expected", "special", lambda ws, k=kind: [
                ws.copy("float.h5"), ws.copy("qdq.h5"), "-q", "--expected", _special(ws, k, "in.expected")], 3,
                prog="ivq-diff", stdin="pipe" if kind == "stdin" else "devnull", timeout=20))
    return out


# ============================================================================ dump fields a reader uses (issue 31)
def _dump_field_cases() -> list[Case]:
    """The dump fields that reached a reader unchecked (the manifest's encodings, ``/meta/partition`` and its
    ``cpu_nodes``), a corrupt object-header checksum, and a tensor that declares 1 TiB: slot (command) × kind."""
    import h5py

    def encoding(**changes: Any) -> Callable[[Any], None]:
        def edit(doc: dict) -> None:
            c = doc["columns"].index("encoding")
            for r in doc["rows"]:
                if r[c]:
                    r[c].update(changes)

        return _edit_manifest(edit)

    def meta(name: str, value: Any) -> Callable[[Any], None]:
        def edit(f: Any) -> None:
            g = f.require_group("meta")
            if name in g:
                del g[name]
            g.create_dataset(name, data=json.dumps(value))

        return edit

    def header_checksum(f: Any) -> None:  # flip a byte inside the tensor's v2 object header (after "OHDR")
        f.attrs["_ohdr"] = int(h5py.h5o.get_info(f[_tpath()].parent.id, _tpath().rsplit("/", 1)[1].encode()).addr)

    def huge(f: Any) -> None:  # 1 TiB declared, consistent with the manifest, nothing written (a small file)
        shape = (1 << 18, 1 << 20)
        p = _tpath()
        attrs = dict(f[p].attrs)
        del f[p]
        ds = f.create_dataset(p, shape=shape, dtype="float32", chunks=(1, 1 << 16), fillvalue=0.5)
        for k, v in attrs.items():
            ds.attrs[k] = v
        _edit_row(T, shape=list(shape), nbytes=4 * shape[0] * shape[1])(f)

    def qdq(fn: Callable[[Any], None]) -> Callable[[Workspace], str]:
        return lambda ws: _h5_then(ws, ws.copy("qdq.h5", "bad.h5"), fn)

    def integers(data: Any = None) -> Callable[[Any], None]:  # TQ's integers (its only data) replaced or removed
        def edit(f: Any) -> None:
            from ivq_debug.dump.format import escape_name

            p = f"records/{RID}/q/{escape_name(TQ)}"
            assert f[p].attrs["derived"], "TQ is not stored as its integers only"
            shape = f[p].shape
            del f[p]
            if data is not None:
                f[p] = data(shape)

        return edit

    def derived_row(**changes: Any) -> Callable[[Any], None]:
        def edit(doc: dict) -> None:
            c = {n: i for i, n in enumerate(doc["columns"])}
            row = next(r for r in doc["rows"] if r[c["name"]] == TQ)
            assert row[c["derived"]], "TQ is not stored as its integers only"
            for k, v in changes.items():
                row[c[k]] = v(row[c[k]]) if callable(v) else v

        return _edit_manifest(edit)

    def flt(fn: Callable[[Any], None]) -> Callable[[Workspace], str]:
        return lambda ws: _h5_then(ws, ws.copy("float.h5", "bad.h5"), fn)

    def ohdr(ws: Workspace) -> str:
        rel = _h5_then(ws, ws.copy("float.h5", "bad.h5"), header_checksum)
        p = ws.work / rel
        with h5py.File(p, "r+") as f:
            at = int(f.attrs["_ohdr"])
            del f.attrs["_ohdr"]
        data = p.read_bytes()
        assert data[at:at + 4] == b"OHDR", "not a v2 object header"
        p.write_bytes(_flip_at(data, at + 12))
        return rel

    kinds: dict[str, tuple[Callable[[Workspace], str], tuple[str, ...], int | tuple[int, ...]]] = {
        "encoding-scale-string": (qdq(encoding(scale="abc")), ("ls", "show", "diff", "report"), 3),
        "encoding-zero-point-strings": (qdq(encoding(zero_point=["a", "b"])), ("ls", "diff"), 3),
        "encoding-bitwidth-1e9": (qdq(encoding(bitwidth=10**9)), ("ls", "show", "diff", "report"), 3),
        "encoding-qmax-float": (qdq(encoding(qmax=1.5)), ("ls", "diff"), 3),
        "meta-partition-list": (qdq(meta("partition", [1, 2])), ("diff", "report"), 3),
        "meta-cpu-nodes-strings": (qdq(meta("partition", {"cpu_nodes": ["a", "b"]})), ("diff", "report"), 3),
        "meta-cpu-node-name-int": (qdq(meta("partition", {"cpu_nodes": [{"name": 5}]})), ("diff",), 3),
        "object-header-checksum": (ohdr, ("show", "diff", "report"), 3),
        "shape-declared-1tib": (flt(huge), ("show",), 0),
        # format version 2: a tensor stored as its integers only (TQ), its integers or its encoding broken
        "integers-missing": (qdq(integers()), ("show-tq", "diff", "report"), 3),
        "integers-float32": (qdq(integers(lambda s: np.zeros(s, np.float32))), ("show-tq", "diff"), 3),
        "integers-int64": (qdq(integers(lambda s: np.zeros(s, np.int64))), ("show-tq", "diff"), 3),
        "integers-shape": (qdq(integers(lambda s: np.zeros(s[:-1], np.uint16))), ("show-tq", "diff"), 3),
        "integers-soft-link": (qdq(integers(lambda s: h5py.SoftLink("/manifest"))), ("show-tq", "diff"), 3),
        "integers-encoding-channels": (qdq(derived_row(encoding=lambda e: {**e, "scale": [0.1, 0.2], "zero_point": 0,
                                                                            "axis": 0})), ("ls", "show-tq", "diff"), 3),
        "integers-encoding-axis": (qdq(derived_row(encoding=lambda e: {**e, "scale": [0.1, 0.2], "axis": 9})),
                                   ("ls", "diff"), 3),
        "integers-encoding-nan-scale": (qdq(derived_row(encoding=lambda e: {**e, "scale": float("nan")})),
                                        ("ls", "show-tq"), 3),
        "integers-no-zero-point": (qdq(derived_row(encoding=lambda e: {k: v for k, v in e.items()
                                                                       if k != "zero_point"})), ("ls", "diff"), 3),
        "integers-has-raw-false": (qdq(derived_row(has_raw=False)), ("ls", "diff"), 3),
        "integers-float16": (qdq(derived_row(dtype="float16", nbytes=lambda n: n // 2)), ("ls",), 3),
    }
    argv: dict[str, tuple[str, Callable[[Workspace, str], list[str]]]] = {
        "ls": ("ivq", lambda ws, b: ["ls", b]),
        "show": ("ivq", lambda ws, b: ["show", b, T, "--values", "5"]),
        "show-tq": ("ivq", lambda ws, b: ["show", b, TQ, "--values", "5"]),
        "diff": ("ivq-diff", lambda ws, b: [ws.copy("float.h5", "ref.h5"), b, "-q"]),
        "report": ("ivq", lambda ws, b: ["report", ws.copy("float.h5", "ref.h5"), b, "-o", "r.html"]),
    }
    out = []
    for what, (make, cmds, code) in kinds.items():
        for cmd in cmds:
            prog, a = argv[cmd]
            out.append(Case(f"dumpfield/{what}/{cmd}", "dumpfield", _argv(make, a), code, prog=prog,
                            memory=512 << 20 if what == "shape-declared-1tib" else None, timeout=20))
    return out


# ============================================================================ option values (issue 31)
def _numeric_options() -> list[tuple[str, str, str, type]]:
    """(prog, command path, flag, type) of every numeric option of every command, read from the parsers: a new
    option gets its cases by construction."""
    import argparse

    from ivq_debug.cli.diff import _Parser, add_diff_arguments
    from ivq_debug.cli.main import build_parser

    out: list[tuple[str, str, str, type]] = []

    def walk(prog: str, p: argparse.ArgumentParser, path: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(prog, sub, f"{path} {name}".strip())
            elif a.type in (int, float) and a.option_strings:
                out.append((prog, path, max(a.option_strings, key=len), a.type))

    walk("ivq", build_parser(), "")
    diff = _Parser(prog="ivq-diff")
    add_diff_arguments(diff)
    walk("ivq-diff", diff, "")
    return out


#: command path → a valid command line before the option under test (inputs copied from the corpus; the part
#: a command reads last may be a name that does not exist: the option is checked before any input is read, and
#: a command that read first would exit 3, not 2)
_OPTION_BASES: dict[str, Callable[[Workspace], list[str]]] = {
    "demo": lambda ws: ["demo", "--golden", "g", "--reports", "r", "--workdir", "w"],
    "ls": lambda ws: ["ls", ws.copy("float.h5")],
    "show": lambda ws: ["show", ws.copy("float.h5"), T],
    "diff": lambda ws: ["diff", ws.copy("float.h5"), ws.copy("qdq.h5"), "-q"],
    "capture onnx": lambda ws: ["capture", "onnx", ws.copy("model.onnx"), "--inputs", ws.copy("x.npz"), "-o", "o.h5"],
    "capture qnn": lambda ws: ["capture", "qnn", ws.copy("model.qdq.onnx"), "--inputs", ws.copy("x.npz"), "-o", "o.h5"],
    "capture": lambda ws: ["capture", "onnx", ws.copy("model.onnx"), "--inputs", ws.copy("x.npz"), "-o", "o.h5"],
    "ingest qnn-net-run": lambda ws: ["ingest", "qnn-net-run", (ws.copy("netrun"), "netrun/output")[1], "--graph",
                                      "netrun/model_net.json", "-o", "o.h5"],
    "ingest session": lambda ws: ["ingest", "session", "--prefill", "phone/prefill", "-o", "o.h5"],
    "reference": lambda ws: ["reference", "session.h5", "--model-dir", "parts", "-o", "r.h5"],
    "quantize": lambda ws: ["quantize", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz"), "-o", "q.onnx"],
    "diagnose": lambda ws: ["diagnose", ws.copy("float.h5"), ws.copy("qdq.h5"), "--model", ws.copy("model.qdq.onnx")],
    "calib-stats": lambda ws: ["calib-stats", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz"), "-o", "s.json"],
    "tune": lambda ws: ["tune", ws.copy("model.onnx"), "--calibration", ws.copy("x.npz", "calib.npz"), "--inputs",
                        ws.copy("x.npz"), "-o", "wd", "--backend", "cpu"],
    "report": lambda ws: ["report", ws.copy("float.h5"), ws.copy("qdq.h5"), "-o", "r.html"],
    "ivq-diff": lambda ws: [ws.copy("float.h5"), ws.copy("qdq.h5"), "-q"],
}


def _option_cases() -> list[Case]:
    """Every numeric option × {NaN (floats), one below its least value (ints)}: exit 2 before any work (a NaN
    threshold passed everything; ``--workers 0``, ``--top -1`` were accepted), plus the values a target must
    know (``--soc-model abc``: exit 7 after compiling once, ``--htp-arch 9999``: exit 0) and ``--overlay-metric
    nosuch`` (exit 2, but the HTML was left)."""
    from ivq_debug.cli.common import NUMBER_MIN

    out = []
    for prog, path, flag, typ in _numeric_options():
        base = _OPTION_BASES["ivq-diff" if prog == "ivq-diff" else path]
        dest = flag.lstrip("-").replace("-", "_")
        if typ is float:
            kinds = {"nan": "nan"}
        elif NUMBER_MIN.get(dest) is not None:
            kinds = {"below-min": str(int(NUMBER_MIN[dest]) - 1)}
        else:
            continue
        for kind, value in kinds.items():
            command = path.replace(" ", "-") or prog
            out.append(Case(f"options/{flag.lstrip('-')}-{kind}/{command}", "options", lambda ws, b=base, f=flag, v=value: [*b(ws), f, v],
                            2, prog=prog, timeout=20))
    for what, extra in (("soc-model-abc", ["--soc-model", "abc"]), ("htp-arch-9999", ["--htp-arch", "9999"])):
        for command, base in (("capture-qnn", "capture qnn"), ("tune", "tune")):
            out.append(Case(f"options/{what}/{command}", "options",
                            lambda ws, e=extra, b=base: [*_OPTION_BASES[b](ws), *e], 2, timeout=20))
    out.append(Case("options/overlay-metric-nosuch/report", "options", lambda ws: [
        *_OPTION_BASES["report"](ws), "--model-explorer", "m.json", "--overlay-metric", "nosuch"], 2, timeout=20))
    return out


# ============================================================================ job shards (issue 31)
#: slot → (the corpus folder its rerun resumes from, where the shards are inside it, the output it may write)
SHARD_SLOTS: dict[str, tuple[str, str, str, tuple[int, ...]]] = {
    "calib-stats": ("calib-shards", "cs", "s.json", (0, 1)),
    "diagnose": ("replay-shards", "ds", "", (0,)),
    "tune": ("sweep-wd", "wd/trials/sweep/shards", "wd", (0, 1)),
}
#: slot → the field a numeric kind breaks (first object in the result that holds it) and how
_SHARD_FIELDS: dict[str, dict[str, tuple[str, Callable[[dict], Any]]]] = {
    "calib-stats": {"nan": ("min", lambda o: float("nan")), "negative": ("count", lambda o: -3),
                    "unordered": ("min", lambda o: o["max"] + 1.0), "inf-sum": ("sum", lambda o: float("inf"))},
    "diagnose": {"nan": ("sum_r2", lambda o: float("nan")), "negative": ("n", lambda o: -1),
                 "unordered": ("top1_agree", lambda o: o["rows"] + 1), "inf-sum": ("sum_tr", lambda o: float("inf"))},
    "tune": {"nan": ("seconds", lambda o: float("nan")), "negative": ("model_bytes", lambda o: -1),
             "inf-sum": ("cycles", lambda o: float("inf"))},
}


def _first_holding(node: Any, key: str) -> dict | None:
    if isinstance(node, dict):
        if key in node:
            return node
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    return next((h for c in children if (h := _first_holding(c, key)) is not None), None)


def _shard_kinds(slot: str) -> dict[str, Callable[[Workspace, Path], None]]:
    """kind → an edit of one shard file (every shard of the folder gets it: whichever is read first fails)."""

    def text(data: str) -> Callable[[Workspace, Path], None]:
        return lambda ws, p: p.write_text(data)

    def doc(fn: Callable[[dict], None]) -> Callable[[Workspace, Path], None]:
        def edit(ws: Workspace, p: Path) -> None:
            d = json.loads(p.read_text())
            fn(d)
            p.write_text(json.dumps(d))  # NaN / Infinity as Python writes them (the shards' own spelling)

        return edit

    def field(key: str, value: Callable[[dict], Any]) -> Callable[[dict], None]:
        def fn(d: dict) -> None:
            o = _first_holding(d["result"], key)
            assert o is not None, f"no {key!r} in the {slot} shard"
            o[key] = value(o)

        return fn

    def outside(ws: Workspace, p: Path) -> None:
        target = ws.outside / p.name
        shutil.move(str(p), target)
        os.symlink(target, p)

    def replace(kind: str) -> Callable[[Workspace, Path], None]:
        def edit(ws: Workspace, p: Path) -> None:
            p.unlink()
            _special(ws, kind, os.path.relpath(p, ws.work))

        return edit

    kinds: dict[str, Callable[[Workspace, Path], None]] = {
        "deep": text("[" * 100_000 + "]" * 100_000),
        "not-json": text("{shard: "),
        "truncated": lambda ws, p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
        "not-utf8": lambda ws, p: p.write_bytes(b'{"schema": "\xff\xfe"}'),
        "not-object": text("[1, 2]"),
        "other-schema": doc(lambda d: d.__setitem__("schema", "ivq-shard/9")),
        "meta-list": doc(lambda d: d.__setitem__("meta", [])),
        "result-list": doc(lambda d: d.__setitem__("result", [])),
        "symlink-outside": outside,
        "fifo": replace("fifo"),
        "dir": replace("dir"),
        "loop": replace("loop"),
        "dangling": lambda ws, p: (p.unlink(), os.symlink("nowhere.json", p)),
    }
    for kind, (key, value) in _SHARD_FIELDS[slot].items():
        kinds[kind] = doc(field(key, value))
    return kinds


def _shard_cases() -> list[Case]:
    """The slots × kinds table of job shards: every command that runs jobs resumes from a copy of a real run's
    shards, one kind of breakage applied to every shard; exit 3 naming the shard, nothing written. The
    ``valid`` row resumes the untouched copy (exit 0 / 1, no job rerun: a new shard would be a leftover)."""
    from tests.hostile.corpus import SHARD_ARGV

    out = []
    for slot, (name, where, output, ok) in SHARD_SLOTS.items():
        def build(ws: Workspace, slot: str = slot, name: str = name, where: str = where,
                  edit: Callable[[Workspace, Path], None] | None = None) -> list[str]:
            for f in ("model.onnx", "model.qdq.onnx", "x.npz", "float.h5", "qdq.h5"):
                ws.copy(f)
            ws.copy("x.npz", "calib.npz")
            ws.copy("x.npz", "x2.npz")
            ws.copy(name, where if slot != "tune" else "wd")
            if edit is not None:
                for p in sorted((ws.work / where).glob("*.json")):
                    edit(ws, p)
            return list(SHARD_ARGV[slot])

        creates = (output,) if output else ()
        out.append(Case(f"shards/valid/{slot}", "shards", build, ok, creates=creates, timeout=120))
        for kind, edit in _shard_kinds(slot).items():
            out.append(Case(f"shards/{kind}/{slot}", "shards", lambda ws, b=build, e=edit: b(ws, edit=e), 3,
                            timeout=120, stdin="pipe" if kind == "fifo" else "devnull"))
    return out


# ============================================================================ valid inputs (every command)
def _valid_cases() -> list[Case]:
    return [
        Case("valid/dumps/ls", "valid", lambda ws: ["ls", ws.copy("float.h5")], 0),
        Case("valid/dumps/ls-records", "valid", lambda ws: ["ls", ws.copy("qdq.h5"), "--records"], 0),
        Case("valid/dumps/show", "valid", lambda ws: ["show", ws.copy("float.h5"), T, "--values", "5"], 0),
        Case("valid/dumps/diff", "valid", lambda ws: [ws.copy("float.h5"), ws.copy("qdq.h5"), "--json", "d.json",
                                                      "--report", "r.html"], 0, prog="ivq-diff",
             creates=("d.json", "r.html")),
        Case("valid/dumps/ivq-diff-json-stdout", "valid", lambda ws: ["diff", ws.copy("float.h5"), ws.copy("float.h5", "f2.h5"),
                                                                      "--json", "-"], 0),
        Case("valid/dumps/report", "valid", lambda ws: ["report", ws.copy("float.h5"), ws.copy("qdq.h5"), "-o", "r.html",
                                                        "--junit", "j.xml", "--model-explorer", "me.json", "--model",
                                                        ws.copy("model.qdq.onnx")], 0,
             creates=("r.html", "j.xml", "me.json")),
        Case("valid/dumps/diagnose", "valid", lambda ws: ["diagnose", ws.copy("float.h5"), ws.copy("qdq.h5"), "--model",
                                                          ws.copy("model.qdq.onnx"), "--budget-sqnr", "-1000",
                                                          "--json", "d.json"], 0, creates=("d.json",)),
        Case("valid/onnx/capture", "valid", lambda ws: ["capture", "onnx", ws.copy("model.onnx"), "--inputs",
                                                        ws.copy("x.npz"), "-o", "o.h5"], 0, creates=("o.h5",)),
        Case("valid/onnx/quantize", "valid", lambda ws: ["quantize", ws.copy("model.onnx"), "--calibration",
                                                         ws.copy("x.npz"), "-o", "q.onnx"], 0, creates=("q.onnx",)),
        Case("valid/netrun/ingest-strict", "valid", lambda ws: [
            "ingest", "qnn-net-run", ws.copy("netrun") + "/output", "--graph", "netrun/model_net.json", "--model",
            ws.copy("model.qdq.onnx"), "--profiling", ws.copy("qnn_ep_detailed.csv"), "--strict", "-o", "o.h5"], 0,
             creates=("o.h5",)),
        Case("valid/output/force-replaces-output", "valid", lambda ws: [
            "diff", ws.copy("float.h5"), ws.copy("qdq.h5"), "-q", "--json", ws.write("d.json", "{}"), "--force"], 0,
             creates=("d.json",)),
        Case("valid/output/exists-without-force", "valid", lambda ws: [
            "diff", ws.copy("float.h5"), ws.copy("qdq.h5"), "-q", "--json", ws.write("d.json", "{}")], 2),
    ]


def all_cases() -> list[Case]:
    """Every case, ids unique."""
    cases = (_valid_cases() + _dump_cases() + _name_cases() + _npz_cases() + _overrides_cases() + _netjson_cases()
             + _netrun_cases() + _profiling_cases() + _onnx_cases() + _special_cases() + _output_cases()
             + _disk_cases() + _diff_json_cases() + _session_cases() + _netrun_model_cases() + _reference_cases()
             + _dynamic_cases() + _qnn_cache_cases() + _tune_cases() + _expected_cases() + _shard_cases() + _dump_field_cases() + _option_cases())
    ids = [c.id for c in cases]
    dup = {i for i in ids if ids.count(i) > 1}
    assert not dup, f"duplicate case ids: {sorted(dup)}"
    return cases
