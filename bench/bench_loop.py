"""The whole loop side by side in one run: every ratio of issue 33's goals, printed with the load average.

One command, each measured step its own process (``bench/common.py:run_measured``; wall time includes the
process's start-up and imports, as a user waits for it):

1. **capture ×2 + diff** on ``bench_many.py``'s ViT-S (float vs QNN QDQ a8w8, ``--images`` images): ivq-debug
   (``ivq capture onnx`` ×2 + ``ivq-diff --json``) against ORT ``qdq_loss_debug`` and Polygraphy
   (``common.run_ivq`` / ``run_ort`` / ``run_polygraphy``, as ``bench_many.py`` runs them), and against the
   machine's limit: the two forwards with every output (the models ``qdq_loss_debug`` augmented, run once each
   on the same images) + a raw write of the bytes both dumps hold (``bench_limit.py``'s ``raw-write``: ``np.save``
   + fsync) + a sequential read of both dumps from the disk (``bench_limit.py``'s ``read``); and **ivq diff in
   memory** (``ivq diff FLOAT.onnx QDQ.onnx --inputs … --json``: both models run and compared in one process, no
   dump; :func:`run_memory`) against ``qdq_loss_debug``, its document checked equal to the dump path's
   (``check_identity.py compare``);
2. **diagnose vs one capture** of the same model and record (``ivq diagnose`` replays the first record): on
   CPU-QDQ (``ivq capture onnx QDQ --inputs IMAGE0`` vs ``ivq diagnose REF TEST --model QDQ``) and on QNN HTP
   (``ivq capture qnn`` vs ``ivq diagnose … --backend qnn``) on a ViT of ``--htp-layers`` blocks (HTP
   emulation compiles every graph: the 12-block model's capture alone is minutes), both with a QNN context cache
   in the work folder that starts empty (the capture compiles, the diagnose may reuse what it can);
3. **one tune trial vs one capture**: in one process, the capture of the baseline QDQ model on the evaluation
   images (``capture.base.capture``, timed in-process) and one trial of ``ivq tune``'s ``Tuner`` on them
   (:func:`one_trial`, the one place that calls the tuner; ``--tune-backend cpu|qnn``);
4. **``ivq demo``** wall time with the user's QNN context cache (warm after the first run on a machine; the run
   that warms it is the first of ``--demo-runs``, the last one is reported).

``--quick`` shrinks the models (4 blocks, 2 images, a 1-block HTP model) for a check in a few minutes; the
defaults take about 10 minutes on 2 idle cores; ``--layers 12 --htp-layers 12 --tune-backend qnn`` is the
issue's full-size setting (tens of minutes).

``--repeat N`` runs the CPU diagnose row N times interleaved (capture, baseline, this revision) and reports each
step's fastest round: on a shared machine the load only adds time, so the minimum is the figure to compare. The
capture section takes it too: N rounds of (baseline with ``--baseline-src``, this revision, this revision's
``ivq diff`` in memory, ``qdq_loss_debug``),
each tool's fastest round reported, every round listed.

    python bench/bench_loop.py [--quick] [--sections capture,diagnose,tune,demo] [--repeat N] [--json OUT]
                               [--workdir DIR]

See bench/README.md and docs/scale.md (the loop).
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # bench/common.py, bench_many.py, bench_limit.py
from bench_many import VitConfig, synthetic_images  # noqa: E402
from common import (  # noqa: E402
    DIFF_OK,
    GiB,
    Row,
    bin_path,
    ivq_env,
    load_avg,
    mem_available,
    run_ivq,
    run_measured,
    run_ort,
    run_polygraphy,
    say,
    self_cmd,
    step_main,
    step_result,
)

SECTIONS = ("capture", "diagnose", "tune", "demo")
#: issue 33's goals: (label, ratio key, at most)
GOALS = (
    ("capture ×2 + diff / ORT qdq_loss_debug", "ivq_vs_ort", 0.8),
    ("ivq diff in memory / ORT qdq_loss_debug", "memory_vs_ort", 0.8),
    ("capture ×2 + diff / Polygraphy", "ivq_vs_poly", 1 / 8),
    ("capture ×2 + diff / the machine's limit", "ivq_vs_limit", 1.3),
    ("ivq diagnose / one capture (CPU-QDQ)", "diagnose_cpu", 2.0),
    ("ivq diagnose / one capture (QNN HTP)", "diagnose_htp", 2.0),
    ("one tune trial / one capture", "trial", 1.5),
    ("ivq demo, warm cache (s)", "demo_s", 100.0),
)


# ------------------------------------------------------------------------------------------------ steps
def step_build(a: dict[str, Any]) -> dict[str, Any]:
    """``bench_many.py``'s ViT (float, QNN QDQ a8w8, the test images) in ``a["dir"]``."""
    from bench_many import step_build as build

    return build(a)


