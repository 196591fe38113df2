"""``platform_kernel``: one model captured on two platforms. A real host capture, re-written as another platform's
with injected kernel faults: a few-ulp LayerNorm (ARM-like rounding) and the AVX2 u8s8 int16 saturation of one
MatMulInteger, computed exactly as that kernel does (the real qemu captures are in tests/platforms/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

import ivq_debug as ivq
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.diagnose import DIAGNOSTICS
from ivq_debug.diagnose.platform import platform_label
from ivq_debug.dump import open_dump
from ivq_debug.dynamic_quant import quantize_dynamic_model
from ivq_debug.onnxgraph.load import load_model
from tests.support.dynamic_models import as_platform, avx2_u8s8_matmul, build_mlp, mlp_input, run_ivq

ARM = {"machine": "aarch64", "cpu_features": ["ASIMD", "ASIMDDP", "ASIMDHP", "NEON"]}
HASWELL = {"machine": "x86_64", "cpu_features": ["AVX", "AVX2", "F16C", "FMA3", "SSE", "SSE2", "SSE41", "SSE42"]}
MMI = "/blocks.0/fc1/MatMul_output_0_output_quantized"
LN = "/blocks.1/ln/out"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("platform")
    build_mlp(d / "m.onnx", outlier=0)  # block 0's fc1 has one large weight column: its u8s8 pairs saturate
    dq = quantize_dynamic_model(d / "m.onnx", d / "q.onnx").model_path
    capture(make_runner("onnx", dq, selection=Selection()), [mlp_input()], d / "host.h5", model={
        "path": str(dq), "sha256": "same-model"}, progress=None)
    return {"dir": d, "model": dq, "host": d / "host.h5"}


def kernels_of(findings: list) -> list:
    return [f for f in findings if f.kind == "platform_kernel"]


def ulps_off(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` with its largest element moved by ``n`` float32 ulps."""
    b = a.copy().reshape(-1)
    i = int(np.argmax(np.abs(b)))
    for _ in range(n):
        b[i] = np.nextafter(b[i], np.float32(np.inf))
    return b.reshape(a.shape)


def saturated(host: dict[str, Path]) -> np.ndarray:
    d = open_dump(host["host"])
    node = next(n for n in load_model(host["model"]).graph.node if n.output[0] == MMI)
    w = {i.name: numpy_helper.to_array(i) for i in load_model(host["model"]).graph.initializer}
    return avx2_u8s8_matmul(d.read(node.input[0]), w[node.input[1]], d.read(node.input[2]), w[node.input[3]])


def test_ulp_level_rounding_is_noise(host: dict[str, Path], tmp_path: Path) -> None:
    ln = open_dump(host["host"]).read(LN)
    arm = as_platform(host["host"], tmp_path / "arm.h5", ARM, {LN: ulps_off(ln, 3)})
    found = kernels_of(ivq.compare(host["host"], arm).findings)
    assert len(found) == 1
    f = found[0]
    assert f.severity == "info" and f.evidence["verdict"] == "ulp_noise"
    assert list(f.evidence["ops"]) == ["LayerNormalization"] and f.evidence["ops"]["LayerNormalization"]["max_ulps"] == 3
    assert "aarch64 (dotprod)" in f.message and f.where["tensor"] == LN
    assert f.evidence["differences"]["machine"] == [open_dump(host["host"]).backend_info["platform"]["machine"],
                                                    "aarch64"]


def test_integer_saturation_is_told_from_noise_with_its_fix(host: dict[str, Path], tmp_path: Path) -> None:
    sat = saturated(host)
    exact = open_dump(host["host"]).read(MMI)
    steps = int(np.abs(sat.astype(np.int64) - exact).max())
    assert steps > 1000  # (the injected fault is real arithmetic: 1809 steps here)
    ln = open_dump(host["host"]).read(LN)
    hw = as_platform(host["host"], tmp_path / "haswell.h5", HASWELL, {MMI: sat, LN: ulps_off(ln, 2)})
    found = {f.evidence["verdict"]: f for f in kernels_of(ivq.compare(host["host"], hw).findings)}
    assert set(found) == {"saturation", "ulp_noise"}
    s = found["saturation"]
    assert s.severity == "error" and list(s.evidence["ops"]) == ["MatMulInteger"]
    assert s.evidence["ops"]["MatMulInteger"]["max_steps"] == steps and s.evidence["ops"]["MatMulInteger"]["k"] == [32]
    assert f"{steps} integer steps at accumulation length K=32" in s.message
    assert "x86_64 (AVX2, no VNNI)" in s.suggestion
    for fix in ("--reduce-range", "session.x64quantprecision=1", "QUInt8"):
        assert fix in s.suggestion
    assert list(found["ulp_noise"].evidence["ops"]) == ["LayerNormalization"]
    # the finding ranks before the symptoms it explains
    assert ivq.compare(host["host"], hw).findings[0].kind == "platform_kernel"


