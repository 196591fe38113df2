"""The writer's fast paths store what the plain h5py path stored: a real QDQ capture (ORT, the CLI) written by the
current :class:`DumpWriter` and by its previous dataset path (``create_dataset`` with 1 MiB-style chunks) holds the
same objects, datatypes, shapes, bytes, attributes (values and HDF5 types), creation properties and digest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from ivq_debug import defaults
from ivq_debug.dump import writer as writer_mod
from ivq_debug.dump.reader import open_dump
from tests.support import qnn_models
from tests.support.cli import ivq_cli
from tests.support.qnn_models import needs_qnn

#: root attributes that name when and how the file was made, not what it holds
PROVENANCE = {"created", "command"}


def _previous_create(self: Any, grp: Any, key: str, arr: np.ndarray, quantized: bool = False) -> Any:
    """The dataset path before the low-level writer: h5py's ``create_dataset``, chunked from the threshold."""
    kw: dict[str, Any] = {}
    if arr.ndim > 0 and arr.nbytes >= defaults.DUMP_MIN_CHUNKED_BYTES:
        kw["chunks"] = writer_mod._chunk_shape(arr.shape, arr.itemsize, defaults.DUMP_CHUNK_BYTES)
        comp = self.compression
        if comp == "auto":
            comp = "lzf" if quantized else None
        if comp:
            kw["compression"] = comp
    return grp.create_dataset(key, data=arr, **kw)


def _attrs(obj: Any) -> dict[str, tuple[str, bytes]]:
    return {k: (str(obj.attrs[k]), obj.attrs.get_id(k).get_type().encode()) for k in obj.attrs}


def _content(path: Path) -> dict[str, Any]:
    """Everything a reader can see in a dump but its layout on disk, object by object."""
    out: dict[str, Any] = {}
    with h5py.File(path, "r") as f:
        out["/"] = {k: v for k, v in _attrs(f).items() if k not in PROVENANCE}

        def visit(name: str, obj: Any) -> None:
            doc: dict[str, Any] = {"attrs": _attrs(obj), "kind": type(obj).__name__}
            if isinstance(obj, h5py.Dataset):
                dcpl = obj.id.get_create_plist()
                doc.update(type=obj.id.get_type().encode(), shape=obj.shape, dtype=obj.dtype.str,
                           bytes=np.asarray(obj[()]).tobytes(), filters=dcpl.get_nfilters(),
                           track_times=dcpl.get_obj_track_times(), fill_defined=dcpl.fill_value_defined(),
                           fill_time=dcpl.get_fill_time(), space=obj.id.get_space().get_simple_extent_type())
            out[name] = doc

        f.visititems(visit)
    return out


@needs_qnn
@pytest.mark.parametrize("compression", [None, "auto"])
def test_capture_dump_is_the_one_the_previous_writer_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          compression: str | None) -> None:
    """Raw: the default (quantized tensors as integers only, version 2); "auto": version 1 (values and integers:
    the dequantized values are what "auto" compresses)."""
    import onnx

    from ivq_debug.qnn.quantize import quantize_for_qnn

    fm = tmp_path / "block.onnx"
    onnx.save(qnn_models.build_block(0), str(fm))
    qm = quantize_for_qnn(fm, tmp_path / "block.a8w8.onnx", qnn_models.block_feeds(1, 4)).model_path
    for i, feeds in enumerate(qnn_models.block_feeds(7, 2)):
        np.savez(tmp_path / f"in{i}.npz", **feeds)
    args = ["--inputs", tmp_path / "in0.npz", "--inputs", tmp_path / "in1.npz"]
    monkeypatch.setattr(defaults, "DUMP_COMPRESSION", compression)
    if compression == "auto":
        monkeypatch.setenv(defaults.DUMP_INTEGERS_ONLY_ENV, "0")
    # a low threshold: the block's tensors (a few KiB) reach the chunked path of the previous writer
    monkeypatch.setattr(defaults, "DUMP_MIN_CHUNKED_BYTES", 1024)
    monkeypatch.setattr(defaults, "DUMP_CHUNK_BYTES", 2048)
    assert ivq_cli("capture", "onnx", qm, *args, "-o", tmp_path / "now.h5") == 0
    with monkeypatch.context() as m:
        m.setattr(writer_mod.DumpWriter, "_create", _previous_create)
        assert ivq_cli("capture", "onnx", qm, *args, "-o", tmp_path / "before.h5") == 0
    now, before = _content(tmp_path / "now.h5"), _content(tmp_path / "before.h5")
    assert sorted(now) == sorted(before)
    assert sum(d.get("kind") == "Dataset" for d in now.values()) > 50  # values, raw integers, manifest, meta
    for name in before:
        assert now[name] == before[name], name
    with h5py.File(tmp_path / "before.h5") as f:  # the previous path did chunk; the new one only to compress
        chunked = [n for n, o in f["records"].items() for o in o.values() if isinstance(o, h5py.Group)
                   for o in o.values() if o.chunks is not None]
        assert chunked
    with h5py.File(tmp_path / "now.h5") as f:
        layouts = {o.compression for g in f["records"].values() for s in g.values() for o in s.values()}
        assert layouts == ({None} if compression is None else {None, "lzf"})
    a, b = open_dump(tmp_path / "now.h5"), open_dump(tmp_path / "before.h5")
    assert a.content_digest() == b.content_digest()
    for e in a.entries:
        np.testing.assert_array_equal(a.read(e), b.read(b.entry(e.name, e.rid, e.kind)))


