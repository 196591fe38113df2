#!/usr/bin/env python
"""Build the QNN format fixtures under ``tests/fixtures/qnn/`` from real QNN HTP (x86 emulator) runs.

What it does (see ``tests/fixtures/qnn/README.md`` for what each file is and what is real):

1. builds a small float model with a 4-D NCHW conv path (Conv → Relu → Reshape → Transpose) joined to a
   transformer-ish path (Add → LayerNormalization → q/k MatMul → scores MatMul → Softmax → pv MatMul →
   MatMul → Gelu → MatMul → residual Add), with exporter-style names (``/conv1/Conv``, ``onnx::MatMul_q``,
   ``input.1``, ``text.embeds``) that QNN sanitizing changes;
2. quantizes it a16/w8 with per-channel weights through ``onnxruntime.quantization`` QNN helpers;
3. exposes every activation ``QuantizeLinear`` output as a graph output (raw integers) and runs it on
   the QNN EP (HTP emulation, soc_model 60 / htp_arch 73, CPU fallback disabled) with
   ``dump_json_qnn_graph`` (real QNN graph JSON), ``profiling_level=detailed`` +
   ``enable_framework_op_trace`` (real CSV with ``ONNX Source Ops``) and ORT's own Chrome trace;
4. writes ``Result_<i>`` folders exactly as qnn-net-run writes them for a converter-built graph:
   sanitized names, ``<name>.raw`` float32 (fixed-point outputs dequantized with the SDK's
   ``tfNToFloat``) and ``<name>_native.raw``, 4-D tensors in NHWC with ``permute_order_to_src`` in the
   net JSON, a two-graph run (``vision`` and ``text`` split) with the ``<graph>/Result_<i>`` level;
5. stores the direct capture (the session outputs) in ``reference.npz`` so tests can check the ingest.

Run: ``python scripts/make_qnn_fixtures.py [--out tests/fixtures/qnn] [--force]`` (about 10 s).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ivq_debug.dump.format import escape_name  # noqa: E402
from ivq_debug.qnn.names import qnn_sanitize  # noqa: E402

SOC_MODEL, HTP_ARCH = "60", "73"
D, SEQ = 8, 16
N_SAMPLES = 2
#: exposing the Q output of the Transpose that feeds the act x act scores MatMul breaks QNN's transpose
#: folding: the MatMul then fails op validation (error 3110) and the session needs the CPU EP. It stays
#: internal in the main runs; the "fallback" run exposes it on purpose to record a two-partition profile.
SKIP_EXPOSE = ("/attn/kT/Transpose_output_0_QuantizeLinear",)


# ----------------------------------------------------------------------------- model
def build_float_model() -> Any:
    """The float model (opset 20, so Gelu is an ONNX op)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)

    def init(name: str, arr: np.ndarray) -> Any:
        return nh.from_array(arr.astype(np.float32), name)

    n = h.make_node
    nodes = [
        n("Conv", ["input.1", "conv1.weight", "conv1.bias"], ["/conv1/Conv_output_0"], name="/conv1/Conv",
          pads=[1, 1, 1, 1], strides=[2, 2]),
        n("Relu", ["/conv1/Conv_output_0"], ["/relu/Relu_output_0"], name="/relu/Relu"),
        n("Reshape", ["/relu/Relu_output_0", "shape_tok"], ["/flat/Reshape_output_0"], name="/flat/Reshape"),
        n("Transpose", ["/flat/Reshape_output_0"], ["/tok/Transpose_output_0"], name="/tok/Transpose", perm=[0, 2, 1]),
        n("Add", ["/tok/Transpose_output_0", "text.embeds"], ["/mix/Add_output_0"], name="/mix/Add"),
        n("LayerNormalization", ["/mix/Add_output_0", "ln.weight", "ln.bias"], ["/ln/LayerNormalization_output_0"],
          name="/ln/LayerNormalization", axis=-1),
        n("MatMul", ["/ln/LayerNormalization_output_0", "onnx::MatMul_q"], ["/attn/q/MatMul_output_0"], name="/attn/q/MatMul"),
        n("MatMul", ["/ln/LayerNormalization_output_0", "onnx::MatMul_k"], ["/attn/k/MatMul_output_0"], name="/attn/k/MatMul"),
        n("Transpose", ["/attn/k/MatMul_output_0"], ["/attn/kT/Transpose_output_0"], name="/attn/kT/Transpose", perm=[0, 2, 1]),
        n("MatMul", ["/attn/q/MatMul_output_0", "/attn/kT/Transpose_output_0"], ["/attn/scores/MatMul_output_0"],
          name="/attn/scores/MatMul"),
        n("Softmax", ["/attn/scores/MatMul_output_0"], ["/attn/Softmax_output_0"], name="/attn/Softmax", axis=-1),
        n("MatMul", ["/attn/Softmax_output_0", "/ln/LayerNormalization_output_0"], ["/attn/pv/MatMul_output_0"],
          name="/attn/pv/MatMul"),
        n("MatMul", ["/attn/pv/MatMul_output_0", "onnx::MatMul_fc1"], ["/mlp/fc1/MatMul_output_0"], name="/mlp/fc1/MatMul"),
        n("Gelu", ["/mlp/fc1/MatMul_output_0"], ["/mlp/act/Gelu_output_0"], name="/mlp/act/Gelu"),
        n("MatMul", ["/mlp/act/Gelu_output_0", "onnx::MatMul_fc2"], ["/mlp/fc2/MatMul_output_0"], name="/mlp/fc2/MatMul"),
        n("Add", ["/mlp/fc2/MatMul_output_0", "/mix/Add_output_0"], ["logits"], name="/res/Add"),
    ]
    inits = [
        init("conv1.weight", rng.normal(0, 0.3, (D, 3, 3, 3))), init("conv1.bias", rng.normal(0, 0.1, (D,))),
        nh.from_array(np.array([1, D, SEQ], dtype=np.int64), "shape_tok"),
        init("ln.weight", 1 + 0.1 * rng.normal(size=D)), init("ln.bias", 0.1 * rng.normal(size=D)),
        init("onnx::MatMul_q", rng.normal(0, 0.3, (D, D))), init("onnx::MatMul_k", rng.normal(0, 0.3, (D, D))),
        init("onnx::MatMul_fc1", rng.normal(0, 0.3, (D, 2 * D))), init("onnx::MatMul_fc2", rng.normal(0, 0.3, (2 * D, D))),
    ]
    g = h.make_graph(
        nodes, "ivq_qnn_fixture",
        [h.make_tensor_value_info("input.1", TP.FLOAT, [1, 3, 8, 8]),
         h.make_tensor_value_info("text.embeds", TP.FLOAT, [1, SEQ, D])],
        [h.make_tensor_value_info("logits", TP.FLOAT, [1, SEQ, D]),
         h.make_tensor_value_info("/conv1/Conv_output_0", TP.FLOAT, [1, D, 4, 4])],
        inits,
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 20)], producer_name="ivq-debug fixtures")
    m.ir_version = 10
    onnx.checker.check_model(m, full_check=True)
    return m


