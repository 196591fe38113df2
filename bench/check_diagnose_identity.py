"""Bit-identity, model parses and wall time of ``ivq diagnose`` on the reference models (issue 27).

``run`` executes a fixed list of ``ivq diagnose`` commands in this process (the CLI a user takes) and writes, per
command, its exit code, its ``--json`` document (``ivq-replay/2``: the replay table, skipped units, findings; the
wall times, ``seconds``, dropped), and what it parsed: every ``onnx.load`` / ``onnx.load_from_string`` / in-place load
and every ONNX Runtime session by source (a file path, or ``<bytes>`` for a model serialized in memory), and every
ONNX model written to disk (``onnx.save``). Run it with each revision (``PYTHONPATH=<checkout>``) on the same
work folder; ``compare`` then checks that every document is equal (floats are compared through their JSON text,
which round-trips a float64 exactly) and prints the parse counts side by side. ``time`` runs one command in its own
process and prints its wall time.

The reference models: the 2-block ViT of ``tests/support/vit.py`` (transformers' ``ViTModel`` quantized with ORT's
QNN flow, an injected activation-scale fault; CPU-QDQ and QNN HTP replays, with and without the user's float model,
every record, the executor) built in ``WORK/vit`` on first use, and with ``--demo DIR`` (an ``ivq demo`` folder:
``DIR/golden``, ``DIR/work``) the demo's prefill on CPU-QDQ and vision on QNN HTP (``docs/scale.md``).

    python bench/check_diagnose_identity.py run --work /tmp/idw -o /tmp/before.json [--demo /tmp/demo]
    python bench/check_diagnose_identity.py compare /tmp/before.json /tmp/after.json
    python bench/check_diagnose_identity.py time --work /tmp/idw [--demo /tmp/demo] [--name vit-cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
#: fields of an ``ivq-replay/2`` document that measure the run rather than its results
RUN_FIELDS = ("seconds",)


class _Factory:
    """The ``tmp_path_factory`` that ``tests/support/vit.models`` takes, in a fixed folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        p = self.root / name
        p.mkdir(parents=True, exist_ok=True)
        return p


def vit_files(work: Path) -> dict[str, Path]:
    """The ViT models and dumps (built once in ``work/vit``)."""
    from ivq_debug.capture.base import Selection, capture, make_runner
    from tests.support import vit

    d = work / "vit"
    done = d / "files.json"
    if done.is_file():
        return {k: Path(v) for k, v in json.loads(done.read_text()).items()}
    m = dict(vit.models(_Factory(d)))
    m["test"] = capture(make_runner("onnx", m["act"], selection=Selection()), [vit.image(7), vit.image(8)],
                        d / "act.h5", progress=None)
    m["htp"] = capture(make_runner("qnn", m["act"], selection=Selection()), [vit.image(7)], d / "act-htp.h5",
                       progress=None)
    m["other"] = capture(make_runner("onnx", m["act"], selection=Selection()), [vit.image(9), vit.image(8)],
                         d / "other-inputs.h5", progress=None)
    done.write_text(json.dumps({k: str(v) for k, v in m.items()}))
    return m


def commands(work: Path, demo: Path | None) -> dict[str, list[str]]:
    """The ``ivq diagnose`` argument lists, by name."""
    m = vit_files(work)
    out = {
        "vit-cpu": [m["ref"], m["test"], "--model", m["act"]],
        "vit-cpu-float-all-iso": [m["ref"], m["test"], "--model", m["act"], "--float-model", m["float"],
                                  "--record", "all", "--attribution", "iso"],
        "vit-cpu-opt-all": [m["ref"], m["test"], "--model", m["act"], "--optimization", "all", "--no-lift"],
        "vit-qnn": [m["ref"], m["htp"], "--model", m["act"], "--backend", "qnn", "--float-model", m["float"]],
        "vit-workers": [m["ref"], m["test"], "--model", m["act"], "--record", "all", "--workers", "2", "--no-lift"],
        "vit-other-inputs": [m["ref"], m["other"], "--model", m["act"]],
    }
    if demo is not None:
        g, w = demo / "golden", demo / "work"
        out["demo-prefill-cpu"] = [g / "demo-ort-fp32.h5", g / "demo-cpu-qdq-a8w8.h5", "--model",
                                   w / "prefill.a8w8.qdq.onnx"]
        export = next(w.glob("*/export.json")).parent  # the exported float parts
        out["demo-prefill-cpu-float"] = [g / "demo-ort-fp32.h5", g / "demo-cpu-qdq-a8w8.h5", "--model",
                                         w / "prefill.a8w8.qdq.onnx", "--float-model",
                                         next(export.glob("prefill*.onnx"))]
        out["demo-vision-qnn"] = [g / "demo-ort-fp32.h5", g / "demo-htp-a8w8.h5", "--model",
                                  w / "vision.a8w8.qdq.onnx", "--record", "0/vision/0", "--backend", "qnn"]
    return {k: [str(x) for x in v] for k, v in out.items()}


