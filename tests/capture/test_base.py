"""The capture stage's shared pieces: the backend registry, make_runner, the one capture loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ivq_debug.capture.base import BACKENDS, Selection, capture, make_runner, model_facts
from ivq_debug.cli.main import main
from ivq_debug.dump import open_dump
from ivq_debug.errors import UsageError
from ivq_debug.inputfiles import sha256_file
from tests.support import tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    _m, x, path = tiny.build(tmp_path_factory.mktemp("base"))
    return path, x


def test_make_runner_checks_backend_and_options(model) -> None:
    path, _ = model
    r = make_runner("onnx", path, selection=Selection(include=["*fc1*"]), soc_model=None)  # None: default
    assert r.backend == "onnxruntime-cpu" and r.sites and all("fc1" in s.name for s in r.sites)
    with pytest.raises(UsageError, match="unknown backend 'tflite'"):
        make_runner("tflite", path)
    with pytest.raises(UsageError, match="does not take htp_arch"):
        make_runner("onnx", path, htp_arch="73")


def test_capture_loop_one_record_per_sample_with_runner_info(model, tmp_path: Path) -> None:
    path, x = model
    runner = make_runner("onnx", path, selection=Selection())
    out = capture(runner, [{"x": x}, {"x": x * 2}], tmp_path / "c.h5", model=model_facts(path), progress=None)
    with open_dump(out) as d:
        assert sorted(d.record_keys()) == [(0, "model", 0), (1, "model", 0)]
        assert d.model["sha256"] == sha256_file(path) and d.model["part"] == "model"
        assert d.backend == "onnxruntime-cpu" and d.backend_info["exposed_tensors"] == len(runner.sites)
        a, b = d.read("logits", (0, "model", 0)), d.read("logits", (1, "model", 0))
        assert not np.array_equal(a, b)
    with pytest.raises(UsageError, match="exists"):
        capture(runner, [{"x": x}], out, progress=None)


def test_capture_loop_custom_record_and_nothing_left_on_failure(model, tmp_path: Path) -> None:
    path, x = model
    runner = make_runner("onnx", path)

    def steps(w, i, sample):
        for step in range(2):
            w.begin_record(sample=i, part="decode", step=step + 1)
            runner.run(sample, w)

    out = capture(runner, [{"x": x}], tmp_path / "s.h5", record=steps, progress=None)
    assert sorted(open_dump(out).record_keys()) == [(0, "decode", 1), (0, "decode", 2)]

    def boom(w, i, sample):
        raise RuntimeError("killed mid-capture")

    with pytest.raises(RuntimeError):
        capture(runner, [{"x": x}], tmp_path / "f.h5", record=boom, progress=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.h5"]


def test_cli_backend_choices_come_from_the_registry(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["capture", "nosuch", "m.onnx", "--inputs", "x.npz", "-o", "o.h5"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "invalid choice: 'nosuch'" in err and all(repr(b) in err for b in BACKENDS) and "\n" not in err


def test_one_call_api_capture_and_dir(model, tmp_path: Path) -> None:
    import ivq_debug as ivq
    import ivq_debug.capture.base  # (binds the subpackage to ivq.capture)

    path, x = model
    np.savez(tmp_path / "x.npz", x=x)
    out = ivq.capture(path, [tmp_path / "x.npz", {"x": x * 3}], tmp_path / "api.h5")
    with open_dump(out) as d:
        assert len(d.record_keys()) == 2 and len(d.tensors()) > 10 and d.model["sha256"] == sha256_file(path)
    assert {"capture", "compare", "open_dump", "write_report"} <= set(dir(ivq))
