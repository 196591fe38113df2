"""Real ARM64 ONNX Runtime kernels (qemu-user, cortex-a76) and an AVX2-only x86 (qemu-x86_64 -cpu Haswell) against
this host, on dynamic INT8 exports of the embedded reference (slow: about 10 minutes, docs/arm64.md).

The arm64 root comes from ``scripts/arm64-root.sh build`` (cached between runs where the machine keeps it); the
core package is built from this checkout into a wheel and installed into the root's venv with ``pip``; every
capture runs the root's ``ivq`` console script. ``IVQ_REQUIRE_ARM64=1`` (``.ci/run``) turns the skip for a missing
qemu / debootstrap into a failure. Tables and wall times go to ``test-artifacts/arm64/``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import numpy_helper

import ivq_debug as ivq
from ivq_debug.capture.onnxrt.optimized import op_name
from ivq_debug.diagnose.platform import INTEGER_ACCUMULATING
from ivq_debug.dump import open_dump
from ivq_debug.dynamic_quant import quantize_dynamic_model
from ivq_debug.onnxgraph.load import load_model
from tests.support.dynamic_models import avx2_u8s8_matmul, run_ivq

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ROOT_SH = REPO / "scripts" / "arm64-root.sh"
PARTS = ("vision", "prefill")
TIMES: dict[str, float] = {}
CHECK = """
import importlib.metadata as md, platform
from packaging.requirements import Requirement
bad = [r for r in map(Requirement, md.requires("ivq-debug") or []) if r.marker is None
       and md.version(r.name) not in r.specifier]
print("ok" if not bad else bad, platform.machine())
"""


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        msg = f"{tool} not installed (apt-get install qemu-user-static debootstrap)"
        if os.environ.get("IVQ_REQUIRE_ARM64"):
            pytest.fail(msg)
        pytest.skip(msg)


def _timed(key: str, cmd: list[Any], ok: tuple[int, ...] = (0,), **kw: Any) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    TIMES[key] = round(time.perf_counter() - t0, 1)
    assert r.returncode in ok, f"{key} failed ({r.returncode}): {r.stderr[-3000:]}"
    return r


def core_wheel(out: Path) -> Path:
    """The package built from this checkout (sources copied out first: no build/ or egg-info in the checkout)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "ivq_debug", src / "ivq_debug", ignore=shutil.ignore_patterns("__pycache__"))
    _timed("wheel", [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "-q", "--no-deps", "-w",
                     out / "dist", src])
    (wheel,) = (out / "dist").glob("ivq_debug-*.whl")
    return wheel


@pytest.fixture(scope="module")
def arm_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The arm64 root with this checkout's core package installed into its venv."""
    _need("qemu-aarch64-static")
    root = Path(subprocess.run([str(ROOT_SH), "path"], capture_output=True, text=True, check=True).stdout.strip())
    if not (root / ".ivq-venv.stamp").exists():
        _need("debootstrap")
    _timed("root build (cached when up to date)", [ROOT_SH, "build"])
    wheel = core_wheel(tmp_path_factory.mktemp("wheel"))
    _timed("pip install (emulated)", [ROOT_SH, "run", "pip", "install", "--disable-pip-version-check", "-q",
                                      "--no-deps", "--force-reinstall", wheel])
    # the core requirements are all the root has, and they suffice (what `pip check` says, in a tenth of its time)
    # -I: the installed metadata only (a stray ivq_debug.egg-info in the working directory would shadow it)
    r = _timed("requirements check (emulated)", [ROOT_SH, "run", "python", "-I", "-c", CHECK])
    assert r.stdout.split() == ["ok", "aarch64"], r.stdout
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reference's vision and prefill parts (fp32 export), dynamic INT8 (s8 weights; and reduce_range)."""
    from ivq_debug.vlm import pipeline
    from ivq_debug.vlm.export import example_inputs

    out = tmp_path_factory.mktemp("ref")
    t0 = time.perf_counter()
    prep = pipeline.prepare("internvl-tiny", out / "work")
    feeds = example_inputs(prep.loaded.model, prep.bucket, prep.samples[0])
    m: dict[str, Path] = {}
    for part in PARTS:
        m[part] = prep.paths[part]
        m[f"{part}.x"] = out / f"{part}.npz"
        np.savez(m[f"{part}.x"], **feeds[part])
        m[f"{part}.dq8"] = quantize_dynamic_model(m[part], out / f"{part}.dq8.onnx").model_path
    m["vision.dq8rr"] = quantize_dynamic_model(m["vision"], out / "vision.dq8rr.onnx", reduce_range=True).model_path
    TIMES["export + quantize (host)"] = round(time.perf_counter() - t0, 1)
    return m


