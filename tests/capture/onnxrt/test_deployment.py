"""Capturing the deployment as it runs: ``--optimization all`` exposes only the optimized graph's tensors and the
outputs stay bit-identical; ``--threads``, ``--session-option`` and the platform are recorded (real ORT runs)."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.capture.onnxrt.optimized import graph_kernels
from ivq_debug.capture.onnxrt.platform import cpu_features, cpuinfo
from ivq_debug.dump import open_dump
from ivq_debug.dynamic_quant import quantize_dynamic_model
from ivq_debug.onnxgraph.load import load_model
from tests.support.dynamic_models import build_mlp, mlp_input, run_ivq


@pytest.fixture(scope="module")
def dq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("deploy")
    build_mlp(d / "m.onnx")
    np.savez(d / "x.npz", **mlp_input())
    return quantize_dynamic_model(d / "m.onnx", d / "m.dq.onnx").model_path


def plain_outputs(model: Path, feeds: dict[str, np.ndarray], **config: str) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]


def test_all_exposes_only_the_optimized_graph(dq: Path, tmp_path: Path, capfd) -> None:
    out = tmp_path / "all.h5"
    code, _, err = run_ivq(["capture", "onnx", dq, "--inputs", dq.parent / "x.npz", "-o", out, "--optimization", "all",
                            "--threads", "1"], capfd)
    assert code == 0, err
    assert "do not exist in the optimized graph" in err
    d = open_dump(out)
    info = d.backend_info
    kernels = d.meta("kernels")
    assert kernels["level"] == "ORT_ENABLE_ALL"
    # every captured tensor is computed by the optimized graph: each of the 5 MatMul+bias chains ran fused
    names = {e.name for e in d.tensors()}
    assert names <= set(kernels["tensors"])
    fused = {n: k for n, k in kernels["tensors"].items() if k["op"] == "com.microsoft.DynamicQuantizeMatMul"}
    assert len(fused) == 5 and {k["k"] for k in fused.values()} == {32, 128}
    assert not any("_quantized" in n for n in names)  # DynamicQuantizeLinear / MatMulInteger outputs were fused away
    og = info["optimized_graph"]
    assert og["dropped"] > 0 and og["exposed"] == len(names) - 1  # (+ the graph output)
    assert info["exposure_check"] == {"bit_identical": True, "max_abs": 0.0}
    # and the captured output is what a deployment's own ORT_ENABLE_ALL session computes, bit for bit
    feeds = mlp_input()
    assert d.read("y").tobytes() == plain_outputs(dq, feeds).tobytes()
    p = info["platform"]
    assert p["machine"] == platform.machine() and p["intra_op_threads"] == 1
    assert p["graph_optimization_level"] == "ORT_ENABLE_ALL" and p["onnxruntime"] == ort.__version__
    assert p["cpu_features"] == cpu_features() and p["cpu_features"]


def test_disable_exposes_every_node_with_its_kernel(dq: Path, tmp_path: Path) -> None:
    runner = make_runner("onnx", dq, selection=Selection())
    capture(runner, [mlp_input()], tmp_path / "d.h5", progress=None)
    d = open_dump(tmp_path / "d.h5")
    kernels = d.meta("kernels")["tensors"]
    mmi = [n for n, k in kernels.items() if k["op"] == "MatMulInteger"]
    assert len(mmi) == 5 and all(kernels[n]["inputs"] and kernels[n]["k"] in (32, 128) for n in mmi)
    assert {e.name for e in d.tensors()} >= set(mmi)
    assert "optimized_graph" not in d.backend_info and "exposure_check" not in d.backend_info


def test_session_options_reach_every_session(tmp_path: Path, capfd) -> None:
    """``optimization.enable_gelu_approximation=1`` turns the fused Gelu into FastGelu: a visible effect."""
    model = build_mlp(tmp_path / "m.onnx", erf_gelu=True)
    np.savez(tmp_path / "x.npz", **mlp_input())
    outs = {}
    for tag, extra in (("exact", []), ("approx", ["--session-option", "optimization.enable_gelu_approximation=1"])):
        code, _, err = run_ivq(["capture", "onnx", model, "--inputs", tmp_path / "x.npz", "-o", tmp_path / f"{tag}.h5",
                                "--optimization", "all", *extra], capfd)
        assert code == 0, err
        d = open_dump(tmp_path / f"{tag}.h5")
        outs[tag] = d
    ops = {t: {k["op"] for k in d.meta("kernels")["tensors"].values()} for t, d in outs.items()}
    assert "com.microsoft.Gelu" in ops["exact"] and "com.microsoft.FastGelu" in ops["approx"]
    assert outs["approx"].backend_info["platform"]["session_options"] == {"optimization.enable_gelu_approximation": "1"}
    assert outs["approx"].backend_info["exposure_check"]["bit_identical"]
    assert outs["approx"].read("y").tobytes() == plain_outputs(
        model, mlp_input(), **{"optimization.enable_gelu_approximation": "1"}).tobytes()
    assert outs["approx"].read("y").tobytes() != outs["exact"].read("y").tobytes()


@pytest.mark.parametrize(("args", "needle"), [
    (["--session-option", "novalue"], "--session-option takes KEY=VALUE"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
])
def test_bad_options_are_one_line_usage_errors(dq: Path, tmp_path: Path, args: list[str], needle: str, capfd) -> None:
    code, _, err = run_ivq(["capture", "onnx", dq, "--inputs", dq.parent / "x.npz", "-o", tmp_path / "o.h5", *args], capfd)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.h5").exists()


def test_graph_kernels_leave_constants_and_feeds_out(dq: Path) -> None:
    k = graph_kernels(load_model(dq), "ORT_DISABLE_ALL")["tensors"]
    assert k["/blocks.0/ln/out"] == {"op": "LayerNormalization", "inputs": []}  # x is a feed: the same in both captures
    assert k["/blocks.0/res"]["inputs"] == ["/blocks.0/fc2/Add_output_0"]
    assert all(not n.endswith((".w", ".b", ".g")) for v in k.values() for n in v["inputs"])


def test_cpuinfo_reads_x86_and_arm(tmp_path: Path) -> None:
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU implementer\t: 0x41\nCPU part\t: 0xd0b\n\n"
                   "processor\t: 1\nFeatures\t: fp\n")
    assert cpuinfo(str(arm)) == {"cpu_model": "implementer 0x41 part 0xd0b", "cpuinfo_flags": ["asimd", "asimddp", "fp"]}
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: sse avx2 fma\n")
    assert cpuinfo(str(x86)) == {"cpu_model": "Some CPU", "cpuinfo_flags": ["avx2", "fma", "sse"]}
    assert cpuinfo(str(tmp_path / "missing")) == {"cpu_model": None, "cpuinfo_flags": []}
