"""Golden dump format: round trips, dtypes kept on disk, atomic finalize, bad files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from ivq_debug.dump import DumpWriter, block_slices, open_dump
from ivq_debug.errors import InputError, UsageError


def test_round_trip_names_dtypes_and_manifest_stats(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((3, 40, 50)).astype(np.float32)
    a16 = rng.standard_normal((600, 300)).astype(np.float16)
    bf = torch.randn(7, 9, dtype=torch.bfloat16)
    ids = np.arange(12, dtype=np.int64).reshape(1, 12)
    p = tmp_path / "d.h5"
    with DumpWriter(p, backend="torch", backend_info={"torch": torch.__version__}, model={"path": "m"}) as w:
        w.begin_record(sample=0, part="prefill", step=0, cache_len=0)
        w.add_input("input_ids", ids)
        w.add_tensor("/a/b.0/C_output_0", a32, op_type="MatMul", layout="NCHW")
        w.add_tensor("model.x[0]", a16)
        w.add_tensor("weird%/./name", bf)
        w.add_tensor("cache_len", np.array(7, np.int64))  # a 0-d tensor stays 0-d (scalar dataspace)
        w.add_tensor("strided", a32[:, ::2, 1:])  # a non-contiguous view is written as its values
        w.begin_record(sample=0, part="decode", step=1, token=5)
        w.add_tensor("model.x[0]", a16[:1])
    d = open_dump(p)
    assert d.backend == "torch" and d.backend_info["torch"] == torch.__version__ and d.complete
    assert len(d.records) == 2 and d.record_meta((0, "decode", 1)) == {"token": 5}
    np.testing.assert_array_equal(d.read("/a/b.0/C_output_0"), a32)
    np.testing.assert_array_equal(d.read("input_ids", kind="input"), ids)
    e16 = d.entry("model.x[0]", (0, "prefill", 0))
    assert e16.dtype == "float16" and d.read(e16).dtype == np.float16
    np.testing.assert_array_equal(d.read(e16), a16)
    # fp16 stays fp16 on disk
    with h5py.File(p) as f:
        assert f["records"][e16.rid]["t"][e16.key].dtype == np.float16
    sc = d.read("cache_len")
    assert sc.shape == () and sc.dtype == np.int64 and int(sc) == 7 and d.entry("cache_len").shape == ()
    np.testing.assert_array_equal(d.read("strided"), a32[:, ::2, 1:])
    eb = d.entry("weird%/./name")
    assert eb.dtype == "bfloat16"
    np.testing.assert_array_equal(d.read(eb), bf.float().numpy())
    # manifest statistics equal numpy's (float64)
    m = d.manifest.set_index(["rid", "name"])
    row = m.loc[(e16.rid, "model.x[0]")]
    x64 = a16.astype(np.float64)
    assert row["min"] == x64.min() and row["max"] == x64.max()
    assert row["mean"] == pytest.approx(x64.mean(), rel=1e-12)
    assert row["std"] == pytest.approx(x64.std(), rel=1e-9)
    assert m.loc[(e16.rid, "/a/b.0/C_output_0")]["layout"] == "NCHW"


def test_non_finite_counted_and_summary_only(tmp_path: Path) -> None:
    x = np.linspace(-1, 1, 10000, dtype=np.float32)
    x[[3, 77]] = [np.nan, np.inf]
    with DumpWriter(tmp_path / "s.h5", backend="x", summary_only=True, summary_samples=100) as w:
        w.add_tensor("t", x)
        w.add_tensor("small", x[:50])
    d = open_dump(tmp_path / "s.h5")
    e = d.entry("t")
    assert e.stats["nonfinite"] == 2 and e.stored == "summary"
    assert d.read_sample(e).shape == (100,)
    assert d.entry("small").stored == "full"
    with pytest.raises(UsageError):
        d.read(e)


def test_refuses_to_overwrite_and_exception_leaves_nothing(tmp_path: Path) -> None:
    p = tmp_path / "d.h5"
    with DumpWriter(p, backend="x") as w:
        w.add_tensor("a", np.zeros(3))
    with pytest.raises(UsageError, match="exists"):
        DumpWriter(p, backend="x")
    before = p.read_bytes()
    q = tmp_path / "e.h5"
    with pytest.raises(RuntimeError), DumpWriter(q, backend="x") as w:
        w.add_tensor("a", np.zeros(3))
        raise RuntimeError("boom")
    assert not q.exists() and not list(tmp_path.glob(".e.h5*"))
    with DumpWriter(p, backend="y", overwrite=True) as w:
        w.add_tensor("b", np.ones(2))
    assert p.read_bytes() != before and open_dump(p).backend == "y"


def test_killed_capture_leaves_no_final_file(tmp_path: Path) -> None:
    final = tmp_path / "killed.h5"
    script = textwrap.dedent(f"""
        import time, numpy as np
        from ivq_debug.dump import DumpWriter
        w = DumpWriter({str(final)!r}, backend="torch")
        w.begin_record()
        for i in range(1000):
            w.add_tensor(f"t{{i}}", np.full((256, 256), i, np.float32))
            if i == 3:
                print("started", flush=True)
            time.sleep(0.01)
        w.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not final.exists()
    partial = list(tmp_path.glob(".killed.h5.partial-*"))
    assert len(partial) == 1
    # the leftover can never be mistaken for a complete dump
    with pytest.raises(InputError):
        open_dump(partial[0])


