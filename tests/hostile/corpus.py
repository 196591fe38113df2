"""The valid small inputs the hostile cases start from, built once per session with the project's own code.

Everything here is real: the float and QDQ models of ``tests/fixtures/qnn`` (a conv path and a
transformer path, quantized a16/w8 by ORT), their ORT captures written by :class:`DumpWriter`
(``float.h5``: ONNX Runtime CPU, ``qdq.h5``: CPU-QDQ, the same inputs), the encodings the QDQ model uses
written in every overrides format the project reads, an ``ivq-diff/1`` result of the two dumps (a
``--baseline``), the committed qnn-net-run output folder with its converter JSON, the committed
profiling files, and that folder ingested with its profile (``ingest.h5``). Each case copies what it needs into its own folder before breaking it.

Built on first use (:class:`Corpus`, so a run that selects none of their cases pays nothing): a device session
(``parts/``: the dynamic-cache InternVL-tiny export, ``phone/``: its vision / prefill / decode qnn-net-run
folders from a real ORT run, ``session.h5``: them ingested by ``ivq ingest session``; about 9 s), and a QNN
compiled-context cache of ``model.qdq.onnx`` (``qnncache/``: one ``ivq capture qnn`` entry), and the job shards
of ``ivq calib-stats``, ``ivq diagnose`` and ``ivq tune --sweep`` (:func:`_jobs_run`: one real run each, 5 to 15 s).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "qnn"


def _feeds(sample: int) -> dict[str, np.ndarray]:
    with np.load(FIX / "reference.npz", allow_pickle=False) as z:
        return {"input.1": z[f"feeds|{sample}|input.1"], "text.embeds": z[f"feeds|{sample}|text.embeds"]}


def _capture(model: Path, feeds: dict[str, np.ndarray], out: Path) -> Path:
    from ivq_debug.capture.base import Selection
    from ivq_debug.capture.onnxrt.runner import OrtRunner
    from ivq_debug.dump import DumpWriter
    from ivq_debug.inputfiles import sha256_file

    r = OrtRunner(model, selection=Selection())
    with DumpWriter(out, backend=r.backend, backend_info=r.info,
                    model={"path": model.name, "sha256": sha256_file(model), "part": "model"},
                    command="tests/hostile corpus") as w:
        w.begin_record(sample=0, part="model", step=0)
        r.run(feeds, w)
    return out


class Corpus(dict):
    """name → path of the corpus; the lazy groups (:data:`LAZY`) are built when a case first asks for one."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        group = next((g for g, names in LAZY.items() if name in names), None)
        if group is None:
            raise KeyError(name)
        self.update(_BUILDERS[group](self.root))
        return self[name]


def _session(root: Path) -> dict[str, Path]:
    from ivq_debug.capture.qnn_net_run.ingest import SessionSpec, capture_session
    from ivq_debug.vlm.load import load_vlm
    from tests.support.device_sessions import build_sessions, parts_exporter

    src = root / "session-src"
    px = parts_exporter(src / "parts", lambda n: load_vlm(n).model, verify=False)
    s = build_sessions(src / "sessions", px, (("internvl-tiny", "dynamic", "correct"),))["internvl-tiny-dynamic-correct"]
    parts = Path(shutil.copytree(s.parts["decode"].parent, root / "parts"))
    phone = root / "phone"
    for part, folder in s.folders.items():
        shutil.copytree(folder, phone / part)
    spec = SessionSpec({p: [phone / p] for p in ("vision", "prefill", "decode")}, model_dir=parts)
    capture_session(spec, root / "session.h5")
    return {"parts": parts, "phone": phone, "session.h5": root / "session.h5"}


def _qnn_cache(root: Path) -> dict[str, Path]:
    import subprocess
    import sys

    cache = root / "qnncache"
    subprocess.run([sys.executable, "-m", "ivq_debug", "capture", "qnn", str(root / "model.qdq.onnx"), "--inputs",
                    str(root / "x.npz"), "-o", str(root / "qnncache.h5"), "--qnn-cache", str(cache)],
                   check=True, capture_output=True, cwd=Path(__file__).resolve().parents[2])
    return {"qnncache": cache}


def _jobs_run(root: Path, slot: str, out: str, codes: tuple[int, ...]) -> Path:
    """The shards of one command that runs jobs, from a real run in ``jobs-<slot>/`` (inputs named as the shard
    cases name them, so that a rerun in a case's folder finds every shard and runs no job): ``calib-shards``
    (``ivq calib-stats --shards``: the range and the histogram pass), ``replay-shards`` (``ivq diagnose
    --shards``), ``sweep-wd`` (``ivq tune --sweep``'s workdir, its shards in ``trials/sweep/shards``)."""
    import subprocess
    import sys

    d = root / f"jobs-{slot}"
    d.mkdir()
    for name in ("model.onnx", "model.qdq.onnx", "x.npz", "float.h5", "qdq.h5"):
        shutil.copyfile(root / name, d / name)
    shutil.copyfile(root / "x.npz", d / "calib.npz")
    shutil.copyfile(root / "x.npz", d / "x2.npz")  # two --inputs: tune warns (a second stderr line) about one
    argv = [a for a in SHARD_ARGV[slot] if a != "--resume"]  # the first run of a sweep is not a resume
    r = subprocess.run([sys.executable, "-m", "ivq_debug", *argv], capture_output=True, cwd=d,
                       env={**os.environ, "PYTHONPATH": str(FIX.parents[2]), "IVQ_NO_PROGRESS": "1"})
    if r.returncode not in codes:
        raise RuntimeError(f"{slot} for the shard corpus: exit {r.returncode}: {r.stderr.decode()[-500:]}")
    return d / out


