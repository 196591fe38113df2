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
    import onnx

    from ivq_debug.qnn.quantize import quantize_for_qnn

    fm = tmp_path / "block.onnx"
    onnx.save(qnn_models.build_block(0), str(fm))
    qm = quantize_for_qnn(fm, tmp_path / "block.a8w8.onnx", qnn_models.block_feeds(1, 4)).model_path
    for i, feeds in enumerate(qnn_models.block_feeds(7, 2)):
        np.savez(tmp_path / f"in{i}.npz", **feeds)
    args = ["--inputs", tmp_path / "in0.npz", "--inputs", tmp_path / "in1.npz"]
    monkeypatch.setattr(defaults, "DUMP_COMPRESSION", compression)
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
