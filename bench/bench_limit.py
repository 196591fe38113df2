"""Capture and diff against what the machine allows: the plain forward, writing the same bytes, reading them back.

On one model and its inputs, in one run, each step its own process (``bench/common.py:run_measured``: wall time
from process start to exit, imports included, and peak RSS):

- **forward**: the model run once with nothing exposed, as a user runs it (``onnxruntime`` CPU EP with graph
  optimizations disabled like ivq's reference; on QNN HTP through ``create_qnn_session``, which compiles the
  graph, or loads it from a warm context cache);
- **capture**: ``ivq capture onnx|qnn`` of the same model and inputs (the CLI);
- **raw write**: every array the capture stored (the float values and, for QDQ tensors, the raw integers: the
  dump's bytes) written with ``np.save`` into its own file, then every file and the folder fsynced; the seconds
  of the writes only (the arrays are read from the dump before the clock starts);
- **read**: both dumps of the diff read sequentially in 8 MiB reads, after evicting them from the page cache
  (``posix_fadvise(DONTNEED)`` on those two files only);
- **diff**: ``ivq-diff ref.h5 test.h5 --json``, also after evicting both dumps.

and prints ``capture / (forward + raw write)`` (the issue-18 goal: ≤ 1.3) and ``diff rate / read rate`` (goal:
≥ 70 %). Models (``--models``): ``scale`` (``bench_scale.py``'s InternVL2-2B-shaped prefill at ``--scale``, CPU:
the reference vs its perturbed copy), ``ocr`` (``tests/support/ocr_models.py``'s PP-OCRv4-like recognizer at
a16w8: CPU-QDQ reference vs QNN HTP, cold and with a warm context cache).

    python bench/bench_limit.py [--models scale,ocr] [--scale 1] [--workdir DIR] [--json OUT]

Timings depend on the machine load (printed with the table). See docs/scale.md and docs/qnn-compile.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, bench_scale.py
from common import GiB, bin_path, ivq_env, load_avg, mem_available, run_measured, say, self_cmd, step_result

HERE = Path(__file__).resolve().parent
READ_CHUNK = 8 << 20


# ------------------------------------------------------------------------------------------------ steps
def step_forward(a: dict[str, Any]) -> dict[str, Any]:
    """One plain forward (nothing exposed): session creation and run seconds."""
    import numpy as np

    feeds = dict(np.load(a["inputs"]))
    t0 = time.perf_counter()
    if a["backend"] == "qnn":
        import onnxruntime as ort

        from ivq_debug.capture.qnn_ep.cache import ContextCache
        from ivq_debug.capture.qnn_ep.session import create_qnn_session

        def options() -> Any:
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            return so

        cache = ContextCache(a["cache"]) if a.get("cache") else None
        sess = create_qnn_session(a["model"], session_options_factory=options, cache=cache).session
    else:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(a["model"], sess_options=so, providers=["CPUExecutionProvider"])
    t1 = time.perf_counter()
    out = sess.run(None, feeds)
    t2 = time.perf_counter()
    return {"session_s": round(t1 - t0, 3), "run_s": round(t2 - t1, 3), "outputs": len(out)}


def step_raw_write(a: dict[str, Any]) -> dict[str, Any]:
    """np.save of every array a dump stores (values + raw integers), each in its own file, then fsync."""
    import numpy as np

    from ivq_debug.dump import open_dump

    arrays = []
    with open_dump(a["dump"]) as d:
        for e in d.tensors():
            if not e.derived:  # (a tensor stored as its integers only: the dump holds the integers alone)
                arrays.append(d.read(e))
            if e.has_raw:
                arrays.append(d.read_raw(e))
    out = Path(a["out"])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    paths = []
    for i, arr in enumerate(arrays):
        p = out / f"{i}.npy"
        with open(p, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        paths.append(p)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    fd = os.open(out, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    nbytes = sum(p.stat().st_size for p in paths)
    shutil.rmtree(out, ignore_errors=True)
    return {"write_s": round(dt, 3), "bytes": nbytes, "files": len(paths),
            "array_bytes": int(sum(x.nbytes for x in arrays))}


def _evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def step_evict(a: dict[str, Any]) -> dict[str, Any]:
    """Drop these files' pages from the page cache (their next read comes from the disk)."""
    _evict(a["paths"])
    return {"evicted": len(a["paths"])}


