"""QNN HTP compile time against the number of exposed tensors, and EPContext cache miss vs hit.

Builds OCR-like recognizers and a ViT in torch (no downloads), exports them with the legacy exporter, quantizes
them with ``ivq_debug.qnn.quantize.quantize_for_qnn`` (a8w8 / a16w8), then, each measurement in its own process
under a hard timeout:

- **session**: one ``create_qnn_session`` of the QDQ model with N activation ``QuantizeLinear`` outputs exposed
  (N evenly spread in topological order, as ``QnnHtpRunner`` exposes them); wall and CPU seconds, and the QNN
  finalize time split into its stages (``profiling_level=detailed``: graph optimizations, sequencing, VTCM, ...);
- **cache**: the same model with every tensor exposed, compiled fresh, compiled with ``ep.context_enable=1``
  (cache miss: compile + dump the EPContext model), and loaded from that EPContext model (cache hit); the
  outputs of the three sessions are compared bit for bit;
- **capture** (``--capture``): ``ivq capture qnn`` with every tensor vs ``--include`` of the model outputs only.

Models (``--models``): ``crnn`` (VGG-like conv backbone + 2-layer BiLSTM, 1x3x48x320, 80 steps), ``svtr``
(PP-OCRv3/v4-like depthwise/hardswish/SE backbone + 2 attention blocks, 1x3x48x320), ``vit12`` (transformers
``ViTModel``, 12 layers, hidden 192, 224²), or any float ONNX file with static input shapes (calibrated on
uniform random inputs).

    python bench/bench_qnn_compile.py [--models crnn,svtr,vit12] [--presets a8w8,a16w8]
        [--exposed 0,10,25,50,100,all] [--option KEY=VALUE ...] [--capture] [--timeout 600] [--json OUT]

Timings from the emulator depend on the machine load: the script prints ``uptime`` with the table, and CPU
seconds (user + system of the measuring process) are less sensitive to other work than wall seconds.
See docs/qnn-compile.md for the measured figures and what they mean.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUILTIN = ("crnn", "svtr", "vit12")
PRESETS = ("a8w8", "a16w8")
#: finalize stages of the QNN profile (``profiling_level=detailed``), short column names
STAGES = {"QNN (finalize) time": "finalize", "Graph Optimizations": "graph_opt",
          "Graph Sequencing for Target": "sequencing", "VTCM Allocation": "vtcm"}


# ------------------------------------------------------------------------------------------------ models
def _torch_model(name: str) -> tuple[Any, tuple[int, ...]]:
    """A random-init torch model and its input shape (eval mode, BatchNorm with non-trivial statistics)."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    def cbr(ci: int, co: int, k: Any = 3, s: Any = 1, p: Any = 1, g: int = 1, act: Any = nn.ReLU) -> nn.Module:
        return nn.Sequential(nn.Conv2d(ci, co, k, s, p, groups=g, bias=False), nn.BatchNorm2d(co), act())

    class Block(nn.Module):  # pre-LN attention block (torch MultiheadAttention) + GELU MLP
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.n1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.fc2(nn.functional.gelu(self.fc1(self.n2(x))))

    class CRNN(nn.Module):  # classic CRNN / PP-OCRv2-like: conv backbone -> BiLSTM x2 -> CTC head
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(
                cbr(3, 32), nn.MaxPool2d(2, 2), cbr(32, 64), nn.MaxPool2d(2, 2), cbr(64, 128), cbr(128, 128),
                nn.MaxPool2d((2, 1), (2, 1)), cbr(128, 256), cbr(256, 256), nn.MaxPool2d((2, 1), (2, 1)),
                cbr(256, 256, k=(3, 1), p=0))
            self.rnn = nn.LSTM(256, 128, num_layers=2, bidirectional=True, batch_first=True)
            self.register_buffer("h0", torch.zeros(4, 1, 128))  # a static state: no Shape/Expand in the graph
            self.head = nn.Linear(256, 97)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, _ = self.rnn(self.backbone(x).squeeze(2).permute(0, 2, 1), (self.h0, self.h0))
            return self.head(y).softmax(-1)

    class SE(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))

    class SVTR(nn.Module):  # PP-OCRv3/v4-like: LCNet backbone -> SVTR neck (attention over tokens) -> CTC head
        def __init__(self) -> None:
            super().__init__()
            plan = [(16, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, (2, 1)), (128, 128, 1), (128, 256, (2, 1)),
                    (256, 256, 1), (256, 256, 1), (256, 256, 1), (256, 512, (2, 1)), (512, 512, 1)]
            layers: list[nn.Module] = [cbr(3, 16, 3, 2, 1, act=nn.Hardswish)]
            for i, (a, b, s) in enumerate(plan):
                layers += [cbr(a, a, 3, s, 1, g=a, act=nn.Hardswish), SE(a) if i >= 9 else nn.Identity(),
                           cbr(a, b, 1, 1, 0, act=nn.Hardswish)]
            self.backbone = nn.Sequential(*layers, nn.AvgPool2d(2, 2))
            self.c1, self.c2 = cbr(512, 64, act=nn.SiLU), cbr(64, 120, 1, 1, 0, act=nn.SiLU)
            self.mix = nn.Sequential(Block(120, 8), Block(120, 8))
            self.norm = nn.LayerNorm(120)
            self.c3, self.c4 = cbr(120, 512, 1, 1, 0, act=nn.SiLU), cbr(1024, 64, act=nn.SiLU)
            self.c5, self.head = cbr(64, 120, 1, 1, 0, act=nn.SiLU), nn.Linear(120, 97)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = self.backbone(x)
            z = self.c2(self.c1(f))
            b, c, h, w = z.shape
            z = self.norm(self.mix(z.flatten(2).transpose(1, 2))).transpose(1, 2).reshape(b, c, h, w)
            z = self.c5(self.c4(torch.cat([f, self.c3(z)], 1)))
            return self.head(z.squeeze(2).transpose(1, 2)).softmax(-1)

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            from transformers import ViTConfig, ViTModel

            cfg = ViTConfig(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768,
                            image_size=224, patch_size=16)
            self.m = ViTModel(cfg, add_pooling_layer=False)

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.m(pixel_values=pixel_values).last_hidden_state

    m, shape = {"crnn": (CRNN, (1, 3, 48, 320)), "svtr": (SVTR, (1, 3, 48, 320)),
                "vit12": (ViT, (1, 3, 224, 224))}[name]
    model = m().eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.1, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    return model, shape


