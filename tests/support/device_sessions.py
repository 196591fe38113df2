"""Device-session fixtures: the folders a phone's ``qnn-net-run`` (or own runtime) leaves, from real ORT runs.

A *device session* is one generation on a "device": an ORT scheduler over split ONNX parts (the HF-style
dynamic-cache export of :mod:`ivq_debug.vlm.export_dynamic`, or the embedded reference's fixed-cache export
of :mod:`ivq_debug.vlm.export`) with a fault knob, written as qnn-net-run lays its runs out::

    <session>/
      vision/  input_list.txt  inputs/0/pixel_values.raw          output/Result_0/image_features.raw
      prefill/ input_list.txt  inputs/0/{inputs_embeds,attention_mask,position_ids}.raw
                                                                    output/Result_0/{logits,present_0_key,…}.raw
      decode/  input_list.txt  inputs/<i>/{…,past_key_values_0_key,…}.raw      (one line per decode step)
                                                                    output/Result_<i>/{logits,present_0_key,…}.raw
      fixture.json             (what the fixture is: fault, expected offset; not something a device writes)

``input_list.txt``: a ``#`` header line (the output names, as SNPE-style lists carry them; qnn-net-run skips
it), then one line per inference of ``<qnn name>:=<relative path>`` tokens. Raw files are headerless
little-endian float32 (qnn-net-run's default input and output type; int64 inputs such as
``attention_mask`` / ``position_ids`` are written as float32 values), names QNN-sanitized
(``present.0.key`` → ``present_0_key``). ``Result_<i>`` is decode step ``i + 1``.

Faults (``FAULTS``): ``correct``; ``off_by_one`` (decode step k at the correct position + 1);
``restart`` (positions restart at 0: step k at k − 1; with the dynamic cache the decode graph has **no**
``position_ids`` input at all and computes ``P − S`` from its cache length, so the decode folder carries no
positions); ``naive_text`` (Qwen2-VL: ``S + k − 1``, the token count, dropping the M-RoPE delta).

Run ``python scripts/make_device_sessions.py OUT`` to write every fixture; the tests generate them into tmp.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.capture.qnn_net_run.io import write_inputs
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.outputs import atomic_write_bytes, atomic_write_text
from ivq_debug.qnn.names import qnn_sanitize

CACHES = ("dynamic", "fixed")
#: fault -> the scheduler's PositionsPolicy mode
FAULTS: dict[str, str] = {"correct": "correct", "off_by_one": "off_by_one", "restart": "restart",
                          "naive_text": "mrope_text_len"}
PARTS = ("vision", "prefill", "decode")
#: the fixtures the tests and the script build: (model, cache, fault)
SESSIONS: tuple[tuple[str, str, str], ...] = (
    ("internvl-tiny", "dynamic", "correct"),
    ("internvl-tiny", "dynamic", "off_by_one"),
    ("internvl-tiny", "dynamic", "restart"),
    ("qwen2vl-tiny", "dynamic", "correct"),
    ("qwen2vl-tiny", "dynamic", "naive_text"),
    ("qwen2vl-tiny", "dynamic", "restart"),
    ("internvl-tiny", "fixed", "correct"),
    ("internvl-tiny", "fixed", "off_by_one"),
    ("internvl-tiny", "fixed", "restart"),
    ("qwen2vl-tiny", "fixed", "naive_text"),
)
BUCKET = 112


@dataclass
class DeviceSession:
    """One written device session and what a correct diagnosis of it is."""

    name: str
    model: str
    cache: str
    fault: str
    root: Path
    folders: dict[str, Path]
    parts: dict[str, Path]  # part -> the ONNX graph the "device" ran
    config: Path  # the HF config.json of the model
    tokens: list[int]  # the device's argmax tokens (step 0 = prefill)
    prefill_len: int
    rope_delta: int  # HF rope_deltas = max(prefill positions) + 1 − S (0 for 1-D RoPE)
    expected_offset: int | None  # observed − expected decode position (None: correct run)
    first_wrong_step: int | None
    decode_has_positions: bool
    dump: Path  # the scheduler's own dump of the run (inputs, outputs and meta)
    native_inputs: bool = False  # inputs/ in the graph dtypes (qnn-net-run --use_native_input_files)


# ------------------------------------------------------------------------------------------- parts
def fixture_folder_args(doc: str, argv: list[str] | None,
                        more: Callable[[argparse.ArgumentParser], None] | None = None
                        ) -> tuple[argparse.Namespace, Path] | None:
    """The command line of the ``scripts/make_*_sessions.py`` writers: ``OUT [--force]`` (+ ``more``'s
    arguments); an OUT that holds files is emptied with ``--force`` and refused without it (None, after one
    line on stderr)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("out", help="output folder")
    ap.add_argument("--force", action="store_true", help="replace an existing output folder")
    if more is not None:
        more(ap)
    a = ap.parse_args(argv)
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        if not a.force:
            print(f"{out} is not empty; pass --force to replace it", file=sys.stderr)
            return None
        shutil.rmtree(out)
    return a, out