def _same_capture(v1: Path, v2: Path) -> int:
    """Version 1 against version 2 of one capture: the same manifest but ``derived``, the same digest, every
    value bit for bit; ``bench/check_identity.py dumps`` agrees. The number of tensors stored as integers only."""
    import subprocess
    import sys

    with open_dump(v1) as a, open_dump(v2) as b:
        assert (a.format_version, b.format_version) == (1, 2)
        assert a.manifest.equals(b.manifest.drop(columns="derived"))
        assert a.content_digest() == b.content_digest()
        derived = [e for e in b.entries if e.derived]
        assert {e.name for e in derived} == {e.name for e in a.entries if e.has_raw}  # every quantized tensor
        for e in b.entries:
            ea = a.entry(e.name, e.rid, e.kind)
            assert a.read(ea).tobytes() == b.read(e).tobytes(), e.name
            assert np.concatenate([x.copy() for x in b.iter_flat(e, 1000, reuse=True)]).tobytes() == \
                a.read(ea).tobytes()
        assert b.size().file < a.size().file
    tool = Path(__file__).resolve().parents[2] / "bench" / "check_identity.py"
    r = subprocess.run([sys.executable, str(tool), "dumps", str(v1), str(v2)], capture_output=True, text=True)
    assert r.returncode == 0 and "IDENTICAL" in r.stdout, r.stdout + r.stderr
    return len(derived)


@needs_qnn
def test_integers_only_qdq_capture_reads_back_as_the_values_capture(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ORT QDQ capture through the CLI as version 1 (``IVQ_DUMP_INTEGERS_ONLY=0``) and as version 2 (the
    default): the same values, manifest and digest, and the same ``ivq diff --json`` against the float capture."""
    import json
    import subprocess
    import sys

    fm, qm, args = qnn_models.block_files(tmp_path)
    assert ivq_cli("capture", "onnx", fm, *args, "-o", tmp_path / "ref.h5") == 0
    assert ivq_cli("capture", "onnx", qm, *args, "-o", tmp_path / "v2.h5") == 0
    monkeypatch.setenv(defaults.DUMP_INTEGERS_ONLY_ENV, "0")
    assert ivq_cli("capture", "onnx", qm, *args, "-o", tmp_path / "v1.h5") == 0
    assert _same_capture(tmp_path / "v1.h5", tmp_path / "v2.h5") > 20
    docs = []
    for v in ("v1", "v2"):
        code = ivq_cli("diff", tmp_path / "ref.h5", tmp_path / f"{v}.h5", "--json", tmp_path / f"{v}.json", "-q")
        assert code in (0, 1)
        docs.append(json.loads((tmp_path / f"{v}.json").read_text()))
    assert docs[0]["summary"]["pairs"] == docs[1]["summary"]["pairs"] > 20 and len(docs[1]["layers"]) > 20
    tool = Path(__file__).resolve().parents[2] / "bench" / "check_identity.py"
    r = subprocess.run([sys.executable, str(tool), "compare", str(tmp_path / "v1.json"), str(tmp_path / "v2.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_qnn
def test_integers_only_htp_capture_reads_back_as_the_values_capture(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A real QNN HTP capture (emulated): the HTP's integers, dequantized by the capture, are rebuilt bit for bit
    by the reader, so every quantized tensor is stored as its integers only."""
    _, qm, args = qnn_models.block_files(tmp_path)
    cache = ["--qnn-cache", tmp_path / "cache"]  # the second capture loads the contexts the first compiled
    assert ivq_cli("capture", "qnn", qm, *args, *cache, "-o", tmp_path / "v2.h5") == 0
    monkeypatch.setenv(defaults.DUMP_INTEGERS_ONLY_ENV, "0")
    assert ivq_cli("capture", "qnn", qm, *args, *cache, "-o", tmp_path / "v1.h5") == 0
    with open_dump(tmp_path / "v2.h5") as d:
        assert d.backend == "qnn-htp"
    assert _same_capture(tmp_path / "v1.h5", tmp_path / "v2.h5") > 20