def step_build(a: dict[str, Any]) -> dict[str, Any]:
    """Float ONNX (built-in torch model or a given file), random calibration / sample, QDQ per preset."""
    import numpy as np
    import onnx

    from ivq_debug.qnn.quantize import quantize_for_qnn

    work, name = Path(a["workdir"]), a["name"]
    float_path = work / f"{name}.onnx"
    t0 = time.perf_counter()
    if a.get("onnx"):
        shutil.copyfile(a["onnx"], float_path)
    else:
        import torch

        model, shape = _torch_model(name)
        torch.onnx.export(model, (torch.rand(*shape),), str(float_path), input_names=["x"], output_names=["y"],
                          opset_version=17, dynamo=False)
    proto = onnx.load(str(float_path), load_external_data=False)
    init = {i.name for i in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in init]
    rng = np.random.default_rng(0)
    calib: dict[str, np.ndarray] = {}
    sample: dict[str, np.ndarray] = {}
    for i in inputs:
        dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if not dims or any(d <= 0 for d in dims):
            raise SystemExit(f"{float_path}: input {i.name!r} has a dynamic shape {dims}; QNN HTP needs static shapes")
        calib[i.name] = rng.random((8, *dims[1:]), dtype=np.float32)
        sample[i.name] = rng.random(tuple(dims), dtype=np.float32)
    np.savez(work / f"{name}.sample.npz", **sample)
    built = {"float_s": round(time.perf_counter() - t0, 2), "qdq": {}}
    for preset in a["presets"]:
        out = work / f"{name}.{preset}.onnx"
        r = quantize_for_qnn(float_path, out, calib, preset=preset, overwrite=True)
        built["qdq"][preset] = {"path": str(out), "seconds": round(r.seconds, 2), "q_nodes": r.quantize_nodes}
    return built