def export_session_parts(model: Any, folder: Path, cache: str, *, restart_prefill_len: int | None = None,
                         verify: bool = True, model_id: str | None = None) -> Any:
    """Export the split parts a device session runs; returns the ``ExportResult``.

    ``cache="dynamic"``: the HF-style export; with ``restart_prefill_len`` the decode graph is the variant
    without a position input whose positions restart at 0 (``P − S``). ``cache="fixed"``: the embedded
    reference's export.
    """
    if cache == "dynamic":
        from ivq_debug.vlm.export_dynamic import export_dynamic_parts

        nopos = restart_prefill_len is not None
        return export_dynamic_parts(model, folder, buckets=[BUCKET], verify=verify, model_id=model_id,
                                    decode_position_input=not nopos,
                                    decode_position_offset=-restart_prefill_len if nopos else 0)
    from ivq_debug.vlm.export import export_parts

    return export_parts(model, folder, buckets=[BUCKET], verify=verify, model_id=model_id)


def session_scheduler(parts_dir: Path, cache: str, mode: str = "correct") -> Any:
    """The ORT scheduler over an export folder (graph outputs only are captured)."""
    from ivq_debug.vlm.scheduler import Scheduler
    from ivq_debug.vlm.scheduler_dynamic import DynamicScheduler

    cls = DynamicScheduler if cache == "dynamic" else Scheduler
    return cls.from_export(parts_dir, BUCKET, positions=mode)


# ------------------------------------------------------------------------------------------- folders
def write_net_run_folder(folder: Path, calls: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
                         output_names: list[str], native_inputs: bool = False) -> Path:
    """Write ``(inputs, outputs)`` per inference as qnn-net-run's input list, inputs and ``Result_<i>``.

    Inputs are float32 (qnn-net-run's default) or, with ``native_inputs``, in their own dtype (int64 masks
    and positions), as ``--use_native_input_files`` reads them.
    """
    if native_inputs:
        files = []
        for i, (feeds, _) in enumerate(calls):
            row = {n: folder / "inputs" / str(i) / f"{qnn_sanitize(n)}.raw" for n in feeds}
            for n, path in row.items():
                v = np.ascontiguousarray(feeds[n])
                atomic_write_bytes(path, v.astype(v.dtype.newbyteorder("<")).tobytes(), overwrite=True)
            files.append(row)
    else:
        files = write_inputs([c[0] for c in calls], folder, overwrite=True).files  # inputs/<i>/<qnn name>.raw
    lines = ["#" + " ".join(qnn_sanitize(n) for n in output_names)]
    for row in files:
        lines.append(" ".join(f"{qnn_sanitize(n)}:={os.path.relpath(p.resolve(), folder.resolve())}"
                              for n, p in row.items()))
    atomic_write_text(folder / "input_list.txt", "\n".join(lines) + "\n", overwrite=True)
    for i, (_, outputs) in enumerate(calls):
        for name in output_names:
            data = np.ascontiguousarray(outputs[name], dtype="<f4").tobytes()
            atomic_write_bytes(folder / "output" / f"Result_{i}" / f"{qnn_sanitize(name)}.raw", data, overwrite=True)
    return folder