def host_capture(model: Path, x: Path, out: Path, level: str, capfd: Any) -> Path:
    code, _, err = run_ivq(["capture", "onnx", model, "--inputs", x, "-o", out, "--optimization", level,
                            "--threads", "1"], capfd)
    assert code == 0, err
    return out


def table(cmp: Any, findings: list[Any]) -> list[dict[str, Any]]:
    """Per op (as run): tensors, bit-identical, kernel differs, max abs diff, verdict."""
    kt = (cmp.test.meta("kernels") or {}).get("tensors", {})
    rows: dict[str, dict[str, Any]] = {}
    for r in cmp.table.itertuples(index=False):
        op = kt.get(r.test_name, {}).get("op", r.test_op_type)
        row = rows.setdefault(op, {"op": op, "tensors": 0, "bit_identical": 0, "kernel_differs": 0, "max_abs": 0.0,
                                   "verdict": "identical"})
        row["tensors"] += 1
        row["bit_identical"] += int(r.max_abs == 0)
        row["max_abs"] = max(row["max_abs"], float(r.max_abs))
    for f in findings:
        for op, o in f.evidence.get("ops", {}).items():
            rows[op]["kernel_differs"] += o["tensors"]
            rows[op]["verdict"] = f.evidence["verdict"]
    for row in rows.values():
        if row["verdict"] == "identical" and row["bit_identical"] < row["tensors"]:
            row["verdict"] = "inherited"
    return sorted(rows.values(), key=lambda r: (-r["max_abs"], r["op"]))


def write_artifacts(name: str, rows: list[dict[str, Any]], findings: list[Any], artifacts: Path) -> None:
    d = artifacts / "arm64"
    d.mkdir(exist_ok=True)
    lines = ["| op (as run) | tensors | bit-identical | kernel differs | max abs diff | verdict |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['op']} | {r['tensors']} | {r['bit_identical']} | {r['kernel_differs']} | {r['max_abs']:.3g} | "
              f"{r['verdict']} |" for r in rows]
    lines += ["", *[f"- {f.severity} {f.kind}: {f.message}" for f in findings]]
    (d / f"{name}.md").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module", autouse=True)
def wall_times(artifacts_dir: Path) -> Any:
    """Every timed step of this module, in test-artifacts/arm64/times.json (docs/arm64.md quotes them)."""
    yield
    (artifacts_dir / "arm64").mkdir(exist_ok=True)
    (artifacts_dir / "arm64" / "times.json").write_text(json.dumps(TIMES, indent=1) + "\n")


def platform_findings(cmp: Any) -> list[Any]:
    return [f for f in cmp.findings if f.kind == "platform_kernel"]