def one_trial(tuner: Any, label: str) -> Any:
    """One trial of ``ivq tune`` with no suggestion (the baseline configuration re-run): the one call of the tuner
    this benchmark times — ``tune.verify.one_trial``, a partial capture (each image run once and compared in memory
    with the reference, the calibration cached; ``docs/tune.md`` "What a trial costs")."""
    from ivq_debug.tune.verify import one_trial as trial

    return trial(tuner, label)


def step_trial(a: dict[str, Any]) -> dict[str, Any]:
    """One capture of the baseline QDQ model on the evaluation images and one tune trial, timed in one process.

    The tuner quantizes ``bench_many``'s float ViT with its calibration images (``synthetic_images(8, seed=2)``,
    as the build step); its reference is the float model after the quantizer's preprocessing on the same images
    (what ``ivq tune`` captures), not timed. The first trial (``before``) writes the baseline model the capture
    row runs; the timed trial is a second one of the same configuration with the checkpoint ignored.
    """
    import numpy as np

    from ivq_debug.capture.base import Selection, capture, make_runner
    from ivq_debug.tune.verify import Tuner

    c = VitConfig(**a["config"])
    wd = Path(a["dir"])
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    feeds = []
    for p in a["inputs"]:
        with np.load(p, allow_pickle=False) as z:
            feeds.append({k: z[k] for k in z.files})
    calib = [{"pixel_values": x} for x in synthetic_images(8, c.image, seed=2)]
    mk = dict(backend=a["backend"], resume=False, target="qnn")
    if a["backend"] == "qnn":
        mk["qnn_session"] = {"qnn_cache": a["cache"]}
    tuner = Tuner(Path(a["float"]), calib, feeds, wd / "reference.h5", wd / "trials", **mk)
    capture(make_runner("onnx", tuner.source(), selection=Selection()), feeds, tuner.reference, overwrite=True,
            progress=None)
    t0 = time.perf_counter()
    first = tuner.trial("before", [])
    t_first = time.perf_counter() - t0
    if first.error:
        raise SystemExit(f"baseline trial failed: {first.error}")
    qdq = first.qdq_model
    if a["backend"] == "qnn":
        runner = make_runner("qnn", qdq, selection=Selection(), qnn_cache=a["cache"])
    else:
        runner = make_runner("onnx", qdq, selection=Selection(), optimization="disable")
    t0 = time.perf_counter()
    capture(runner, feeds, wd / "capture.h5", overwrite=True, progress=None)
    t_cap = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = one_trial(tuner, "again")
    t_trial = time.perf_counter() - t0
    if again.error:
        raise SystemExit(f"trial failed: {again.error}")
    # the tensors the trial measured (the watched output, the model outputs) have the baseline's figures, to the bit
    same = bool(again.sqnr_table) and all(first.sqnr_table.get(k) == v for k, v in again.sqnr_table.items())
    return {"capture_s": round(t_cap, 2), "trial_s": round(t_trial, 2), "first_trial_s": round(t_first, 2),
            "ratio": round(t_trial / t_cap, 2), "same_sqnr": same, "backend": a["backend"], "images": len(feeds)}