def test_same_platform_or_another_model_raises_nothing(host: dict[str, Path], tmp_path: Path) -> None:
    ln = open_dump(host["host"]).read(LN)
    same = as_platform(host["host"], tmp_path / "same.h5", {}, {LN: ulps_off(ln, 3)})
    assert kernels_of(ivq.compare(host["host"], same).findings) == []
    # other settings on the same machine (threads, level, session options) are not another platform
    settings = as_platform(host["host"], tmp_path / "settings.h5", {"intra_op_threads": 2, "session_options": {
        "session.x64quantprecision": "1"}}, {LN: ulps_off(ln, 3)})
    assert kernels_of(ivq.compare(host["host"], settings).findings) == []
    other = tmp_path / "other.h5"
    capture(make_runner("onnx", host["model"], selection=Selection()), [mlp_input()], other,
            model={"sha256": "another-model"}, progress=None)
    arm_other = as_platform(other, tmp_path / "arm-other.h5", ARM, {LN: ulps_off(ln, 3)})
    assert kernels_of(ivq.compare(host["host"], arm_other).findings) == []


def test_bit_identical_platforms_say_so(host: dict[str, Path], tmp_path: Path) -> None:
    arm = as_platform(host["host"], tmp_path / "arm.h5", ARM)
    (f,) = kernels_of(ivq.compare(host["host"], arm).findings)
    assert f.severity == "info" and f.evidence["verdict"] == "identical" and "bit-identical" in f.message


def test_graphs_fused_differently_point_at_qdqisint8allowed(host: dict[str, Path], tmp_path: Path) -> None:
    ln = open_dump(host["host"]).read(LN)
    arm = as_platform(host["host"], tmp_path / "arm.h5", ARM, {LN: ulps_off(ln, 1)})
    with open_dump(arm) as d:
        kernels = d.meta("kernels")
    kernels["tensors"][LN] = {**kernels["tensors"][LN], "op": "com.microsoft.SimplifiedLayerNormalization"}
    regraphed = as_platform(arm, tmp_path / "arm2.h5", {}, kernels=kernels)
    found = {f.evidence["verdict"]: f for f in kernels_of(ivq.compare(host["host"], regraphed).findings)}
    assert found["fused_differently"].severity == "warning"
    assert "session.qdqisint8allowed=1" in found["fused_differently"].suggestion


def test_ivq_diff_prints_the_finding(host: dict[str, Path], tmp_path: Path, capfd) -> None:
    hw = as_platform(host["host"], tmp_path / "haswell.h5", HASWELL, {MMI: saturated(host)})
    code, out, err = run_ivq(["diff", host["host"], hw], capfd)
    assert code == 1, err  # saturation is an error finding: `--fail-on error` (the default) fails the run
    assert "platform_kernel" in out and "accumulation saturates" in " ".join(out.split())  # (results: stdout)
    assert "FAIL: 1 error finding(s): platform_kernel" in out


def test_registered_and_labels() -> None:
    assert "platform_kernel" in {d.kind for d in DIAGNOSTICS}
    assert platform_label({"machine": "x86_64", "cpu_features": ["AVX2", "AVX512VNNI"]}) == "x86_64 (AVX-512 VNNI)"
    assert platform_label({"machine": "x86_64", "cpu_features": ["AVX2", "AVXVNNI"]}) == "x86_64 (AVX-VNNI)"
    assert platform_label({"machine": "aarch64", "cpu_features": ["NEON"]}) == "aarch64 (NEON)"
