"""qnn-net-run adapter: input files and input_list.txt, the command line, tool discovery, device plans."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.capture.qnn_net_run.io import quantize_like_sdk, write_inputs
from ivq_debug.capture.qnn_net_run.outputs import ingest_output
from ivq_debug.capture.qnn_net_run.tool import (
    NetRunSpec,
    build_command,
    find_adb,
    find_sdk,
    plan_device_run,
    run_local,
)
from ivq_debug.errors import ToolNotFoundError, UsageError
from ivq_debug.qnn.netjson import read_net_json
from tests.support.qnn_fixtures import MULTI, SINGLE


def _samples(ref, group="feeds"):  # type: ignore[no-untyped-def]
    return [{"input.1": ref[(group, i, "input.1")], "text.embeds": ref[(group, i, "text.embeds")]} for i in (0, 1)]


def test_write_inputs_float_nhwc(tmp_path: Path, ref) -> None:  # type: ignore[no-untyped-def]
    g = read_net_json(SINGLE / "model_net.json")
    il = write_inputs(_samples(ref), tmp_path / "in", graph=g)
    lines = il.lines
    assert len(lines) == 2 and il.names == ["input_1", "text_embeds"]
    for i, line in enumerate(lines):
        toks = line.split(" ")
        assert [t.split(":=")[0] for t in toks] == ["input_1", "text_embeds"]
        p = Path(toks[0].split(":=")[1])
        assert p.is_absolute() and p.stat().st_size == 192 * 4
        nhwc = np.fromfile(p, "<f4").reshape(1, 8, 8, 3)
        assert np.array_equal(nhwc, ref[("feeds", i, "input.1")].transpose(0, 2, 3, 1))  # NCHW → NHWC
    with pytest.raises(UsageError, match="output exists"):
        write_inputs(_samples(ref), tmp_path / "in", graph=g)
    write_inputs(_samples(ref), tmp_path / "in", graph=g, overwrite=True)


def test_write_inputs_native_round_trips_the_integers(tmp_path: Path, ref, sites) -> None:  # type: ignore[no-untyped-def]
    """The text graph's input is quantized (uint16): writing the vision graph's float output natively gives
    back exactly the integers that graph produced (SDK floatToTfN ∘ tfNToFloat = identity)."""
    from ivq_debug.dump.quant import dequantize

    g = read_net_json(MULTI / "text_net.json")
    name = "/tok/Transpose_output_0_QuantizeLinear_Output"
    q = ref[("vision", 1, name)]
    x = dequantize(q, sites[name].encoding)
    il = write_inputs([{name: x, "text.embeds": ref[("feeds", 1, "text.embeds")]}], tmp_path, graph=g, native=True)
    p = il.files[0]["_tok_Transpose_output_0_QuantizeLinear_Output"]
    assert np.array_equal(np.fromfile(p, "<u2").reshape(q.shape), q)
    t = il.files[0]["text_embeds"]
    assert t.stat().st_size == 128 * 4  # a float input stays float32 in native mode
    assert np.array_equal(quantize_like_sdk(np.array([-1.0, 0.0, 0.5, 1e9]), 0.01, -100, 8), [0, 100, 150, 255])


def test_write_inputs_errors(tmp_path: Path, ref) -> None:  # type: ignore[no-untyped-def]
    g = read_net_json(SINGLE / "model_net.json")
    s = _samples(ref)
    with pytest.raises(UsageError, match="sample 0 has no value for graph input 'text_embeds'"):
        write_inputs([{"input.1": s[0]["input.1"]}], tmp_path / "a", graph=g)
    with pytest.raises(UsageError, match="not graph inputs: \\['extra'\\]"):
        write_inputs([{**s[0], "extra": s[0]["input.1"]}], tmp_path / "b", graph=g)
    with pytest.raises(UsageError, match="has shape \\[1, 8, 8, 3\\], the graph wants \\[1, 3, 8, 8\\]"):
        write_inputs([{**s[0], "input.1": s[0]["input.1"].transpose(0, 2, 3, 1)}], tmp_path / "c", graph=g)
    il = write_inputs(s, tmp_path / "d")  # no graph: names as given, float32, no layout change
    assert il.lines[0].startswith("input.1:=") and il.files[0]["input.1"].stat().st_size == 192 * 4


def test_build_command() -> None:
    spec = NetRunSpec(backend="htp", model="libQnnModel.so", input_list="/in/list.txt", output_dir="/out",
                      debug=True, profiling_level="detailed", native_output=True, config_file="cfg.json",
                      num_inferences=3, perf_profile="burst", set_output_tensors=["a", "b"])
    assert build_command(spec) == [
        "qnn-net-run", "--backend", "libQnnHtp.so", "--model", "libQnnModel.so", "--input_list", "/in/list.txt",
        "--output_dir", "/out", "--debug", "--profiling_level", "detailed", "--use_native_output_files",
        "--config_file", "cfg.json", "--num_inferences", "3", "--perf_profile", "burst",
        "--set_output_tensors", "a,b"]
    ctx = NetRunSpec(backend="/sdk/lib/libQnnHtp.so", retrieve_context="m.bin", input_list="l", output_dir="o",
                     output_data_type="float_and_native")
    assert build_command(ctx)[1:5] == ["--backend", "/sdk/lib/libQnnHtp.so", "--retrieve_context", "m.bin"]
    for bad, needle in [
        (dict(model="m.so", retrieve_context="c.bin"), "exactly one of model"),
        (dict(), "exactly one of model"),
        (dict(retrieve_context="c.bin", debug=True), "--debug cannot be used with --retrieve_context"),
        (dict(retrieve_context="c.bin", set_output_tensors=["x"]), "--set_output_tensors cannot"),
        (dict(model="m.so", profiling_level="verbose"), "profiling_level must be one of"),
        (dict(model="m.so", native_output=True, output_data_type="native_only"), "not both"),
    ]:
        with pytest.raises(UsageError, match=needle):
            build_command(NetRunSpec(backend="htp", input_list="l", output_dir="o", **bad))


def test_tools_not_found_exit_5(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for v in ("QNN_SDK_ROOT", "QAIRT_SDK_ROOT", "ADB"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolNotFoundError) as ei:
        find_sdk()
    assert ei.value.exit_code == 5 and "QNN_SDK_ROOT" in str(ei.value)
    with pytest.raises(ToolNotFoundError, match="adb not found"):
        find_adb()
    with pytest.raises(ToolNotFoundError, match="not found or not executable"):
        find_sdk(tmp_path / "qnn-net-run")


def _fake_sdk(root: Path) -> Path:
    """An SDK layout whose qnn-net-run copies the fixture outputs (to exercise discovery and run_local)."""
    b = root / "bin" / "x86_64-linux-clang"
    b.mkdir(parents=True)
    (root / "lib" / "x86_64-linux-clang").mkdir(parents=True)
    (root / "lib" / "x86_64-linux-clang" / "libQnnHtp.so").write_bytes(b"")
    exe = b / "qnn-net-run"
    exe.write_text(f"""#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in --output_dir) out="$2"; shift;; esac; shift; done