def run_one(args: list[str], out: Path) -> dict[str, Any]:
    """One ``ivq diagnose`` in this process: exit code, JSON document, parse counts."""
    from ivq_debug.cli.main import main
    from tests.support.parses import counting

    out.unlink(missing_ok=True)
    with counting() as counts:
        try:
            main(["diagnose", *args, "--json", str(out), "--force"])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
    doc = json.loads(out.read_text()) if out.is_file() else None
    if doc is not None:
        for f in RUN_FIELDS:
            doc.pop(f, None)
    return {"exit": code, "doc": doc, "counts": {k: dict(v) for k, v in counts.items()}}


def run_mode(work: Path, demo: Path | None, out: str, only: list[str] | None) -> int:
    os.environ.setdefault("IVQ_NO_PROGRESS", "1")
    os.environ.setdefault("IVQ_QNN_CACHE", "off")
    work.mkdir(parents=True, exist_ok=True)
    res = {}
    for name, args in commands(work, demo).items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        res[name] = run_one(args, work / f"{name}.json")
        res[name]["seconds"] = round(time.perf_counter() - t0, 2)
        c = res[name]["counts"]
        print(f"{name}: exit {res[name]['exit']}, {res[name]['seconds']} s, parses {sum(c['onnx_parse'].values())}, "
              f"sessions {sum(c['ort_session'].values())}, saves {sum(c['onnx_save'].values())}", flush=True)
    Path(out).write_text(json.dumps(res, indent=1, sort_keys=True))
    return 0


def timeless(doc: Any) -> Any:
    """A document without its wall times (:data:`RUN_FIELDS` at any depth: the effect runs time themselves too)."""
    if isinstance(doc, dict):
        return {k: timeless(v) for k, v in doc.items() if k not in RUN_FIELDS}
    return [timeless(v) for v in doc] if isinstance(doc, list) else doc


def compare_mode(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    for res in (*a.values(), *b.values()):
        res["doc"] = timeless(res["doc"])
    bad = 0
    for name in sorted(set(a) & set(b)):
        ra, rb = a[name], b[name]
        same = ra["exit"] == rb["exit"] and ra["doc"] == rb["doc"]
        units = len((ra["doc"] or {}).get("units", []))
        findings = len((ra["doc"] or {}).get("findings", []))
        print(f"{name}: {'identical' if same else 'DIFFERENT'} (exit {ra['exit']}/{rb['exit']}, {units} units, "
              f"{findings} findings), {ra['seconds']} s -> {rb['seconds']} s")
        if not same:
            bad += 1
            da, db = ra["doc"] or {}, rb["doc"] or {}
            for k in sorted(set(da) | set(db)):
                if da.get(k) != db.get(k):
                    print(f"    {k}: {json.dumps(da.get(k))[:300]}\n    -> {json.dumps(db.get(k))[:300]}")
        for kind in ("onnx_parse", "ort_session", "onnx_save"):
            ca, cb = ra["counts"][kind], rb["counts"][kind]
            print(f"    {kind}: {sum(ca.values())} {dict(sorted(ca.items()))}\n"
                  f"    {' ' * len(kind)}  -> {sum(cb.values())} {dict(sorted(cb.items()))}")
    missing = sorted(set(a) ^ set(b))
    if missing:
        print(f"only in one file: {missing}")
    return 1 if bad else 0


def time_mode(work: Path, demo: Path | None, name: str) -> int:
    args = commands(work, demo)[name]
    env = dict(os.environ, IVQ_NO_PROGRESS="1", IVQ_QNN_CACHE="off")
    cmd = [sys.executable, "-m", "ivq_debug", "diagnose", *args, "--json", str(work / f"{name}.time.json"), "--force"]
    t0 = time.perf_counter()
    code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode
    print(f"{name}: exit {code}, wall {time.perf_counter() - t0:.2f} s: {' '.join(cmd[1:])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--demo", type=Path)
    r.add_argument("-o", "--out", required=True)
    r.add_argument("--only", action="append")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    t = sub.add_parser("time")
    t.add_argument("--work", type=Path, required=True)
    t.add_argument("--demo", type=Path)
    t.add_argument("--name", default="vit-cpu")
    a = p.parse_args(argv)
    if a.mode == "run":
        return run_mode(a.work, a.demo, a.out, a.only)
    if a.mode == "compare":
        return compare_mode(a.a, a.b)
    return time_mode(a.work, a.demo, a.name)


if __name__ == "__main__":
    sys.exit(main())
