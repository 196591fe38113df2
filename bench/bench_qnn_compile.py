"""QNN HTP compile time against the number of exposed tensors, the context cache (miss vs hit), and `ivq capture qnn`.

Builds OCR-like recognizers and a ViT in torch (``tests/support/ocr_models.py``, no downloads), exports them with
the legacy exporter, quantizes them with ``ivq_debug.qnn.quantize.quantize_for_qnn`` (a8w8, a16w8), then, each
measurement in its own process under a hard timeout:

- **session**: one ``create_qnn_session`` of the QDQ model with N activation ``QuantizeLinear`` outputs exposed
  (N evenly spread in topological order) the way ``QnnHtpRunner`` exposes them (channels-last tensors through
  the NHWC plan; ``--layout`` adds the same rows exposed as plain NCHW outputs, the code before issue 18):
  wall and CPU seconds, QNN ops, and the QNN finalize time split into its stages (``profiling_level=detailed``);
- **cache**: the runner's capture sessions with every tensor exposed: compiled without a cache, compiled and
  published into a fresh context cache (miss), loaded from it (hit); the captured tensors compared bit for bit;
- **capture** (``--capture``): ``ivq capture qnn`` with every tensor vs ``--include`` of the model output only,
  both compiling (``--no-qnn-cache``), and every tensor again on a warm cache; with ``--baseline-src DIR`` (an
  exported older revision: ``git archive REV ivq_debug | tar -x -C DIR``) the same two cold captures with that
  code, in the same run.

Models (``--models``): ``ocr`` (PP-OCRv4-like, 1x3x48x320: the compile that explodes with exposed NCHW conv
tensors), ``crnn`` (conv + 2-layer BiLSTM, 80 steps), ``svtr``, ``vit12``, ``ocr-small``, ``vit-tiny``, or any
float ONNX file with static input shapes (calibrated on uniform random inputs).

    python bench/bench_qnn_compile.py [--models ocr,crnn,svtr,vit12] [--presets a8w8,a16w8]
        [--exposed 0,10,25,50,100,all] [--layout] [--capture] [--baseline-src DIR] [--option KEY=VALUE ...]
        [--timeout 600] [--json OUT]

Timings from the emulator depend on the machine load: the script prints the load average with each table, and
CPU seconds (user + system of the measuring process) are less sensitive to other work than wall seconds.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py
sys.path.insert(1, str(ROOT))  # tests/support/ocr_models.py (the models the tests use)
from common import bin_path, ivq_env, load_avg, say  # noqa: E402

DEFAULT_MODELS = ("ocr", "crnn", "svtr", "vit12")
PRESETS = ("a8w8", "a16w8")
#: finalize stages of the QNN profile (``profiling_level=detailed``), short column names
STAGES = {"QNN (finalize) time": "finalize", "Graph Optimizations": "graph_opt",
          "Graph Sequencing for Target": "sequencing", "VTCM Allocation": "vtcm"}


# ------------------------------------------------------------------------------------------------ models
def step_build(a: dict[str, Any]) -> dict[str, Any]:
    """Float ONNX (built-in torch model or a given file), a seeded sample, QDQ per preset."""
    import numpy as np

    from ivq_debug.onnxgraph.load import load_model
    from ivq_debug.qnn.quantize import quantize_for_qnn
    from tests.support import ocr_models

    work, name = Path(a["workdir"]), a["name"]
    t0 = time.perf_counter()
    if a.get("onnx"):
        float_path = work / f"{name}.onnx"
        shutil.copyfile(a["onnx"], float_path)
        proto = load_model(float_path)
        init = {i.name for i in proto.graph.initializer}
        inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
                  for i in proto.graph.input if i.name not in init}
        for k, dims in inputs.items():
            if not dims or any(d <= 0 for d in dims):
                raise SystemExit(f"{float_path}: input {k!r} has a dynamic shape {dims}; QNN HTP needs static shapes")
        rng = np.random.default_rng(0)
        sample = {k: rng.random(tuple(d), dtype=np.float32) for k, d in inputs.items()}
        calib = [{k: rng.random(tuple(d), dtype=np.float32) for k, d in inputs.items()} for _ in range(8)]
    else:
        float_path, shape, sample = ocr_models.build(name, work)
        calib = ocr_models.calibration(shape)
    np.savez(work / f"{name}.sample.npz", **sample)
    built: dict[str, Any] = {"float_s": round(time.perf_counter() - t0, 2), "qdq": {}}
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


def _runner(qdq: str, *, nhwc: bool = True, **kw: Any) -> Any:
    from ivq_debug.capture.base import Selection
    from ivq_debug.capture.qnn_ep.runner import QnnHtpRunner

    return QnnHtpRunner(qdq, selection=Selection(), channels_last=nhwc, **{"qnn_cache": False, **kw})


def _spread(sites: list[Any], n: str) -> list[Any]:
    """N of ``sites`` evenly spread in topological order (``all``: every one)."""
    k = len(sites) if n == "all" else min(int(n), len(sites))
    if k == 0:
        return []
    return [sites[i] for i in sorted({round(i * (len(sites) - 1) / max(1, k - 1)) for i in range(k)})]


def step_session(a: dict[str, Any]) -> dict[str, Any]:
    """One QNN HTP session with N exposed tensors: wall / CPU seconds, QNN ops and the finalize stages."""
    from ivq_debug.capture.qnn_ep.session import QnnSessionConfig, create_qnn_session

    runner = _runner(a["qdq"], nhwc=a.get("nhwc", True))
    chosen = _spread(runner.sites, a["n"])
    with tempfile.TemporaryDirectory(prefix="ivq-bench-qnn-") as td:
        csv = Path(td) / "profile.csv"
        cfg = QnnSessionConfig(profiling_level="detailed", profiling_file_path=csv,
                               provider_options=dict(a["options"]))
        model = runner.ort.model_with_outputs([s.output for s in chosen])
        c0, t0 = _cpu(), time.perf_counter()
        qs = create_qnn_session(model, cfg, session_options_factory=runner.ort.session_options,
                                model_proto=runner.model)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        stages = _stages(csv)
    summary = (qs.op_trace or {}).get("summary") or {}
    nhwc = sum(1 for s in chosen if s.output in runner.ort.exposed_as)
    return {"exposed": len(chosen), "sites": len(runner.sites), "channels_last": nhwc, "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "qnn_ops": summary.get("total_qnn_ops"), **stages}


def _capture_timed(qdq: str, feeds: dict[str, Any], out: Path, **kw: Any) -> dict[str, Any]:
    from ivq_debug.capture.base import capture

    r = _runner(qdq, **kw)
    c0, t0 = _cpu(), time.perf_counter()
    capture(r, [feeds], out, overwrite=True, progress=None)
    info = r.info
    sessions = {k: v["session_seconds"] for k, v in info["sessions"].items()}
    return {"capture_s": round(time.perf_counter() - t0, 2), "cpu_s": round(_cpu() - c0, 2), "sessions": sessions,
            "cache": info.get("context_cache"), "exposed": info["exposed_tensors"]}


def _raw_bytes(path: Path) -> dict[str, bytes]:
    from ivq_debug.dump import open_dump

    with open_dump(path) as d:
        return {e.name: (d.read_raw(e) if e.has_raw else d.read(e.name)).tobytes() for e in d.tensors()}


def step_cache(a: dict[str, Any]) -> dict[str, Any]:
    """The runner's capture with every tensor exposed: no cache, cache miss (compile + publish), cache hit
    (load); session seconds and the captured tensors compared bit for bit."""
    import numpy as np

    feeds = dict(np.load(a["sample"]))
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ivq-bench-ctx-") as td:
        cache = Path(td) / "cache"
        for label, kw in (("compile", {}), ("miss", {"qnn_cache": cache}), ("hit", {"qnn_cache": cache})):
            res[label] = _capture_timed(a["qdq"], feeds, Path(td) / f"{label}.h5", **kw)
        ref = _raw_bytes(Path(td) / "compile.h5")
        for label in ("miss", "hit"):
            res[f"{label}_bit_identical"] = _raw_bytes(Path(td) / f"{label}.h5") == ref
        res["cache_bytes"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    res["exposed"] = res["hit"]["exposed"]
    return res


def step_capture(a: dict[str, Any]) -> dict[str, Any]:
    """``ivq capture qnn`` wall time: every tensor vs the model output only, compiling (``--no-qnn-cache``);
    every tensor on a warm cache; with ``baseline_src`` the two cold captures with that code too."""
    from ivq_debug.onnxgraph.load import load_model

    outputs = [o.name for o in load_model(a["qdq"]).graph.output]
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ivq-bench-cap-") as td:
        cache = Path(td) / "cache"
        plans: list[tuple[str, list[str], str | None]] = [
            ("all", ["--no-qnn-cache"], None),
            ("outputs_only", ["--no-qnn-cache", *[x for o in outputs for x in ("--include", o)]], None),
            ("all_miss", ["--qnn-cache", str(cache)], None),
            ("all_hit", ["--qnn-cache", str(cache)], None)]
        if a.get("groups"):
            plans.append(("groups", ["--no-qnn-cache", "--max-outputs-per-run", str(a["groups"])], None))
        if a.get("baseline_src"):
            plans += [("before_all", [], a["baseline_src"]),
                      ("before_outputs_only", [x for o in outputs for x in ("--include", o)], a["baseline_src"])]
            if a.get("groups"):
                plans.append(("before_groups", ["--max-outputs-per-run", str(a["groups"])], a["baseline_src"]))
        for label, extra, src in plans:
            cmd = [bin_path("ivq"), "capture", "qnn", a["qdq"], "--inputs", a["sample"], "-o",
                   str(Path(td) / f"{label}.h5"), "--force", *extra]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a["timeout"], env=ivq_env(src))
            except subprocess.TimeoutExpired:
                res[f"{label}_error"] = f"timed out after {a['timeout']:.0f} s"
                continue
            res[f"{label}_s"] = round(time.perf_counter() - t0, 1)
            if p.returncode != 0:
                res[f"{label}_error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
            elif label.endswith("groups"):
                from ivq_debug.dump import open_dump

                with open_dump(Path(td) / f"{label}.h5") as d:
                    info = d.backend_info
                res[f"{label}_sessions"] = len(info.get("sessions", {}))
                res[f"{label}_unexposable"] = len(info.get("unexposable", []))
        if "all_s" in res and "all_hit_s" in res and "all_error" not in res and "all_hit_error" not in res:
            res["hit_bit_identical"] = _raw_bytes(Path(td) / "all_hit.h5") == _raw_bytes(Path(td) / "all.h5")
        if a.get("baseline_src") and "before_all_s" in res and "before_all_error" not in res:
            from ivq_debug.dump import open_dump

            before, after = _raw_bytes(Path(td) / "before_all.h5"), _raw_bytes(Path(td) / "all.h5")
            res["before_tensors"], res["after_tensors"] = len(before), len(after)
            res["before_identical"] = sum(before[k] == after.get(k) for k in before)
            res["before_differ"] = [k for k in before if k in after and before[k] != after[k]][:6]
            res["before_only"] = sorted(set(before) - set(after))[:6]
            for label in ("before_all", "all"):
                with open_dump(Path(td) / f"{label}.h5") as d:
                    res[f"{label}_exposure_check"] = d.backend_info.get("exposure_check")
    for pre in ("", "before_"):
        if res.get(f"{pre}all_s") and res.get(f"{pre}outputs_only_s"):
            res[f"{pre}ratio"] = round(res[f"{pre}all_s"] / res[f"{pre}outputs_only_s"], 2)
    return res


STEPS = {"build": step_build, "session": step_session, "cache": step_cache, "capture": step_capture}


# ------------------------------------------------------------------------------------------------ driver
def run_step(step: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one step in its own process under ``timeout`` seconds; its JSON result or ``{"error": ...}``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step, "--step-args", json.dumps(args)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                           env=ivq_env())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"error": f"exit {p.returncode}: {tail[-1][:240] if tail else ''}"}
    return json.loads(lines[-1])


def _fmt(v: Any) -> str:
    return "–" if v is None else str(v)


def _groups(c: dict[str, Any]) -> str:
    def one(pre: str) -> str:
        return (f"{_fmt(c.get(pre + 'groups_s'))} s, {_fmt(c.get(pre + 'groups_sessions'))}, "
                f"{_fmt(c.get(pre + 'groups_unexposable'))}")
    return "–" if "groups_s" not in c else f"{one('before_')} / {one('')}"


def _tables(rows: list[dict[str, Any]], caches: list[dict[str, Any]], captures: list[dict[str, Any]]) -> None:
    print(f"\n## session creation vs exposed tensors ({load_avg()})\n")
    print("| model | preset | exposed | layout | channels-last | QNN ops | wall s | CPU s | finalize s | graph opt s | "
          "sequencing s | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['preset']} | {_fmt(r.get('exposed', r['n']))} | {r['layout']} | "
              f"{_fmt(r.get('channels_last'))} | {_fmt(r.get('qnn_ops'))} | {_fmt(r.get('wall_s'))} | "
              f"{_fmt(r.get('cpu_s'))} | {_fmt(r.get('finalize'))} | {_fmt(r.get('graph_opt'))} | "
              f"{_fmt(r.get('sequencing'))} | {r.get('error', '')} |")
    if caches:
        print("\n## context cache: the capture with every tensor exposed, no cache / miss (compile + publish) / hit\n")
        print("| model | preset | exposed | capture s: no cache / miss / hit | capture session s: no cache / miss / "
              "hit (load) | plain session s: no cache / miss / hit | cache bytes | miss = no cache | hit = no cache "
              "| note |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for c in caches:
            if "error" in c:
                print(f"| {c['model']} | {c['preset']} | – | – | – | – | – | – | – | {c['error']} |")
                continue
            k = ("compile", "miss", "hit")
            tot = " / ".join(_fmt(c[x]["capture_s"]) for x in k)
            cap = " / ".join(_fmt(c[x]["sessions"].get("capture")) for x in k)
            plain = " / ".join(_fmt(c[x]["sessions"].get("plain")) for x in k)
            print(f"| {c['model']} | {c['preset']} | {c['exposed']} | {tot} | {cap} | {plain} | "
                  f"{_fmt(c.get('cache_bytes'))} | {c['miss_bit_identical']} | {c['hit_bit_identical']} | |")
    if captures:
        print(f"\n## ivq capture qnn: every tensor vs the model output only ({load_avg()})\n")
        print("| model | preset | all s (compiling) | outputs only s | ratio | all, cache miss s | all, cache hit s | "
              "hit = compiled | before: all s | before: outputs only s | before: ratio | before = after tensors | "
              "groups: s, sessions, unexposable (before / after) | note |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in captures:
            note = "; ".join(f"{k[:-6]}: {v}" for k, v in c.items() if k.endswith("_error"))
            same = (f"{c['before_identical']} / {c['before_tensors']}" if "before_identical" in c else "–")
            print(f"| {c['model']} | {c['preset']} | {_fmt(c.get('all_s'))} | {_fmt(c.get('outputs_only_s'))} | "
                  f"{_fmt(c.get('ratio'))} | {_fmt(c.get('all_miss_s'))} | {_fmt(c.get('all_hit_s'))} | "
                  f"{_fmt(c.get('hit_bit_identical'))} | {_fmt(c.get('before_all_s'))} | "
                  f"{_fmt(c.get('before_outputs_only_s'))} | {_fmt(c.get('before_ratio'))} | {same} | "
                  f"{_groups(c)} | {note or c.get('error', '')} |")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated built-in names (ocr, crnn, svtr, vit12, ocr-small, vit-tiny) or paths of "
                         "float ONNX models with static inputs")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--exposed", default="0,10,25,50,100,all", help="numbers of exposed tensors to time")
    ap.add_argument("--layout", action="store_true",
                    help="also time each exposure count with plain NCHW exposure (the code before issue 18)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="extra QNN provider option for every session (e.g. htp_graph_finalization_optimization_mode=1)")
    ap.add_argument("--no-cache", action="store_true", help="skip the context cache rows")
    ap.add_argument("--capture", action="store_true", help="also time `ivq capture qnn` (all vs output only)")
    ap.add_argument("--groups", type=int, default=None, metavar="N",
                    help="with --capture: also capture in groups of N tensors (--max-outputs-per-run N)")
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="with --capture: also the cold captures with the ivq_debug package found in DIR")
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
    print(f"# bench_qnn_compile ({load_avg()}; {os.cpu_count()} cores; options {options or 'default'})", flush=True)
    rows: list[dict[str, Any]] = []
    caches: list[dict[str, Any]] = []
    captures: list[dict[str, Any]] = []
    layouts = [("nhwc", True)] + ([("nchw", False)] if a.layout else [])
    try:
        for spec in [m for m in a.models.split(",") if m]:
            builtin = not spec.endswith(".onnx")
            name = spec if builtin else Path(spec).stem
            say(f"{name}: building")
            built = run_step("build", {"workdir": str(work), "name": name, "presets": presets,
                                       "onnx": None if builtin else str(Path(spec).resolve())}, a.timeout)
            if "error" in built:
                print(f"{name}: build failed: {built['error']}", flush=True)
                continue
            sample = str(work / f"{name}.sample.npz")
            for preset, q in built["qdq"].items():
                n_sites = None
                for n in [x for x in a.exposed.split(",") if x]:
                    if n != "all" and n_sites is not None and int(n) >= n_sites:
                        continue  # the same session as "all"
                    for layout, nhwc in layouts:
                        if n == "0" and layout == "nchw":
                            continue  # nothing exposed: the same session
                        say(f"{name} {preset}: session, {n} exposed, {layout}")
                        r = run_step("session", {"qdq": q["path"], "n": n, "options": options, "nhwc": nhwc},
                                     a.timeout)
                        n_sites = r.get("sites", n_sites)
                        rows.append({"model": name, "preset": preset, "n": n, "layout": layout, **r})
                        print(json.dumps(rows[-1]), flush=True)
                if not a.no_cache:
                    say(f"{name} {preset}: cache")
                    caches.append({"model": name, "preset": preset,
                                   **run_step("cache", {"qdq": q["path"], "sample": sample}, 3 * a.timeout)})
                    print(json.dumps(caches[-1]), flush=True)
                if a.capture:
                    say(f"{name} {preset}: ivq capture qnn")
                    captures.append({"model": name, "preset": preset, **run_step(
                        "capture", {"qdq": q["path"], "sample": sample, "timeout": a.timeout, "groups": a.groups,
                                    "baseline_src": str(Path(a.baseline_src).resolve()) if a.baseline_src else None},
                        6 * a.timeout + 60)})
                    print(json.dumps(captures[-1]), flush=True)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    _tables(rows, caches, captures)
    if a.json:
        from ivq_debug.outputs import atomic_write_text

        atomic_write_text(a.json, json.dumps({"options": options, "sessions": rows, "cache": caches,
                                              "capture": captures}, indent=1), overwrite=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
