"""Verify overrides: re-quantize, re-capture on QNN HTP (emulated on x86), compare before and after.

A *trial* quantizes the float model with a set of overrides, captures the QDQ model on the test backend
(QNN HTP by default) for the given inputs, compares it with the float reference dump and, optionally,
runs a task metric (e.g. caption accuracy of the reference VLM). :func:`verify` runs the baseline and
the suggested overrides; :func:`greedy` adds suggestions one at a time and keeps those that help, until
the watched tensors meet a budget or nothing more helps, escalating a 16-bit entry that is still bad to
fp16 (the node left unquantized).

Costs come with each trial: the QDQ model size, and the summed per-op cycles of a detailed QNN profile
(emulated cycles: relative only, see ``docs/qnn-capture.md``).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.api import compare
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.console import track
from ivq_debug.dump import open_dump
from ivq_debug.errors import InputError
from ivq_debug.qnn.quantize import quantize_for_qnn
from ivq_debug.tune.suggest import Suggestion, ort_overrides
from ivq_debug.util import json_safe


@dataclass
class Trial:
    """One quantize + capture + compare round."""

    label: str
    suggestions: list[Suggestion]
    qdq_model: Path
    dump: Path
    comparison: Any
    task: dict[str, Any] = field(default_factory=dict)
    model_bytes: int = 0
    cycles: float | None = None
    seconds: float = 0.0

    def sqnr(self, name: str) -> float | None:
        """Worst SQNR of a tensor over the records (None when absent)."""
        t = self.comparison.table
        v = t.loc[(t["ref_name"] == name) | (t["test_name"] == name), "sqnr_db"]
        return float(v.min()) if len(v) else None


@dataclass
class TuneReport:
    """Before / after figures of a tuning run."""

    before: Trial
    after: Trial
    watch: list[str]
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def changed(self):
        """Per changed tensor: SQNR before / after / gain (DataFrame)."""
        import pandas as pd

        rows = []
        for s in self.after.suggestions:
            b, a = self.before.sqnr(s.tensor), self.after.sqnr(s.tensor)
            rows.append({"tensor": s.tensor, "action": s.action, "sqnr_before": b, "sqnr_after": a,
                         "gain_db": (a - b) if a is not None and b is not None else None, "reason": s.reason})
        return pd.DataFrame(rows, columns=["tensor", "action", "sqnr_before", "sqnr_after", "gain_db", "reason"])

    @property
    def end_to_end(self):
        """Watched tensors and task metrics, before and after (DataFrame)."""
        import pandas as pd

        rows = []
        for w in self.watch:
            b, a = self.before.sqnr(w), self.after.sqnr(w)
            rows.append({"what": f"sqnr_db {w}", "before": b, "after": a,
                         "change": (a - b) if a is not None and b is not None else None})
        for k in sorted(set(self.before.task) | set(self.after.task)):
            b, a = self.before.task.get(k), self.after.task.get(k)
            ok = isinstance(a, (int, float)) and isinstance(b, (int, float))
            rows.append({"what": k, "before": b, "after": a, "change": (a - b) if ok else None})
        rows.append({"what": "model bytes", "before": self.before.model_bytes, "after": self.after.model_bytes,
                     "change": self.after.model_bytes - self.before.model_bytes})
        if self.before.cycles is not None and self.after.cycles is not None:
            rows.append({"what": "HTP cycles per run (emulated, relative)", "before": self.before.cycles,
                         "after": self.after.cycles, "change": self.after.cycles - self.before.cycles})
        return pd.DataFrame(rows, columns=["what", "before", "after", "change"])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""

        return json_safe({
            "watch": self.watch,
            "changed": self.changed.to_dict(orient="records"),
            "end_to_end": self.end_to_end.to_dict(orient="records"),
            "overrides": [s.to_dict() for s in self.after.suggestions],
            "steps": self.steps,
            "before": {"qdq_model": str(self.before.qdq_model), "dump": str(self.before.dump)},
            "after": {"qdq_model": str(self.after.qdq_model), "dump": str(self.after.dump)},
        })


def _cycles(dump_path: Path) -> float | None:

    with open_dump(dump_path) as d:
        if "profiling" not in d.table_names():
            return None
        p = d.table("profiling")
    ops = p[(p["is_op"].astype(bool)) & (p["unit"] == "cycles")]
    if ops.empty:
        return None
    runs = sorted(r for r in ops["run"].dropna().unique() if r >= 0)
    if runs:
        ops = ops[ops["run"] == runs[0]]
    return float(ops["value"].sum())


@dataclass
class Tuner:
    """What every trial shares: the float model, calibration, inputs, reference and backend.

    Args:
        float_model: the float ONNX model to quantize.
        calibration: calibration data (see :func:`ivq_debug.qnn.quantize.load_calibration`).
        feeds: inputs to capture, one dict per sample (records ``(sample, part, 0)``).
        reference: the float reference dump of the same inputs (path).
        workdir: where trial models and dumps go.
        preset: quantization preset (``a8w8``…).
        part: record part name of the captures.
        runner_factory: ``f(qdq_path, profiling_csv) -> runner`` (default: QNN HTP, detailed profiling).
        task: ``f(qdq_path) -> dict`` of task metrics (e.g. caption accuracy).
        quantize_kw: extra :func:`~ivq_debug.qnn.quantize.quantize_for_qnn` arguments.
        base_overrides: ORT overrides every trial starts from (the configuration being tuned);
            suggestions replace the entries of the tensors they name.
    """

    float_model: Path
    calibration: Any
    feeds: Sequence[dict[str, np.ndarray]]
    reference: Path
    workdir: Path
    preset: str = "a8w8"
    part: str = "model"
    runner_factory: Callable[[Path, Path], Any] | None = None
    task: Callable[[Path], dict[str, Any]] | None = None
    quantize_kw: dict[str, Any] = field(default_factory=dict)
    base_overrides: dict[str, Any] = field(default_factory=dict)

    def trial(self, label: str, suggestions: list[Suggestion]) -> Trial:
        """Quantize with ``suggestions``, capture, compare (and run the task metric)."""
        t0 = time.perf_counter()
        wd = Path(self.workdir)
        wd.mkdir(parents=True, exist_ok=True)
        qdq = wd / f"{label}.qdq.onnx"
        act = "QUInt16" if self.preset.startswith("a16") else "QUInt8"
        suggested, exclude = ort_overrides(suggestions, act)
        overrides = {**self.base_overrides, **suggested}
        kw = dict(self.quantize_kw)
        if exclude:
            kw["nodes_to_exclude"] = [*kw.get("nodes_to_exclude", []), *exclude]
        quantize_consistent(self.float_model, qdq, self.calibration, self.preset, overrides, kw)
        dump = wd / f"{label}.h5"
        prof = wd / f"{label}.profile.csv"
        if self.runner_factory is not None:
            runner = self.runner_factory(qdq, prof)
        else:
            runner = make_runner("qnn", qdq, selection=Selection(), profiling_level="detailed", profiling_path=prof,
                                 overwrite=True, allow_cpu_fallback=bool(exclude))
        capture(runner, self.feeds, dump, part=self.part, model={"path": str(qdq), "label": label},
                overwrite=True, progress=None)
        cmp = compare(self.reference, dump, progress=False)
        task = self.task(qdq) if self.task else {}
        return Trial(label, list(suggestions), qdq, dump, cmp, task, qdq.stat().st_size, _cycles(dump),
                     time.perf_counter() - t0)


_CONFLICT = re.compile(r"Desired producer quant_type for (.+?) doesn't match existing type")


def quantize_consistent(float_model: Path, out: Path, calibration: Any, preset: str, overrides: dict[str, Any],
                        kw: dict[str, Any], max_fixes: int = 16) -> list[str]:
    """Quantize with overrides, resolving ORT's mixed-precision type conflicts; returns the fixes made.

    ORT's QNN mixed-precision fixer wants a tensor at a precision boundary to be produced in the type its
    neighbours imply; when an override disagrees it raises "Desired producer quant_type for X ...". Each such
    X is given the other activation type (8 ↔ 16 bit) and the quantization retried; the fixes are recorded.
    """
    from onnxruntime.quantization import QuantType


    fixes: list[str] = []
    default = QuantType.QUInt16 if preset.startswith("a16") else QuantType.QUInt8
    for _ in range(max_fixes + 1):
        try:
            quantize_for_qnn(float_model, out, calibration, preset=preset, overrides=overrides or None,
                             overwrite=True, **kw)
            return fixes
        except InputError as e:
            m = _CONFLICT.search(str(e))
            if not m or len(fixes) >= max_fixes:
                raise
            name = m.group(1)
            entry = dict((overrides.get(name) or [{}])[0])
            cur = entry.get("quant_type", default)
            entry["quant_type"] = QuantType.QUInt8 if cur == QuantType.QUInt16 else QuantType.QUInt16
            overrides = {**overrides, name: [entry]}
            fixes.append(f"{name} -> {entry['quant_type'].name}")
    return fixes


def verify(tuner: Tuner, suggestions: list[Suggestion], watch: Sequence[str] = (),
           before: Trial | None = None) -> TuneReport:
    """Baseline vs the given overrides (``watch``: tensors whose SQNR is the end-to-end figure)."""
    before = before or tuner.trial("before", [])
    after = tuner.trial("after", suggestions)
    return TuneReport(before, after, list(watch) or _default_watch(before))


def _default_watch(trial: Trial) -> list[str]:
    t = trial.comparison.table
    if t.empty:
        return []
    return [t.sort_values("order").iloc[-1]["ref_name"]]


def greedy(tuner: Tuner, suggestions: list[Suggestion], watch: Sequence[str], *, budget_sqnr_db: float,
           min_gain_db: float = 0.5, max_trials: int = 24, progress: bool = True) -> TuneReport:
    """Add suggestions one at a time while they help the watched tensors, until the budget is met.

    A suggestion is kept when the worst watched SQNR improves by at least ``min_gain_db``. A kept 16-bit
    entry whose own tensor stays below the budget is retried as fp16 (its node left unquantized).
    """

    watch = list(watch)
    before = tuner.trial("before", [])

    def score(tr: Trial) -> float:
        vals = [tr.sqnr(w) for w in watch]
        vals = [v for v in vals if v is not None]
        return min(vals) if vals else -math.inf

    best, best_score = before, score(before)
    active: list[Suggestion] = []
    steps: list[dict[str, Any]] = [{"step": 0, "label": "before", "score_db": best_score, "kept": True}]
    n = 0
    queue = list(suggestions)
    it = track(queue, "tuning", total=len(queue)) if progress else queue
    for s in it:
        if best_score >= budget_sqnr_db or n >= max_trials:
            break
        n += 1
        tr = tuner.trial(f"step{n}", [*active, s])
        sc = score(tr)
        keep = sc >= best_score + min_gain_db
        steps.append({"step": n, "label": tr.label, "added": s.tensor, "action": s.action, "score_db": sc,
                      "kept": keep})
        if keep:
            active.append(s)
            best, best_score = tr, sc
            own = tr.sqnr(s.tensor)
            if s.bitwidth == 16 and own is not None and own < budget_sqnr_db and s.node and n < max_trials:
                n += 1
                fp = replace(s, action="fp16", reason=s.reason + "; still below budget at 16-bit → fp16")
                tr2 = tuner.trial(f"step{n}", [*active[:-1], fp])
                sc2 = score(tr2)
                keep2 = sc2 >= best_score + min_gain_db
                steps.append({"step": n, "label": tr2.label, "added": s.tensor, "action": "fp16",
                              "score_db": sc2, "kept": keep2})
                if keep2:
                    active[-1] = fp
                    best, best_score = tr2, sc2
    return TuneReport(before, best, watch, steps)


def tune_dir_cleanup(workdir: str | os.PathLike, keep: Sequence[str] = ()) -> None:
    """Remove trial files except the labels in ``keep``."""
    for p in Path(workdir).glob("step*"):
        if not any(p.name.startswith(k + ".") for k in keep):
            p.unlink()