def graph_io(path: Path) -> tuple[list[str], list[str]]:
    """Input and output names of an ONNX graph, in graph order."""
    g = load_model(path).graph
    inits = {i.name for i in g.initializer}
    return [i.name for i in g.input if i.name not in inits], [o.name for o in g.output]


def session_calls(dump: Path, part: str, parts: dict[str, Path], sample: int = 0
                  ) -> list[tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """``(step, graph inputs, graph outputs)`` of every call of one part in a scheduler dump, by step."""
    ins, outs = graph_io(parts[part])
    calls = []
    with open_dump(dump) as d:
        for (s, p, step), rid in sorted(d.record_keys().items(), key=lambda kv: kv[0][2]):
            if s != sample or p != part:
                continue
            fi = {e.name: d.read(e) for e in d.tensors(rid, kind="input") if e.name in ins}
            fo = {e.name: d.read(e) for e in d.tensors(rid) if e.name in outs}
            calls.append((step, {n: fi[n] for n in ins if n in fi}, {n: fo[n] for n in outs}))
    return calls


def write_session_folders(dump: Path, parts: dict[str, Path], root: Path, native_inputs: bool = False
                          ) -> dict[str, Path]:
    """The vision / prefill / decode folders of the scheduler run in ``dump``."""
    folders = {}
    for part in PARTS:
        calls = session_calls(dump, part, parts)
        folders[part] = write_net_run_folder(root / part, [(i, o) for _, i, o in calls], graph_io(parts[part])[1],
                                             native_inputs)
    return folders


# ------------------------------------------------------------------------------------------- dumps
def device_view(src: Path, dst: Path, parts: dict[str, Path], drop: tuple[str, ...] = ()) -> Path:
    """The dump of what the session folders carry: each call's graph inputs and outputs, no meta.

    ``drop`` names inputs left out as well, e.g. ``("position_ids",)`` for a device whose positions were not kept.
    """
    with open_dump(src) as d, DumpWriter(dst, backend="device", model=d.model, overwrite=True) as w:
        io = {p: graph_io(parts[p]) for p in PARTS}
        for (sample, part, step), rid in sorted(d.record_keys().items()):
            ins, outs = io.get(part, ([], []))
            w.begin_record(sample=sample, part=part, step=step)
            for e in d.tensors(rid, kind="input"):
                if e.name in ins and e.name not in drop:
                    w.add_input(e.name, d.read(e))
            for e in d.tensors(rid):
                if e.name in outs:
                    w.add_tensor(e.name, d.read(e), op_type="output")
    return dst


def reference_dump(parts_dir: Path, cache: str, image: np.ndarray, tokens: list[int], dst: Path) -> Path:
    """The reference run: parts with a position input on ORT CPU, correct positions, teacher-forced on ``tokens``.

    For a session whose decode graph has no position input, pass the export *with* positions.
    """
    sched = session_scheduler(parts_dir, cache, "correct")
    with DumpWriter(dst, backend="onnxruntime-cpu", overwrite=True) as w:
        sched.generate(image, writer=w, forced_tokens=tokens)
    return dst


# ------------------------------------------------------------------------------------------- sessions
def expected(fault: str, prefill_positions: np.ndarray) -> tuple[int, int | None]:
    """``(rope_delta, expected offset)`` of a fault: observed − expected decode position."""
    S = int(prefill_positions.shape[-1])
    mx = int(prefill_positions.max())
    rope_delta = mx + 1 - S
    return rope_delta, {"correct": None, "off_by_one": 1, "restart": -(mx + 1), "naive_text": -rope_delta}[fault]


def make_session(name: str, model_name: str, cache: str, fault: str, parts_dir: Path, root: Path,
                 image: np.ndarray, config: Path, native_inputs: bool = False) -> DeviceSession:
    """Run one device session over an export folder and write its folders under ``root``.

    For ``cache="dynamic"`` and ``fault="restart"``, ``parts_dir`` must hold the no-position decode variant.
    """
    from ivq_debug.vlm.export_dynamic import load_dynamic_manifest
    from ivq_debug.vlm.manifest import load_manifest

    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose from {sorted(FAULTS)}")
    m = load_dynamic_manifest(parts_dir) if cache == "dynamic" else load_manifest(parts_dir)
    nopos = cache == "dynamic" and not m.get("decode_position_input", True)
    if nopos != (cache == "dynamic" and fault == "restart"):
        raise ValueError(f"{parts_dir}: the dynamic restart session needs the no-position decode graph (and only it)")
    sched = session_scheduler(parts_dir, cache, "correct" if nopos else FAULTS[fault])
    root.mkdir(parents=True, exist_ok=True)
    full = root.parent / f"{root.name}.scheduler.h5"
    with DumpWriter(full, backend="onnxruntime-cpu", overwrite=True) as w:
        gen = sched.generate(image, writer=w)
    parts = dict(sched.spec.part_paths)
    folders = write_session_folders(full, parts, root, native_inputs)
    pos = sched.spec.prefill_positions
    rope_delta, off = expected(fault, pos)
    s = DeviceSession(name, model_name, cache, fault, root, folders, parts, config, list(gen.tokens),
                      int(pos.shape[-1]), rope_delta, off, None if off is None else 1, not nopos, full, native_inputs)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items() if k not in ("folders", "parts")}
    meta |= {"folders": {k: str(v) for k, v in folders.items()}, "parts": {k: str(v) for k, v in parts.items()}}
    atomic_write_text(root / "fixture.json", json.dumps(meta, indent=1), overwrite=True)
    return s


