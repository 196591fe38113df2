"""``ivq tune --search`` on the PP-OCRv4 text recognizer (issue 29): wall time, peak RSS, workdir size (peak, while
the run goes, and what the finished run keeps), the frontier table, and exact match on held-out lines.

The recognizer is ``ch_PP-OCRv4_rec_infer.onnx`` from the ``rapidocr-onnxruntime==1.4.4`` wheel (``pip download``,
cached in the workdir); the text lines are rendered by ``tests/support/ppocr.py`` (16 calibration lines, ``--lines``
evaluation lines for the tune, ``--held`` lines neither calibrated nor tuned on). One ``ivq tune`` process per
backend, as a user runs it::

    IVQ_PPOCR_LABELS=eval.json ivq tune rec.onnx --calibration cal --inputs eval/000.npz ... -o t --backend cpu \\
        --task-metric tests/support/ppocr_metric.py:exact_match --search

Then, in the same run, one capture of the same evaluation lines (``ivq capture onnx`` of the baseline's QDQ model,
every tensor into a dump: the unit issue 33 measures a tune in) and exact match on the held-out lines (ORT CPU; the
float model, the baseline a8w8, plain ``--per-channel`` and the recommended model; ``--htp-held``: the recommended
model on QNN HTP too). Goals (issue 29): 12 evaluation lines, CPU-QDQ trials <= 5 min and workdir <= 200 MB (its
peak, sampled every second) on 2 idle cores; QNN HTP trials <= 10 min. Printed with the load average before and
after, the ratio to the capture, and the tune's own split (``tune.json`` ``timings``).

    python bench/bench_tune.py [--backend cpu,qnn] [--lines 12] [--held 48] [--htp-held] [--workdir DIR]
    python bench/bench_tune.py --baseline-src /tmp/ivq-old      # an older revision's ivq_debug, the same run
    python bench/bench_tune.py --quick                          # 4 evaluation lines, 8 held out
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/common.py
from common import MiB, ivq_env, load_avg, run_measured, say  # noqa: E402

from tests.support import ppocr  # noqa: E402

METRIC = ROOT / "tests" / "support" / "ppocr_metric.py"
GOAL_S = {"cpu": 300, "qnn": 600}
GOAL_BYTES = 200 * MiB


def _du(path: Path) -> int:
    """The bytes of the files under ``path``, a hard-linked file once (as ``du`` counts)."""
    seen: dict[tuple[int, int], int] = {}
    for f in path.rglob("*") if path.exists() else []:
        try:
            st = f.lstat()
        except OSError:  # removed while listed
            continue
        if f.is_file():
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


class PeakSize:
    """The largest size a folder reaches while a step runs (sampled every second)."""

    def __init__(self, path: Path) -> None:
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, _du(self.path))
            except OSError:  # a file removed while it was listed
                pass
            self._stop.wait(1.0)

    def __enter__(self) -> PeakSize:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _du(self.path))


def exact(model: Path, files: list[Path], labels: Path, providers: str = "cpu") -> float:
    """Exact match of ``model`` on ``files`` (ORT CPU without graph optimization, or QNN HTP at level all)."""
    import numpy as np
    import onnxruntime as ort

    from tests.support.ppocr_metric import score

    doc = json.loads(labels.read_text())
    if providers == "qnn":
        from ivq_debug.capture.qnn_ep.session import QnnSessionConfig, create_qnn_session

        def opts() -> ort.SessionOptions:
            o = ort.SessionOptions()
            o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            return o

        sess = create_qnn_session(str(model), QnnSessionConfig(), session_options_factory=opts).session
    else:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    outs = [{"y": sess.run(None, {name: np.load(f)["x"]})[0]} for f in files]
    return score(outs, doc["characters"], doc["labels"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/ivq-bench-tune")
    p.add_argument("--backend", default="cpu", help="cpu, qnn or cpu,qnn (one ivq tune run each)")
    p.add_argument("--lines", type=int, default=12, help="evaluation lines of the tune")
    p.add_argument("--calibration", type=int, default=16, help="calibration lines")
    p.add_argument("--held", type=int, default=48, help="held-out lines read once per model at the end")
    p.add_argument("--htp-held", action="store_true", help="also read the held-out lines on QNN HTP (slow)")
    p.add_argument("--baseline-src", help="also run this exported ivq_debug revision (before / after, same run)")
    p.add_argument("--quick", action="store_true", help="4 evaluation lines, 8 held out")
    p.add_argument("--json", help="write every figure here")
    a = p.parse_args(argv)
    if a.quick:
        a.lines, a.held = 4, 8
    wd = Path(a.workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    # the tune runs `python -m ivq_debug`, which imports the package of the working directory first: from a checkout's
    # root, --baseline-src would run that checkout's code again (PYTHONPATH comes after the working directory)
    os.chdir(wd)
    say(f"fetching the recognizer ({ppocr.WHEEL})")
    rec = ppocr.fetch(wd / "model")
    data = ppocr.write_dataset(wd / "lines", rec, calibration=a.calibration, evaluation=a.lines, held_out=a.held)
    out: dict = {"load_before": load_avg(), "lines": a.lines, "calibration": a.calibration, "held": a.held,
                 "model_bytes": rec.stat().st_size, "runs": {}}
    held = {"float": exact(rec, data["held"], data["held_labels"])}
    srcs = [("after", ROOT)] + ([("before", Path(a.baseline_src).resolve())] if a.baseline_src else [])
    for backend, (rev, src) in [(b, s) for b in a.backend.split(",") for s in srcs]:
        name = backend if rev == "after" else f"{backend}-{rev}"
        run = wd / f"tune-{name}"
        shutil.rmtree(run, ignore_errors=True)
        extra = ["--optimization", "all"] if backend == "qnn" else []
        cmd = [sys.executable, "-m", "ivq_debug", "tune", str(rec), "--calibration", str(data["cal"]),
               *[x for f in data["eval"] for x in ("--inputs", str(f))], "-o", str(run), "--backend", backend, *extra,
               "--task-metric", f"{METRIC}:exact_match", "--search"]
        env = ivq_env(src) | {ppocr.LABELS_ENV: str(data["eval_labels"])}
        load0 = load_avg()
        say(f"ivq tune --backend {backend} --search ({a.lines} evaluation lines, {rev}: {src}; {load0})")
        with PeakSize(run) as size:
            m = run_measured(cmd, log=wd / "logs" / f"tune-{name}", env=env)
        print(m.stdout)
        if not m.ok:
            say(f"ivq tune --backend {backend} failed: {m.why()}")
        doc = json.loads((run / "tune.json").read_text()) if (run / "tune.json").exists() else {}
        s = doc.get("search") or {}
        trials = _trials(run)
        r = {"exit": m.returncode, "wall_s": round(m.seconds, 1), "cpu_s": round(m.cpu_seconds, 1),
             "peak_rss_mib": round(m.peak_rss / MiB),
             "workdir_peak_mib": round(size.peak / MiB, 1), "workdir_kept_mib": round(_du(run) / MiB, 1),
             "chosen": s.get("chosen"), "command": s.get("command"), "frontier": s.get("frontier"),
             "trials": len(trials), "trial_s": {t["label"]: t.get("seconds") for t in trials},
             "goal_s": GOAL_S[backend], "load_before": load0, "load_after": load_avg(), "revision": rev,
             "timings": doc.get("timings"), "table": _table(s.get("table")),
             "end_to_end": doc.get("end_to_end"), "target_check": _check(doc.get("target_check"))}
        if doc.get("before") and rev == "after":
            r["capture"] = _capture(Path(doc["before"]["qdq_model"]), data["eval"], wd)
            r["ratio_to_capture"] = round(r["wall_s"] / r["capture"]["wall_s"], 2) if r["capture"]["ok"] else None
        if doc.get("recommended") and rev == "after":
            after = Path(doc["after"]["qdq_model"])
            held[f"recommended ({backend}: {s.get('chosen')})"] = exact(after, data["held"], data["held_labels"])
            if a.htp_held:
                held[f"recommended ({backend}: {s.get('chosen')}) on QNN HTP"] = exact(
                    after, data["held"], data["held_labels"], "qnn")
        if backend == a.backend.split(",")[0] and doc.get("before"):
            held["a8w8 (baseline)"] = exact(Path(doc["before"]["qdq_model"]), data["held"], data["held_labels"])
        out["runs"][name] = r
    pc = wd / "per-channel.onnx"
    m = run_measured([sys.executable, "-m", "ivq_debug", "quantize", str(rec), "--calibration", str(data["cal"]),
                      "--per-channel", "-o", str(pc), "--force"], log=wd / "logs" / "per-channel", env=ivq_env(ROOT))
    if m.ok:
        held["per-channel"] = exact(pc, data["held"], data["held_labels"])
    out["held_exact_match_cpu"] = held
    for b, r in out["runs"].items():
        t_ok = "met" if r["wall_s"] <= r["goal_s"] else "missed"
        b_ok = "met" if r["workdir_peak_mib"] * MiB <= GOAL_BYTES else "missed"
        cap = r.get("capture") or {}
        vs = (f"; one capture of the same lines {cap['wall_s']} s: ratio {r['ratio_to_capture']}"
              if cap.get("ok") else "")
        say(f"{b} ({r['revision']}): {r['wall_s']} s, CPU {r['cpu_s']} s (goal {r['goal_s']} s on 2 idle cores: {t_ok}; "
            f"{r['load_before']} before, {r['load_after']} after){vs}")
        say(f"{b} ({r['revision']}): workdir peak {r['workdir_peak_mib']} MiB (goal 200 MB: {b_ok}), kept "
            f"{r['workdir_kept_mib']} MiB, peak RSS {r['peak_rss_mib']} MiB; chosen {r['chosen']} ({r['command']}); "
            f"split {r.get('timings')}")
    for k, v in held.items():
        say(f"exact match, {a.held} held-out lines: {k}: {v:.3f}")
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0


def _capture(model: Path, files: list[Path], wd: Path) -> dict:
    """One ``ivq capture onnx`` of the same evaluation lines (every tensor into a dump), timed, then removed."""
    out = wd / "capture.h5"
    cmd = [sys.executable, "-m", "ivq_debug", "capture", "onnx", str(model),
           *[x for f in files for x in ("--inputs", str(f))], "-o", str(out), "--force"]
    m = run_measured(cmd, log=wd / "logs" / "capture", env=ivq_env(ROOT))
    size = out.stat().st_size if out.exists() else 0
    out.unlink(missing_ok=True)
    return {"ok": m.ok, "wall_s": round(m.seconds, 1), "dump_mib": round(size / MiB), "load_after": load_avg(),
            **({} if m.ok else {"why": m.why()})}


def _table(rows: list[dict] | None) -> list[dict]:
    """The search table's figures a before / after comparison reads (lever, SQNR, bytes, task, status, and how far
    a lever stopped early got)."""
    keys = ("lever", "sqnr_db", "gain_db", "model_bytes", "task", "status", "frontier", "stopped")
    return [{k: r.get(k) for k in keys} for r in rows or []]


def _check(check: dict | None) -> dict | None:
    """The HTP check's figures (watched SQNR and task, before / after, CPU-QDQ and HTP)."""
    if not check:
        return check
    return {k: check.get(k) for k in ("checked", "watch", "task", "samples", "not_held", "error")}


def _trials(run: Path) -> list[dict]:
    p = run / "trials" / "checkpoint.json"
    return list(json.loads(p.read_text())["trials"].values()) if p.exists() else []


if __name__ == "__main__":
    os.environ.setdefault("IVQ_NO_PROGRESS", "1")
    raise SystemExit(main())