def step_read(a: dict[str, Any]) -> dict[str, Any]:
    """Read the files sequentially (8 MiB reads) after evicting them from the page cache."""
    _evict(a["paths"])
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for p in a["paths"]:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return {"read_s": round(time.perf_counter() - t0, 3), "bytes": total}


STEPS = {"forward": step_forward, "raw-write": step_raw_write, "read": step_read, "evict": step_evict}


# ------------------------------------------------------------------------------------------------ driver
def _step(name: str, args: dict[str, Any], log: Path, opts: argparse.Namespace) -> dict[str, Any]:
    m = run_measured(self_cmd(__file__, name, args), log=log, guard=opts.guard, env=ivq_env())
    res = step_result(m) if m.ok else {"error": m.why()}
    return {**res, "wall_s": round(m.seconds, 2), "peak_rss": m.peak_rss}


def _cli(cmd: list[str], log: Path, opts: argparse.Namespace, ok: tuple[int, ...] = (0,)) -> dict[str, Any]:
    m = run_measured(cmd, log=log, guard=opts.guard, env=ivq_env(), ok_codes=ok)
    return {"wall_s": round(m.seconds, 2), "peak_rss": m.peak_rss, **({} if m.ok else {"error": m.why()})}


def measure(name: str, work: Path, ref_model: Path, test_model: Path, inputs: Path, backend: str,
            opts: argparse.Namespace, *, ref_backend: str = "onnx", capture_args: tuple[str, ...] = (),
            cache: Path | None = None, ref_dump: Path | None = None) -> dict[str, Any]:
    """One row: forward, capture, raw write of the test model; read and diff of the two dumps."""
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"name": name, "backend": backend}
    say(f"{name}: forward")
    row["forward"] = _step("forward", {"model": str(test_model), "inputs": str(inputs), "backend": backend,
                                       "cache": str(cache) if cache else None}, d / "forward", opts)
    ref = ref_dump or d / "ref.h5"
    if ref_dump is None:
        say(f"{name}: capture ref")
        row["capture_ref"] = _cli([bin_path("ivq"), "capture", ref_backend, str(ref_model), "--inputs", str(inputs),
                                   "-o", str(ref), "--force"], d / "capture_ref", opts)
    say(f"{name}: capture")
    test = d / "test.h5"
    row["capture"] = _cli([bin_path("ivq"), "capture", backend, str(test_model), "--inputs", str(inputs), "-o",
                           str(test), "--force", *capture_args], d / "capture", opts)
    if not test.exists() or not ref.exists():
        return row
    say(f"{name}: raw write")
    row["raw_write"] = _step("raw-write", {"dump": str(test), "out": str(d / "raw")}, d / "raw_write", opts)
    say(f"{name}: sequential read")
    row["read"] = _step("read", {"paths": [str(ref), str(test)]}, d / "read", opts)
    _step("evict", {"paths": [str(ref), str(test)]}, d / "evict", opts)
    say(f"{name}: ivq-diff")
    row["diff"] = _cli([bin_path("ivq-diff"), str(ref), str(test), "--json", str(d / "diff.json"), "--force", "-q"],
                       d / "diff", opts, ok=(0, 1))
    row["dump_bytes"] = test.stat().st_size
    row["both_dumps_bytes"] = ref.stat().st_size + test.stat().st_size
    fw, cap, raw = row["forward"].get("wall_s"), row["capture"].get("wall_s"), row["raw_write"].get("write_s")
    if fw and cap and raw is not None:
        row["capture_ratio"] = round(cap / (fw + raw), 2)
    rd, df = row["read"].get("read_s"), row["diff"].get("wall_s")
    if rd and df:
        row["diff_rate_share"] = round(rd / df, 3)
    return row