#: the commands that run jobs, as the shard cases and :func:`_shards` run them (inputs in the working folder)
SHARD_ARGV: dict[str, list[str]] = {
    "calib-stats": ["calib-stats", "model.onnx", "--calibration", "x.npz", "--encodings", "model.qdq.onnx", "-o",
                    "s.json", "--shards", "cs"],
    "diagnose": ["diagnose", "float.h5", "qdq.h5", "--model", "model.qdq.onnx", "--shards", "ds", "--budget-sqnr",
                 "-1000"],
    "tune": ["tune", "model.onnx", "--calibration", "calib.npz", "--inputs", "x.npz", "--inputs", "x2.npz", "-o",
             "wd", "--backend", "cpu", "--sweep", "--groups", "2", "--resume"],
}

#: lazy group → the names it provides
LAZY: dict[str, tuple[str, ...]] = {"session": ("parts", "phone", "session.h5"), "qnncache": ("qnncache",),
                                    "calib-shards": ("calib-shards",), "replay-shards": ("replay-shards",),
                                    "sweep-wd": ("sweep-wd",)}
_BUILDERS = {"session": _session, "qnncache": _qnn_cache,
             "calib-shards": lambda root: {"calib-shards": _jobs_run(root, "calib-stats", "cs", (0, 1))},
             "replay-shards": lambda root: {"replay-shards": _jobs_run(root, "diagnose", "ds", (0,))},
             "sweep-wd": lambda root: {"sweep-wd": _jobs_run(root, "tune", "wd", (0, 1))}}


def build(root: Path) -> Corpus:
    """Write the valid corpus under ``root``; returns name → path (names are the files' names)."""
    from ivq_debug.comparator import compare
    from ivq_debug.dump import open_dump
    from ivq_debug.qnn.encodings import encodings_from_qdq_model, to_legacy, to_ort_overrides, to_v1

    root.mkdir(parents=True, exist_ok=True)
    out = Corpus(root)

    def put(name: str, data: bytes | str) -> Path:
        p = root / name
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        out[name] = p
        return p

    for name in ("model.onnx", "model.qdq.onnx"):
        out[name] = Path(shutil.copy(FIX / name, root / name))
    np.savez(root / "x.npz", **_feeds(0))
    out["x.npz"] = root / "x.npz"
    out["float.h5"] = _capture(out["model.onnx"], _feeds(0), root / "float.h5")
    out["qdq.h5"] = _capture(out["model.qdq.onnx"], _feeds(0), root / "qdq.h5")

    encs = encodings_from_qdq_model(out["model.qdq.onnx"])
    put("legacy.json", json.dumps(to_legacy(encs), indent=1))
    put("v1.json", json.dumps(to_v1(encs), indent=1))
    no_bias = replace(encs, params={n: e for n, e in encs.params.items() if e.bitwidth != 32})
    put("ort.json", json.dumps(to_ort_overrides(no_bias, json_safe=True), indent=1))
    aimet2 = {"version": "2.0.0", "activation_encodings": [], "param_encodings": []}
    for sec, target in ((encs.activations, "activation_encodings"), (encs.params, "param_encodings")):
        for n, e in sec.items():
            s = e.as_signed() if e.symmetric else e
            aimet2[target].append({"name": n, "output_dtype": f"{'int' if s.signed else 'uint'}{e.bitwidth}",
                                   "y_scale": list(s.scale) if len(s.scale) > 1 else s.scale[0],
                                   "y_zero_point": list(s.zero_point) if len(s.zero_point) > 1 else s.zero_point[0],
                                   **({"axis": e.axis} if e.axis is not None else {})})
    put("aimet2.json", json.dumps(aimet2, indent=1))

    with open_dump(out["float.h5"]) as a, open_dump(out["qdq.h5"]) as b:
        put("baseline.json", json.dumps(compare(a, b).to_json()))
    put("map.json", "{}\n")

    shutil.copytree(FIX / "net_run" / "single", root / "netrun")
    out["netrun"] = root / "netrun"
    for f in ("qnn_ep_detailed.csv", "qnn_ep_basic.csv", "ort_trace.json", "viewer_basic.txt"):
        out[f] = Path(shutil.copy(FIX / "profiling" / f, root / f))
    # a device run ingested with its profile: the dump the report's timeline reads
    from ivq_debug.capture.qnn_net_run.ingest import capture_net_run

    out["ingest.h5"] = capture_net_run(out["netrun"] / "output", root / "ingest.h5", out["netrun"] / "model_net.json",
                                       model=out["model.qdq.onnx"], profiling=out["qnn_ep_detailed.csv"]).path
    return out