def parts_key(model_name: str, cache: str, fault: str) -> str:
    """Name of the parts folder a session runs: ``<model>-<cache>``, ``-nopos`` for the dynamic restart."""
    return f"{model_name}-{cache}" + ("-nopos" if cache == "dynamic" and fault == "restart" else "")


def parts_exporter(out: Path, load: Callable[[str], Any], verify: bool = True) -> Callable[[str, str, str], Any]:
    """``get(model_name, cache, fault) -> ExportResult`` of the parts that session runs, exported under
    ``out/<parts_key>`` on first use.

    ``load(model_name)`` returns the torch model; ``verify`` checks the dynamic-cache exports against torch
    (the fixed-cache export has its own tests).
    """
    from ivq_debug.vlm import task

    done: dict[str, Any] = {}

    def get(model_name: str, cache: str, fault: str = "correct") -> Any:
        key = parts_key(model_name, cache, fault)
        if key not in done:
            S = len(task.prompt_ids(_image_tokens())) if key.endswith("-nopos") else None
            done[key] = export_session_parts(load(model_name), out / key, cache, restart_prefill_len=S,
                                             verify=verify and cache == "dynamic", model_id=model_name)
        return done[key]

    return get


def build_sessions(out: Path, parts: Callable[[str, str, str], Any], sessions: tuple[tuple[str, str, str], ...] = SESSIONS
                   ) -> dict[str, DeviceSession]:
    """Write each of ``sessions`` under ``out/<name>``; ``parts`` is a :func:`parts_exporter`."""
    from ivq_debug.vlm.load import reference_path

    image = session_image()
    built: dict[str, DeviceSession] = {}
    for model_name, cache, fault in sessions:
        name = f"{model_name}-{cache}-{fault}"
        folder = parts(model_name, cache, fault).folder
        built[name] = make_session(name, model_name, cache, fault, folder, out / name, image,
                                   reference_path(model_name) / "config.json")
    return built


def session_image() -> np.ndarray:
    """The image every session captions (the first eval image of the bucket)."""
    from ivq_debug.vlm import task

    return task.eval_set(BUCKET, 1)[0].image


def _image_tokens() -> int:
    from ivq_debug.vlm.build import num_image_tokens

    return num_image_tokens(BUCKET)