echo "LD=$LD_LIBRARY_PATH"
cp -r {SINGLE}/output/Result_0 "$out"/
""")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_find_sdk_and_run_local(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    exe = _fake_sdk(tmp_path / "sdk")
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "sdk"))
    sdk = find_sdk()
    assert sdk.net_run == exe and sdk.root == tmp_path / "sdk"
    assert sdk.backend_lib("htp") == str(tmp_path / "sdk" / "lib" / "x86_64-linux-clang" / "libQnnHtp.so")
    spec = NetRunSpec(backend="htp", model="libQnnModel.so", input_list="l.txt", output_dir=tmp_path / "out")
    res = run_local(spec, sdk)
    assert res.ok and res.argv[:3] == [str(exe), "--backend", sdk.backend_lib("htp")]
    assert f"LD={tmp_path / 'sdk' / 'lib' / 'x86_64-linux-clang'}" in res.stdout
    ing = ingest_output(res.output_dir, SINGLE / "model_net.json")
    assert ing.complete and ing.results == {"model": [0]}


def test_device_plan(tmp_path: Path, ref) -> None:  # type: ignore[no-untyped-def]
    sdk_root = tmp_path / "sdk"
    _fake_sdk(sdk_root)
    from ivq_debug.capture.qnn_net_run.tool import QnnSdk

    sdk = QnnSdk(sdk_root / "bin" / "x86_64-linux-clang" / "qnn-net-run", sdk_root)
    il = write_inputs(_samples(ref), tmp_path / "in", graph=read_net_json(SINGLE / "model_net.json"))
    spec = NetRunSpec(backend="htp", retrieve_context=tmp_path / "model.bin", input_list=il.path,
                      output_dir=tmp_path / "out", profiling_level="basic")
    plan = plan_device_run(spec, il, sdk, adb="adb", serial="ABC123", dsp_arch="v75")
    pushed = [s[4] for s in plan.steps if s[3] == "push"]
    assert pushed[0].endswith("bin/aarch64-android/qnn-net-run")
    assert any(p.endswith("hexagon-v75/unsigned/libQnnHtpV75Skel.so") for p in pushed)
    assert any(p.endswith("model.bin") for p in pushed)
    assert all(s[:3] == ["adb", "-s", "ABC123"] for s in plan.steps)
    d = "/data/local/tmp/ivq_debug"
    assert f"--retrieve_context {d}/model.bin" in plan.shell_command
    assert f"--input_list {d}/input_list.txt --output_dir {d}/output" in plan.shell_command
    assert plan.steps[-1][3:] == ["pull", f"{d}/output", str(tmp_path / "out")]
    dev_list = (tmp_path / "in" / ".input_list.txt.device").read_text().splitlines()
    assert dev_list[1] == f"input_1:={d}/inputs/1/input_1.raw text_embeds:={d}/inputs/1/text_embeds.raw"
    assert os.path.exists(il.path)
