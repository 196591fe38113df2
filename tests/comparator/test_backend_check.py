"""Issue 32: ``ivq-diff CPUQDQ.h5 HTP.h5`` (REF is the ORT CPU-QDQ capture of the QDQ model HTP ran) gets the backend
check with no option: the clean QNN HTP (emulated) capture of the seed-0 block at a16w8 passes, the same capture
with one activation computed with a wrong encoding on the HTP side (``v`` requantized at scale x 0.1: saturated, as
a corrupted device encoding does) fails with ``backend_divergence`` at ``v``. Both dumps captured through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from ivq_debug import defaults
from ivq_debug.cli.common import run
from ivq_debug.cli.diff import _main as diff_main
from ivq_debug.cli.main import _main as ivq_main
from ivq_debug.dump import open_dump
from tests.support import qnn_models as models
from tests.support.qnn_models import FEED_SEED, needs_qnn

pytestmark = [pytest.mark.qnn, needs_qnn]

FAULT = "v"


def inject_wrong_encoding(src: Path, dst: Path, tensor: str, factor: float) -> Path:
    """A copy of the dump ``src`` whose ``tensor`` (every record) is what the backend computes when it quantizes
    that tensor with its scale times ``factor``: values requantized on the finer grid and saturated at its range."""
    shutil.copyfile(src, dst)
    with open_dump(src) as d:
        ents = [e for e in d.entries if e.name == tensor and e.kind == "tensor"]
        enc = ents[0].encoding
    s, zp, lo, hi = float(enc["scale"]) * factor, int(enc["zero_point"]), int(enc["qmin"]), int(enc["qmax"])
    with h5py.File(dst, "r+") as f:
        for rid in f["records"]:
            g = f["records"][rid]
            x = g["t"][tensor][()].astype(np.float64)
            q = np.clip(np.round(x / s) + zp, lo, hi)
            g["t"][tensor][...] = ((q - zp) * s).astype(g["t"][tensor].dtype)
            if "q" in g and tensor in g["q"]:
                g["q"][tensor][...] = q.astype(g["q"][tensor].dtype)
    return dst


@pytest.fixture(scope="module")
def dumps(qnn_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("backend-check")
    np.savez(d / "x.npz", **models.block_feeds(FEED_SEED)[0])
    qdq = qnn_models["block.a16w8"]
    for backend, out in (("onnx", "cpu-qdq.h5"), ("qnn", "htp.h5")):
        with pytest.MonkeyPatch.context() as m:  # the HTP dump as format version 1 (its values stored: the fault
            if backend == "qnn":                 # is injected into them); the CPU one as version 2 (integers only)
                m.setenv(defaults.DUMP_INTEGERS_ONLY_ENV, "0")
            assert run("ivq", ivq_main, ["capture", backend, str(qdq), "--inputs", str(d / "x.npz"), "-o",
                                         str(d / out)]) == 0
    with open_dump(d / "cpu-qdq.h5") as a, open_dump(d / "htp.h5") as b:
        assert (a.format_version, b.format_version) == (2, 1)
    return {"dir": d, "cpuqdq": d / "cpu-qdq.h5", "htp": d / "htp.h5",
            "bad": inject_wrong_encoding(d / "htp.h5", d / "htp-bad.h5", FAULT, 0.1)}


def _diff(*argv: object) -> int:
    return run("ivq-diff", diff_main, [str(a) for a in argv])


def test_backend_fault_fails_with_no_option(dumps, capfd) -> None:
    capfd.readouterr()
    code = _diff(dumps["cpuqdq"], dumps["bad"], "--json", dumps["dir"] / "bad.json", "--force")
    out, err = capfd.readouterr()
    assert code == 1, err
    assert out.splitlines()[-1].startswith("FAIL: ") and f"backend_divergence at {FAULT}" in out.splitlines()[-1]
    doc = json.loads((dumps["dir"] / "bad.json").read_text())
    (f,) = [f for f in doc["findings"] if f["kind"] == "backend_divergence"]
    assert f["severity"] == "error" and f["where"]["tensor"] == FAULT
    assert f["evidence"]["lsb_rmse_8bit"] > 4 * defaults.BACKEND_CHECK_LSB_RMSE  # measured 23.5 steps
    assert doc["verdict"]["applied"]["backend_check"]["models"]["model"]  # the same QDQ model on both sides
    assert doc["backend_check"]["lsb_rmse"] == defaults.BACKEND_CHECK_LSB_RMSE


def test_clean_backend_passes_the_default_check(dumps, capfd) -> None:
    capfd.readouterr()
    code = _diff(dumps["cpuqdq"], dumps["htp"], "--json", dumps["dir"] / "ok.json", "--force")
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert out.splitlines()[-1].startswith("PASS: backend check against the CPU-QDQ reference")
    doc = json.loads((dumps["dir"] / "ok.json").read_text())
    assert not [f for f in doc["findings"] if f["kind"] == "backend_divergence"]
    # measured: the clean HTP stays within 0.4 8-bit steps rms of CPU-QDQ at a16w8 (the limit is 4)
    steps = [layer["metrics"]["lsb_rmse"] / 256 for layer in doc["layers"]
             if isinstance(layer["metrics"].get("lsb_rmse"), float)]
    assert steps and max(steps) < defaults.BACKEND_CHECK_LSB_RMSE / 4


def test_declared_thresholds_replace_the_default_check(dumps, capfd) -> None:
    assert _diff(dumps["cpuqdq"], dumps["bad"], "--min-sqnr", "0", "--fail-on", "never") == 0
    assert "backend check" not in capfd.readouterr().out