def feeds(seed: int, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input.1": rng.normal(size=(1, 3, 8, 8)).astype(np.float32),
             "text.embeds": rng.normal(size=(1, SEQ, D)).astype(np.float32)} for _ in range(n)]


def quantize(float_path: Path, qdq_path: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantType
    from onnxruntime.quantization import quantize as ort_quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds(100, 8))

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    cfg = get_qnn_qdq_config(str(float_path), Reader(), activation_type=QuantType.QUInt16,
                             weight_type=QuantType.QUInt8, per_channel=True)
    ort_quantize(str(float_path), str(qdq_path), cfg)


def expose_q_outputs(model: Any, skip: tuple[str, ...] = SKIP_EXPOSE) -> Any:
    """Add every activation QuantizeLinear output as a graph output."""
    import onnx

    m = copy.deepcopy(model)
    inits = {i.name for i in m.graph.initializer}
    outs = {o.name for o in m.graph.output}
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits and n.name not in skip:
            for o in n.output:
                if o not in outs:
                    m.graph.output.append(onnx.ValueInfoProto(name=o))
                    outs.add(o)
    return m


# ----------------------------------------------------------------------------- QNN EP session
def qnn_session(model_path: Path, work: Path, tag: str, profiling: str | None = "detailed",
                fallback: bool = False, ort_trace: bool = False) -> tuple[Any, dict[str, Path]]:
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    if oq.get_ep_name() not in ort.get_available_providers():
        try:
            ort.register_execution_provider_library(oq.get_ep_name(), oq.get_library_path())
        except Exception:  # already registered in this process
            pass
    devs = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    paths = {"json_dir": work / f"{tag}_json", "trace_dir": work / f"{tag}_trace", "csv": work / f"{tag}.csv"}
    paths["json_dir"].mkdir(parents=True, exist_ok=True)
    paths["trace_dir"].mkdir(parents=True, exist_ok=True)
    if ort_trace:
        so.enable_profiling = True
        so.profile_file_prefix = str(work / f"{tag}_ort")
    opts = {"backend_path": oq.get_qnn_htp_path(), "soc_model": SOC_MODEL, "htp_arch": HTP_ARCH,
            "dump_json_qnn_graph": "1", "json_qnn_graph_dir": str(paths["json_dir"]),
            "enable_framework_op_trace": "1", "framework_op_trace_dir": str(paths["trace_dir"])}
    if profiling:
        opts.update(profiling_level=profiling, profiling_file_path=str(paths["csv"]))
    so.add_provider_for_devices(devs, opts)
    return ort.InferenceSession(str(model_path), sess_options=so), paths