def step_forward_all(a: dict[str, Any]) -> dict[str, Any]:
    """The forward of a model with every tensor an output (``qdq_loss_debug``'s augmented model) on the images."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(a["model"], sess_options=so, providers=["CPUExecutionProvider"])
    n = 0
    for p in a["inputs"]:
        with np.load(p, allow_pickle=False) as z:
            out = sess.run(None, {k: z[k] for k in z.files})
        n += sum(x.nbytes for x in out)
    return {"outputs": len(sess.get_outputs()), "bytes": n}


def step_diff_split(a: dict[str, Any]) -> dict[str, Any]:
    """The CPU seconds (this thread's) of each part of the comparator's per-pair work over ``ivq-diff``'s pairs of
    ``a["ref"]`` vs ``a["test"]``, one pair after the other in one thread: opening and checking the two datasets
    (their dtype and file layout), reading the blocks (a derived tensor: dequantized), the pinned metrics, the
    encoding fit. ``python bench/bench_loop.py --step diff-split --step-args '{"ref": "ref.h5", "test": "test.h5"}'``
    (with ``PYTHONPATH`` at another revision's ``ivq_debug``: that revision's costs)."""
    from ivq_debug.align.matcher import align
    from ivq_debug.dump.reader import open_dump
    from ivq_debug.encoding_fit import EncodingAccumulator
    from ivq_debug.metrics import MetricAccumulator, one_blas_thread

    ref, test = open_dump(a["ref"]), open_dump(a["test"])
    pairs = align(ref, test).pairs
    t = {"open": 0.0, "read": 0.0, "metrics": 0.0, "fit": 0.0}
    n = (4 << 20) // 4
    with one_blas_thread:
        for p in pairs:
            c0 = time.thread_time()
            ref.stored_dtype(p.ref), test.stored_dtype(p.test), ref.raw_layout(p.ref), test.raw_layout(p.test)
            c1 = time.thread_time()
            blocks = list(zip(ref.iter_flat(p.ref, n), test.iter_flat(p.test, n), strict=True))
            c2 = time.thread_time()
            acc, enc = MetricAccumulator(), EncodingAccumulator.for_encoding(p.test.encoding)
            for r, x in blocks:
                c3 = time.thread_time()
                r64 = acc.update(r, x)
                c4 = time.thread_time()
                if enc is not None:
                    enc.update(r64)
                t["metrics"] += c4 - c3
                t["fit"] += time.thread_time() - c4
            t["open"] += c1 - c0
            t["read"] += c2 - c1
    return {"pairs": len(pairs), "elements": int(sum(p.ref.size for p in pairs)),
            **{k: round(v, 3) for k, v in t.items()}}


STEP_FUNCS = {"build": step_build, "trial": step_trial, "forward-all": step_forward_all, "diff-split": step_diff_split}


# ---------------------------------------------------------------------------------------------- driver
def _run(cmd: list[str], log: Path, opts: argparse.Namespace, ok: tuple[int, ...] = (0,),
         src: str | None = None) -> dict[str, Any]:
    m = run_measured(cmd, log=log, guard=opts.guard, env=ivq_env(src), ok_codes=ok)
    res = step_result(m) if m.ok and cmd[1].endswith(".py") else {}
    return {**res, "wall_s": round(m.seconds, 2), "cpu_s": round(m.cpu_seconds, 2), "peak_rss": m.peak_rss,
            **({} if m.ok else {"error": m.why()})}


def _step(name: str, args: dict[str, Any], log: Path, opts: argparse.Namespace, script: Path | None = None
          ) -> dict[str, Any]:
    return _run(self_cmd(script or __file__, name, args), log, opts)


def build(work: Path, layers: int, images: int, opts: argparse.Namespace) -> tuple[Path, Path, list[Path], dict]:
    """The ViT of ``layers`` blocks (built once per size in the work folder)."""
    d = work / f"vit-{layers}"
    done = d / "build.json"
    if not done.is_file() or json.loads(done.read_text()).get("images", 0) < images:
        say(f"building the {layers}-block ViT ...")
        res = _step("build", {"config": asdict(VitConfig(layers=layers)), "dir": str(d), "images": images},
                    work / f"build-{layers}", opts)
        if "error" in res:
            raise SystemExit(f"model build failed: {res['error']}")
        res["images"] = images
        done.write_text(json.dumps(res))
    return d / "float.onnx", d / "qdq.onnx", [d / f"input_{i}.npz" for i in range(images)], json.loads(done.read_text())


def section_capture(work: Path, fm: Path, qm: Path, inputs: list[Path], opts: argparse.Namespace) -> dict[str, Any]:
    """capture ×2 + diff: ivq-debug, qdq_loss_debug, Polygraphy and the machine's limit."""
    rows: list[Row] = []
    rounds: dict[str, list[Row]] = {"ivq-debug": [], MEMORY: [], "ORT qdq_loss_debug": []}
    if opts.baseline_src:
        rounds["ivq-debug (baseline)"] = []
    for i in range(opts.repeat):  # interleaved: baseline, this revision, qdq_loss_debug, again
        say(f"capture ×2 + diff: round {i + 1} of {opts.repeat} (load {load_avg()})")
        if opts.baseline_src:
            say("ivq-debug (baseline): capture ×2 + diff ...")
            rounds["ivq-debug (baseline)"].append(run_ivq(work, "ivq-debug (baseline)", fm, qm, inputs, opts,
                                                          src=opts.baseline_src, tag="base"))
        say("ivq-debug: capture ×2 + diff ...")
        rounds["ivq-debug"].append(run_ivq(work, "ivq-debug", fm, qm, inputs, opts))
        say("ivq diff in memory ...")
        rounds[MEMORY].append(run_memory(work, fm, qm, inputs, opts))
        say("ORT qdq_loss_debug ...")
        rounds["ORT qdq_loss_debug"].append(run_ort(work, fm, qm, inputs, opts, external=False))
    # each tool's fastest round (the load only adds time on a shared machine)
    best = {k: min(v, key=lambda r: r.total if r.total is not None else float("inf")) for k, v in rounds.items()}
    ivq, ort, mem = best["ivq-debug"], best["ORT qdq_loss_debug"], best[MEMORY]
    rows += [ivq, mem, ort] + ([best["ivq-debug (baseline)"]] if opts.baseline_src else [])
    poly = None
    if not opts.no_polygraphy:
        say("Polygraphy ...")
        rows.append(poly := run_polygraphy(work, fm, qm, inputs, opts))
    out: dict[str, Any] = {"rows": {r.tool: {"total_s": r.total, "failed": r.failed, "peak_rss": r.max_rss,
                                             **{s: r.sec(s) for s in ("capture_ref", "capture_test", "compare")}}
                                    for r in rows},
                           "rounds_s": {k: [r.total for r in v] for k, v in rounds.items()},
                           "rounds_steps_s": {k: [{s: r.sec(s) for s in STEPS} for r in v]
                                              for k, v in rounds.items() if k.startswith("ivq")},
                           "rounds_steps_cpu_s": {k: [{s: _cpu(r, s) for s in STEPS} for r in v]
                                                  for k, v in rounds.items() if k.startswith("ivq")}}
    # the machine's limit: forwards with every output + raw write of the dumps' bytes + sequential read
    d = Path(ivq.extra.get("dir", work / "ivq-full"))
    lim: dict[str, Any] = {}
    if (d / "test.h5").exists() and (work / "ort" / "test.aug.onnx").exists():
        for side in ("ref", "test"):
            say(f"limit: forward with every output ({side})")
            lim[f"forward_{side}"] = _step("forward-all", {"model": str(work / "ort" / f"{side}.aug.onnx"),
                                                          "inputs": [str(p) for p in inputs]},
                                           work / "limit" / f"forward_{side}", opts)
            say(f"limit: raw write ({side})")
            lim[f"write_{side}"] = _step("raw-write", {"dump": str(d / f"{side}.h5"), "out": str(work / "limit" / "raw")},
                                         work / "limit" / f"write_{side}", opts, HERE / "bench_limit.py")
        say("limit: sequential read of both dumps")
        lim["read"] = _step("read", {"paths": [str(d / "ref.h5"), str(d / "test.h5")]}, work / "limit" / "read", opts,
                            HERE / "bench_limit.py")
        parts = [lim["forward_ref"].get("wall_s"), lim["forward_test"].get("wall_s"),
                 lim["write_ref"].get("write_s"), lim["write_test"].get("write_s"), lim["read"].get("read_s")]
        lim["total_s"] = round(sum(parts), 2) if all(p is not None for p in parts) else None
    out["limit"] = lim
    out["dump_bytes"] = {s: (d / f"{s}.h5").stat().st_size for s in ("ref", "test") if (d / f"{s}.h5").exists()}
    out["ratios"] = {"ivq_vs_ort": _ratio(ivq.total, ort.total), "ivq_vs_poly": _ratio(ivq.total, poly and poly.total),
                     "ivq_vs_limit": _ratio(ivq.total, lim.get("total_s")),
                     "memory_vs_ort": _ratio(mem.total, ort.total)}
    out["memory_identity"] = memory_identity(d, Path(mem.extra.get("dir", work / "ivq-memory")), work / "identity")
    if opts.baseline_src:
        b = best["ivq-debug (baseline)"]
        bd = Path(b.extra.get("dir", work / "ivq-base"))
        out["baseline_dump_bytes"] = {s: (bd / f"{s}.h5").stat().st_size for s in ("ref", "test")
                                      if (bd / f"{s}.h5").exists()}
        out["ratios"]["baseline_vs_ort"] = _ratio(b.total, ort.total)
        out["identity"] = identity(bd, d, work / "identity")
    out["dir"] = str(d)
    return out


#: the row of ``ivq diff FLOAT.onnx QDQ.onnx --inputs …`` (both models run and compared in memory, one process)
MEMORY = "ivq diff in memory"


def run_memory(work: Path, ref_model: Path, test_model: Path, inputs: list[Path], opts: argparse.Namespace) -> Row:
    """``ivq diff REF.onnx TEST.onnx --inputs … --json`` (``docs/cli.md``): what ``run_ivq``'s two captures and
    diff compute, in one process, nothing written but the JSON. Its wall time (imports included) is the row's
    ``compare`` step; the captures are inside it (0 s of their own)."""
    d = work / "ivq-memory"
    d.mkdir(parents=True, exist_ok=True)
    row = Row(MEMORY)
    feeds = [x for p in inputs for x in ("--inputs", str(p))]
    cmd = [bin_path("ivq"), "diff", str(ref_model), str(test_model), *feeds, "--json", str(d / "diff.json"),
           "--force", "-q"]
    row.steps["compare"] = m = run_measured(cmd, log=d / "diff", guard=opts.guard, env=ivq_env(), ok_codes=DIFF_OK,
                                            require=d / "diff.json")
    if m.ok:
        row.seconds = {"capture_ref": 0.0, "capture_test": 0.0}
        row.rss = {"capture_ref": m.peak_rss, "capture_test": m.peak_rss}
    row.disk = 0
    row.extra["dir"] = str(d)
    return row


def memory_identity(dumps: Path, memory: Path, logs: Path) -> str:
    """The in-memory ``ivq diff``'s document against the dump path's (``check_identity.py compare``: every value,
    the dumps' paths and creation times aside): its last output line."""
    import subprocess

    a, b = dumps / "diff.json", memory / "diff.json"
    if not (a.is_file() and b.is_file()):
        return "missing"
    logs.mkdir(parents=True, exist_ok=True)
    say("identity: ivq diff in memory vs capture ×2 + ivq-diff")
    r = subprocess.run([sys.executable, str(HERE / "check_identity.py"), "compare", str(a), str(b)],
                       capture_output=True, text=True, env=ivq_env())
    (logs / "compare-memory.log").write_text(r.stdout + r.stderr)
    lines = (r.stdout or r.stderr).strip().splitlines()
    last = lines[-1] if lines else f"exit {r.returncode}"
    return last.split(": ")[-1] if r.returncode == 0 else f"DIFFERENT (exit {r.returncode}; {logs / 'compare-memory.log'})"


def identity(base: Path, this: Path, logs: Path) -> dict[str, str]:
    """The baseline's and this revision's last captures and diffs against each other (``check_identity.py``:
    ``dumps`` on both captures, ``compare`` on the two ``ivq-diff --json`` documents): its last output line each."""
    import subprocess

    logs.mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}
    for what, args in (("ref dumps", ["dumps", "ref.h5", "ref.h5"]), ("test dumps", ["dumps", "test.h5", "test.h5"]),
                       ("ivq-diff --json", ["compare", "diff.json", "diff.json"])):
        say(f"identity: {what}")
        if not ((base / args[1]).is_file() and (this / args[2]).is_file()):
            out[what] = "missing"
            continue
        r = subprocess.run([sys.executable, str(HERE / "check_identity.py"), args[0], str(base / args[1]),
                            str(this / args[2])], capture_output=True, text=True, env=ivq_env())
        (logs / f"{args[0]}-{args[1]}.log").write_text(r.stdout + r.stderr)
        lines = (r.stdout or r.stderr).strip().splitlines()
        out[what] = (lines[-1] if lines else f"exit {r.returncode}").split(": ", 1)[-1] if r.returncode == 0 else \
            f"DIFFERENT (exit {r.returncode}; {logs / f'{args[0]}-{args[1]}.log'})"
    return out


