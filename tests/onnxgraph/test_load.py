"""The one ONNX loader: single-file models above the in-place threshold keep their shape inputs inline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

from ivq_debug.cli.main import main
from ivq_debug.dump import open_dump
from ivq_debug.errors import InputError
from ivq_debug.onnxgraph.load import IN_PLACE_MIN_BYTES, load_model


def _model(path: Path, cols: int) -> Path:
    """x[1,16] @ W[16,cols] -> Reshape to [-1, 64] -> Expand -> Slice rows: shape inputs are small int64
    initializers that ONNX Runtime's load-time shape inference must read."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((16, cols)).astype(np.float32), "W"),
             nh.from_array(np.array([-1, 64], np.int64), "shape"),
             nh.from_array(np.array([2, cols // 64, 64], np.int64), "expand"),
             nh.from_array(np.array([0], np.int64), "starts"), nh.from_array(np.array([4], np.int64), "ends"),
             nh.from_array(np.array([1], np.int64), "axes")]
    nodes = [h.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
             h.make_node("Reshape", ["y", "shape"], ["r"], name="reshape"),
             h.make_node("Expand", ["r", "expand"], ["e"], name="expand"),
             h.make_node("Slice", ["e", "starts", "ends", "axes"], ["out"], name="slice")]
    g = h.make_graph(nodes, "big", [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                     [h.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("load")
    cols_above = (IN_PLACE_MIN_BYTES // (16 * 4) // 64 + 1) * 64  # W alone is just over the threshold
    out = {"above": _model(d / "above.onnx", cols_above), "below": _model(d / "below.onnx", cols_above - 1024)}
    assert out["above"].stat().st_size >= IN_PLACE_MIN_BYTES > out["below"].stat().st_size
    return out


def test_in_place_keeps_shape_inputs_and_small_initializers_inline(models) -> None:
    m = load_model(models["above"])
    ext = {t.name for t in m.graph.initializer if t.external_data}
    assert ext == {"W"}
    assert not any(t.external_data for t in load_model(models["below"]).graph.initializer)


@pytest.mark.parametrize("which", ["above", "below"])
def test_capture_cli_on_single_file_models_around_the_threshold(models, which, tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    with pytest.raises(SystemExit) as e:
        main(["capture", "onnx", str(models[which]), "--inputs", str(tmp_path / "x.npz"), "-o", str(tmp_path / "c.h5")])
    assert e.value.code == 0
    want = ort.InferenceSession(str(models[which]), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with open_dump(tmp_path / "c.h5") as d:
        assert np.array_equal(d.read("out"), want)
        assert {"y", "r", "e"} <= {e.name for e in d.tensors()}
    assert sorted(p.name for p in models[which].parent.iterdir()) == ["above.onnx", "below.onnx"]  # no temp left


def test_unreadable_models_are_input_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such ONNX model"):
        load_model(tmp_path / "missing.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(InputError, match="not a readable ONNX model"):
        load_model(bad)
    with pytest.raises(InputError, match="not a readable ONNX model"):
        load_model(b"\xff\xff\xff")
