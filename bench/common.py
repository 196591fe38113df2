"""What the benchmarks share: measured child processes, the peer tools' runs, the side-by-side table.

Every measured step is its own process (wall time and peak RSS from ``os.wait4``). The peers run as a user
would run them:

- ivq-debug: ``ivq capture onnx`` of the reference and the test model, then ``ivq-diff --json``;
- Polygraphy: ``polygraphy run --onnxrt --onnx-outputs '*' --save-outputs`` per model, then the saved runs
  compared with ``SnrCompareFunc`` (:func:`step_poly_compare`);
- ORT ``qdq_loss_debug``: ``modify_model_output_intermediate_tensors`` per model, then one process with
  ``collect_activations``, ``create_activation_matching`` and ``compute_activation_error``.

Step functions here run through this file (``python bench/common.py --step NAME --step-args JSON``);
each benchmark runs its own steps through its own file (:func:`self_cmd`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
#: ivq-diff exit codes that carry a valid result (1 = a budget failed)
DIFF_OK = (0, 1)
#: the three columns of every row: capture of the reference, capture of the test, the comparison
STEPS = ("capture_ref", "capture_test", "compare")


# ------------------------------------------------------------------------------------------ measurement
@dataclass
class Measured:
    """One measured child process."""

    cmd: list[str]
    seconds: float
    peak_rss: int  # bytes, ru_maxrss of the child (os.wait4)
    returncode: int
    stdout: str
    stderr: str
    killed: str | None = None  # why the guard killed it
    ok_codes: tuple[int, ...] = (0,)  # ivq-diff: (0, 1), 1 = a budget failed, a valid result
    missing: str | None = None  # an output the step must write and did not
    cpu_seconds: float = 0.0  # user + system CPU of the child (os.wait4): what a loaded machine inflates least

    @property
    def ok(self) -> bool:
        """Finished by itself with an accepted exit code and wrote its output."""
        return self.killed is None and self.returncode in self.ok_codes and self.missing is None

    def why(self) -> str:
        """One line saying why it did not succeed."""
        if self.killed:
            return self.killed
        tail = [ln for ln in (self.stderr or self.stdout).strip().splitlines() if ln.strip()]
        return f"exit {self.returncode}: {tail[-1][:200] if tail else ''}"


def _rss_of(pid: int) -> int:
    """Current RSS of a process (bytes; 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_measured(cmd: Sequence[str], *, log: Path, limit_as: int | None = None, guard: int | None = None,
                 env: dict[str, str] | None = None, ok_codes: tuple[int, ...] = (0,),
                 require: Path | None = None) -> Measured:
    """Run ``cmd`` as its own process; return wall time and its peak RSS (``os.wait4``).

    ``limit_as`` sets ``RLIMIT_AS`` in the child (``ulimit -v``). ``guard`` kills the child when its RSS
    goes over that many bytes, so a tool that would exhaust the machine fails alone (reported, not hidden).
    stdout / stderr go to ``log`` (``.out`` / ``.err``) so a chatty tool cannot block on a pipe.
    ``require``: a file the command must have written (ivq-diff exits 1 both for "a budget failed" and for
    an internal error such as ``MemoryError``; only the former writes its ``--json``).
    """
    if require is not None:
        require.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    out_p, err_p = log.with_name(log.name + ".out"), log.with_name(log.name + ".err")

    def limit() -> None:
        if limit_as is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    killed = None
    with open(out_p, "w") as fo, open(err_p, "w") as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(list(cmd), stdout=fo, stderr=fe, env=env, preexec_fn=limit, start_new_session=True)
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if guard is not None and killed is None:
                rss = _rss_of(p.pid)
                if rss > guard:
                    killed = f"killed by the benchmark's guard at RSS {rss / GiB:.1f} GiB (> {guard / GiB:.1f} GiB)"
                    os.killpg(p.pid, signal.SIGKILL)
            time.sleep(0.02)
        dt = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    missing = str(require) if require is not None and not require.exists() else None
    return Measured(list(cmd), dt, ru.ru_maxrss * 1024, p.returncode, out_p.read_text(errors="replace"),
                    err_p.read_text(errors="replace"), killed, ok_codes, missing, ru.ru_utime + ru.ru_stime)


def self_cmd(script: str | Path, step: str, args: dict[str, Any]) -> list[str]:
    """The command that runs one ``--step`` of a benchmark script in its own process."""
    return [sys.executable, str(Path(script).resolve()), "--step", step, "--step-args", json.dumps(args)]


def step_result(m: Measured) -> dict[str, Any]:
    """The JSON document a step printed last on stdout (``{}`` when none)."""
    lines = [ln for ln in m.stdout.strip().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def bin_path(name: str) -> str:
    """A console script of this interpreter's environment (the venv), else from PATH."""
    p = Path(sys.executable).with_name(name)
    return str(p) if p.exists() else (shutil.which(name) or name)


def dir_bytes(paths: Sequence[Path]) -> int:
    """Total size of the files that exist among ``paths``."""
    return sum(p.stat().st_size for p in paths if p.exists())


def say(msg: str) -> None:
    """Progress on stderr (stdout carries the tables)."""
    print(msg, file=sys.stderr, flush=True)


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def mem_available() -> int:
    """MemAvailable (bytes)."""
    return _meminfo("MemAvailable")


def mem_total() -> int:
    """MemTotal (bytes)."""
    return _meminfo("MemTotal")


def load_avg() -> str:
    """The load average, as printed next to every timing."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def as_float(v: Any) -> float | None:
    """A metric from an ``ivq-diff/1`` document (non-finite values are strings there)."""
    if v is None:
        return None
    if isinstance(v, str):
        return {"inf": math.inf, "-inf": -math.inf}.get(v, math.nan)
    return float(v)


def layer_sqnr(p: Path) -> dict[str, float | None]:
    """``ref_name -> sqnr_db`` of an ``ivq-diff/1`` JSON file."""
    doc = json.loads(p.read_text())
    return {ly["ref_name"]: as_float(ly["metrics"].get("sqnr_db")) for ly in doc["layers"]}


# ------------------------------------------------------------------------------------------- the rows
@dataclass
class Row:
    """One line of the table: a tool (or variant) doing capture ref, capture test and compare."""

    tool: str
    steps: dict[str, Measured | None] = field(default_factory=dict)  # capture_ref, capture_test, compare
    disk: int | None = None
    note: str = ""
    skipped: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # seconds / peak RSS per step when a step is not one process (ORT: phases of one process)
    seconds: dict[str, float] = field(default_factory=dict)
    rss: dict[str, int] = field(default_factory=dict)

    def sec(self, step: str) -> float | None:
        """Seconds of a step (None when it did not run or failed)."""
        if step in self.seconds:
            return self.seconds[step]
        m = self.steps.get(step)
        return m.seconds if m is not None and m.ok else None

    def peak(self, step: str) -> int | None:
        """Peak RSS of a step in bytes (None when it did not run; measured even when it failed)."""
        if step in self.rss:
            return self.rss[step]
        m = self.steps.get(step)
        return m.peak_rss if m is not None else None

    @property
    def failed(self) -> str | None:
        """Why the row is incomplete, if it is."""
        if self.skipped:
            return self.skipped
        for name, m in self.steps.items():
            if m is not None and not m.ok:
                return f"{name}: {m.why()}"
        return None

    @property
    def total(self) -> float | None:
        """capture ref + capture test + compare, when all three finished."""
        secs = [self.sec(s) for s in STEPS]
        return None if self.failed or any(s is None for s in secs) else sum(secs)  # type: ignore[arg-type]

    @property
    def max_rss(self) -> int | None:
        """The largest per-step peak RSS."""
        vals = [v for v in (self.peak(s) for s in STEPS) if v is not None]
        return max(vals) if vals else None


def row_json(r: Row) -> dict[str, Any]:
    """A row's figures for ``--json``."""
    return {"tool": r.tool, "seconds": {s: r.sec(s) for s in STEPS}, "peak_rss": {s: r.peak(s) for s in STEPS},
            "total_s": r.total, "disk": r.disk, "failed": r.failed, "note": r.note,
            "pairs": r.extra.get("pairs"),
            "breakdown": {k: r.extra[k] for k in ("augment_s", "process_s", "captured", "dropped") if k in r.extra}}


def ivq_env(src: str | Path | None = None) -> dict[str, str]:
    """The environment of an ivq-debug step: no progress bars; ``src``: run the ivq_debug package found there
    (an exported older revision, for before/after rows measured in the same run) instead of this one."""
    env = dict(os.environ, IVQ_NO_PROGRESS="1")
    if src is not None:
        env["PYTHONPATH"] = str(Path(src).resolve())
    return env


def run_ivq(work: Path, name: str, ref_model: Path, test_model: Path, inputs: Sequence[Path], opts: argparse.Namespace,
            *, capture_args: Sequence[str] = (), test_args: Sequence[str] = (), src: str | Path | None = None,
            tag: str | None = None) -> Row:
    """ivq-debug: ``ivq capture onnx`` of both models (``--inputs`` once per sample) and ``ivq-diff --json``.

    ``capture_args`` go to both captures, ``test_args`` to the test capture only; ``src`` runs another
    checkout's ``ivq_debug`` (see :func:`ivq_env`); the files go to ``work/ivq-<tag>``.
    """
    d = work / f"ivq-{tag or 'full'}"
    d.mkdir(parents=True, exist_ok=True)
    row = Row(name)
    env = ivq_env(src)
    feeds = [x for p in inputs for x in ("--inputs", str(p))]
    for side, model, extra in (("ref", ref_model, ()), ("test", test_model, test_args)):
        cmd = [bin_path("ivq"), "capture", "onnx", str(model), *feeds, "-o", str(d / f"{side}.h5"), "--force",
               *capture_args, *extra]
        say(f"  {name}: capture {side}")
        row.steps[f"capture_{side}"] = m = run_measured(cmd, log=d / f"capture_{side}", guard=opts.guard, env=env)
        if not m.ok:
            row.steps.setdefault("compare", None)
            return row
    say(f"  {name}: ivq-diff")
    cmd = [bin_path("ivq-diff"), str(d / "ref.h5"), str(d / "test.h5"), "--json", str(d / "diff.json"), "--force", "-q"]
    row.steps["compare"] = run_measured(cmd, log=d / "diff", guard=opts.guard, env=env, ok_codes=DIFF_OK,
                                        require=d / "diff.json")
    row.disk = dir_bytes([d / "ref.h5", d / "test.h5"])
    row.extra["dir"] = str(d)
    if (d / "diff.json").exists():
        doc = json.loads((d / "diff.json").read_text())
        many = len(inputs) > 1
        row.extra["sqnr"] = {(f"{ly['record']['sample']}:{ly['ref_name']}" if many else ly["ref_name"]):
                             as_float(ly["metrics"].get("sqnr_db")) for ly in doc["layers"]}
        row.extra["pairs"] = doc["summary"]["pairs"]
    return row


def ensure_polygraphy(install: bool) -> str | None:
    """None when Polygraphy is importable (installing it into this environment if allowed), else the reason."""
    probe = [sys.executable, "-c", "import polygraphy, onnxruntime; print(polygraphy.__version__)"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return None
    if not install:
        return "Polygraphy is not installed (pip install '.[bench]'; benchmark-only dependency)"
    say("Polygraphy is not installed: installing it into this environment (benchmark-only dependency): "
        f"{sys.executable} -m pip install polygraphy")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "polygraphy"], capture_output=True, text=True)
    if r.returncode != 0 or subprocess.run(probe, capture_output=True).returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()
        return f"pip install polygraphy failed: {tail[-1][:160] if tail else r.returncode}"
    return None


def step_poly_inputs(a: dict[str, Any]) -> dict[str, Any]:
    """Write the benchmark inputs (one ``.npz`` per sample) as a Polygraphy ``--load-inputs`` JSON (a list of
    feed dicts, one per iteration)."""
    import numpy as np
    from polygraphy.json import save_json

    feeds = []
    for p in a["npz"]:
        with np.load(p, allow_pickle=False) as z:
            feeds.append({k: z[k] for k in z.files})
    save_json(feeds, a["out"])
    import polygraphy

    return {"version": polygraphy.__version__}


def run_polygraphy(work: Path, ref_model: Path, test_model: Path, inputs: Sequence[Path],
                   opts: argparse.Namespace) -> Row:
    """Polygraphy: mark all outputs, save both runs as JSON, compare the saved runs with SNR."""
    row = Row("Polygraphy")
    reason = ensure_polygraphy(not opts.no_install)
    if reason:
        row.skipped = reason
        return row
    d = work / "polygraphy"
    d.mkdir(parents=True, exist_ok=True)
    info = step_result(run_measured(self_cmd(__file__, "poly-inputs", {"npz": [str(p) for p in inputs],
                                                                        "out": str(d / "inputs.json")}),
                                    log=d / "inputs"))
    row.note = f"polygraphy {info.get('version', '?')}"
    exe = bin_path("polygraphy")
    for side, model in (("ref", ref_model), ("test", test_model)):
        out = d / f"{side}.json"
        out.unlink(missing_ok=True)
        cmd = [exe, "run", str(model), "--onnxrt", "--onnx-outputs", "*",
               "--graph-optimization-level", "ORT_DISABLE_ALL", "--load-inputs", str(d / "inputs.json"),
               "--save-outputs", str(out)]
        say(f"  Polygraphy: run --onnx-outputs '*' --save-outputs ({side})")
        row.steps[f"capture_{side}"] = m = run_measured(cmd, log=d / f"capture_{side}", guard=opts.guard)
        if not m.ok:
            row.steps.setdefault("compare", None)
            row.disk = dir_bytes([d / "ref.json", d / "test.json"])
            return row
    res_p = d / "compare.json"
    res_p.unlink(missing_ok=True)
    say("  Polygraphy: RunResults.load ×2 + Comparator.compare_accuracy(SnrCompareFunc) on float outputs")
    row.steps["compare"] = run_measured(self_cmd(__file__, "poly-compare",
                                                 {"ref": str(d / "ref.json"), "test": str(d / "test.json"),
                                                  "out": str(res_p), "acc": str(d / "accuracy.json")}),
                                        log=d / "compare", guard=opts.guard)
    row.disk = dir_bytes([d / "ref.json", d / "test.json"])
    if res_p.exists():
        res = json.loads(res_p.read_text())
        row.extra["sqnr"] = {k: as_float(v) for k, v in res["snr"].items()}
        row.extra["pairs"] = len(res["snr"])
        row.extra["dropped"] = res["dropped"]
        row.extra["captured"] = res["captured"]
        if res.get("renamed"):
            row.extra["renamed"] = res["renamed"]
    return row


#: the ORT quantizer's name of the dequantized copy of tensor X (X + this suffix)
DQ_SUFFIX = "_DequantizeLinear_Output"


def step_poly_compare(a: dict[str, Any]) -> dict[str, Any]:
    """Compare two saved Polygraphy runs with ``SnrCompareFunc`` over their floating-point outputs.

    What ``polygraphy run --load-outputs ref.json test.json --compare snr`` does, through the API: with
    ``--onnx-outputs '*'`` the runs also hold int64 shape tensors and bool masks (and, for a QDQ model, the
    uint8 quantized values), on which Polygraphy 0.53.6's SNR raises ``TypeError: numpy boolean subtract``,
    so the user drops non-float outputs first. The first run is the signal
    (SNR = 10·log10(mean(r²)/mean((r−t)²))). When the test run is a QDQ model, each float tensor ``X`` is
    compared with its dequantized copy ``X_DequantizeLinear_Output`` (what the next op reads, and what ivq-debug
    and ``qdq_loss_debug`` compare) instead of the QDQ model's own pre-quantization ``X``.
    Keys are ``name`` for one iteration, ``i:name`` for several.
    """
    import numpy as np
    from polygraphy.comparator import Comparator, RunResults, SnrCompareFunc

    runs = [RunResults.load(a["ref"]), RunResults.load(a["test"])]
    dropped = captured = renamed = 0
    nbytes = 0
    for ri, rr in enumerate(runs):
        for _name, iters in rr.items():
            for it in iters:
                for k in list(it.keys()):
                    arr = np.asarray(it[k])
                    captured += 1
                    nbytes += arr.nbytes
                    if arr.dtype.kind != "f":
                        it.dct.pop(k)
                        dropped += 1
                if ri == 1:
                    for k in [k for k in it.keys() if k.endswith(DQ_SUFFIX)]:
                        it.dct[k[: -len(DQ_SUFFIX)]] = it.dct.pop(k)
                        renamed += 1
    acc = Comparator.compare_accuracy(runs, compare_func=SnrCompareFunc())
    acc.save(a["acc"])
    snr: dict[str, Any] = {}
    mismatched = 0
    for result in acc:
        for _pair, iters in result.items():
            for i, it in enumerate(iters):
                for name, r in it.items():
                    if isinstance(r, bool):  # a bare verdict: shapes differ, no SNR computed
                        mismatched += 1
                        continue
                    v = float(r.snr)
                    snr[f"{i}:{name}" if len(iters) > 1 else name] = v if math.isfinite(v) else (
                        "inf" if v > 0 else "-inf")
    Path(a["out"]).write_text(json.dumps({"snr": snr, "dropped": dropped // 2, "captured": captured // 2,
                                          "renamed": renamed, "shape_mismatch": mismatched,
                                          "bytes_per_run": nbytes // 2}))
    return {"outputs": len(snr)}


def step_ort_augment(a: dict[str, Any]) -> dict[str, Any]:
    """``qdq_loss_debug.modify_model_output_intermediate_tensors`` on one model."""
    from onnxruntime.quantization.qdq_loss_debug import modify_model_output_intermediate_tensors

    modify_model_output_intermediate_tensors(a["model"], a["out"], save_as_external_data=a["external"])
    return {}


def step_ort_collect_compare(a: dict[str, Any]) -> dict[str, Any]:
    """``collect_activations`` on both augmented models, then ``create_activation_matching`` and
    ``compute_activation_error``: all in memory, in one process, as the module is designed.

    With a QDQ test model this is the module's own use: ``create_activation_matching(qdq, float)`` pairs each
    activation's pre- and post-QDQ values and the float model's, and ``xmodel_err`` (float vs dequantized,
    over all inputs at once) is the per-tensor SQNR. With a float test model it matches nothing (it pairs by
    QDQ suffixes only); the user then pairs by name in the same structure and reads ``qdq_err``.
    Both are 20·log10(‖ref‖ / ‖ref − test‖), signal = reference.
    """
    import resource

    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations,
        compute_activation_error,
        create_activation_matching,
    )

    class Reader(CalibrationDataReader):  # the same inputs for both models
        def __init__(self) -> None:
            self.feeds = []
            for p in a["inputs"]:
                with np.load(p, allow_pickle=False) as z:
                    self.feeds.append({k: z[k] for k in z.files})
            self.it = iter(self.feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    def rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    res: dict[str, Any] = {"seconds": {}, "rss": {}}
    t0 = time.perf_counter()
    ref = collect_activations(a["ref"], Reader())
    res["seconds"]["collect_ref"], res["rss"]["collect_ref"] = time.perf_counter() - t0, rss()
    t0 = time.perf_counter()
    test = collect_activations(a["test"], Reader())
    res["seconds"]["collect_test"], res["rss"]["collect_test"] = time.perf_counter() - t0, rss()
    t0 = time.perf_counter()
    qdq_style = create_activation_matching(test, ref)
    if qdq_style:
        for v in qdq_style.values():
            v.setdefault("float", [])  # compute_activation_error reads the key (KeyError without a float peer)
        match, key = qdq_style, "xmodel_err"
    else:
        match = {n: {"pre_qdq": ref[n], "post_qdq": test[n], "float": []} for n in ref if n in test}
        key = "qdq_err"
    err = compute_activation_error(match)
    res["seconds"]["compare"], res["rss"]["compare"] = time.perf_counter() - t0, rss()
    res["qdq_style_pairs"] = len(qdq_style)
    res["pairs"] = sum(1 for e in err.values() if key in e)
    res["bytes"] = int(sum(x.nbytes for v in ref.values() for x in v))
    res["sqnr"] = {n: float(e[key]) for n, e in err.items() if key in e}
    res["samples"] = len(a["inputs"])
    Path(a["out"]).write_text(json.dumps(res))
    return {"pairs": res["pairs"]}


def run_ort(work: Path, ref_model: Path, test_model: Path, inputs: Sequence[Path], opts: argparse.Namespace,
            external: bool) -> Row:
    """ORT ``qdq_loss_debug``: augment each model (own process), then collect + match + error (one process)."""
    row = Row("ORT qdq_loss_debug")
    d = work / "ort"
    d.mkdir(parents=True, exist_ok=True)
    aug: dict[str, Measured] = {}
    for side, model in (("ref", ref_model), ("test", test_model)):
        say(f"  ORT qdq_loss_debug: modify_model_output_intermediate_tensors ({side})")
        out = d / f"{side}.aug.onnx"
        aug[side] = m = run_measured(self_cmd(__file__, "ort-augment", {"model": str(model), "out": str(out),
                                                                         "external": external}),
                                     log=d / f"augment_{side}", guard=opts.guard)
        if not m.ok:
            row.steps[f"capture_{side}"] = m
            row.steps.setdefault("compare", None)
            return row
    say("  ORT qdq_loss_debug: collect_activations ×2, create_activation_matching, compute_activation_error")
    res_p = d / "result.json"
    res_p.unlink(missing_ok=True)
    m = run_measured(self_cmd(__file__, "ort-collect-compare",
                              {"ref": str(d / "ref.aug.onnx"), "test": str(d / "test.aug.onnx"),
                               "inputs": [str(p) for p in inputs], "out": str(res_p)}),
                     log=d / "collect_compare", guard=opts.guard)
    row.extra["augment_s"] = {k: v.seconds for k, v in aug.items()}
    row.extra["augmented_model_bytes"] = dir_bytes([d / "ref.aug.onnx", d / "test.aug.onnx"])
    if not m.ok or not res_p.exists():
        row.steps["capture_ref"] = aug["ref"]
        row.steps["compare"] = m
        return row
    res = json.loads(res_p.read_text())
    s, r = res["seconds"], res["rss"]
    # capture = augment (own process) + collect_activations; peak RSS of a capture step = the larger of the
    # augment process and the collect phase (ru_maxrss is monotone within the one process)
    row.seconds = {"capture_ref": aug["ref"].seconds + s["collect_ref"],
                   "capture_test": aug["test"].seconds + s["collect_test"],
                   "compare": s["compare"]}
    row.rss = {"capture_ref": max(aug["ref"].peak_rss, r["collect_ref"]),
               "capture_test": max(aug["test"].peak_rss, r["collect_test"]), "compare": m.peak_rss}
    row.steps = {"capture_ref": aug["ref"], "capture_test": aug["test"], "compare": m}
    row.extra["process_s"] = m.seconds
    if res.get("samples", 1) == 1:  # over several inputs ORT's SQNR pools them: not comparable per sample
        row.extra["sqnr"] = res["sqnr"]
    row.extra["pairs"] = res["pairs"]
    row.extra["qdq_style_pairs"] = res["qdq_style_pairs"]
    row.disk = 0
    row.note = (f"capture = augment {aug['ref'].seconds:.1f} / {aug['test'].seconds:.1f} s + collect_activations "
                f"{s['collect_ref']:.1f} / {s['collect_test']:.1f} s; in memory; augmented models on disk: "
                + gib(row.extra["augmented_model_bytes"]))
    return row


# ---------------------------------------------------------------------------------------------- report
def gib(n: int | None) -> str:
    """Bytes as GiB (≥ 1/4 GiB) or MiB."""
    if n is None:
        return "—"
    return f"{n / GiB:.2f} GiB" if n >= GiB / 4 else f"{n / MiB:,.0f} MiB"


def secs(v: float | None) -> str:
    """Seconds with one decimal (— when missing)."""
    return "—" if v is None else f"{v:,.1f}"


def ratio(a: float | int | None, b: float | int | None) -> str:
    """a / b with two decimals (— when either is missing)."""
    if a is None or b is None or not b:
        return "—"
    return f"{a / b:.2f}"


def table(rows: list[Row], ivq_tool: str = "ivq-debug") -> list[str]:
    """The markdown table of every row (ratios against the row named ``ivq_tool``)."""
    ivq = next((r for r in rows if r.tool == ivq_tool), None)
    lines = [
        "| tool | capture ref s | capture test s | compare s | total s | peak RSS capture ref | peak RSS capture test "
        "| peak RSS compare | on disk | ivq/this time | ivq/this peak RSS | ivq/this disk | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        note = "; ".join(x for x in (r.failed, r.note) if x)
        if r.skipped:
            lines.append(f"| {r.tool} | skipped | | | | | | | | | | | {r.skipped} |")
            continue
        lines.append(
            f"| {r.tool} | {secs(r.sec('capture_ref'))} | {secs(r.sec('capture_test'))} | {secs(r.sec('compare'))} "
            f"| {secs(r.total)} | {gib(r.peak('capture_ref'))} | {gib(r.peak('capture_test'))} | {gib(r.peak('compare'))} "
            f"| {gib(r.disk)} | {ratio(ivq.total if ivq else None, r.total)} "
            f"| {ratio(ivq.max_rss if ivq else None, r.max_rss)} "
            f"| {ratio(ivq.disk if ivq else None, r.disk) if r.disk else '—'} | {note} |"
        )
    return lines


def sanity(rows: list[Row], tools: Sequence[str] = ("ivq-debug", "Polygraphy", "ORT qdq_loss_debug"),
           tol_db: float = 0.01) -> tuple[list[str], bool]:
    """Do the tools agree on the worst layer and on SQNR over the tensors they all compared?"""
    have = {r.tool: r.extra["sqnr"] for r in rows if r.extra.get("sqnr") and not r.failed and r.tool in tools}
    if len(have) < 2:
        return ["sanity check: fewer than two tools produced per-layer results; nothing to compare"], True
    shared = set.intersection(*(set(v) for v in have.values()))
    shared = {n for n in shared if all(v[n] is not None and math.isfinite(v[n]) for v in have.values())}
    lines = [f"sanity check on the {len(shared)} tensors {' and '.join(have)} all compared with a finite SQNR "
             f"(10·log10(Σr²/Σ(t−r)²), signal = reference):"]
    worst = {}
    for tool, v in have.items():
        w = min(shared, key=lambda n: v[n]) if shared else None
        worst[tool] = w
        lines.append(f"  {tool:<20} {len(v):>5} tensors compared; worst shared layer {w} "
                     f"({v[w]:.2f} dB)" if w else f"  {tool}: no shared tensor")
    names = list(have)
    dev = 0.0
    for n in shared:
        vals = [have[t][n] for t in names]
        dev = max(dev, max(vals) - min(vals))
    same_worst = len(set(worst.values())) == 1
    ok = same_worst and dev < tol_db
    lines.append(f"  same worst layer: {'yes' if same_worst else 'NO'}; largest SQNR difference between tools on a "
                 f"shared tensor: {dev:.2e} dB -> {'AGREE' if ok else 'DISAGREE'}")
    return lines, ok


STEP_FUNCS = {
    "poly-inputs": step_poly_inputs,
    "poly-compare": step_poly_compare,
    "ort-augment": step_ort_augment,
    "ort-collect-compare": step_ort_collect_compare,
}


def step_main(funcs: dict[str, Any], argv: list[str] | None = None) -> int:
    """Run one ``--step NAME --step-args JSON`` of ``funcs`` and print its JSON result."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", required=True, choices=sorted(funcs))
    ap.add_argument("--step-args", default="{}")
    o = ap.parse_args(argv)
    print(json.dumps(funcs[o.step](json.loads(o.step_args))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(step_main(STEP_FUNCS))