# ---------------------------------------------------------------------------------------------- sessions
def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _stages(csv: Path) -> dict[str, float]:
    """Seconds of the finalize stages in a QNN profile CSV (summed over graphs)."""
    from ivq_debug.qnn.profiling import read_qnn_ep_csv

    out: dict[str, float] = {}
    if not csv.exists():
        return out
    t = read_qnn_ep_csv(csv)
    t = t[(t["phase"] == "finalize") & (t["unit"] == "us")]
    for ident, key in STAGES.items():
        sel = t[t["identifier"] == ident]
        if len(sel):
            out[key] = round(float(sel["value"].sum()) / 1e6, 3)
    return out


def _runner_and_sites(qdq: str, n: str) -> tuple[Any, list[Any]]:
    """The capture runner of ``qdq`` and N of its sites, evenly spread in topological order."""
    from ivq_debug.capture.base import Selection
    from ivq_debug.capture.qnn_ep.runner import QnnHtpRunner

    runner = QnnHtpRunner(qdq, selection=Selection())
    sites = runner.sites
    k = len(sites) if n == "all" else min(int(n), len(sites))
    if k == 0:
        return runner, []
    idx = sorted({round(i * (len(sites) - 1) / max(1, k - 1)) for i in range(k)})
    return runner, [sites[i] for i in idx]


def step_session(a: dict[str, Any]) -> dict[str, Any]:
    """One QNN HTP session with N exposed tensors: wall / CPU seconds and the finalize stages."""
    from ivq_debug.capture.qnn_ep.session import QnnSessionConfig, create_qnn_session

    runner, chosen = _runner_and_sites(a["qdq"], a["n"])
    with tempfile.TemporaryDirectory(prefix="ivq-bench-qnn-") as td:
        csv = Path(td) / "profile.csv"
        cfg = QnnSessionConfig(profiling_level="detailed", profiling_file_path=csv,
                               provider_options=dict(a["options"]))
        model = runner.model_with_outputs([s.output for s in chosen])
        c0, t0 = _cpu(), time.perf_counter()
        qs = create_qnn_session(model, cfg, session_options_factory=runner.session_options, model_proto=runner.model)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        stages = _stages(csv)
    summary = (qs.op_trace or {}).get("summary") or {}
    return {"exposed": len(chosen), "sites": len(runner.sites), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "qnn_ops": summary.get("total_qnn_ops"), "onnx_nodes": summary.get("total_onnx_nodes"), **stages}