def test_block_slices_cover_every_element_once() -> None:
    rng = np.random.default_rng(1)
    for shape in [(), (5,), (3, 7), (2, 3, 4), (1, 1, 9), (4, 1, 5, 6), (0, 3)]:
        a = rng.standard_normal(shape)
        for block in (8, 24, 100, 10_000):
            seen = np.zeros(a.shape, dtype=int) if a.ndim else np.zeros((), int)
            for sl in block_slices(a.shape, 8, block):
                seen[sl] += 1
            assert (seen == 1).all(), (shape, block)


def test_flat_reads_match_hdf5_for_every_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    arrays = {
        "contiguous": rng.standard_normal((10, 30)).astype(np.float32),  # < 64 KiB: not chunked
        "chunked": rng.standard_normal((3, 700, 300)).astype(np.float32),  # chunks cut axis 1
        "chunked16": rng.standard_normal((5, 900, 257)).astype(np.float16),
    }
    for comp in ("auto", "lzf"):
        p = tmp_path / f"{comp}.h5"
        with DumpWriter(p, backend="x", compression=comp) as w:
            for k, a in arrays.items():
                w.add_tensor(k, a)
        d = open_dump(p)
        for k, a in arrays.items():
            e = d.entry(k)
            # small datasets are stored contiguous and never compressed
            assert (d.raw_layout(e) is not None) == (comp == "auto" or k == "contiguous"), (comp, k)
            for n in (7, 1000, 123_457, 10**7):
                got = np.concatenate(list(d.iter_flat(e, n)))
                np.testing.assert_array_equal(got, a.reshape(-1))
        d.close()


def test_chunks_split_evenly_so_edge_chunks_store_no_padding(tmp_path: Path) -> None:
    from ivq_debug.dump.writer import _chunk_shape

    # a ViT fc1 output [1, 197, 1536] fp32 (1.16 MiB): 2 chunks of 99 rows, not 170 + a padded edge chunk of 170
    assert _chunk_shape((1, 197, 1536), 4, 1 << 20) == (1, 99, 1536)
    assert _chunk_shape((8, 1025, 1025), 4, 1 << 20) == (1, 205, 1025)
    a = np.round(np.random.default_rng(0).standard_normal((1, 197, 1536)), 1).astype(np.float32)
    with DumpWriter(tmp_path / "c.h5", backend="x", compression="lzf") as w:
        w.add_tensor("fc1", a)
    with h5py.File(tmp_path / "c.h5") as f:
        ds = f["records/r000000/t/fc1"]
        assert ds.chunks == (1, 99, 1536) and ds.compression == "lzf"
    np.testing.assert_array_equal(open_dump(tmp_path / "c.h5").read("fc1"), a)


def test_uncompressed_tensors_are_contiguous_and_read_as_one_segment(tmp_path: Path) -> None:
    # chunks only serve compression: an uncompressed tensor of any size is one contiguous run (no edge-chunk
    # padding, one write, one raw segment for the readers)
    a = np.arange(197 * 1536, dtype=np.float32).reshape(1, 197, 1536)
    with DumpWriter(tmp_path / "c.h5", backend="x", compression=None) as w:
        w.add_tensor("fc1", a)
        w.add_tensor("flag", np.array([True, False]))
    with h5py.File(tmp_path / "c.h5") as f:
        ds = f["records/r000000/t/fc1"]
        assert ds.chunks is None and ds.compression is None
        assert ds.id.get_storage_size() == a.nbytes
        assert f["records/r000000/t/flag"].dtype == np.bool_
    d = open_dump(tmp_path / "c.h5")
    assert d.raw_layout(d.entry("fc1")) is not None
    np.testing.assert_array_equal(d.read("fc1"), a)
    np.testing.assert_array_equal(d.read("flag"), [True, False])


