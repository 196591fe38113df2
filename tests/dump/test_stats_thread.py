"""The writer's thread: a capture whose runner hands its tensors over (``add_tensor(..., owned=True)``) gets the
statistics and the content digest made beside its HDF5 writes, and writes the same dump as with them made in the
capture's thread: every dataset, attribute, manifest row and the digest, on a real ORT float and QDQ capture."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ivq_debug import defaults
from ivq_debug.dump import DumpWriter
from ivq_debug.dump import writer as writer_mod
from ivq_debug.dump.reader import open_dump
from ivq_debug.dump.stats import tensor_stats
from tests.support import qnn_models
from tests.support.cli import ivq_cli
from tests.support.qnn_models import needs_qnn

TOOL = Path(__file__).resolve().parents[2] / "bench" / "check_identity.py"


def _identical(a: Path, b: Path) -> None:
    r = subprocess.run([sys.executable, str(TOOL), "dumps", str(a), str(b)], capture_output=True, text=True)
    assert r.returncode == 0 and "IDENTICAL" in r.stdout, r.stdout + r.stderr
    with open_dump(a) as da, open_dump(b) as db:
        assert da.attrs["content_sha256"] == db.attrs["content_sha256"]
        assert da.manifest.equals(db.manifest)


# slow: six CLI captures, 30 s at load ~3 (the default suite stays within 6 min)
@pytest.mark.slow
@needs_qnn
def test_a_capture_with_the_stats_thread_is_the_capture_without_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fm, qm, args = qnn_models.block_files(tmp_path, 3)
    handed: list[bool] = []
    add = writer_mod.DumpWriter.add_tensor

    def spy(self: DumpWriter, name: str, value: object, **kw: object) -> None:
        handed.append(bool(kw.get("owned")))
        add(self, name, value, **kw)

    monkeypatch.setattr(writer_mod.DumpWriter, "add_tensor", spy)
    for label, model in (("float", fm), ("a8w8", qm)):
        out = {}
        # the caller's thread; the writer's thread collecting after each tensor (1 byte pending at most); at close
        for mode, thread, pending in (("inline", False, 0), ("each", True, 1), ("close", True, 1 << 40)):
            monkeypatch.setattr(defaults, "DUMP_STATS_THREAD", thread)
            monkeypatch.setattr(defaults, "DUMP_STATS_PENDING_BYTES", pending)
            out[mode] = tmp_path / f"{label}-{mode}.h5"
            handed.clear()
            assert ivq_cli("capture", "onnx", model, *args, "-o", out[mode]) == 0
            # the exposed tensors handed over; a float graph output (returned to the caller too) not; a QDQ one is
            # captured from its QuantizeLinear: its values are a new array, handed over
            assert sum(handed) > 20 and all(handed) == (label == "a8w8")
        _identical(out["inline"], out["each"])
        _identical(out["inline"], out["close"])
        with open_dump(out["close"]) as d:
            assert (d.format_version == 2) == (label == "a8w8")
            for e in d.tensors()[:40]:  # the manifest's statistics are those of the values a reader gets
                s = tensor_stats(d.read(e))
                assert [s[k] for k in ("min", "max", "mean", "std")] == [e.stats[k] for k in ("min", "max", "mean",
                                                                                              "std")], e.name


def test_a_buffer_not_handed_over_is_summed_before_add_returns(tmp_path: Path) -> None:
    """A caller that reuses its buffer (a torch hook's live activation) does not pass ``owned``: its statistics
    and digest are those of the values at the call, whatever it writes into the buffer after."""
    buf = np.arange(24, dtype=np.float32).reshape(2, 12)
    p, q = tmp_path / "live.h5", tmp_path / "copy.h5"
    with DumpWriter(p, backend="x", stats_thread=True) as w:
        w.begin_record()
        w.add_tensor("a", buf)
        buf[:] = -1  # the next activation lands in the same buffer
        w.add_tensor("b", buf)
    with DumpWriter(q, backend="x", stats_thread=False) as w:
        w.begin_record()
        w.add_tensor("a", np.arange(24, dtype=np.float32).reshape(2, 12))
        w.add_tensor("b", np.full((2, 12), -1, np.float32))
    _identical(p, q)
    with open_dump(p) as d:
        assert d.entry("a").stats["max"] == 23.0 and d.entry("b").stats["max"] == -1.0


def test_an_aborted_capture_stops_the_thread_and_leaves_nothing(tmp_path: Path) -> None:
    p = tmp_path / "cut.h5"
    rng = np.random.default_rng(0)
    with pytest.raises(RuntimeError, match="forward failed"):
        with DumpWriter(p, backend="x", stats_thread=True) as w:
            w.begin_record()
            for k in range(8):
                w.add_tensor(f"t{k}", rng.standard_normal((64, 256)).astype(np.float32), owned=True)
            assert w._pool is not None
            raise RuntimeError("forward failed")
    assert w._pool is None and not w._pending
    assert not list(tmp_path.iterdir())
