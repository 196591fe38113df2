"""A device session run with ``qnn-net-run --debug``: every layer's output in every ``Result_<i>``, from real ORT runs.

The parts are a **legacy** (TorchScript) export of transformers' own ``InternVLForConditionalGeneration`` with a
dynamic KV cache, saved as such exports ship: no ``value_info`` and the output axes the exporter named after their
producer (``MatMullogits_dim_0``, ``Concatpresent.1.key_dim_0``, ``Concatpresent.0.key_dim_3``), not pinned.
The "device" is an ORT scheduler over those parts; each call's vision / prefill / decode inputs are then run
again with every activation exposed and written as ``qnn-net-run --debug`` writes them::

    <root>/<part>/input_list.txt  inputs/<i>/<qnn name>.raw
                  output/Result_<i>/<qnn name>.raw    graph outputs and every intermediate, float32, the QNN name
                                                      (``/language_model/layers.0/Add_output_0`` ->
                                                      ``_language_model_layers_0_Add_output_0.raw``)

The intermediates are the graph's float activations (node outputs of floating type, ``Constant`` nodes left
out): the tensors a converted QNN graph keeps, its shape arithmetic and constants folded by the converter.

The fault: decode call ``FAULT_STEP`` ran with one weight of layer ``FAULT_LAYER``'s MLP scaled by
``FAULT_SCALE`` (a corrupted weight buffer for one call); every other call is the clean graph's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.onnxgraph.load import load_model
from ivq_debug.outputs import atomic_write_bytes, atomic_write_text
from ivq_debug.qnn.names import qnn_sanitize
from tests.support.device_sessions import (
    BUCKET,
    PARTS,
    graph_io,
    session_calls,
    session_image,
    session_scheduler,
    write_net_run_folder,
)

MODEL = "internvl-tiny"
FAULT_STEP = 3
FAULT_LAYER = 1
FAULT_SCALE = 1.5


@dataclass
class DebugSession:
    """The written session and what a correct reading of it is."""

    root: Path
    parts_dir: Path
    folders: dict[str, Path]
    parts: dict[str, Path]
    config: Path
    tokens: list[int]
    intermediates: dict[str, list[str]]  # part -> the graph's activations written per Result folder
    fault_tensor: str  # the first tensor the fault changes (the scaled MatMul's output)
    fault_step: int


def export_legacy_parts(model: Any, folder: Path) -> Path:
    """The dynamic-cache parts as a legacy export ships them: producer-named output axes, no ``value_info``."""
    import onnx

    from ivq_debug.vlm.export_dynamic import export_dynamic_parts

    export_dynamic_parts(model, folder, buckets=[BUCKET], verify=False, overwrite=True, model_id=MODEL,
                         pin_output_dims=False)
    for p in sorted(folder.glob("*.onnx")):
        m = onnx.load(str(p))
        del m.graph.value_info[:]
        onnx.save(m, str(p))
    return folder


def activations(model: Any) -> list[str]:
    """The float node outputs of a graph in node order (``Constant`` outputs left out), graph outputs excluded."""
    from ivq_debug.onnxgraph.infer import value_types

    g = model.graph
    types = value_types(model)
    outs = {o.name for o in g.output}
    names = []
    for n in g.node:
        if n.op_type == "Constant":
            continue
        names += [o for o in n.output if o and o not in outs and types.get(o, (0, None))[0] == 1]  # FLOAT
    return names


def _exposing_session(model: Any, names: list[str]) -> Any:
    import onnx
    import onnxruntime as ort
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in names:
        m.graph.output.append(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def faulty_model(model: Any, layer: int, scale: float) -> tuple[Any, str]:
    """A copy of ``model`` whose first MLP MatMul weight of ``layer`` is scaled; returns it and that MatMul's output."""
    import onnx
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {i.name: i for i in m.graph.initializer}
    node = next(n for n in m.graph.node if n.op_type == "MatMul" and f"layers.{layer}/mlp/" in n.name
                and any(x in inits for x in n.input))
    w = next(inits[x] for x in node.input if x in inits)
    w.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(w) * np.float32(scale)).astype(np.float32), w.name))
    return m, node.output[0]


def _write_debug_files(folder: Path, i: int, values: dict[str, np.ndarray]) -> None:
    for name, v in values.items():
        atomic_write_bytes(folder / "output" / f"Result_{i}" / f"{qnn_sanitize(name)}.raw",
                           np.ascontiguousarray(v, dtype="<f4").tobytes(), overwrite=True)


def build_debug_session(model: Any, root: Path, config: Path) -> DebugSession:
    """Export the parts, run the session on ORT and write its folders as ``qnn-net-run --debug`` does."""
    from ivq_debug.dump import DumpWriter

    parts_dir = export_legacy_parts(model, root / "parts")
    atomic_write_text(parts_dir / "config.json", config.read_text(), overwrite=True)
    sched = session_scheduler(parts_dir, "dynamic", "correct")
    dump = root / "scheduler.h5"
    with DumpWriter(dump, backend="onnxruntime-cpu", overwrite=True) as w:
        gen = sched.generate(session_image(), writer=w)
    parts = dict(sched.spec.part_paths)
    folders, inter = {}, {}
    fault_tensor = ""
    for part in PARTS:
        proto = load_model(parts[part])
        names = activations(proto)
        inter[part] = names
        outs = graph_io(parts[part])[1]
        clean = _exposing_session(proto, names)
        bad = None
        if part == "decode":
            fm, fault_tensor = faulty_model(proto, FAULT_LAYER, FAULT_SCALE)
            bad = _exposing_session(fm, names)
        calls = session_calls(dump, part, parts)
        written = []
        for step, feeds, _ in calls:
            sess = bad if (bad is not None and step == FAULT_STEP) else clean
            got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
            written.append((feeds, got))
        folder = write_net_run_folder(root / part, [(f, {o: g[o] for o in outs}) for f, g in written], outs)
        for i, (_, got) in enumerate(written):
            _write_debug_files(folder, i, {n: got[n] for n in names})
        folders[part] = folder
    s = DebugSession(root, parts_dir, folders, parts, parts_dir / "config.json", list(gen.tokens), inter,
                     fault_tensor, FAULT_STEP)
    atomic_write_text(root / "fixture.json", json.dumps(
        {"model": MODEL, "fault": {"step": FAULT_STEP, "layer": FAULT_LAYER, "scale": FAULT_SCALE,
                                   "first_tensor": fault_tensor},
         "intermediates": {p: len(v) for p, v in inter.items()}, "tokens": s.tokens}, indent=1), overwrite=True)
    return s