def test_attributes_have_the_types_h5py_gives_them(tmp_path: Path) -> None:
    enc = {"bitwidth": 8, "dtype": "uint8", "scale": 0.1, "zero_point": 3, "axis": None, "qmin": 0, "qmax": 255}
    values = {"name": "x/y", "dtype": "float32", "order": np.int32(7), "op_type": "Add", "scope": "blocks.0",
              "layout": "NCHW"}
    with DumpWriter(tmp_path / "a.h5", backend="x", summary_only=True, summary_samples=4) as w:
        w.add_tensor("x/y", np.zeros((3, 5), np.float32), op_type="Add", order=np.int32(7), scope="blocks.0",
                     layout="NCHW", encoding=enc, raw=np.zeros((3, 5), np.uint8))
    with h5py.File(tmp_path / "a.h5") as f, h5py.File(tmp_path / "ref.h5", "w", libver="latest") as g:
        ds = f["records/r000000/t/x%2Fy"]
        ref = g.create_dataset("r", data=0)
        for k, v in {**values, "encoding": ds.attrs["encoding"], "summary_only": True}.items():
            ref.attrs[k] = v  # what h5py itself writes for these values
        assert sorted(ds.attrs) == sorted(ref.attrs)
        for k in ref.attrs:
            assert ds.attrs.get_id(k).get_type().encode() == ref.attrs.get_id(k).get_type().encode(), k
            assert ds.attrs[k] == ref.attrs[k], k
    e = open_dump(tmp_path / "a.h5").entry("x/y")
    assert (e.order, e.op_type, e.scope, e.layout, e.encoding, e.stored) == (7, "Add", "blocks.0", "NCHW", enc, "summary")


def test_stats_overflowing_float64_sum_is_not_non_finite(tmp_path: Path) -> None:
    big = np.array([1e308, 1e308, -3.0], np.float64)  # finite values whose float64 sum overflows
    with DumpWriter(tmp_path / "b.h5", backend="x") as w:
        w.add_tensor("big", big)
        w.add_tensor("nan", np.array([1.0, np.nan, np.inf, 2.0], np.float32))
    d = open_dump(tmp_path / "b.h5")
    assert d.entry("big").stats["nonfinite"] == 0 and d.entry("big").stats["max"] == 1e308
    s = d.entry("nan").stats
    assert (s["nonfinite"], s["min"], s["max"], s["mean"]) == (2, 1.0, 2.0, 1.5)


@pytest.mark.parametrize("comp", [None, "lzf"])
def test_manifest_shape_that_lies_is_an_input_error(tmp_path: Path, comp: str | None) -> None:
    p = tmp_path / "lie.h5"
    with DumpWriter(p, backend="x", compression=comp) as w:
        w.add_tensor("small", np.ones((4, 8), np.float32))
        w.add_tensor("big", np.ones((4, 300, 100), np.float32))
    with h5py.File(p, "r+") as f:  # replace the data by smaller arrays, keeping the manifest
        for name, shape in (("small", (2, 8)), ("big", (2, 300, 100))):
            g = f["records/r000000/t"]
            attrs = dict(g[name].attrs)
            del g[name]
            ds = g.create_dataset(name, data=np.zeros(shape, np.float32), chunks=True if comp else None,
                                  compression=comp)
            ds.attrs.update(attrs)
    d = open_dump(p)
    for name in ("small", "big"):
        with pytest.raises(InputError, match="manifest says shape"):
            list(d.iter_flat(d.entry(name), 1 << 20))


def test_selection_skips_attention_probs_and_views() -> None:
    from ivq_debug.capture.base import Selection

    s = Selection(skip_attention_probs=True, skip_views=True)
    assert not s.accepts("/layers.0/attn/Softmax_output_0", "Softmax")
    assert not s.accepts("model.vision_tower.encoder.layer.0.attention[1]", "InternVLVisionAttention")
    assert s.accepts("model.vision_tower.encoder.layer.0.attention[0]", "InternVLVisionAttention")
    assert not s.accepts("/layers.0/attn/Reshape_output_0", "Reshape")
    assert s.accepts("/layers.0/mlp/fc1/MatMul_output_0", "MatMul")
    assert Selection().accepts("/layers.0/attn/Softmax_output_0", "Softmax")


def test_fp16_dumps_compare_in_float64(tmp_path: Path) -> None:
    import math

    import ivq_debug as ivq

    rng = np.random.default_rng(5)
    r = rng.standard_normal((257, 311)).astype(np.float16)
    t = (r.astype(np.float32) + np.float32(1e-3) * rng.standard_normal(r.shape).astype(np.float32)).astype(np.float16)
    for name, arr in (("r.h5", r), ("t.h5", t)):
        with DumpWriter(tmp_path / name, backend="x") as w:
            w.add_tensor("a", arr)
    with h5py.File(tmp_path / "t.h5") as f:  # on disk as fp16
        assert next(iter(f["records"].values()))["t"]["a"].dtype == np.float16
    cmp = ivq.compare(tmp_path / "r.h5", tmp_path / "t.h5", block_bytes=4096)  # many blocks
    row = cmp.table.iloc[0]
    r64, t64 = r.astype(np.float64), t.astype(np.float64)
    assert row["ref_dtype"] == row["test_dtype"] == "float16"
    assert row["sqnr_db"] == pytest.approx(10 * math.log10((r64**2).sum() / ((t64 - r64) ** 2).sum()), rel=1e-12)
    assert row["max_abs"] == np.abs(t64 - r64).max()