def step_cache(a: dict[str, Any]) -> dict[str, Any]:
    """Fresh compile vs compile + EPContext dump (miss) vs EPContext load (hit); outputs compared bit for bit."""
    import numpy as np
    import onnx

    from ivq_debug.capture.qnn_ep.session import QnnSessionConfig, create_qnn_session

    runner, chosen = _runner_and_sites(a["qdq"], "all")
    model = runner.model_with_outputs([s.output for s in chosen])
    names = runner.output_names + [s.output for s in chosen]
    feeds = dict(np.load(a["sample"]))
    opts = dict(a["options"])
    res: dict[str, Any] = {"exposed": len(chosen)}
    outs: dict[str, list[Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ivq-bench-ctx-") as td:
        ctx = Path(td) / "model_ctx.onnx"
        entries = {"ep.context_enable": "1", "ep.context_file_path": str(ctx), "ep.context_embed_mode": "0"}
        plans = (("compile", model, QnnSessionConfig(provider_options=opts), runner.model),
                 ("miss", model, QnnSessionConfig(provider_options=opts, session_config=entries), runner.model),
                 ("hit", str(ctx), QnnSessionConfig(provider_options=opts), None))
        for label, src, cfg, proto in plans:
            if label == "hit":
                proto = onnx.load(str(ctx), load_external_data=False)
                res["ctx_bytes"] = sum(p.stat().st_size for p in Path(td).iterdir())
            t0 = time.perf_counter()
            qs = create_qnn_session(src, cfg, session_options_factory=runner.session_options, model_proto=proto)
            res[f"{label}_s"] = round(time.perf_counter() - t0, 2)
            outs[label] = qs.session.run(names, feeds)
            if label == "hit":
                res["hit_has_op_trace"] = bool(qs.op_trace)
            del qs
    same = [all(x.tobytes() == y.tobytes() for x, y in zip(outs["compile"], outs[k], strict=True)) for k in ("miss", "hit")]
    res["miss_bit_identical"], res["hit_bit_identical"] = same
    return res


def step_capture(a: dict[str, Any]) -> dict[str, Any]:
    """``ivq capture qnn`` wall time: every tensor vs the model outputs only (``--include``)."""
    import onnx

    outputs = [o.name for o in onnx.load(a["qdq"], load_external_data=False).graph.output]
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ivq-bench-cap-") as td:
        for label, extra in (("all", []), ("outputs_only", [x for o in outputs for x in ("--include", o)])):
            cmd = [_bin("ivq"), "capture", "qnn", a["qdq"], "--inputs", a["sample"], "-o", str(Path(td) / f"{label}.h5"),
                   *extra]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a["timeout"])
            res[f"{label}_s"] = round(time.perf_counter() - t0, 1)
            if p.returncode != 0:
                res[f"{label}_error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
    if "all_s" in res and res.get("outputs_only_s"):
        res["ratio"] = round(res["all_s"] / res["outputs_only_s"], 2)
    return res


#: ops ORT's layout transformer runs channels-last for the QNN EP (their rank-4 outputs live in NHWC on HTP)
LAYOUT_SENSITIVE = {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool",
                    "BatchNormalization", "InstanceNormalization", "Resize", "DepthToSpace", "SpaceToDepth", "LRN",
                    "GridSample"}
#: ops the transpose optimizer moves a channels-last layout through (element-wise, Q/DQ, concat, reductions)
LAYOUT_FOLLOWING = {"QuantizeLinear", "DequantizeLinear", "Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
                    "LeakyRelu", "PRelu", "Elu", "Add", "Mul", "Sub", "Div", "Pow", "Sqrt", "Concat", "Identity", "Erf",
                    "Gelu", "Neg", "Abs", "Max", "Min", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"}


def channels_last_sites(runner: Any, sites: list[Any], feeds: dict[str, Any]) -> set[str]:
    """Exposed outputs that HTP holds channels-last: rank 4 (one CPU-EP run) and produced by a layout-sensitive op,
    or by layout-following ops whose activation inputs are all channels-last (a data-flow heuristic)."""
    import onnxruntime as ort

    from ivq_debug.onnxgraph.fold import constant_nodes

    cpu = ort.InferenceSession(runner.model_with_outputs([s.output for s in sites]), providers=["CPUExecutionProvider"])
    rank4 = {s.output for s, v in zip(sites, cpu.run([s.output for s in sites], feeds), strict=True) if v.ndim == 4}
    inits = {i.name for i in runner.model.graph.initializer}
    _, const = constant_nodes(list(runner.model.graph.node), inits)
    nhwc: set[str] = set()
    for n in runner.model.graph.node:
        acts = [i for i in n.input if i and i not in inits and i not in const]
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            acts = acts[:1]
        if n.op_type in LAYOUT_SENSITIVE or (n.op_type in LAYOUT_FOLLOWING and acts and all(i in nhwc for i in acts)):
            nhwc.update(o for o in n.output if o)
    return {s.output for s in sites if s.output in rank4 and s.output in nhwc}


def step_layout(a: dict[str, Any]) -> dict[str, Any]:
    """Prototype: expose channels-last tensors through an explicit NCHW->NHWC Transpose, which cancels the
    NHWC->NCHW transpose QNN otherwise adds per exposed output; compile time and bits against plain exposure."""
    import numpy as np
    import onnx
    from onnx import helper

    from ivq_debug.capture.qnn_ep.session import QnnSessionConfig, create_qnn_session

    runner, sites = _runner_and_sites(a["qdq"], "all")
    feeds = dict(np.load(a["sample"]))
    cl = channels_last_sites(runner, sites, feeds)
    m = onnx.ModelProto()
    m.CopyFrom(runner.model)
    names = []
    for s in sites:
        name = s.output
        if s.output in cl:
            name = f"{s.output}__nhwc"
            m.graph.node.append(helper.make_node("Transpose", [s.output], [name], perm=[0, 2, 3, 1], name=name))
        m.graph.output.append(onnx.ValueInfoProto(name=name))
        names.append(name)
    res: dict[str, Any] = {"exposed": len(sites), "channels_last": len(cl)}
    outs: dict[str, list[Any]] = {}
    for label, model, fetch in (("plain", str(runner.model_path), runner.output_names),
                                ("nchw", runner.model_with_outputs([s.output for s in sites]),
                                 runner.output_names + [s.output for s in sites]),
                                ("nhwc", m.SerializeToString(), runner.output_names + names)):
        c0, t0 = _cpu(), time.perf_counter()
        qs = create_qnn_session(model, QnnSessionConfig(provider_options=dict(a["options"])),
                                session_options_factory=runner.session_options, model_proto=runner.model)
        res[f"{label}_s"], res[f"{label}_cpu_s"] = round(time.perf_counter() - t0, 2), round(_cpu() - c0, 2)
        res[f"{label}_qnn_ops"] = ((qs.op_trace or {}).get("summary") or {}).get("total_qnn_ops")
        outs[label] = qs.session.run(fetch, feeds)
        del qs
    k = len(runner.output_names)
    back = [np.ascontiguousarray(v.transpose(0, 3, 1, 2)) if n.endswith("__nhwc") else v
            for n, v in zip(names, outs["nhwc"][k:], strict=True)]
    res["tensors_identical"] = sum(x.tobytes() == y.tobytes() for x, y in zip(outs["nchw"][k:], back, strict=True))
    for label in ("nchw", "nhwc"):
        res[f"{label}_outputs_equal_plain"] = all(x.tobytes() == y.tobytes()
                                                  for x, y in zip(outs["plain"], outs[label][:k], strict=True))
    return res


STEPS = {"build": step_build, "session": step_session, "cache": step_cache, "capture": step_capture,
         "layout": step_layout}


# ------------------------------------------------------------------------------------------------ driver
def _bin(name: str) -> str:
    p = Path(sys.executable).with_name(name)
    return str(p) if p.exists() else (shutil.which(name) or name)


def run_step(step: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one step in its own process under ``timeout`` seconds; its JSON result or ``{"error": ...}``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step, "--step-args", json.dumps(args)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"error": f"exit {p.returncode}: {tail[-1][:240] if tail else ''}"}
    return json.loads(lines[-1])


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _fmt(v: Any) -> str:
    return "–" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--models", default="crnn,svtr,vit12",
                    help=f"comma-separated: {', '.join(BUILTIN)}, or paths of float ONNX models with static inputs")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--exposed", default="0,10,25,50,100,all", help="numbers of exposed tensors to time")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="extra QNN provider option for every session (e.g. htp_graph_finalization_optimization_mode=1)")
    ap.add_argument("--no-cache", action="store_true", help="skip the EPContext miss/hit rows")
    ap.add_argument("--capture", action="store_true", help="also time `ivq capture qnn` (all vs outputs only)")
    ap.add_argument("--layout", action="store_true",
                    help="also time the channels-last exposure prototype against plain exposure (bits compared)")
    ap.add_argument("--timeout", type=float, default=600, help="hard limit per measured process (s)")
    ap.add_argument("--workdir", default=None, help="models (default: a temp folder, removed at the end)")
    ap.add_argument("--json", default=None, help="write every figure as JSON")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--step-args", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.step:
        print(json.dumps(STEPS[a.step](json.loads(a.step_args))))
        return 0
    options = dict(kv.split("=", 1) for kv in a.option)
    presets = [p for p in a.presets.split(",") if p]
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ivq-bench-qnn-compile-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# bench_qnn_compile ({_load()}; {os.cpu_count()} cores; options {options or 'default'})", flush=True)
    rows: list[dict[str, Any]] = []
    caches: list[dict[str, Any]] = []
    captures: list[dict[str, Any]] = []
    layouts: list[dict[str, Any]] = []
    try:
        for spec in [m for m in a.models.split(",") if m]:
            name = spec if spec in BUILTIN else Path(spec).stem
            built = run_step("build", {"workdir": str(work), "name": name, "presets": presets,
                                       "onnx": None if spec in BUILTIN else str(Path(spec).resolve())}, a.timeout)
            if "error" in built:
                print(f"{name}: build failed: {built['error']}", flush=True)
                continue
            sample = str(work / f"{name}.sample.npz")
            for preset, q in built["qdq"].items():
                n_sites = None
                for n in [x for x in a.exposed.split(",") if x]:
                    if n != "all" and n_sites is not None and int(n) >= n_sites:
                        continue  # the same session as "all"
                    r = run_step("session", {"qdq": q["path"], "n": n, "options": options}, a.timeout)
                    n_sites = r.get("sites", n_sites)
                    rows.append({"model": name, "preset": preset, "n": n, **r})
                    print(json.dumps(rows[-1]), flush=True)
                if not a.no_cache:
                    caches.append({"model": name, "preset": preset,
                                   **run_step("cache", {"qdq": q["path"], "sample": sample, "options": options},
                                              3 * a.timeout)})
                    print(json.dumps(caches[-1]), flush=True)
                if a.layout:
                    layouts.append({"model": name, "preset": preset, **run_step(
                        "layout", {"qdq": q["path"], "sample": sample, "options": options}, 3 * a.timeout)})
                    print(json.dumps(layouts[-1]), flush=True)
                if a.capture:
                    captures.append({"model": name, "preset": preset, **run_step(
                        "capture", {"qdq": q["path"], "sample": sample, "timeout": a.timeout}, 2 * a.timeout + 60)})
                    print(json.dumps(captures[-1]), flush=True)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n## session creation vs exposed tensors ({_load()})\n")
    print("| model | preset | exposed | QNN ops | wall s | CPU s | finalize s | graph opt s | sequencing s | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['preset']} | {_fmt(r.get('exposed', r['n']))} | {_fmt(r.get('qnn_ops'))} | "
              f"{_fmt(r.get('wall_s'))} | {_fmt(r.get('cpu_s'))} | {_fmt(r.get('finalize'))} | "
              f"{_fmt(r.get('graph_opt'))} | {_fmt(r.get('sequencing'))} | {r.get('error', '')} |")
    if caches:
        print("\n## EPContext cache: fresh compile, miss (compile + dump), hit (load), all tensors exposed\n")
        print("| model | preset | exposed | compile s | miss s | hit s | context bytes | miss = fresh | hit = fresh | note |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for c in caches:
            print(f"| {c['model']} | {c['preset']} | {_fmt(c.get('exposed'))} | {_fmt(c.get('compile_s'))} | "
                  f"{_fmt(c.get('miss_s'))} | {_fmt(c.get('hit_s'))} | {_fmt(c.get('ctx_bytes'))} | "
                  f"{_fmt(c.get('miss_bit_identical'))} | {_fmt(c.get('hit_bit_identical'))} | {c.get('error', '')} |")
    if layouts:
        print("\n## channels-last exposure prototype: every tensor exposed, plain (NCHW) vs through a Transpose (NHWC)\n")
        print("| model | preset | exposed | channels-last | plain s | NCHW s | NHWC s | NCHW CPU s | NHWC CPU s | "
              "QNN ops plain / NCHW / NHWC | tensors identical | outputs = plain (NCHW, NHWC) | note |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in layouts:
            ops = "/".join(_fmt(c.get(f"{x}_qnn_ops")) for x in ("plain", "nchw", "nhwc"))
            print(f"| {c['model']} | {c['preset']} | {_fmt(c.get('exposed'))} | {_fmt(c.get('channels_last'))} | "
                  f"{_fmt(c.get('plain_s'))} | {_fmt(c.get('nchw_s'))} | {_fmt(c.get('nhwc_s'))} | "
                  f"{_fmt(c.get('nchw_cpu_s'))} | {_fmt(c.get('nhwc_cpu_s'))} | {ops} | "
                  f"{_fmt(c.get('tensors_identical'))} | {_fmt(c.get('nchw_outputs_equal_plain'))}, "
                  f"{_fmt(c.get('nhwc_outputs_equal_plain'))} | {c.get('error', '')} |")
    if captures:
        print("\n## ivq capture qnn: every tensor vs model outputs only\n")
        print("| model | preset | all s | outputs only s | ratio | note |")
        print("|---|---|---|---|---|---|")
        for c in captures:
            note = c.get("error") or c.get("all_error") or c.get("outputs_only_error") or ""
            print(f"| {c['model']} | {c['preset']} | {_fmt(c.get('all_s'))} | {_fmt(c.get('outputs_only_s'))} | "
                  f"{_fmt(c.get('ratio'))} | {note} |")
    if a.json:
        from ivq_debug.util import atomic_write_text

        atomic_write_text(a.json, json.dumps({"options": options, "sessions": rows, "cache": caches,
                                              "capture": captures, "layout": layouts}, indent=1),
                          overwrite=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
