"""Every command a new user runs on a model nobody here exported (issue 20), from the CLI: quantize, capture on
ORT CPU and QNN HTP, diff; the conventions (stdout / stderr, exit codes, --version, signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from ivq_debug import __version__
from ivq_debug.cli.diff import main as diff_main
from ivq_debug.cli.main import main as ivq_main
from ivq_debug.errors import EXIT_RUN, EXIT_USAGE
from ivq_debug.onnxgraph.intake import read_quantization_metadata
from ivq_debug.qnn.quantize import quantize_for_qnn
from tests.support.qnn_models import needs_qnn
from tests.support.thirdparty_models import METADATA, save_textline, textline_feeds

ROOT = Path(__file__).resolve().parents[2]


def ivq(*argv: object, prog=ivq_main) -> int:
    with pytest.raises(SystemExit) as e:
        prog([str(a) for a in argv])
    return int(e.value.code)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("thirdparty-cli")
    out = {"model": save_textline(d), "shape": save_textline(d, "shape.onnx", shape_reshape=True)}
    cal = textline_feeds(1, 4)
    np.savez(d / "cal.npz", x=np.concatenate([f["x"] for f in cal]))
    for name, width in (("in", 32), ("in48", 48)):
        np.savez(d / f"{name}.npz", **textline_feeds(2, 1, width)[0])
        out[name] = d / f"{name}.npz"
    out["cal"], out["dir"] = d / "cal.npz", d
    return out


def test_quantize_reports_and_stores_the_effective_types(files, tmp_path: Path, capfd) -> None:
    q = tmp_path / "q.onnx"
    assert ivq("quantize", files["model"], "-o", q, "--calibration", files["cal"], "--preset", "a16w8",
               "--json", tmp_path / "q.json") == 0
    out, err = capfd.readouterr()
    assert f"wrote {q}: a16w8" in out
    assert "effective: activations uint16 x" in out and "weights uint8 x7 · biases int32 x2" in out
    assert "did not hold" not in out and "Traceback" not in out + err  # (metadata once made this a TypeError)
    assert "intake: fixed input 'x' axis 3 ('width') = 32" in err  # notes: stderr
    doc = json.loads((tmp_path / "q.json").read_text())
    assert doc["effective"]["counts"]["weight"] == {"uint8": 7}
    m = onnx.load(str(q))
    assert read_quantization_metadata(m)["counts"] == doc["effective"]["counts"]
    assert all({p.key: p.value for p in m.metadata_props}[k] == v for k, v in METADATA.items())
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 8, 32]


def test_per_channel_on_opset_12_writes_a_valid_model(files, tmp_path: Path, capfd) -> None:
    q = tmp_path / "pc.onnx"
    assert ivq("quantize", files["model"], "-o", q, "--calibration", files["cal"], "--per-channel") == 0
    out, err = capfd.readouterr()
    assert "(per-channel 2)" in out and "opset 12 upgraded to 13" in err
    onnx.checker.check_model(str(q))
    assert next(o.version for o in onnx.load(str(q)).opset_import if o.domain in ("", "ai.onnx")) == 13


@pytest.mark.qnn
@needs_qnn
def test_capture_cpu_and_htp_then_diff(files, tmp_path: Path, capfd) -> None:
    q = tmp_path / "q.onnx"
    assert ivq("quantize", files["model"], "-o", q, "--calibration", files["cal"], "--preset", "a16w8") == 0
    for backend, model, dump in (("onnx", files["model"], "float.h5"), ("onnx", q, "cpu.h5"), ("qnn", q, "htp.h5")):
        capfd.readouterr()
        assert ivq("capture", backend, model, "--inputs", files["in"], "-o", tmp_path / dump) == 0, \
            capfd.readouterr().err
        out, _ = capfd.readouterr()
        assert out.startswith(f"wrote {tmp_path / dump}")
    # the dynamic width made QNN fail with "Having zero graph inputs"; the float model is fixed at capture time
    assert ivq("capture", "qnn", files["model"], "--inputs", files["in"], "--inputs", files["in48"],
               "-o", tmp_path / "two.h5") == EXIT_USAGE
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "input 'x' axis 3 ('width') is dynamic and the samples disagree" in err[0]
    assert "--inputs" in err[0] and not (tmp_path / "two.h5").exists()
    assert ivq(tmp_path / "float.h5", tmp_path / "htp.h5", "--json", "-", "-q", prog=diff_main) == 0
    out, err = capfd.readouterr()
    doc = json.loads(out)  # stdout is the document only
    logits = next(r for r in doc["layers"] if r["ref_name"] == "logits")
    cpu_vs_htp = float(logits["metrics"]["sqnr_db"])
    assert 20 < cpu_vs_htp < 80 and "PASS" in err
    assert ivq(tmp_path / "cpu.h5", tmp_path / "htp.h5", "--min-sqnr", "200", prog=diff_main) == 1  # budget: 1
    assert "FAIL" in capfd.readouterr().out


@pytest.mark.qnn
@needs_qnn
def test_unsupported_at_optimization_disable_advises_all(files, tmp_path: Path, capfd) -> None:
    # a QDQ model quantized elsewhere keeps the paddle2onnx Shape -> Gather -> Concat -> Reshape chain
    q = quantize_for_qnn(files["shape"], tmp_path / "shape.q.onnx", files["cal"], fold_shapes=False).model_path
    capfd.readouterr()
    assert ivq("capture", "qnn", q, "--inputs", files["in"], "-o", tmp_path / "a.h5") == EXIT_RUN  # not 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seq.shape (Shape)" in err[0]
    assert "--optimization all" in err[0] and "(checked: at --optimization all every node runs on HTP)" in err[0]
    assert ivq("capture", "qnn", q, "--inputs", files["in"], "-o", tmp_path / "a.h5", "--optimization", "all") == 0
    # ivq quantize folds the chain: the model it writes runs on HTP at "disable" too
    folded = tmp_path / "shape.folded.onnx"
    assert ivq("quantize", files["shape"], "-o", folded, "--calibration", files["cal"]) == 0
    assert "3 shape node(s) folded into initializers (Shape x1, Gather x1, Concat x1)" in capfd.readouterr().err
    assert ivq("capture", "qnn", folded, "--inputs", files["in"], "-o", tmp_path / "f.h5") == 0


def test_version_goes_to_stdout(capfd) -> None:
    assert ivq("--version") == 0
    assert capfd.readouterr().out.strip() == f"ivq-debug {__version__}"


def _signal_run(argv: list[str], tmp_path: Path, sig: int, code: int, after: float, wait_for: str) -> None:
    """Run ``ivq *argv`` in a subprocess (TMPDIR = ``tmp_path``), send ``sig`` ``after`` s after ``wait_for``
    appears in ``tmp_path``; assert the exit code and that nothing is left in ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "ivq_debug", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(wait_for)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(after)
    assert proc.poll() is None
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == ("ivq: terminated" if sig == signal.SIGTERM else "ivq: interrupted")
    # no dump, no .partial, no temp folder (".ses" is a session id `import onnxruntime` writes into TMPDIR)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".ses") == [], err