def test_summary_only_dumps_diff_end_to_end(tmp_path: Path, capfd) -> None:
    """Summary-only dumps (statistics + strided samples) go through ivq-diff, projector detector included."""
    from ivq_debug.cli.diff import main as diff_main

    rng = np.random.default_rng(7)
    base = rng.standard_normal((64, 1000)).astype(np.float32)
    for name, noise in (("r.h5", 0.0), ("t.h5", 0.2)):
        with DumpWriter(tmp_path / name, backend="x", summary_only=True, summary_samples=512) as w:
            w.begin_record(part="vision")
            w.add_tensor("/vision_tower/layernorm/out", base, scope="vision_tower.layernorm")
            w.add_tensor("image_features", base + noise * rng.standard_normal(base.shape).astype(np.float32),
                         scope="multi_modal_projector.linear_2")
    with pytest.raises(SystemExit) as e:
        diff_main([str(tmp_path / "r.h5"), str(tmp_path / "t.h5"), "--json", str(tmp_path / "d.json"), "-q"])
    assert e.value.code == 0, capfd.readouterr().err
    import json

    doc = json.loads((tmp_path / "d.json").read_text())
    assert any(f["kind"] == "projector_drift" for f in doc["findings"])


def test_size_counts_values_by_kind_against_the_file(tmp_path: Path) -> None:
    """``Dump.size``: the bytes of values by kind (raw integers at their encoding's width) against the file, raw
    and compressed; the ratio is what ``ivq ls`` prints."""
    enc = {"bitwidth": 8, "dtype": "uint8", "scale": 0.05, "zero_point": 128, "axis": None, "qmin": 0, "qmax": 255}
    enc16 = {**enc, "bitwidth": 16, "dtype": "uint16", "zero_point": 32768, "qmax": 65535}
    q = np.random.default_rng(0).integers(120, 136, (256, 1024)).astype(np.uint8)  # 16 levels: compresses
    deq = ((q.astype(np.float32) - 128) * np.float32(0.05)).astype(np.float32)
    sizes = {}
    for comp in (None, "gzip"):
        p = tmp_path / f"{comp}.h5"
        with DumpWriter(p, backend="onnxruntime-cpu-qdq", compression=comp, integers_only=False) as w:
            w.begin_record(sample=0, part="model", step=0)
            w.add_input("x", np.ones((1, 3, 8, 8), np.float32))
            w.add_tensor("a", deq, encoding=enc, raw=q)
            w.add_tensor("b", deq[:16], encoding=enc16, raw=q[:16].astype(np.uint16))
            w.add_tensor("f", np.zeros(10, np.float64))
        with open_dump(p) as d:
            sizes[comp] = s = d.size()
        assert s.file == p.stat().st_size
        assert (s.tensors, s.inputs, s.raw, s.summarized) == (deq.nbytes + deq[:16].nbytes + 80, 768,
                                                              q.nbytes + 2 * q[:16].size, 0)
        assert s.to_json()["data"] == s.data == s.tensors + s.inputs + s.raw
    assert sizes[None].file > sizes[None].data  # raw: the values plus HDF5's metadata
    with DumpWriter(tmp_path / "v2.h5", backend="onnxruntime-cpu-qdq") as w:  # integers only (the default)
        w.add_tensor("a", deq, encoding=enc, raw=q)
        w.add_tensor("f", np.zeros(10, np.float64))
    with open_dump(tmp_path / "v2.h5") as d:
        s = d.size()
    assert (s.tensors, s.derived, s.raw, s.data) == (80, deq.nbytes, q.nbytes, 80 + q.nbytes)
    assert s.to_json()["derived"] == deq.nbytes
    assert s.data < s.file < s.data + 64 << 10  # the integers (and metadata): not the values
    assert sizes["gzip"].file < 0.5 * sizes["gzip"].data  # 16 levels of 256
    with DumpWriter(tmp_path / "s.h5", backend="x", summary_only=True, summary_samples=8) as w:
        w.add_tensor("big", deq)  # kept as statistics and 8 samples: counted apart, not as values held
        w.add_tensor("small", deq[0, :4])  # no more values than the samples: stored whole
    with open_dump(tmp_path / "s.h5") as d:
        s = d.size()
    assert (s.tensors, s.summarized, s.raw) == (16, deq.nbytes, 0)