def run(sess: Any, samples: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    names = [o.name for o in sess.get_outputs()]
    inames = {i.name for i in sess.get_inputs()}
    return [dict(zip(names, sess.run(None, {k: v for k, v in s.items() if k in inames}), strict=True))
            for s in samples]


def graph_jsons(json_dir: Path) -> list[Path]:
    return sorted(p for p in json_dir.glob("*.json") if not p.name.endswith("_tensor_log.json"))


# ----------------------------------------------------------------------------- converter-style net JSON
def dq_params(model: Any) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """initializer (quantized weight) name → (scale, zero point, axis) of the DQ that reads it."""
    from onnx import numpy_helper

    arrs = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in arrs:
            axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
            zp = arrs[n.input[2]] if len(n.input) > 2 and n.input[2] else np.zeros_like(arrs[n.input[1]], np.int32)
            out[n.input[0]] = (np.atleast_1d(arrs[n.input[1]]), np.atleast_1d(zp), axis)
    return out


def converter_style(ort_json: dict[str, Any], qdq_model: Any, command: str) -> dict[str, Any]:
    """An ORT ``dump_json_qnn_graph`` document rewritten as qnn-onnx-converter writes ``<model>_net.json``.

    Names are sanitized; graph inputs and outputs of rank 4 are NHWC with ``permute_order_to_src``
    ``[0, 3, 1, 2]``; per-channel (AXIS_SCALE_OFFSET) static tensors get their real scales from the QDQ
    model (ORT's dump only holds the union's first member). Everything else is ORT's output verbatim.
    """
    d = copy.deepcopy(ort_json)
    d["converter_command"] = command
    params = dq_params(qdq_model)
    tensors = {}
    for name, t in d["graph"]["tensors"].items():
        t = dict(t)
        if t.get("type") in (0, 1) and len(t["dims"]) == 4:
            n_, c, hh, w = t["dims"]
            t["dims"] = [n_, hh, w, c]
            t["permute_order_to_src"] = [0, 3, 1, 2]
            t["axis_format"], t["src_axis_format"] = "NHWC", "NCHW"
        qp = t.get("quant_params", {})
        if qp.get("encoding") == 1 and name in params:
            scale, zp, _ = params[name]
            axis = int(np.frombuffer(np.float32(qp["scale_offset"]["scale"]).tobytes(), dtype="<i4")[0])
            t["quant_params"] = {
                "definition": qp.get("definition", 1), "encoding": 1,
                "axis_scale_offset": {
                    "axis": axis, "num_scale_offsets": len(scale),
                    "scale_offsets": [{"scale": float(s), "offset": -int(z)} for s, z in zip(scale, zp, strict=True)],
                },
            }
        tensors[qnn_sanitize(name)] = t
    d["graph"]["tensors"] = tensors
    nodes = {}
    for name, nd in d["graph"]["nodes"].items():
        nd = dict(nd)
        nd["input_names"] = [qnn_sanitize(x) for x in nd["input_names"]]
        nd["output_names"] = [qnn_sanitize(x) for x in nd["output_names"]]
        nodes[qnn_sanitize(name)] = nd
    d["graph"]["nodes"] = nodes
    return d


def _type_inputs(path: Path, values: dict[str, np.ndarray]) -> None:
    """Give untyped graph inputs of an extracted model the dtype / shape of the captured values."""
    import onnx
    from onnx import helper

    m = onnx.load(path)
    for i in m.graph.input:
        if not i.type.HasField("tensor_type") and i.name in values:
            v = values[i.name]
            i.CopyFrom(helper.make_tensor_value_info(i.name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
    onnx.save(m, path)


def sdk_float(q: np.ndarray, scale: float, offset: int) -> np.ndarray:
    """SampleApp ``tfNToFloat``: ``float((double(q) + offset) * scale)``."""
    return ((q.astype(np.float64) + float(offset)) * float(np.float32(scale))).astype(np.float32)


def write_results(out_dir: Path, net: dict[str, Any], outputs: list[dict[str, np.ndarray]],
                  mode: str) -> None:
    """``Result_<i>/`` folders as qnn-net-run's ``writeOutputTensors`` does for each APP_READ tensor."""
    by_qnn = {qnn_sanitize(k): k for k in outputs[0]}
    for i, outs in enumerate(outputs):
        rdir = out_dir / f"Result_{i}"
        rdir.mkdir(parents=True, exist_ok=True)
        for name, t in net["graph"]["tensors"].items():
            if t["type"] != 1:
                continue
            arr = outs[by_qnn[name]]
            perm = t.get("permute_order_to_src")
            if perm:
                arr = np.transpose(arr, np.argsort(perm))
            arr = np.ascontiguousarray(arr)
            assert list(arr.shape) == t["dims"], (name, arr.shape, t["dims"])
            if t["data_type"] == 562:  # FLOAT_32: always <name>.raw
                arr.astype("<f4").tofile(rdir / f"{name}.raw")
                continue
            so = t["quant_params"]["scale_offset"]
            if mode in ("float_only", "float_and_native"):
                sdk_float(arr, so["scale"], so["offset"]).astype("<f4").tofile(rdir / f"{name}.raw")
            if mode in ("native_only", "float_and_native"):
                arr.astype(arr.dtype.newbyteorder("<")).tofile(rdir / f"{name}_native.raw")


# ----------------------------------------------------------------------------- small synthesized files
VIEWER_BASIC = """Qnn Init/Prepare/Finalize/De-Init/Execute/Lib-Load Statistics:
------------------------------------------------------------
Init Stats:
-----------
    NetRun:  331158 us

Compose Graphs Stats:
--------------
    NetRun:  74748 us

Finalize Stats:
---------------
Graph 0 (model):
    NetRun:  256372 us
    Backend (RPC (finalize) time): 4922 us
    Backend (QNN accelerator (finalize) time): 4504 us
    Backend (Accelerator (finalize) time): 4421 us
    Backend (QNN (finalize) time): 256364 us

De-Init Stats:
--------------
    NetRun:  15810 us
    Backend (RPC (deinit) time): 1224 us
    Backend (QNN Accelerator (deinit) time): 966 us
    Backend (Accelerator (deinit) time): 934 us
    Backend (QNN (deinit) time): 15801 us

Execute Stats (Average):
------------------------
Total Inference Time:
---------------------
Graph 0 (model):
    NetRun:  2952 us
    Backend (Number of HVX threads used): 4 count
    Backend (RPC (execute) time): 2920 us
    Backend (QNN accelerator (execute) time): 2600 us
    Backend (Accelerator (execute) time): 2492 us
    Backend (QNN (execute) time): 2949 us

Execute Stats (Overall):
------------------------
    NetRun IPS:  214.8888 inf/sec
"""


def viewer_detailed(csv_path: Path) -> str:
    """qnn-profile-viewer-shaped text (detailed) built from run 0 of the real CSV (shape UNCONFIRMED)."""
    import csv

    rows = list(csv.reader(open(csv_path)))[1:]
    ops, total = [], None
    seen_exec = False
    for r in rows:
        if r[1] == "EXECUTE":
            break
        if r[1] == "BACKEND" and r[6] == "Accelerator (execute) time (cycles)":
            total, seen_exec = r[2], True
        elif r[1] == "NODE" and seen_exec:
            ops.append((qnn_sanitize(r[6].split(":OpId_")[0]) + ":OpId_" + r[6].split(":OpId_")[1]
                        if ":OpId_" in r[6] else r[6], r[2]))
    lines = ["Input Log File Location: output/qnn-profiling-data_0.log", "",
             "Execute Stats (Average):", "------------------------", "Total Inference Time:",
             "---------------------", "Graph 0 (model):", "    NetRun:  9120 us",
             f"    Backend (Accelerator (execute) time (cycles)): {total} cycles"]
    lines += [f"        {ident}: {v} cycles" for ident, v in ops]
    lines += ["    Backend (Accelerator (execute) time): 8404 us", "    Backend (QNN (execute) time): 8627 us", ""]
    return "\n".join(lines)


def context_json(net: dict[str, Any], graph: str, wrapped: bool) -> dict[str, Any]:
    """A qnn-context-binary-utility-shaped JSON of the net's graph I/O (schema from public readers)."""
    from ivq_debug.qnn.netjson import DATA_TYPES

    def tensor(name: str, t: dict[str, Any]) -> dict[str, Any]:
        so = t["quant_params"]["scale_offset"]
        defined = t["quant_params"]["definition"] == 1
        info: dict[str, Any] = {
            "name": name, "id": t["id"],
            "type": ("QNN_TENSOR_TYPE_APP_WRITE" if t["type"] == 0 else "QNN_TENSOR_TYPE_APP_READ") if wrapped else t["type"],
            "dataFormat": "QNN_TENSOR_DATA_FORMAT_FLAT_BUFFER" if wrapped else 0,
            "dataType": f"QNN_DATATYPE_{DATA_TYPES[t['data_type']][0]}" if wrapped else t["data_type"],
            "rank": len(t["dims"]), "dimensions": t["dims"],
        }
        if wrapped:
            info["quantizeParams"] = {
                "definition": "QNN_DEFINITION_DEFINED" if defined else "QNN_DEFINITION_UNDEFINED",
                "quantizationEncoding": "QNN_QUANTIZATION_ENCODING_SCALE_OFFSET" if defined
                else "QNN_QUANTIZATION_ENCODING_UNDEFINED",
                "scaleOffset": {"scale": so["scale"], "offset": so["offset"]},
            }
            return {"version": 2, "info": info}
        info["quantizeParams"] = {"definition": t["quant_params"]["definition"],
                                  "quantizationEncoding": t["quant_params"]["encoding"],
                                  "scaleOffsetEncoding": {"scale": so["scale"], "offset": so["offset"]}}
        return info

    ts = net["graph"]["tensors"]
    ins = [tensor(n, t) for n, t in ts.items() if t["type"] == 0]
    outs = [tensor(n, t) for n, t in ts.items() if t["type"] == 1]
    g: dict[str, Any] = {"graphName": graph, "graphInputs": ins, "graphOutputs": outs}
    if wrapped:
        return {"info": {"backendId": 6, "buildId": "synthesized by scripts/make_qnn_fixtures.py",
                         "graphs": [{"version": 1, "info": g}]}}
    return {"graphs": [g]}


# ----------------------------------------------------------------------------- main
def dump_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def make(out: Path) -> dict[str, Any]:
    import onnx
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    work = Path(tempfile.mkdtemp(prefix="ivq_qnn_fix_"))
    cwd = os.getcwd()
    os.chdir(work)  # the HTP libraries may drop files in the cwd
    try:
        fp = work / "model.onnx"
        onnx.save(build_float_model(), fp)
        qdq = work / "model.qdq.onnx"
        quantize(fp, qdq)
        qmodel = onnx.load(qdq)
        exposed = expose_q_outputs(qmodel)
        run_model = out / "model.qdq.onnx"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(fp, out / "model.onnx")
        onnx.save(exposed, run_model)
        samples = feeds(1, N_SAMPLES)

        # --- main run: whole model, detailed profile, ORT trace, graph JSON
        sess, paths = qnn_session(run_model, work, "main", "detailed", ort_trace=True)
        outputs = run(sess, samples)
        trace = Path(sess.end_profiling())
        del sess
        (gj,) = graph_jsons(paths["json_dir"])
        ort_graph = json.loads(gj.read_text())
        prof = out / "profiling"
        prof.mkdir(parents=True, exist_ok=True)
        shutil.copy(paths["csv"], prof / "qnn_ep_detailed.csv")
        shutil.copy(trace, prof / "ort_trace.json")
        shutil.copy(paths["trace_dir"] / "qnn_op_trace.json", prof / "qnn_op_trace.json")
        dump_json(out / "ort_dump_json_qnn_graph.json", ort_graph)

        # --- basic profile (one run)
        sess, bpaths = qnn_session(run_model, work, "basic", "basic")
        run(sess, samples[:1])
        del sess
        shutil.copy(bpaths["csv"], prof / "qnn_ep_basic.csv")

        # --- fallback: the kT Q output exposed too; two QNN partitions + CPU nodes
        fb_model = work / "fallback.onnx"
        onnx.save(expose_q_outputs(qmodel, skip=()), fb_model)
        sess, fpaths = qnn_session(fb_model, work, "fallback", "detailed", fallback=True, ort_trace=True)
        run(sess, samples[:1])
        ftrace = Path(sess.end_profiling())
        del sess
        shutil.copy(fpaths["csv"], prof / "fallback_qnn_ep_detailed.csv")
        shutil.copy(ftrace, prof / "fallback_ort_trace.json")
        n_fallback_graphs = len(graph_jsons(fpaths["json_dir"]))

        # --- single-graph qnn-net-run output (float_and_native), with the binary QNN log ORT wrote
        cmd = ("ivq-debug scripts/make_qnn_fixtures.py: ORT dump_json_qnn_graph of model.qdq.onnx, "
               "names sanitized, 4-D graph I/O in NHWC")
        net = converter_style(ort_graph, qmodel, cmd)
        single = out / "net_run" / "single"
        dump_json(single / "model_net.json", net)
        write_results(single / "output", net, outputs, "float_and_native")
        qlog = paths["csv"].with_name(paths["csv"].stem + "_qnn.log")
        if qlog.exists():
            shutil.copy(qlog, single / "output" / "qnn-profiling-data_0.log")

        # --- two graphs: vision (conv path) and text (rest); native_only
        vis_out = ["/tok/Transpose_output_0_QuantizeLinear_Output", "/conv1/Conv_output_0"]
        vis_out += [o.name for o in exposed.graph.output if o.name.startswith(("input.1", "/conv1", "/relu", "/flat"))]
        vis_out = list(dict.fromkeys(vis_out))
        text_in = ["/tok/Transpose_output_0_QuantizeLinear_Output", "text.embeds"]
        text_out = [o.name for o in exposed.graph.output if o.name not in vis_out]
        multi = out / "net_run" / "multi"
        parts_out: dict[str, list[dict[str, np.ndarray]]] = {}
        for gname, ins, outs_ in (("vision", ["input.1"], vis_out), ("text", text_in, text_out)):
            sub = multi / f"{gname}.qdq.onnx"
            sub.parent.mkdir(parents=True, exist_ok=True)
            onnx.utils.extract_model(str(run_model), str(sub), ins, outs_, check_model=False)
            _type_inputs(sub, outputs[0])
            s, sp = qnn_session(sub, work, gname, None)
            if gname == "vision":
                res = run(s, samples)
            else:
                res = run(s, [{"/tok/Transpose_output_0_QuantizeLinear_Output":
                               parts_out["vision"][i]["/tok/Transpose_output_0_QuantizeLinear_Output"],
                               "text.embeds": samples[i]["text.embeds"]} for i in range(N_SAMPLES)])
            del s
            parts_out[gname] = res
            (sj,) = graph_jsons(sp["json_dir"])
            snet = converter_style(json.loads(sj.read_text()), onnx.load(sub), cmd)
            dump_json(multi / f"{gname}_net.json", snet)
            write_results(multi / "output" / gname, snet, res, "native_only")

        # --- context-binary-shaped JSON, viewer text
        ctx = out / "context"
        dump_json(ctx / "context_wrapped.json", context_json(net, "model", wrapped=True))
        dump_json(ctx / "context_plain.json", context_json(net, "model", wrapped=False))
        (prof / "viewer_basic.txt").write_text(VIEWER_BASIC)
        (prof / "viewer_detailed.txt").write_text(viewer_detailed(prof / "qnn_ep_detailed.csv"))

        # --- the direct capture
        ref: dict[str, np.ndarray] = {}
        for group, res, ins in (("single", outputs, samples), ("vision", parts_out["vision"], samples),
                                ("text", parts_out["text"], None)):
            for i, o in enumerate(res):
                for k, v in o.items():
                    ref[f"{group}|{i}|{escape_name(k)}"] = v
            for i, s in enumerate(ins or []):
                for k, v in s.items():
                    ref[f"feeds|{i}|{escape_name(k)}"] = v
        np.savez_compressed(out / "reference.npz", **ref)
        meta = {
            "soc_model": SOC_MODEL, "htp_arch": HTP_ARCH, "onnxruntime": ort.__version__,
            "onnxruntime_qnn": oq.__version__, "onnx": onnx.__version__, "numpy": np.__version__,
            "samples": N_SAMPLES, "not_exposed": list(SKIP_EXPOSE), "fallback_qnn_graphs": n_fallback_graphs,
            "keys": "reference.npz keys are '<group>|<sample>|<escaped ONNX name>' (groups: single, vision, "
                    "text, feeds); names escaped with ivq_debug.dump.format.escape_name",
        }
        dump_json(out / "reference.json", meta)
        return meta
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "qnn"))
    ap.add_argument("--force", action="store_true", help="replace the existing fixture folder")
    a = ap.parse_args(argv)
    out = Path(a.out)
    generated = ("model.onnx", "model.qdq.onnx", "reference.npz", "reference.json", "ort_dump_json_qnn_graph.json",
                 "net_run", "profiling", "context")
    if any((out / g).exists() for g in generated):
        if not a.force:
            print(f"{out} already holds fixtures; pass --force to regenerate", file=sys.stderr)
            return 2
        for g in generated:
            p = out / g
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    meta = make(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 1024:.0f} KiB): {json.dumps(meta)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