def _gib(n: Any) -> str:
    return "–" if n is None else (f"{n / GiB:.2f} GiB" if n >= GiB / 4 else f"{n / (1 << 20):.1f} MiB")


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The ratio table (markdown)."""
    out = ["| model | backend | forward s (session + run) | capture s | raw write s (bytes) | capture / (forward + "
           "raw write) | read s (both dumps) | diff s | diff rate / read rate | note |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, c, w, rd, df = (r.get(k, {}) for k in ("forward", "capture", "raw_write", "read", "diff"))
        note = "; ".join(f"{k}: {v['error']}" for k, v in r.items() if isinstance(v, dict) and "error" in v)
        share = r.get("diff_rate_share")
        out.append(
            f"| {r['name']} | {r['backend']} | {f.get('wall_s', '–')} ({f.get('session_s', '–')} + {f.get('run_s', '–')}) "
            f"| {c.get('wall_s', '–')} | {w.get('write_s', '–')} ({_gib(w.get('bytes'))}) | "
            f"**{r.get('capture_ratio', '–')}** | {rd.get('read_s', '–')} ({_gib(rd.get('bytes'))}) | "
            f"{df.get('wall_s', '–')} | **{f'{100 * share:.0f} %' if share else '–'}** | {note} |")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or one internal ``--step``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="scale,ocr", help="comma-separated: scale, ocr")
    ap.add_argument("--scale", default="1", help="bench_scale's --scale of the scale model (tiny, or S > 0)")
    ap.add_argument("--workdir", default="/tmp/ivq-bench-limit", help="models, dumps, logs")
    ap.add_argument("--guard-gib", type=float, default=None, help="kill a step past this RSS (default 80%% available)")
    ap.add_argument("--json", default=None, help="every figure as JSON")
    ap.add_argument("--keep", action="store_true", help="keep models and dumps")
    ap.add_argument("--step", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--step-args", default="{}", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.step:
        print(json.dumps(STEPS[opts.step](json.loads(opts.step_args))), flush=True)
        return 0
    opts.guard = int((opts.guard_gib * GiB) if opts.guard_gib else 0.8 * mem_available())
    work = Path(opts.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"# bench_limit — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; {load_avg()}", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        models = [m for m in opts.models.split(",") if m]
        if "scale" in models:
            from bench_scale import config_for_scale

            md = work / "scale-models"
            say(f"scale: building (--scale {opts.scale})")
            b = run_measured(self_cmd(HERE / "bench_scale.py", "build",
                                      {"config": asdict(config_for_scale(opts.scale)), "dir": str(md)}),
                             log=work / "build-scale")
            if not b.ok:
                raise SystemExit(f"scale model build failed: {b.why()}")
            rows.append(measure(f"scale {opts.scale}", work, md / "ref.onnx", md / "test.onnx", md / "inputs.npz",
                                "onnx", opts))
        if "ocr" in models:
            md = work / "ocr-models"
            md.mkdir(parents=True, exist_ok=True)
            say("ocr: building")
            b = run_measured(self_cmd(HERE / "bench_qnn_compile.py", "build",
                                      {"workdir": str(md), "name": "ocr", "presets": ["a16w8"], "onnx": None}),
                             log=work / "build-ocr")
            if not b.ok:
                raise SystemExit(f"ocr model build failed: {b.why()}")
            qdq, inputs = Path(step_result(b)["qdq"]["a16w8"]["path"]), md / "ocr.sample.npz"
            cache = work / "qnn-cache"
            shutil.rmtree(cache, ignore_errors=True)
            rows.append(measure("ocr a16w8, compiling", work, qdq, qdq, inputs, "qnn", opts,
                                capture_args=("--no-qnn-cache",)))
            ref = work / "ocr a16w8, compiling" / "ref.h5"
            # warm the cache (a capture compiles and stores both sessions), then the same row on it
            _cli([bin_path("ivq"), "capture", "qnn", str(qdq), "--inputs", str(inputs), "-o", str(work / "warm.h5"),
                  "--force", "--qnn-cache", str(cache)], work / "warm", opts)
            rows.append(measure("ocr a16w8, warm context cache", work, qdq, qdq, inputs, "qnn", opts,
                                capture_args=("--qnn-cache", str(cache)), cache=cache, ref_dump=ref))
    finally:
        if not opts.keep:
            for p in work.glob("*"):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
    print(f"\n## capture and diff against the machine ({load_avg()})\n")
    print("\n".join(table(rows)))
    if opts.json:
        from ivq_debug.outputs import atomic_write_text

        atomic_write_text(opts.json, json.dumps(rows, indent=1), overwrite=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