@pytest.mark.parametrize("level", ["disable", "all"])
def test_x86_vs_arm64_integer_exact_float_ulps(arm_root: Path, models: dict[str, Path], tmp_path: Path, capfd,
                                               level: str, artifacts_dir: Path) -> None:
    for part in PARTS:
        model, x = models[f"{part}.dq8"], models[f"{part}.x"]
        x86 = host_capture(model, x, tmp_path / f"x86-{part}.h5", level, capfd)
        arm = tmp_path / f"arm-{part}.h5"
        _timed(f"arm64 capture {part} {level}", [ROOT_SH, "run", "ivq", "capture", "onnx", model, "--inputs", x, "-o",
                                                 arm, "--optimization", level, "--threads", "1"])
        a = open_dump(arm)
        p = a.backend_info["platform"]
        assert p["machine"] == "aarch64" and "ASIMDDP" in p["cpu_features"] and "SVE" not in p["cpu_features"]
        if level == "all":
            assert a.backend_info["exposure_check"]["bit_identical"]  # observer-free on ARM too
        cmp = ivq.compare(x86, arm)
        found = platform_findings(cmp)
        write_artifacts(f"x86-vs-arm64-{part}-{level}", table(cmp, found), found, artifacts_dir)
        verdicts = {f.evidence["verdict"]: f for f in found}
        # integer arithmetic is bit-identical (VNNI x86 vs ARM dotprod): no saturation, no graph difference
        assert set(verdicts) <= {"ulp_noise", "identical"}, [f.message for f in found]
        noise = verdicts.get("ulp_noise")
        if noise is not None:
            assert "aarch64 (dotprod)" in noise.message and noise.severity == "info"
            for op, o in noise.evidence["ops"].items():
                assert o["max_ulps"] is not None and o["max_ulps"] <= 64, (op, o)
                assert level == "all" or op not in INTEGER_ACCUMULATING  # (fused ops round their float scaling)
        kt = cmp.test.meta("kernels")["tensors"]
        ints = [r for r in cmp.table.itertuples() if kt.get(r.test_name, {}).get("op") in ("MatMulInteger", "ConvInteger")]
        assert level == "all" or (ints and all(r.max_abs == 0 for r in ints))