#: the steps of capture ×2 + diff
STEPS = ("capture_ref", "capture_test", "compare")


def _cpu(row: Row, step: str) -> float | None:
    """User + system CPU seconds of a step's process (what a loaded machine inflates least)."""
    m = row.steps.get(step)
    return round(m.cpu_seconds, 2) if m is not None and m.ok else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _diagnoses(opts: argparse.Namespace, d: Path, name: str, args: list[str], cache: Path | None = None
               ) -> dict[str, Any]:
    """``ivq diagnose ARGS`` with this revision and, with ``--baseline-src``, with the baseline first (each with its
    own copy of the QNN context cache as the capture left it, so neither reuses what the other compiled)."""
    out: dict[str, Any] = {}
    revs = ([("baseline", opts.baseline_src)] if opts.baseline_src else []) + [("this", None)]
    for rev, src in revs:
        extra: list[str] = []
        if cache is not None:
            mine = d / f"qnn-cache-{rev}"
            shutil.rmtree(mine, ignore_errors=True)
            shutil.copytree(cache, mine)
            extra = ["--qnn-cache", str(mine)]
        say(f"diagnose {name}: ivq diagnose ({rev} revision)")
        js = d / f"{name}-{rev}.json"
        out[rev] = _run([bin_path("ivq"), "diagnose", *args, *extra, "--json", str(js), "--force"],
                        d / f"{name}-diagnose-{rev}", opts, ok=DIFF_OK, src=src)
        if js.is_file():
            doc = json.loads(js.read_text())
            out[rev]["units"] = len(doc.get("units", []))
            out[rev]["sessions"] = doc.get("sessions")
            doc.pop("seconds", None)
            out[rev]["doc"] = doc
    if "baseline" in out:
        a, b = out["baseline"].pop("doc", None), out["this"].get("doc")
        out["identical"] = a is not None and _timeless(a) == _timeless(b)
    out["this"].pop("doc", None)
    return out