@pytest.mark.parametrize("sig, code, after", [(signal.SIGINT, 130, 0.0), (signal.SIGTERM, 143, 0.5)])
def test_signal_during_capture_leaves_nothing(files, tmp_path: Path, sig: int, code: int, after: float) -> None:
    """Ctrl-C as the dump appears, SIGTERM while samples are being written: exit 128 + signal, nothing left."""
    argv = ["capture", "onnx", str(files["model"]), "-o", str(tmp_path / "o.h5")]
    _signal_run(argv + [a for _ in range(400) for a in ("--inputs", str(files["in"]))], tmp_path, sig, code, after,
                ".o.h5.partial-*")


@pytest.mark.qnn
@needs_qnn
def test_sigterm_during_qnn_capture_removes_its_trace_folder(files, tmp_path: Path) -> None:
    q = files["dir"] / "sig.q.onnx"
    if not q.exists():
        assert ivq("quantize", files["model"], "-o", q, "--calibration", files["cal"]) == 0
    argv = ["capture", "qnn", str(q), "-o", str(tmp_path / "h.h5")]
    _signal_run(argv + [a for _ in range(100) for a in ("--inputs", str(files["in"]))], tmp_path, signal.SIGTERM,
                143, 0.0, "ivq-qnn-trace-*")


def test_cpu_capture_keeps_an_axis_the_samples_disagree_on(files, tmp_path: Path, capfd) -> None:
    """ORT CPU runs dynamic shapes: two widths in one dump, from the CLI and from ``ivq.capture``."""
    import ivq_debug
    from ivq_debug.dump import open_dump

    assert ivq("capture", "onnx", files["model"], "--inputs", files["in"], "--inputs", files["in48"],
               "-o", tmp_path / "cli.h5") == 0
    assert "intake: fixed" not in capfd.readouterr().err
    api = ivq_debug.capture(files["model"], [files["in"], files["in48"]], tmp_path / "api.h5")
    for path in (tmp_path / "cli.h5", api):
        with open_dump(path) as d:
            assert [d.read("logits", (s, "model", 0)).shape for s in (0, 1)] == [(1, 32, 10), (1, 48, 10)]
            assert "fixed_dims" not in d.backend_info
    with open_dump(ivq_debug.capture(files["model"], [files["in48"]], tmp_path / "one.h5")) as d:
        assert d.backend_info["fixed_dims"] == ["input 'x' axis 3 ('width') = 48 from the inputs"]
