"""``ivq diff A.onnx B.onnx --inputs …``: two models compared in memory give the ``ivq-diff/1`` document, the
verdict and the exit code of ``ivq capture onnx`` ×2 + ``ivq-diff`` (every value equal, apart from the dumps'
paths and creation times), on a real float transformer block and its a8w8 QDQ model (3 samples), and on a
float model with a perturbed weight; one sample's values held at a time; bad inputs are one line, exit 3."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ivq_debug.capture.base import Selection
from ivq_debug.modeldiff import held_capture
from tests.support import qnn_models
from tests.support.cli import ivq_cli
from tests.support.qnn_models import needs_qnn

pytestmark = needs_qnn


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The float block, its a8w8 QDQ model, the float block with fc1's weight perturbed, 3 samples, and the
    captures of all three (the dump path)."""
    d = tmp_path_factory.mktemp("diff-models")
    fm, qm, args = qnn_models.block_files(d, 3)
    m = onnx.load(str(fm))
    init = next(i for i in m.graph.initializer if i.name == "W1")
    w = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(
        (w + 0.05 * np.random.default_rng(0).standard_normal(w.shape)).astype(w.dtype), "W1"))
    pert = d / "block.fc1-perturbed.onnx"
    onnx.save(m, str(pert))
    for name, model in (("ref", fm), ("test", qm), ("pert", pert)):
        assert ivq_cli("capture", "onnx", model, *args, "-o", d / f"{name}.h5") == 0
    return {"dir": d, "float": fm, "qdq": qm, "pert": pert, "inputs": args}