def test_haswell_saturates_and_reduce_range_fixes_it(models: dict[str, Path], tmp_path: Path, capfd,
                                                     artifacts_dir: Path) -> None:
    _need("qemu-x86_64-static")
    haswell = ["qemu-x86_64-static", "-cpu", "Haswell", sys.executable, "-m", "ivq_debug"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = {}
    for tag in ("dq8", "dq8rr"):
        model, x = models[f"vision.{tag}"], models["vision.x"]
        x86 = host_capture(model, x, tmp_path / f"x86-{tag}.h5", "disable", capfd)
        hw = tmp_path / f"haswell-{tag}.h5"
        _timed(f"haswell capture vision {tag}", [*haswell, "capture", "onnx", model, "--inputs", x, "-o", hw,
                                                 "--threads", "1"], env=env)
        cmp = ivq.compare(x86, hw)
        assert open_dump(hw).backend_info["platform"]["cpu_features"].count("AVX512F") == 0
        out[tag] = cmp
        found = platform_findings(cmp)
        write_artifacts(f"x86-vs-haswell-vision-{tag}", table(cmp, found), found, artifacts_dir)
    (sat,) = [f for f in platform_findings(out["dq8"]) if f.evidence["verdict"] == "saturation"]
    assert sat.severity == "error" and "x86_64 (AVX2, no VNNI)" in sat.message
    assert "MatMulInteger" in sat.evidence["ops"] and "--reduce-range" in sat.suggestion
    # the Haswell integers are exactly the AVX2 kernel's pairwise int16-saturated products (the fast tests' model)
    tensor = sat.evidence["ops"]["MatMulInteger"]["first"]
    model = load_model(models["vision.dq8"])
    node = next(n for n in model.graph.node if n.output[0] == tensor)
    w = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    hw = open_dump(tmp_path / "haswell-dq8.h5")
    got = hw.read(tensor)
    assert np.array_equal(got, avx2_u8s8_matmul(hw.read(node.input[0]), w[node.input[1]], hw.read(node.input[2]),
                                                w[node.input[3]]))
    assert not np.array_equal(got, open_dump(tmp_path / "x86-dq8.h5").read(tensor))
    # replayed on Haswell with the VNNI capture as reference, each unit measures its own kernel: the units whose
    # pairs saturate introduce error on their own (measured 33-61 dB in 7 of 14), a float op at most rounding (the
    # AVX2 Softmax: 144 dB)
    _timed("haswell replay vision dq8", [*haswell, "diagnose", tmp_path / "x86-dq8.h5", tmp_path / "haswell-dq8.h5",
                                         "--model", models["vision.dq8"], "--json", tmp_path / "replay.json"], env=env,
           ok=(0, 1))
    units = json.loads((tmp_path / "replay.json").read_text())["units"]
    intro = {u["tensor"]: float(u["intro_sqnr_db"]) for u in units}
    kinds = {u["tensor"]: u["op_type"] for u in units}
    assert all(v >= 100 for t, v in intro.items() if kinds[t] != "MatMulInteger"), intro
    saturating = [t for t, v in intro.items() if kinds[t] == "MatMulInteger" and math.isfinite(v)]
    assert saturating, intro
    # reduce_range: every integer tensor and every model output bit-identical with the VNNI host
    rr = out["dq8rr"]
    assert not [f for f in platform_findings(rr) if f.evidence["verdict"] == "saturation"]
    kt = rr.test.meta("kernels")["tensors"]
    assert all(r.max_abs == 0 for r in rr.table.itertuples() if kt.get(r.test_name, {}).get("op") == "MatMulInteger")
    assert all(rr.table.set_index("ref_name").loc[o.name, "max_abs"] == 0 for o in model.graph.output)


def test_reference_dynamic_int8_diff_and_replay(models: dict[str, Path], tmp_path: Path, capfd) -> None:
    """Float vs dynamic INT8 on this host: the diff names the worst layers, the replay their introduced error."""
    for part in PARTS:
        f = host_capture(models[part], models[f"{part}.x"], tmp_path / f"{part}-float.h5", "disable", capfd)
        q = host_capture(models[f"{part}.dq8"], models[f"{part}.x"], tmp_path / f"{part}-dq8.h5", "disable", capfd)
        code, out, err = run_ivq(["diff", f, q, "--top", "5"], capfd)
        assert code == 0, err
        cmp = ivq.compare(f, q)
        assert cmp.alignment.unmatched_ref == []
        worst = cmp.worst(5)
        assert all(name in " ".join(out.split()) for name in worst["ref_name"].head(2))  # (the table: stdout)
        code, _, err = run_ivq(["diagnose", f, q, "--model", models[f"{part}.dq8"], "--json", tmp_path / "r.json",
                                "--force"], capfd)
        assert code in (0, 1), err
        units = json.loads((tmp_path / "r.json").read_text())["units"]  # (ivq-replay/1 writes inf as "inf")
        for u in units:
            for k in ("intro_sqnr_db", "cum_sqnr_db", "inherited_share"):
                u[k] = float(u[k]) if u[k] is not None else math.nan
        dyn = [u for u in units if u["op_type"] == "MatMulInteger"]
        assert len(dyn) == sum(op_name(n) == "MatMulInteger" for n in load_model(models[f"{part}.dq8"]).graph.node)
        assert all(np.isfinite(u["intro_sqnr_db"]) and 0 <= u["inherited_share"] <= 1 for u in dyn)
        # each of the worst tensors is a replayed unit: a dynamic unit introduces part of its error (finite, and no
        # more than its cumulative error), a float op fed the reference introduces none (all of it is inherited)
        rows = {u["tensor"]: u for u in units}
        for name in worst["ref_name"]:
            u = rows[name]
            if u["op_type"] == "MatMulInteger":
                assert np.isfinite(u["intro_sqnr_db"]) and u["intro_sqnr_db"] >= u["cum_sqnr_db"] - 1e-6, u
            else:
                assert u["intro_sqnr_db"] == math.inf and u["inherited_share"] == 1.0, u
        if part == "prefill":  # measured: layer 1's down_proj, 31.2 dB cumulative, 33.3 dB of it its own
            top = rows[worst["ref_name"].iloc[0]]
            assert top["op_type"] == "MatMulInteger" and top["inherited_share"] < 0.5, top
