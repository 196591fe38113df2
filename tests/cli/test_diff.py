"""Issue acceptance: a real PyTorch model exported to ONNX, both captured; a perturbed layer is found."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ivq_debug.cli.diff import main as diff_main
from ivq_debug.dump import open_dump
from tests.support import tiny


def run_diff(args: list[str], capfd) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        diff_main(args)
    out, err = capfd.readouterr()
    return int(e.value.code), out, err


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tiny")
    m, x, onnx_path = tiny.build(tmp)
    paths = {
        "onnx": onnx_path,
        "torch": tiny.capture_torch(m, x, tmp / "torch.h5"),
        "ort": tiny.capture_ort(onnx_path, x, tmp / "ort.h5"),
        "ort2": tiny.capture_ort(onnx_path, x, tmp / "ort2.h5"),
    }
    # perturb the weights of blocks.1.fc1 in a copy of the ONNX model
    model = onnx.load(str(onnx_path))
    node = next(n for n in model.graph.node if n.name == "/blocks.1/fc1/MatMul")
    init = next(i for i in model.graph.initializer if i.name == node.input[1])
    w = numpy_helper.to_array(init)
    rng = np.random.default_rng(0)
    init.CopyFrom(numpy_helper.from_array((w + 0.05 * rng.standard_normal(w.shape)).astype(w.dtype), init.name))
    pert = tmp / "tiny.perturbed.onnx"
    onnx.save(model, str(pert))
    paths["perturbed"] = tiny.capture_ort(pert, x, tmp / "perturbed.h5")
    paths["tmp"] = tmp
    return paths


def test_torch_vs_onnx_aligns_and_passes_export_preset(captured, capfd) -> None:
    code, _, err = run_diff([str(captured["torch"]), str(captured["ort"]), "--preset", "export",
                             "--json", str(captured["tmp"] / "clean.json")], capfd)
    assert code == 0, err
    doc = json.loads((captured["tmp"] / "clean.json").read_text())
    assert doc["schema"] == "ivq-diff/1"
    assert doc["summary"]["pairs"] == 18  # 17 hooked modules (dropouts skipped) + logits
    assert doc["unmatched"]["ref"]["count"] == 0
    assert max(float(layer["metrics"]["max_abs"]) for layer in doc["layers"]) <= 1e-5
    assert doc["first_divergence"] is None
    assert {layer["ref_name"] for layer in doc["layers"]} >= {"blocks.1.fc1", "blocks.2.act", "head"}


def test_perturbed_layer_is_first_divergence_and_fails(captured, capfd) -> None:
    out_json = captured["tmp"] / "pert.json"
    code, out, _ = run_diff([str(captured["torch"]), str(captured["perturbed"]), "--min-sqnr", "40",
                             "--json", str(out_json)], capfd)
    assert code == 1
    doc = json.loads(out_json.read_text())
    fd = doc["first_divergence"]
    assert fd["ref_name"] == "blocks.1.fc1"
    assert fd["test_name"] == "/blocks.1/fc1/Add_output_0"
    assert float(fd["metrics"]["sqnr_db"]) < 40
    # everything before it in execution order is still clean
    clean = {layer["ref_name"] for layer in doc["layers"] if layer["passed"]}
    assert {"embed", "blocks.0", "blocks.1.ln"} <= clean
    assert any(f["kind"] == "first_divergence" and f["where"]["tensor"] == "blocks.1.fc1" for f in doc["findings"])
    assert "FAIL" in out and "blocks.1.fc1" in out  # the table and the verdict: stdout (| grep works)


def test_identical_captures_exit_zero(captured, capfd) -> None:
    code, out, err = run_diff([str(captured["ort"]), str(captured["ort2"]), "--min-sqnr", "40"], capfd)
    assert code == 0, err
    assert "PASS" in out and "PASS" not in err


def test_identical_json_on_stdout(captured, capfd) -> None:
    code, out, err = run_diff([str(captured["ort"]), str(captured["ort2"]), "--json", "-", "-q"], capfd)
    assert code == 0
    doc = json.loads(out)  # stdout holds only the document: the verdict went to stderr
    assert "PASS" in err
    assert doc["summary"]["identical"] == doc["summary"]["pairs"] > 20
    assert all(layer["metrics"]["sqnr_db"] == "inf" for layer in doc["layers"])


def test_bad_inputs_exit_3_with_one_line(captured, capfd, tmp_path: Path) -> None:
    bad = tmp_path / "not.h5"
    bad.write_text("hello")
    trunc = tmp_path / "trunc.h5"
    trunc.write_bytes(captured["ort"].read_bytes()[:4000])
    for target in (bad, trunc, tmp_path / "missing.h5"):
        code, _out, err = run_diff([str(captured["ort"]), str(target)], capfd)
        assert code == 3
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(target) in lines[0] and "Traceback" not in err


def test_unmatched_beyond_allowance_exits_4(captured, capfd, tmp_path: Path) -> None:
    _m, x, onnx_path = tiny.build(tmp_path)
    from ivq_debug.capture.base import Selection
    from ivq_debug.capture.onnxrt.runner import OrtRunner
    from ivq_debug.dump import DumpWriter

    r = OrtRunner(onnx_path, selection=Selection(include=["/blocks.0/*"]))
    sub = tmp_path / "sub.h5"
    with DumpWriter(sub, backend=r.backend) as w:
        r.run({"x": x}, w)
    code, _, err = run_diff([str(captured["torch"]), str(sub), "--max-unmatched", "0"], capfd)
    assert code == 4 and "unmatched" in err
    code, _, _ = run_diff([str(captured["torch"]), str(sub), "--max-unmatched", "100"], capfd)
    assert code == 0


def test_baseline_fails_only_on_regression(captured, capfd) -> None:
    tmp = captured["tmp"]
    base = tmp / "base.json"
    run_diff([str(captured["torch"]), str(captured["ort"]), "--min-sqnr", "40", "--json", str(base)], capfd)
    code, _, _ = run_diff([str(captured["torch"]), str(captured["ort2"]), "--baseline", str(base)], capfd)
    assert code == 0
    cur = tmp / "cur.json"
    code, out, _ = run_diff([str(captured["torch"]), str(captured["perturbed"]), "--min-sqnr", "40",
                             "--baseline", str(base), "--json", str(cur)], capfd)
    assert code == 1 and "regression" in out
    regs = json.loads(cur.read_text())["regressions"]
    assert regs[0]["ref_name"] == "blocks.1.fc1"
    # against a baseline that already had the perturbation, nothing regressed
    code, _, _ = run_diff([str(captured["torch"]), str(captured["perturbed"]), "--min-sqnr", "40",
                           "--baseline", str(cur), "--json", str(tmp / "again.json")], capfd)
    assert code == 0


def test_dynamo_export_aligns_through_name_scopes(tmp_path: Path) -> None:
    import ivq_debug as ivq

    m, x, onnx_path = tiny.build(tmp_path, dynamo=True)
    t = tiny.capture_torch(m, x, tmp_path / "t.h5")
    o = tiny.capture_ort(onnx_path, x, tmp_path / "o.h5")
    cmp = ivq.compare(t, o)
    scoped = cmp.table[cmp.table["match"] == "scope"]
    assert len(scoped) >= 15
    assert cmp.table["max_abs"].max() <= 1e-5
    assert set(scoped["ref_name"]) >= {"blocks.0.fc1", "blocks.2.fc2", "head"}


def test_capture_in_output_subsets_and_external_data(tmp_path: Path, captured, monkeypatch) -> None:
    import ivq_debug as ivq

    _m, x, onnx_path = tiny.build(tmp_path)
    sub = tiny.capture_ort(onnx_path, x, tmp_path / "sub.h5", max_outputs_per_run=3, verify=True)
    ext_dir = tmp_path / "ext"
    ext_dir.mkdir()
    model = onnx.load(str(onnx_path))
    onnx.save_model(model, str(ext_dir / "tiny.onnx"), save_as_external_data=True, location="tiny.data",
                    size_threshold=0)
    assert (ext_dir / "tiny.data").stat().st_size > 10_000
    ext = tiny.capture_ort(ext_dir / "tiny.onnx", x, tmp_path / "ext.h5", verify=True)
    # embedded weights referenced in place (what large models get): same values, nothing left behind
    from ivq_debug.onnxgraph.load import Model, load_in_place

    inplace = tmp_path / "inplace"
    inplace.mkdir()
    onnx.save_model(onnx.load(str(onnx_path)), str(inplace / "tiny.onnx"))
    assert any(t.external_data for t in load_in_place(inplace / "tiny.onnx", inline_max_bytes=0).graph.initializer)
    monkeypatch.setattr("ivq_debug.capture.onnxrt.runner.load",
                        lambda p, **kw: Model(load_in_place(p, inline_max_bytes=0), path=p))
    ip = tiny.capture_ort(inplace / "tiny.onnx", x, tmp_path / "inplace.h5", verify=True)
    monkeypatch.undo()
    assert sorted(p.name for p in inplace.iterdir()) == ["tiny.onnx"]
    for other in (sub, ext, ip):
        cmp = ivq.compare(captured["ort"], other)
        assert cmp.summary["identical"] == cmp.summary["pairs"] == len(open_dump(captured["ort"]).tensors())
        assert open_dump(other).backend_info["exposure_check"]["bit_identical"] is True