def _pathless(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without what names the dumps (their paths, creation times)."""
    for side in ("ref", "test"):
        doc[side].pop("path")
        doc[side].pop("created")
        doc["contract"]["identity"][side].pop("path")
    return doc


def _both(models: dict[str, Any], test: str, *flags: object, tag: str) -> tuple[tuple[int, dict], tuple[int, dict]]:
    """(exit code, document) of the dump path and of the in-memory path on the same models and inputs."""
    d = models["dir"]
    dumps = ivq_cli("diff", d / "ref.h5", d / f"{test}.h5", "--json", d / f"{tag}.dumps.json", "-q", *flags)
    mem = ivq_cli("diff", models["float"], models[{"test": "qdq", "pert": "pert"}[test]], *models["inputs"],
                  "--json", d / f"{tag}.memory.json", "-q", *flags)
    return ((dumps, json.loads((d / f"{tag}.dumps.json").read_text())),
            (mem, json.loads((d / f"{tag}.memory.json").read_text())))


@pytest.mark.parametrize("flags", [(), ("--min-sqnr", "20", "--rank-by", "sqnr_db", "--top", "5")],
                         ids=["defaults", "budget"])
def test_float_vs_qdq_in_memory_is_the_dump_path(models: dict[str, Any], flags: tuple[str, ...]) -> None:
    (code_d, doc_d), (code_m, doc_m) = _both(models, "test", *flags, tag="qdq-" + str(len(flags)))
    assert doc_m["ref"]["path"].endswith("block.onnx (in memory)")
    assert doc_m["ref"]["model"] == doc_d["ref"]["model"]  # the model file's path and SHA-256
    assert code_m == code_d
    assert _pathless(doc_m) == _pathless(doc_d)  # every metric, finding and verdict equal
    s = doc_m["summary"]
    assert s["pairs"] == 3 * 39 and s["records"] == 3 and doc_m["ref"]["tensors"] == 3 * 37  # 3 samples
    assert doc_m["test"]["backend"] == "onnxruntime-cpu-qdq" and doc_m["test"]["tensors"] == 3 * 39
    assert 5 < s["min_sqnr_db"] < 40  # quantization error, measured
    assert sum("lsb_rmse" in ly["metrics"] for ly in doc_m["layers"]) > 20  # the encoding fit on the QDQ pairs
    if flags:
        assert code_m == 1 and s["failed"] > 0 and doc_m["first_divergence"] is not None


def test_a_perturbed_weight_is_found_in_memory_as_in_the_dumps(models: dict[str, Any]) -> None:
    (code_d, doc_d), (code_m, doc_m) = _both(models, "pert", "--min-sqnr", "40", tag="pert")
    assert code_m == code_d == 1
    assert _pathless(doc_m) == _pathless(doc_d)
    first = doc_m["first_divergence"]
    assert first["ref_name"] == "f0" and first["record"]["sample"] == 0  # fc1's output: the perturbed weight
    ok = {ly["ref_name"] for ly in doc_m["layers"] if ly["passed"]}
    assert {"x1", "q", "k", "v", "h1"} <= ok  # before fc1: the same values


def test_one_sample_is_held_at_a_time_and_a_value_read_later_is_made_again(models: dict[str, Any]) -> None:
    from ivq_debug.arrays import read_arrays

    samples = [read_arrays(p) for p in models["inputs"][1::2]]
    held = held_capture(models["float"], samples, models["inputs"][1::2], options={"selection": Selection()})
    held.hold(0)
    first = {k[2]: a.copy() for k, a in held.sink._arrays.items() if k[1] == "tensor"}
    held.hold(1)
    assert {k[0] for k in held.sink._arrays if k[1] == "tensor"} == {"r000001"}  # sample 0's tensors dropped
    assert {k[0] for k in held.sink._arrays if k[1] == "input"} == {"r000000", "r000001"}  # the feeds kept
    whole = held.dump()
    assert len(whole.record_keys()) == 2 and held.forwards == 2
    e = whole.entry("f0", "r000000")
    again = whole.read(e)  # sample 0 again: one more forward, the same bits
    assert held.forwards == 3 and {k[0] for k in held.sink._arrays if k[1] == "tensor"} == {"r000000"}
    assert again.tobytes() == first["f0"].tobytes()
    assert not np.array_equal(again, whole.read(whole.entry("f0", "r000001")))  # another sample's values


def test_the_report_reads_values_of_samples_dropped(models: dict[str, Any]) -> None:
    """The HTML report reads values of every sample (its charts and histograms) after the comparison: the samples
    dropped are run again, and each chart's points are the dump path's."""
    d = models["dir"]
    assert ivq_cli("diff", models["float"], models["qdq"], *models["inputs"], "--report", d / "r.html", "-q") == 1
    assert ivq_cli("diff", d / "ref.h5", d / "test.h5", "--report", d / "r.dumps.html", "-q") == 1  # (saturation)
    points = re.findall(r"<title>([^<]*) · block → block\.a8w8: ([^<]*)</title>", (d / "r.html").read_text())
    want = re.findall(r"<title>([^<]*) · ref → test: ([^<]*)</title>", (d / "r.dumps.html").read_text())
    assert len(want) >= 3 * 39 and points == want


@pytest.mark.parametrize(("case", "code", "message"), [
    ("missing model", 3, "no such ONNX model"),
    ("bad model", 3, "not a readable ONNX model"),
    ("missing inputs file", 3, "no such inputs file"),
    ("inputs of another model", 3, "missing model input(s) ['x', 'pos']"),
    ("no inputs", 2, "compared on --inputs"),
    ("a model and a dump", 2, "not one of each"),
    ("--inputs with dumps", 2, "--inputs applies to two models"),
    ("--expected", 2, "--expected reads the reference's values"),
])
def test_bad_inputs_are_one_line(models: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                 case: str, code: int, message: str) -> None:
    d, fm, qm = models["dir"], models["float"], models["qdq"]
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    np.savez(tmp_path / "other.npz", y=np.zeros(3, np.float32))
    ins = models["inputs"][:2]
    argv = {
        "missing model": [tmp_path / "none.onnx", qm, *ins],
        "bad model": [tmp_path / "bad.onnx", qm, *ins],
        "missing inputs file": [fm, qm, "--inputs", tmp_path / "none.npz"],
        "inputs of another model": [fm, qm, "--inputs", tmp_path / "other.npz"],
        "no inputs": [fm, qm],
        "a model and a dump": [fm, d / "test.h5", *ins],
        "--inputs with dumps": [d / "ref.h5", d / "test.h5", *ins],
        "--expected": [fm, qm, *ins, "--expected", d / "test.h5"],
    }[case]
    capfd.readouterr()
    assert ivq_cli("diff", *argv) == code
    err = capfd.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_the_comparison_and_its_diagnostics_run_each_sample_once(models: dict[str, Any]) -> None:
    """The default ``ivq diff`` (alignment, metrics, contract, every diagnostic) runs each sample once per model:
    what the diagnostics read after the comparison is the records' inputs, which stay held."""
    from ivq_debug.arrays import read_arrays
    from ivq_debug.modeldiff import compare_models

    paths = models["inputs"][1::2]
    cmp = compare_models(models["float"], models["qdq"], [read_arrays(p) for p in paths], sources=paths,
                         options={"selection": Selection()}, progress=False)
    assert cmp.summary["pairs"] == 3 * 39 and cmp.findings  # (the saturation findings of the dump path)
    assert cmp.ref._held.forwards == 3 and cmp.test._held.forwards == 3