def _timeless(doc: Any) -> Any:
    from check_diagnose_identity import timeless

    return timeless(doc)


def _fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of least wall time among those without an error (else the first), with every round's wall time."""
    ok = [r for r in runs if "error" not in r]
    best = dict(min(ok, key=lambda r: r["wall_s"]) if ok else runs[0])
    if len(runs) > 1:
        best["rounds_s"] = [r.get("wall_s") for r in runs]
        if any("cpu_s" in r for r in runs):
            best["rounds_cpu_s"] = [r.get("cpu_s") for r in runs]
    return best


def _best_of(caps: list[dict[str, Any]], tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The CPU row of ``--repeat`` interleaved rounds: each step's fastest round (the load of a shared machine only
    adds time), the documents identical in every round."""
    out: dict[str, Any] = {"capture": _fastest(caps)}
    for rev in ("baseline", "this"):
        if rev in tries[0]:
            out[rev] = _fastest([t[rev] for t in tries])
    if "identical" in tries[0]:
        out["identical"] = all(t.get("identical") for t in tries)
    return out


def section_diagnose(work: Path, opts: argparse.Namespace, cpu: tuple[Path, Path, list[Path]], ref_dump: Path,
                     test_dump: Path) -> dict[str, Any]:
    """``ivq diagnose`` vs one capture of the same model and record, on CPU-QDQ and on QNN HTP."""
    out: dict[str, Any] = {}
    ivq = bin_path("ivq")
    d = work / "diagnose"
    d.mkdir(parents=True, exist_ok=True)
    _fm, qm, inputs = cpu
    caps, tries = [], []
    for i in range(opts.repeat):  # interleaved: capture, baseline, this revision, again
        say(f"diagnose CPU-QDQ: one capture of the first record (round {i + 1} of {opts.repeat})")
        caps.append(_run([ivq, "capture", "onnx", str(qm), "--inputs", str(inputs[0]), "-o", str(d / "cpu-one.h5"),
                          "--force"], d / f"cpu-capture-{i}", opts))
        tries.append(_diagnoses(opts, d, "cpu", [str(ref_dump), str(test_dump), "--model", str(qm)]))
    out["cpu"] = {"model": f"ViT {opts.layers} blocks", **_best_of(caps, tries)}
    if "htp" not in opts.skip:
        hfm, hqm, hin, _ = build(work, opts.htp_layers, 1, opts)
        cache = d / "qnn-cache"
        shutil.rmtree(cache, ignore_errors=True)
        say(f"diagnose HTP ({opts.htp_layers} blocks): float reference")
        ref = _run([ivq, "capture", "onnx", str(hfm), "--inputs", str(hin[0]), "-o", str(d / "htp-ref.h5"), "--force"],
                   d / "htp-ref", opts)
        say("diagnose HTP: one capture (cold context cache)")
        cap = _run([ivq, "capture", "qnn", str(hqm), "--inputs", str(hin[0]), "-o", str(d / "htp.h5"), "--force",
                    "--qnn-cache", str(cache)], d / "htp-capture", opts)
        runs = {"this": {"error": "capture failed"}}
        if "error" not in cap and "error" not in ref:
            runs = _diagnoses(opts, d, "htp", [str(d / "htp-ref.h5"), str(d / "htp.h5"), "--model", str(hqm),
                                               "--backend", "qnn"], cache)
        out["htp"] = {"model": f"ViT {opts.htp_layers} blocks", "capture": cap, **runs}
    for v in out.values():
        c = v["capture"].get("wall_s") if "error" not in v["capture"] else None
        for rev in ("this", "baseline"):
            if rev in v:
                t = v[rev].get("wall_s") if "error" not in v[rev] else None
                v[rev]["ratio"] = _ratio(t, c)
        v["ratio"] = v["this"].get("ratio")
    return out


def section_tune(work: Path, fm: Path, inputs: list[Path], opts: argparse.Namespace) -> dict[str, Any]:
    say(f"tune: one capture and one trial ({opts.tune_backend}) ...")
    return _step("trial", {"config": asdict(VitConfig(layers=opts.layers)), "float": str(fm),
                           "inputs": [str(p) for p in inputs], "dir": str(work / "tune"), "backend": opts.tune_backend,
                           "cache": str(work / "tune-qnn-cache")}, work / "tune-trial", opts)


def section_demo(work: Path, opts: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for i in range(opts.demo_runs):
        d = work / "demo"
        shutil.rmtree(d, ignore_errors=True)
        say(f"ivq demo (run {i + 1} of {opts.demo_runs}) ...")
        r = _run([bin_path("ivq"), "demo", "--golden", str(d / "golden"), "--reports", str(d / "reports"),
                  "--workdir", str(d / "work")], work / f"demo-{i}", opts)
        js = d / "reports" / "demo.json"
        if js.is_file():
            r["timings_s"] = json.loads(js.read_text()).get("timings_s")
        runs.append(r)
    return {"runs": runs, "wall_s": runs[-1].get("wall_s") if runs and "error" not in runs[-1] else None}


def report(res: dict[str, Any]) -> list[str]:
    """The goals table: every ratio, its goal, met or not."""
    ratios: dict[str, Any] = {}
    cap, dia, tun, dem = (res.get(k) or {} for k in SECTIONS)
    ratios.update(cap.get("ratios", {}))
    ratios["diagnose_cpu"] = (dia.get("cpu") or {}).get("ratio")
    ratios["diagnose_htp"] = (dia.get("htp") or {}).get("ratio")
    ratios["trial"] = tun.get("ratio")
    ratios["demo_s"] = dem.get("wall_s")
    low = floors(res)
    lines = ["| goal (issue 33) | measured | at most | | floor |", "|---|---:|---:|---|---:|"]
    for label, key, goal in GOALS:
        v, f = ratios.get(key), low.get(key)
        lines.append(f"| {label} | {'—' if v is None else f'{v:.2f}'} | {goal:.3g} | "
                     f"{'—' if v is None else ('met' if v <= goal else 'NOT met')} | "
                     f"{'—' if f is None else f'{f:.2f}' + (' (above the goal)' if f > goal else '')} |")
    res["ratios"], res["floors"] = ratios, low
    return lines


def cores() -> int:
    """The cores this process may run on (its affinity; a container's CPU set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def floors(res: dict[str, Any]) -> dict[str, float | None]:
    """The least each goal's ratio can be on this machine for the work measured (``None`` where no bound is):

    - capture ×2 + diff / ``qdq_loss_debug``: the machine's limit over ``qdq_loss_debug`` (two forwards with every
      output, a raw write of the dumps' bytes, a sequential read: what any tool writing those dumps does at least);
    - a diagnose / one capture: the diagnose's CPU seconds (every process and thread it ran, user + system) spread
      over every core with no wait, over the capture's wall: no schedule of the same work is shorter.

    A floor above a goal says the goal asks for less work, not a better schedule."""
    out: dict[str, float | None] = {}
    cap = res.get("capture") or {}
    ort = (cap.get("rows") or {}).get("ORT qdq_loss_debug") or {}
    out["ivq_vs_ort"] = _ratio((cap.get("limit") or {}).get("total_s"), ort.get("total_s"))
    n = res.get("cores") or cores()
    for kind in ("cpu", "htp"):
        v = (res.get("diagnose") or {}).get(kind) or {}
        cpu = (v.get("this") or {}).get("cpu_s")
        out[f"diagnose_{kind}"] = _ratio(cpu / n if cpu is not None else None, (v.get("capture") or {}).get("wall_s"))
    return out


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def _mib(v: int | None) -> str:
    return "—" if v is None else f"{v / (1 << 20):,.0f} MiB"


def details(res: dict[str, Any]) -> list[str]:
    """The figures behind each ratio, one line each."""
    out = []
    cap = res.get("capture")
    if cap:
        for tool, r in cap["rows"].items():
            steps = ("one process: both forwards, alignment, metrics" if tool == MEMORY else
                     f"capture ref {_s(r['capture_ref'])}, capture test {_s(r['capture_test'])}, compare "
                     f"{_s(r['compare'])}")
            out.append(f"{tool}: total {_s(r['total_s'])} s ({steps}; peak RSS {_mib(r.get('peak_rss'))})"
                       + (f"; FAILED {r['failed']}" if r["failed"] else ""))
        if cap.get("memory_identity"):
            out.append(f"ivq diff in memory vs capture ×2 + ivq-diff (check_identity.py compare): "
                       f"{cap['memory_identity']}")
        lim = cap["limit"]
        if lim:
            out.append(f"limit: {lim.get('total_s')} s = forwards with every output {lim['forward_ref'].get('wall_s')} + "
                       f"{lim['forward_test'].get('wall_s')} s, raw write {lim['write_ref'].get('write_s')} + "
                       f"{lim['write_test'].get('write_s')} s, sequential read {lim['read'].get('read_s')} s")
        out.append("dumps: " + ", ".join(f"{k} {v / (1 << 20):,.0f} MiB" for k, v in cap["dump_bytes"].items())
                   + ("; baseline's: " + ", ".join(f"{k} {v / (1 << 20):,.0f} MiB"
                                                   for k, v in cap["baseline_dump_bytes"].items())
                      if cap.get("baseline_dump_bytes") else ""))
        if any(len(v) > 1 for v in cap.get("rounds_s", {}).values()):
            out.append("capture rounds (s): " + "; ".join(f"{k} {v}" for k, v in cap["rounds_s"].items()))
            for k, v in cap.get("rounds_steps_s", {}).items():
                cpu = cap.get("rounds_steps_cpu_s", {}).get(k, [{}] * len(v))
                out.append(f"{k} rounds (capture ref, capture test, compare: wall s / CPU s): "
                           + "; ".join(", ".join(f"{_s(r[s])}/{_s(c.get(s))}" for s in STEPS)
                                       for r, c in zip(v, cpu, strict=True)))
        if cap["ratios"].get("baseline_vs_ort") is not None:
            out.append(f"baseline revision: capture ×2 + diff / qdq_loss_debug = {cap['ratios']['baseline_vs_ort']} "
                       f"(this revision: {cap['ratios']['ivq_vs_ort']})")
        if cap.get("identity"):
            out.append("baseline vs this revision (check_identity.py): "
                       + "; ".join(f"{k} {v}" for k, v in cap["identity"].items()))
    for k, v in (res.get("diagnose") or {}).items():
        for rev in ("baseline", "this"):
            if rev not in v:
                continue
            r = v[rev]
            rounds = (f"; rounds: capture {v['capture']['rounds_s']} s, diagnose {r['rounds_s']} s"
                      if "rounds_s" in r else "")
            if "rounds_cpu_s" in r:
                rounds += f" (CPU {r['rounds_cpu_s']} s)"
            # CPU (user + system) beside the wall: on a shared machine the load inflates it least
            out.append(f"diagnose {k} ({v['model']}, {rev} revision): capture {v['capture'].get('wall_s')} s "
                       f"(CPU {v['capture'].get('cpu_s')} s), diagnose {r.get('wall_s')} s (CPU {r.get('cpu_s')} s) "
                       f"= {r.get('ratio')}× ({r.get('units')} units, {r.get('sessions')} sessions)"
                       + rounds
                       + "".join(f"; {s} error: {x['error']}" for s, x in (("capture", v["capture"]), ("diagnose", r))
                                 if "error" in x))
        if "identical" in v:
            out.append(f"diagnose {k}: baseline and this revision's --json documents (wall times aside) "
                       f"{'IDENTICAL' if v['identical'] else 'DIFFERENT'}")
    t = res.get("tune")
    if t:
        out.append(f"tune ({t.get('backend')}, {t.get('images')} images): capture {t.get('capture_s')} s, trial "
                   f"{t.get('trial_s')} s (first trial {t.get('first_trial_s')} s; same results: {t.get('same_sqnr')})"
                   + (f"; error: {t['error']}" if "error" in t else ""))
    dm = res.get("demo")
    if dm:
        for i, r in enumerate(dm["runs"]):
            out.append(f"ivq demo run {i + 1}: {r.get('wall_s')} s; phases {r.get('timings_s')}"
                       + (f"; error: {r['error']}" if "error" in r else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or one internal ``--step``)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--step"]:
        return step_main(STEP_FUNCS, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models: 4 blocks, 2 images, a 1-block HTP model")
    ap.add_argument("--layers", type=int, default=None, help="ViT blocks of the CPU model (default 12; quick 4)")
    ap.add_argument("--images", type=int, default=None, help="evaluation images (default 4; quick 2)")
    ap.add_argument("--htp-layers", type=int, default=None, help="ViT blocks of the HTP model (default 2; quick 1)")
    ap.add_argument("--tune-backend", choices=["cpu", "qnn"], default="cpu", help="the tune trial's backend")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--skip", default="", help="comma-separated: htp (the HTP diagnose row)")
    ap.add_argument("--no-polygraphy", action="store_true", help="leave Polygraphy out (its figure does not move)")
    ap.add_argument("--no-install", action="store_true", help="do not pip-install Polygraphy when missing")
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="also run each ivq diagnose with the ivq_debug package in DIR (an older revision: git archive "
                         "REV ivq_debug | tar -x -C DIR), before this revision's, results compared")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of the CPU diagnose row (capture, baseline, this revision, interleaved); each "
                         "step's fastest round is reported, every round listed (default 1)")
    ap.add_argument("--demo-runs", type=int, default=1, help="ivq demo runs (the last is reported; default 1)")
    ap.add_argument("--bytecode-cache", action="store_true",
                    help="let every step's Python cache its compiled modules (under WORKDIR/pycache), as a pip-installed "
                         "ivq-debug has them; without it an environment with PYTHONDONTWRITEBYTECODE=1 compiles ivq_debug's "
                         "modules in every command (docs/scale.md, capture x2 + diff against the limit)")
    ap.add_argument("--workdir", default="/tmp/ivq-bench-loop", help="models, dumps, logs")
    ap.add_argument("--guard-gib", type=float, default=None, help="kill a step past this RSS (default 80%% available)")
    ap.add_argument("--json", default=None, help="every figure as JSON")
    opts = ap.parse_args(argv)
    opts.layers = opts.layers or (4 if opts.quick else 12)
    opts.images = opts.images or (2 if opts.quick else 4)
    opts.htp_layers = opts.htp_layers or (1 if opts.quick else 2)
    opts.skip = {s for s in opts.skip.split(",") if s}
    opts.guard = int((opts.guard_gib * GiB) if opts.guard_gib else 0.8 * mem_available())
    sections = [s for s in opts.sections.split(",") if s]
    work = Path(opts.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if opts.bytecode_cache:  # (every step inherits this environment: both revisions and the peers alike)
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = str(work.resolve() / "pycache")
    started = time.time()
    head = (f"# bench_loop — {time.strftime('%Y-%m-%d %H:%M')}, {cores()} cores; ViT {opts.layers} blocks, "
            f"{opts.images} images; HTP ViT {opts.htp_layers} blocks; tune on {opts.tune_backend}; {load_avg()} before"
            + ("; bytecode cached" if opts.bytecode_cache else
               "; modules compiled per command" if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""))
    print(head, flush=True)
    res: dict[str, Any] = {"settings": {k: v if not isinstance(v, set) else sorted(v) for k, v in vars(opts).items()},
                           "load_before": load_avg(), "cores": cores()}
    fm, qm, inputs, _info = build(work, opts.layers, opts.images, opts)
    full = work / "ivq-full"
    if "capture" in sections or ("diagnose" in sections and not (full / "test.h5").is_file()):
        res["capture"] = section_capture(work, fm, qm, inputs, opts)
        res["load_after_capture"] = load_avg()
    if "diagnose" in sections:
        d = Path(res["capture"]["dir"]) if "capture" in res else full  # (else this work folder's earlier dumps)
        res["diagnose"] = section_diagnose(work, opts, (fm, qm, inputs), d / "ref.h5", d / "test.h5")
        res["load_after_diagnose"] = load_avg()
    if "tune" in sections:
        res["tune"] = section_tune(work, fm, inputs, opts)
        res["load_after_tune"] = load_avg()
    if "demo" in sections:
        res["demo"] = section_demo(work, opts)
    res["load_after"] = load_avg()
    res["wall_s"] = round(time.time() - started)
    print(f"\n## issue 33's ratios ({res['load_before']} before; {res['load_after']} after; {res['wall_s']} s)\n")
    print("\n".join(report(res)))
    print()
    print("\n".join(details(res)))
    if opts.json:
        Path(opts.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
