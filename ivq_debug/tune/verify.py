"""Verify overrides before recommending them: re-quantize, re-capture on the backend, compare before and after.

A *trial* writes the suggestions as the overrides file that will be delivered (QNN ``legacy`` / ``1.0.0`` or ORT
JSON: every trial round-trips the format), reads it back, quantizes the float model with it, captures the QDQ
model on the verified backend (QNN HTP, emulated on x86, or ORT CPU-QDQ) for the evaluation inputs, compares it
with the float reference dump and, optionally, scores a task metric. :func:`verify` tries candidate sets in
order (all suggestions, then weights only / activations only, each pattern group, the top half, the top one)
and recommends the first that does not lower the watched outputs' SQNR (the final output by default) or any
task metric; every refused set is reported with the reason. :func:`greedy` adds suggestions one at a time and
keeps those that help, escalating a 16-bit entry that is still bad to fp16 (the node left unquantized).

Calibration and evaluation stay apart: the quantizer calibrates on the calibration data, widened ranges come
from the float model's ranges over the calibration data (:meth:`Tuner.calibration_ranges`), and the evaluation
inputs are only scored.

Every trial is checkpointed (``<workdir>/checkpoint.json``, rewritten atomically after each trial, keyed by the
trial's settings): a run that fails late loses nothing, and a rerun with the same workdir reuses the finished
trials. Costs come with each trial: the QDQ model size, and the summed per-op cycles of a detailed QNN profile
(emulated cycles: relative only, see ``docs/qnn-capture.md``).
"""

from __future__ import annotations

import concurrent.futures as cf
import glob
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import comparator, defaults, interrupt
from ivq_debug.api import compare
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.capture.qnn_ep.session import qnn_ep_status
from ivq_debug.capture.worker import ProcessRunner
from ivq_debug.comparator.records import RecordwiseComparison
from ivq_debug.console import track
from ivq_debug.dump import Dump, open_dump
from ivq_debug.dump.contract import input_digest
from ivq_debug.dump.memory import MemoryDump, MemorySink
from ivq_debug.dump.stats import tensor_stats
from ivq_debug.errors import InputError, IvqError, RunError, UsageError, one_line
from ivq_debug.executor import job_key, versions
from ivq_debug.inputfiles import is_inside, regular_file, sha256_file
from ivq_debug.jsonio import json_safe, load_json
from ivq_debug.onnxgraph.load import external_files, load_model, model_file_bytes
from ivq_debug.outputs import atomic_write_text
from ivq_debug.qnn.encodings import EncodingSet, encodings_from_qdq_model, to_ort_overrides
from ivq_debug.qnn.quantize import (
    CALIBRATION_OPTIONS,
    float_producers,
    load_calibration,
    preprocess_float_model,
    quantize_for_qnn,
)
from ivq_debug.schema import check_schema
from ivq_debug.tune.legal import forbidden, refusal, split_legal, violations
from ivq_debug.tune.reference import LiveRecord, LiveReference
from ivq_debug.tune.suggest import (
    EXCLUDE_SUFFIX,
    SUGGESTION_SCHEMA,
    Suggestion,
    read_overrides,
    write_suggestions,
)

CHECKPOINT = "checkpoint.json"
#: the workdir folder of calibration results every trial of one quantizer setting shares
#: (:func:`~ivq_debug.qnn.quantize.calibration_cache_key`)
CALIBRATION_CACHE = "calibration-cache"
#: how many candidate sets :func:`verify` tries before it gives up (each is one trial: quantize + a partial capture)
MAX_CANDIDATES = 6


_PATH_OR_NULL = {"type": ["string", "null"]}
#: ``checkpoint.json`` (``version`` 1): trial key → the finished (or failed) trial
CHECKPOINT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["version", "trials"],
    "properties": {
        "version": {"const": 1},
        "trials": {"type": "object", "additionalProperties": {
            "type": "object",
            "required": ["label", "qdq_model", "dump"],
            "properties": {
                "label": {"type": "string"}, "qdq_model": {"type": "string"}, "dump": {"type": "string"},
                "overrides": _PATH_OR_NULL, "error": {"type": ["string", "null"]},
                "suggestions": {"type": "array", "items": {"type": "object"}},
                "fixes": {"type": "array", "items": SUGGESTION_SCHEMA},
                "task": {"type": ["object", "null"]}, "model_bytes": {"type": ["integer", "null"], "minimum": 0},
                "cycles": {"type": ["number", "null"]}, "seconds": {"type": ["number", "null"]}}}},
    },
}


def read_checkpoint(path: str | os.PathLike, workdir: str | os.PathLike) -> dict[str, Any]:
    """A tune ``checkpoint.json`` (:data:`CHECKPOINT_SCHEMA`), every file it names inside ``workdir``.

    Raises:
        InputError: not a regular JSON file of the schema, or a trial whose model, dump or overrides path leaves
            the workdir (a resumed trial reads them).
    """
    doc = load_json(path, "tune checkpoint")
    check_schema(doc, CHECKPOINT_SCHEMA, path)
    for key, t in doc["trials"].items():
        for k in ("qdq_model", "dump", "overrides"):  # relative to the workdir (absolute in older checkpoints)
            if t.get(k) is not None and not is_inside(os.path.join(workdir, t[k]), workdir):
                raise InputError(f"trials[{key!r}].{k}: {t[k]!r} is not a file of the workdir {str(workdir)!r}", path)
    return doc


def load_task_metric(spec: str) -> Callable[[list[dict[str, Any]]], Any]:
    """``module:function`` or ``path/to/file.py:function`` → the function.

    Raises:
        UsageError: ``spec`` is not ``MODULE:FUNCTION``, or an importable module that is missing, fails or lacks
            the function (exit 2).
        InputError: a ``.py`` file that is not a regular file, does not import (its exception, ``SystemExit``
            included, on one line) or lacks the function (exit 3).
    """
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise UsageError(f"--task-metric wants MODULE:FUNCTION, got {spec!r}")
    is_file = mod_name.endswith(".py")
    err: type[IvqError] = InputError if is_file else UsageError
    where = mod_name if is_file else None
    try:
        if is_file:
            path = regular_file(mod_name, "task metric file")
            sp = importlib.util.spec_from_file_location(path.stem, path)
            if sp is None or sp.loader is None:
                raise InputError("cannot load the task metric file", path)
            mod = importlib.util.module_from_spec(sp)
            sp.loader.exec_module(mod)
        else:
            mod = importlib.import_module(mod_name)
    except IvqError:
        raise
    except (Exception, SystemExit) as e:  # the user's module; SystemExit: a module that exits on import
        what = f"cannot import {'the task metric' if is_file else repr(mod_name)}"
        raise err(f"--task-metric: {what} ({type(e).__name__}: {one_line(e, 200)})", where) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise err(f"--task-metric: {'the file' if is_file else repr(mod_name)} has no function {fn_name!r}", where)
    return fn


@dataclass
class Trial:
    """One quantize + capture + compare round (``error`` set when it failed)."""

    label: str
    suggestions: list[Suggestion]
    qdq_model: Path
    dump: Path
    comparison: Any
    task: dict[str, Any] = field(default_factory=dict)
    model_bytes: int = 0
    cycles: float | None = None
    seconds: float = 0.0
    error: str | None = None
    overrides: Path | None = None
    reused: bool = False
    #: ``{tensor: worst SQNR}`` kept when the dump is not (:func:`worst_sqnr`)
    sqnr_table: dict[str, float] = field(default_factory=dict)
    #: the types the quantizer resolved, as suggestions (dicts) now part of :attr:`suggestions`
    fixes: list[dict[str, Any]] = field(default_factory=list)
    #: per watched tensor: mean and worst SQNR over the evaluation samples (:func:`per_sample`)
    samples: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the QNN session options of an HTP trial (:meth:`Tuner.qnn_options`; None on CPU-QDQ)
    session: dict[str, Any] | None = None
    #: ``{"samples": run, "of": given}`` when the trial stopped early (:meth:`Tuner.trial` ``stop``): its figures
    #: are over the samples run, no task metric
    stopped: dict[str, int] | None = None

    def sqnr(self, name: str) -> float | None:
        """Worst SQNR of a tensor over the records (None when absent or the trial failed)."""
        if self.error:
            return None
        if self.comparison is None:
            return self.sqnr_table.get(name)
        t = self.comparison.table
        v = t.loc[(t["ref_name"] == name) | (t["test_name"] == name), "sqnr_db"]
        return float(v.min()) if len(v) else None

    def release(self) -> None:
        """Let go of the sample the baseline's comparison holds in memory (:meth:`Tuner.trial`) once the diagnosis
        has read it; the table and the figures stay."""
        cmp = self.comparison
        if cmp is None:
            return
        if isinstance(cmp.ref, LiveRecord):
            cmp.ref._owner.release(cmp.ref._sample)
        if isinstance(cmp.test, MemoryDump):
            cmp.test.close()


@dataclass
class TuneReport:
    """Before / after figures of a tuning run, and the candidate sets refused on the way."""

    before: Trial
    after: Trial
    watch: list[str]
    steps: list[dict[str, Any]] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    recommended: bool = True
    backend: str = "qnn"
    format: str = "legacy"
    #: the recommended set measured on the target backend when the trials ran elsewhere (:func:`confirm_on_target`)
    target_check: dict[str, Any] = field(default_factory=dict)

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
            "backend": self.backend, "format": self.format, "recommended": self.recommended,
            "watch": self.watch,
            "changed": self.changed.to_dict(orient="records"),
            "end_to_end": self.end_to_end.to_dict(orient="records"),
            "overrides": [s.to_dict() for s in self.after.suggestions] if self.recommended else [],
            "refused": self.refused,
            "steps": self.steps,
            "target_check": self.target_check,
            "samples": {"before": self.before.samples, "after": self.after.samples},
            "resolved_types": self.after.fixes,
            "before": {"qdq_model": str(self.before.qdq_model),
                       "dump": str(self.before.dump) if self.before.dump.exists() else None,
                       "session": self.before.session},
            "after": {"qdq_model": str(self.after.qdq_model),
                      "dump": str(self.after.dump) if self.after.dump.exists() else None,
                      "overrides": str(self.after.overrides) if self.after.overrides else None,
                      "session": self.after.session},
        })


def _cycles(dump: Any) -> float | None:
    """The summed per-op cycles of the first profiled run of a dump (a path or an open dump)."""
    if not isinstance(dump, Dump):
        with open_dump(dump) as d:
            return _cycles(d)
    if "profiling" not in dump.table_names():
        return None
    p = dump.table("profiling")
    ops = p[(p["is_op"].astype(bool)) & (p["unit"] == "cycles")]
    if ops.empty:
        return None
    runs = sorted(r for r in ops["run"].dropna().unique() if r >= 0)
    if runs:
        ops = ops[ops["run"] == runs[0]]
    return float(ops["value"].sum())


def _suggestion_key(s: Suggestion) -> list[Any]:
    return [s.tensor, s.action, s.rmin, s.rmax, s.axis, s.node]


def _jsonable_overrides(d: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(json_safe({k: [{kk: getattr(vv, "name", vv) for kk, vv in e.items()} for e in v]
                                            for k, v in d.items()}), default=str))


class Stop:
    """The early stop of a trial (:meth:`Tuner.trial` ``stop``): called after each sample with the worst SQNR so far
    of each measured tensor, True ends the trial there. :meth:`observe` is told the trial's cost as it becomes known;
    a stop that weighs it (:class:`~ivq_debug.tune.search.Below`) keeps it, the others ignore it (a plain function
    of the worst SQNRs is one of those: :func:`as_stop`)."""

    def __call__(self, worst: Mapping[str, float]) -> bool:
        raise NotImplementedError

    def observe(self, model_bytes: int | None = None, cycles: float | None = None) -> None:
        """The running trial's model bytes (once quantized) and HTP cycles (after its first sample): ignored."""


@dataclass(frozen=True)
class _StopWhen(Stop):
    """A plain function of the worst SQNRs as a :class:`Stop`."""

    rule: Callable[[Mapping[str, float]], bool]

    def __call__(self, worst: Mapping[str, float]) -> bool:
        return self.rule(worst)


def as_stop(stop: Callable[[Mapping[str, float]], bool] | None) -> Stop | None:
    """``stop`` as a :class:`Stop` (a plain function: one that does not weigh the trial's cost)."""
    return stop if stop is None or isinstance(stop, Stop) else _StopWhen(stop)


@dataclass
class Tuner:
    """What every trial shares: the float model, calibration, inputs, reference and backend.

    Args:
        float_model: the float ONNX model to quantize.
        calibration: calibration data (see :func:`ivq_debug.qnn.quantize.load_calibration`).
        feeds: evaluation inputs to capture, one dict per sample (records ``(sample, part, 0)``).
        reference: the float reference dump of the same inputs (path), or None: the float model's tensors made
            in memory as the comparisons read them (:class:`~ivq_debug.tune.reference.LiveReference`; nothing
            written, the same figures to the bit).
        workdir: where trial models and dumps go (and ``checkpoint.json``).
        preset: quantization preset (``a8w8``…).
        part: record part name of the captures.
        runner_factory: ``f(qdq_path, profiling_csv) -> runner`` (default: by ``backend``).
        task: ``f(qdq_path) -> dict`` of task metrics (higher is better; e.g. caption accuracy).
        output_metric: ``f(outputs) -> float | dict``: a task metric on the trial's model outputs (one
            ``{output name: array}`` per evaluation input, in order; higher is better).
        quantize_kw: extra :func:`~ivq_debug.qnn.quantize.quantize_for_qnn` arguments (``per_channel``,
            ``calibrate_method``, ...).
        base_overrides: ORT overrides every trial starts from (the configuration being tuned);
            suggestions replace the entries of the tensors they name.
        backend: ``"qnn"`` (QNN HTP, emulated on x86, detailed profile) or ``"cpu"`` (ORT CPU-QDQ).
        fmt: the overrides format every trial writes and reads back (``legacy``, ``1.0.0``, ``ort``).
        resume: reuse the finished trials of ``checkpoint.json`` with the same settings.
        preprocess: run the quantizer's ``qnn_preprocess_model`` once (``<workdir>/preprocessed.onnx``) and
            quantize that model in every trial, so overrides can name the tensors it creates (the ``Gemm``
            outputs between reshapes); the overrides files name the quantizer's tensors.
        target: the backend the recommendation is for (``qnn``: HTP, whatever ``backend`` verifies): every trial's
            suggestions and quantized model are checked against its precision table (:mod:`ivq_debug.tune.legal`).
        optimization: the ORT graph optimization level of the HTP sessions (``ivq capture qnn --optimization``).
        qnn_session: other QNN runner options (``soc_model``, ``htp_arch``, ``fast_compile``, ``qnn_cache``).
    """

    float_model: Path
    calibration: Any
    feeds: Sequence[dict[str, np.ndarray]]
    reference: Path | None
    workdir: Path
    preset: str = "a8w8"
    part: str = "model"
    runner_factory: Callable[[Path, Path], Any] | None = None
    task: Callable[[Path], dict[str, Any]] | None = None
    output_metric: Callable[[list[dict[str, np.ndarray]]], Any] | None = None
    quantize_kw: dict[str, Any] = field(default_factory=dict)
    base_overrides: dict[str, Any] = field(default_factory=dict)
    backend: str = "qnn"
    fmt: str = "legacy"
    resume: bool = True
    preprocess: bool = True
    target: str = "qnn"
    optimization: str = "disable"
    qnn_session: dict[str, Any] = field(default_factory=dict)
    #: how the evaluation set was made (:func:`evaluation_split`), reported in ``tune.json``
    evaluation: dict[str, Any] = field(default_factory=dict)
    #: every trial writes its dump (``--keep-dumps``); otherwise only the baseline's is written (the diagnosis
    #: reads it) and the other trials compare in memory (:meth:`compare_in_memory`)
    keep_dumps: bool = False
    #: tensors a trial compared in memory measures besides the model outputs, the last tensor (the default
    #: watch) and its own suggestions' tensors (:meth:`measured`): the watched tensors (``--watch``)
    watch: tuple[str, ...] = ()
    #: the calibration results trials share (default ``<workdir>/calibration-cache``; a job's tuner names its
    #: search's, so workers in other folders calibrate once too)
    calibration_cache: Path | None = None
    #: the order the evaluation samples run in a trial compared in memory (sample indices; None: as given): a
    #: search runs its levers on sample 0, then the baseline's hardest samples (``search.hardest_first``), so a
    #: lever that cannot matter stops sooner. Keep sample 0 first (the alignment checks values on the first record
    #: compared); the figures are then the same in any order (worst and mean per sample, the task metric on the
    #: outputs put back in sample order)
    order: tuple[int, ...] | None = None
    _calibrated: dict[str, tuple[float, float]] | None = field(default=None, repr=False)
    _digests: dict[str, str] = field(default_factory=dict, repr=False)
    _ranges: dict[str, tuple[float, float]] | None = field(default=None, repr=False)
    _checkpoint: dict[str, Any] | None = field(default=None, repr=False)
    _source: Path | None = field(default=None, repr=False)
    _outs: list[str] | None = field(default=None, repr=False)
    _live: LiveReference | None = field(default=None, repr=False)
    #: the keys of the trials this run finished (shared by the tuner's copies): a trial run again in the same run
    #: — the HTP baseline of each target check, the chosen lever — reuses its checkpoint entry even without
    #: :attr:`resume`
    _ran: set[str] = field(default_factory=set, repr=False)
    #: where the trials' seconds went, summed over this tuner and its copies (``tune.json`` ``timings``,
    #: :meth:`timing_summary`): quantize (and how many were served by the run's model cache), run + compare
    timings: dict[str, float] = field(default_factory=dict, repr=False)

    def _took(self, what: str, seconds: float, n: int = 1) -> None:
        self.timings[f"{what}_s"] = self.timings.get(f"{what}_s", 0.0) + seconds
        self.timings[what] = self.timings.get(what, 0) + n

    def timing_summary(self) -> dict[str, Any]:
        """The trials' split (seconds rounded) and the in-memory reference's forwards and kept bytes."""
        out: dict[str, Any] = {k: round(v, 1) if k.endswith("_s") else int(v) for k, v in self.timings.items()}
        if self._live is not None:
            out |= {"reference_forwards": self._live.forwards, "reference_kept_bytes": self._live.kept_bytes()}
        return out

    def live(self) -> LiveReference | None:
        """The in-memory float reference (None with a reference dump), shared by the copies of this tuner."""
        if self.reference is not None:
            return None
        if self._live is None:
            self._live = LiveReference(self.source(), self.feeds, self.part)
        return self._live

    def reference_digest(self) -> str:
        """The reference's identity in keys: the dump's content digest, or what the live one is made of."""
        live = self.live()
        if live is not None:
            return live.digest()
        return dump_digest(self.reference)

    def source(self) -> Path:
        """The model every trial quantizes: the float model after the quantizer's preprocessing (when it changes
        anything), else the float model itself."""
        if self._source is None:
            self._source = Path(self.float_model)
            if self.preprocess:
                samples, _ = load_calibration(self.calibration, self.float_model,
                                              **{k: v for k, v in self.quantize_kw.items() if k in CALIBRATION_OPTIONS})
                pre = preprocessed_model(self.float_model, Path(self.workdir), samples)
                if pre is not None:
                    self._source = pre
        return self._source

    # ------------------------------------------------------------------ calibration
    def calibration_ranges(self) -> dict[str, tuple[float, float]]:
        """``{tensor: (min, max)}`` of the float model over the calibration samples (the finite values' extrema,
        as a dump's statistics give them: :func:`~ivq_debug.dump.stats.tensor_stats`): the only source of widened
        ranges. One forward per sample into memory, nothing written (it was a summary-only dump of 107 MB on
        PP-OCRv4's recognizer over 16 lines: a strided sample of every tensor nobody read)."""
        if self._ranges is None:
            samples, _ = load_calibration(self.calibration, self.source(),
                                          **{k: v for k, v in self.quantize_kw.items() if k in CALIBRATION_OPTIONS})
            runner = make_runner("onnx", self.source(), selection=Selection())
            sink = MemorySink(runner.backend, runner.info, path="<calibration ranges>")
            out: dict[str, tuple[float, float]] = {}
            for i, feeds in enumerate(samples):
                interrupt.raise_if_signalled()
                d = sink.record(runner, feeds, i, self.part)
                for e in [*d.tensors(), *d.tensors(kind="input")]:
                    st = tensor_stats(d.read(e))
                    lo, hi = st.get("min"), st.get("max")
                    if lo is None or hi is None:
                        continue
                    cur = out.get(e.name)
                    out[e.name] = (min(lo, cur[0]), max(hi, cur[1])) if cur else (float(lo), float(hi))
                d.close()
            runner.close()
            self._ranges = out
        return self._ranges

    # ------------------------------------------------------------------ checkpoint
    def __post_init__(self) -> None:
        if self.resume:
            self._ckpt()  # a resumed run checks its checkpoint before any work

    def _ckpt(self) -> dict[str, Any]:
        if self._checkpoint is None:
            p = Path(self.workdir) / CHECKPOINT
            doc: dict[str, Any] = {"version": 1, "trials": {}}
            if self.resume and os.path.lexists(p):
                doc = read_checkpoint(p, self.workdir)
            self._checkpoint = doc
        return self._checkpoint

    def _save(self, key: str, entry: dict[str, Any]) -> None:
        doc = self._ckpt()
        doc["trials"][key] = json_safe(entry)
        Path(self.workdir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(self.workdir) / CHECKPOINT, json.dumps(doc, indent=1, default=str) + "\n",
                          overwrite=True)

    def _digest(self, what: str, path: Path) -> str:
        if what not in self._digests:
            self._digests[what] = sha256_file(path) if Path(path).exists() else str(path)
        return self._digests[what]

    def key(self, suggestions: Sequence[Suggestion]) -> str:
        """The checkpoint key of a trial: its suggestions and every setting that changes its result. The model
        and the reference enter by content (SHA-256), so a run resumed from another working directory, with
        other relative paths to the same files, reuses the trials."""
        blob = json.dumps({"s": [_suggestion_key(s) for s in suggestions], "preset": self.preset, "fmt": self.fmt,
                           "backend": self.backend, "kw": {k: str(v) for k, v in sorted(self.quantize_kw.items())},
                           "base": _jsonable_overrides(self.base_overrides),
                           "model": self._digest("model", Path(self.float_model)),
                           "ref": self._digest("ref", Path(self.reference)) if self.reference is not None
                           else self._live_key(), "target": self.target,
                           "qnn": self.qnn_options() if self.backend == "qnn" else None},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _live_key(self) -> str:
        if "ref" not in self._digests:
            self._digests["ref"] = self.live().digest()  # type: ignore[union-attr]
        return self._digests["ref"]

    def qnn_options(self) -> dict[str, Any]:
        """The QNN session settings of every HTP session of the tune (recorded in each trial)."""
        return {"optimization": self.optimization, **dict(sorted(self.qnn_session.items()))}

    def _rel(self, p: Path) -> str:
        """A workdir file as the checkpoint records it: relative to the workdir."""
        return os.path.relpath(p, self.workdir)

    def _abs(self, p: str) -> Path:
        return Path(p) if os.path.isabs(p) else Path(self.workdir) / p

    # ------------------------------------------------------------------ a trial
    def trial(self, label: str, suggestions: list[Suggestion], *, keep_dump: bool | None = None,
              stop: Callable[[Mapping[str, float]], bool] | None = None, whole: bool | None = None) -> Trial:
        """Write, read back and apply ``suggestions``; quantize, check the pairs against the target backend's table
        (:mod:`ivq_debug.tune.legal`), capture, compare (and score the task).

        Type conflicts the quantizer raises are resolved in the *suggestions* (:meth:`_quantize`), so the trial's
        :attr:`Trial.suggestions` — what is delivered — hold the type of every tensor the trial changed.
        ``keep_dump``: capture the trial into a dump and keep it (default: every trial's with
        :attr:`keep_dumps`; needs a reference dump); the others are *partial captures*: each evaluation sample
        is run once and compared with the reference in memory (:meth:`compare_in_memory`, the same numbers to
        the bit), and only the figures stay (``tune.json``, the checkpoint). ``whole`` (default: the baseline,
        label ``before``): compared on every pair, and its comparison holds the first sample's tensors, test and reference, in
        memory (``comparison.test`` / ``comparison.ref``: what the diagnosis replays; :meth:`Trial.release`
        lets them go); a resumed run runs it again unless its dump was kept. ``stop``: called after each sample
        with the worst SQNR so far of each measured tensor; True ends the trial there (:attr:`Trial.stopped`; the
        figures of the samples run, no task metric; never reused by another trial); a :class:`Stop` is told the
        model's bytes once quantized and the HTP cycles of the first sample (:meth:`Stop.observe`). The calibration
        runs once per quantizer setting (``<workdir>/calibration-cache``: overrides do not enter it), and HTP
        sessions load their compiled contexts from the QNN context cache when the trial's model compiled before.
        """
        t0 = time.perf_counter()
        wd = Path(self.workdir)
        wd.mkdir(parents=True, exist_ok=True)
        keep = self.keep_dumps if keep_dump is None else keep_dump
        full = label == "before" if whole is None else whole  # a diagnosis and suggestions read every pair
        if keep and self.reference is None:
            raise UsageError("a trial that keeps its dump needs a reference dump (Tuner.reference)")
        key = self.key(suggestions)
        qdq = wd / f"{label}.qdq.onnx"
        dump = wd / f"{label}.h5"
        done = self._ckpt()["trials"].get(key)
        covered = done is not None and (done.get("measured") is None or self.measured(
            _with_fixes(suggestions, [Suggestion(**f) for f in done.get("fixes") or []]), self.outputs())
            <= set(done["measured"]))
        dpath = self._abs(done["dump"]) if done is not None else dump
        if (self.resume or key in self._ran) and done is not None and not done.get("error") \
                and not done.get("stopped") \
                and self._abs(done["qdq_model"]).exists() \
                and ((dpath.exists() and self.reference is not None) or (done.get("sqnr") is not None and not keep
                                                                         and (full or covered))):
            if dpath.exists() and self.reference is not None:
                cmp = compare(self.reference, dpath, progress=False)
            elif full:  # the baseline's whole comparison again, from its kept model (nothing re-quantized)
                prof = wd / f"{label}.profile.csv"
                cmp = self.compare_in_memory(self._runner(self._abs(done["qdq_model"]), prof,
                                                          bool(done.get("fallback")), check=False), hold=0)[0]
                _remove_profiles(prof)
            else:
                cmp = None
            ov = self._abs(done["overrides"]) if done.get("overrides") else None
            applied = _with_fixes(suggestions, [Suggestion(**f) for f in done.get("fixes") or []])
            return Trial(done["label"], applied, self._abs(done["qdq_model"]), dpath, cmp,
                         dict(done.get("task") or {}), int(done.get("model_bytes") or 0), done.get("cycles"),
                         float(done.get("seconds") or 0.0), None, ov, reused=True,
                         sqnr_table={k: _json_number(v) for k, v in (done.get("sqnr") or {}).items()},
                         fixes=list(done.get("fixes") or []),
                         samples=dict(done.get("samples") or {}), session=done.get("session"))
        entry: dict[str, Any] = {"label": label, "suggestions": [s.to_dict() for s in suggestions],
                                 "qdq_model": self._rel(qdq), "dump": self._rel(dump),
                                 "target": self.target, "session": self.qnn_options() if self.backend == "qnn" else None}
        applied, fixes = list(suggestions), []
        try:
            why = forbidden(suggestions, self.source(), self.preset, self.target)
            if why:
                raise UsageError(refusal(why, self.target))
            ov_path, applied, fixes, exclude = self._quantize(label, suggestions, qdq)
            bad = violations(qdq, self.target)
            if bad:
                raise UsageError(f"the quantized model is not run by {self.target.upper()}: "
                                 + "; ".join(str(v) for v in bad))
            prof = wd / f"{label}.profile.csv"
            t1 = time.perf_counter()
            stop = as_stop(stop)
            if stop is not None:
                stop.observe(model_bytes=model_file_bytes(qdq))
            runner = self._runner(qdq, prof, bool(exclude), check=keep)
            outs = self.outputs()
            measure = None if keep or full else self.measured(applied, outs)
            if keep:
                capture(runner, self.feeds, dump, part=self.part, model={"path": str(qdq), "label": label},
                        overwrite=True, progress=None)
                cmp = compare(self.reference, dump, progress=False)
                with open_dump(dump) as d:
                    per, cycles = _outputs(d, outs) if self.output_metric is not None else [], _cycles(d)
            else:
                cmp, per, cycles = self.compare_in_memory(runner, outs if self.output_metric is not None else [],
                                                          measure=measure, hold=0 if full else None, stop=stop,
                                                          second=self._second(qdq, prof, bool(exclude)))
            self._took(f"run_compare_{self.backend}", time.perf_counter() - t1)
            ran = int(cmp.table["sample"].nunique()) if len(cmp.table) else len(self.feeds)
            stopped = {"samples": ran, "of": len(self.feeds)} if stop is not None and ran < len(self.feeds) else None
            task = dict(self.task(qdq)) if self.task and stopped is None else {}
            if self.output_metric is not None and stopped is None:
                task.update(_score(self.output_metric, per))
            if not suggestions:
                self._calibrated = None  # the baseline's encodings are the calibrated ranges of later fixes
        except Exception as e:  # a failed trial is a result: recorded, checkpointed, refused (the whole reason)
            msg = one_line(e) if isinstance(e, IvqError) else f"{type(e).__name__}: {one_line(e)}"
            entry |= {"error": msg, "seconds": round(time.perf_counter() - t0, 2),
                      "fixes": [f.to_dict() for f in fixes]}
            if getattr(e, "unsupported", None):  # a QNN refusal: every node with its reason (the line groups them)
                entry["unsupported"] = list(e.unsupported)
            self._save(key, entry)
            return Trial(label, applied, qdq, dump, None, error=entry["error"], seconds=entry["seconds"],
                         session=entry["session"])
        tr = Trial(label, applied, qdq, dump, cmp, task, model_file_bytes(qdq), cycles,
                   time.perf_counter() - t0, None, ov_path, fixes=[f.to_dict() for f in fixes],
                   session=entry["session"], stopped=stopped)
        tr.sqnr_table = worst_sqnr(cmp)
        tr.samples = per_sample(cmp, _default_watch(tr))
        if not keep:
            dump.unlink(missing_ok=True)
            _remove_profiles(prof)
        entry |= {"overrides": self._rel(ov_path) if ov_path else None, "task": task, "fallback": bool(exclude),
                  "model_bytes": tr.model_bytes, "cycles": tr.cycles, "seconds": round(tr.seconds, 2),
                  "fixes": tr.fixes, "sqnr": tr.sqnr_table, "samples": tr.samples,
                  "measured": None if measure is None else sorted(measure), "stopped": stopped}
        self._save(key, entry)
        if stopped is None:
            self._ran.add(key)
        return tr

    def worker(self, workdir: str | os.PathLike) -> Tuner:
        """A copy for a job in its own folder (another process, a Ray worker): absolute paths, the preprocessed
        model as its float model, the calibrated ranges and the calibration cache of this tuner, no checkpoint."""
        return replace(self, float_model=self.source().resolve(),
                       reference=Path(self.reference).resolve() if self.reference is not None else None,
                       workdir=Path(workdir), resume=False, preprocess=False, _checkpoint=None, _source=None, _ran=set(),
                       _ranges=None, _calibrated=self.calibrated(), _digests={},
                       calibration_cache=Path(self.calibration_cache or Path(self.workdir) / CALIBRATION_CACHE
                                              ).resolve())

    def outputs(self) -> list[str]:
        """The float model's graph outputs (a task metric's inputs; always measured)."""
        if self._outs is None:
            self._outs = [o.name for o in load_model(self.float_model).graph.output]
        return list(self._outs)

    def measured(self, suggestions: Sequence[Suggestion], outputs: Sequence[str] = ()) -> set[str]:
        """The tensors a trial compared in memory measures: what its report reads — the watched tensors
        (:attr:`watch`), the model ``outputs``, the tensors its suggestions name (the changed-layers table)."""
        return {*self.watch, *outputs, *(s.tensor for s in suggestions)}

    def watching(self, watch: Sequence[str]) -> Tuner:
        """This tuner, or a copy whose trials also measure ``watch`` (a search's watched tensors)."""
        if set(watch) <= set(self.watch):
            return self
        return replace(self, watch=tuple(dict.fromkeys([*self.watch, *watch])), _checkpoint=self._ckpt())

    def compare_in_memory(self, runner: Any, outputs: Sequence[str] = (), measure: Collection[str] | None = None,
                          hold: int | None = None, stop: Callable[[Mapping[str, float]], bool] | None = None,
                          second: Callable[[], Any] | None = None
                          ) -> tuple[Any, list[dict[str, np.ndarray]], float | None]:
        """A partial capture: each evaluation sample run once through ``runner`` into memory
        (:class:`~ivq_debug.dump.memory.MemorySink`) and compared with the reference at once, then dropped.

        Returns (the comparison of every record, as :func:`ivq_debug.comparator.compare` of a whole capture would
        give it: the alignment's value checks are shared across records; the graph ``outputs`` of each sample,
        for a task metric; the HTP cycles of the first profiled run). The reference is read as for any
        comparison; at most one sample's tensors are in memory. ``measure``: compute the metrics of the pairs
        naming one of these tensors (reference or test name) and of each record's last tensor (the default
        watch) only; every tensor is still captured and aligned, so each figure is the one a whole comparison
        gives (None: every pair). ``hold``: the sample whose tensors the returned comparison keeps in memory, its
        ``test`` and, with the in-memory reference, its ``ref`` (default: none, ``test`` is the last sample's
        listing). ``stop``: after each sample, given the worst SQNR so far of each measured tensor (reference and
        test names); True ends the run there (the table holds the samples run).

        The reference is the dump :attr:`reference` or, without one, the float model run on each sample as the
        comparison reads it (:meth:`live`). ``second``: makes a second runner of the same model; the samples then
        run on both at once, in two threads (:class:`_Samples`: the same records, compared in order).
        """
        live, stop = self.live(), as_stop(stop)
        ref_file = open_dump(self.reference) if live is None else None
        sink = MemorySink(runner.backend, runner.info, path=f"<trial of {Path(runner.model_path).name}>"
                          if getattr(runner, "model_path", None) else "<trial>")
        joined = RecordwiseComparison()  # (the alignment's value checks shared across the records)
        last = held = held_ref = None
        cycles: float | None = None
        worst: dict[str, float] = {}
        samples = _Samples(runner, sink, self.feeds, self.part, second, order=self.order)
        outs: dict[int, list[dict[str, np.ndarray]]] = {}
        try:
            for k, (i, mem) in enumerate(samples):
                if k == 0:  # the first run of the first session: the cycles of its profile
                    cycles = _cycles(mem)
                    if stop is not None:
                        stop.observe(cycles=cycles)
                ref = ref_file if live is None else (live.hold(i) if i == hold else live.record(i, measure))
                cmp = comparator.compare(ref, mem, progress=False, memo=joined.memo, select=None if measure is None else
                                         lambda ps: _pairs_naming(ps, measure))
                if live is not None and i != hold:
                    ref.close()  # the live reference keeps what was read (within its budget)
                joined.add(cmp, (i, self.part, 0))
                if outputs:
                    outs[i] = _outputs(mem, outputs)
                if last is not None and last is not held:
                    last.close()
                last = mem
                if i == hold:
                    held, held_ref = mem, ref
                if stop is not None and k + 1 < len(self.feeds) and stop(worst_sqnr(cmp, worst)):
                    break
        finally:
            samples.close()  # (an early stop: the second runner finishes its sample and goes)
            if second is not None:
                self._took("second_runner", samples.helped_s, len(samples.helped))
                self.timings["second_runner_cpu_s"] = self.timings.get("second_runner_cpu_s", 0.0) \
                    + samples.helped_cpu_s
        assert last is not None, "a tune has at least one evaluation input"
        per = [o for i in sorted(outs) for o in outs[i]]  # in sample order, whatever order they ran in
        if last is not held:
            last.close()
        test = held if held is not None else last
        ref = ref_file if ref_file is not None else (held_ref if held_ref is not None else ref)
        return joined.result(ref, test), per, cycles

    def _runner(self, qdq: Path, prof: Path, fallback: bool, check: bool = True) -> Any:
        """The trial's runner: ORT CPU-QDQ or QNN HTP, every tensor exposed. ``check``: an HTP runner makes the
        capture's exposure check (the outputs with and without the exposed tensors: one more run of the first
        sample, on a session of its own), recorded in a kept dump; a trial compared in memory keeps no backend
        information, so it does not pay for it (PP-OCRv4 a16w16: ~10 s of emulation per HTP check)."""
        if self.runner_factory is not None:
            return self.runner_factory(qdq, prof)
        if self.backend == "cpu":
            return make_runner("onnx", qdq, selection=Selection(), optimization="disable")
        return make_runner("qnn", qdq, selection=Selection(), profiling_level="detailed", profiling_path=prof,
                           overwrite=True, allow_cpu_fallback=fallback, optimization=self.optimization,
                           verify=check, **self.qnn_session)

    def _second(self, qdq: Path, prof: Path, fallback: bool) -> Callable[[], Any] | None:
        """A factory of a second HTP runner of a trial's model (:data:`~ivq_debug.defaults.TUNE_HTP_RUNNERS`), in
        this process's worker process (:class:`~ivq_debug.capture.worker.ProcessRunner`: two HTP sessions of one
        process take turns): its profile in ``<label>.profile.b.csv``, no exposure check (:meth:`_runner`).
        None on CPU-QDQ (ORT runs a session on every core already), with a runner factory, or for one sample."""
        if self.backend != "qnn" or self.runner_factory is not None or len(self.feeds) < 2 \
                or defaults.TUNE_HTP_RUNNERS < 2:
            return None
        return lambda: ProcessRunner("qnn", qdq, path=f"<trial of {qdq.name}>", selection=Selection(),
                                     profiling_level="detailed", profiling_path=prof.with_name(prof.stem + ".b.csv"),
                                     overwrite=True, verify=False, allow_cpu_fallback=fallback,
                                     optimization=self.optimization, **self.qnn_session)

    def calibrated(self) -> dict[str, tuple[float, float]]:
        """``{tensor: (min, max)}`` the calibration gave (the baseline's activation encodings, grid ranges): the
        range of a type the quantizer had to resolve. Falls back to :meth:`calibration_ranges` before a baseline."""
        if self._calibrated is None:
            base = Path(self.workdir) / "before.qdq.onnx"
            if not base.exists():
                return self.calibration_ranges()
            out = {}
            for name, e in encodings_from_qdq_model(base).activations.items():
                if e.scale:
                    (lo,), (hi,) = e.grid_range()
                    out[name] = (float(lo), float(hi))
            self._calibrated = out
        return self._calibrated

    def _write_read(self, label: str, suggestions: list[Suggestion]) -> tuple[Path | None, dict[str, Any], list[str]]:
        """The suggestions written in the tuner's format and read back: (file, ORT overrides, float nodes)."""
        if not suggestions:
            return None, dict(self.base_overrides), []
        path = Path(self.workdir) / f"{label}.overrides.json"
        act_bits = 16 if self.preset.startswith("a16") else 8
        write_suggestions(suggestions, path, fmt=self.fmt, activation_bits=act_bits, float_model=self.source(),
                          overwrite=True)
        encs, exclude = read_overrides(path, load_model(self.source()))
        floats = [n for n, e in encs.activations.items() if e.is_float]
        ints = EncodingSet(format=encs.format, activations={n: e for n, e in encs.activations.items()
                                                              if not e.is_float}, params=dict(encs.params))
        # a float entry leaves its producer unquantized, as `ivq quantize --overrides` of the delivered file does
        exclude = list(dict.fromkeys([*exclude, *float_producers(floats, load_model(self.source()))]))
        return path, {**self.base_overrides, **to_ort_overrides(ints)}, exclude

    def _quantized(self, overrides: Mapping[str, Any], kw: Mapping[str, Any]) -> Path:
        """Where the model of one quantization is kept for the run (beside the calibration cache, pruned with it):
        keyed by everything :func:`~ivq_debug.qnn.quantize.quantize_for_qnn` reads — the model handed to it, the
        calibration data, the preset, the knobs, the ORT overrides and the nodes left float — so two trials of
        the same quantization (a lever's job and its re-run in the workdir, a CPU-QDQ trial and its HTP check,
        two levers that name the same set) quantize once."""
        if "calibration" not in self._digests:
            self._digests["calibration"] = calibration_digest(self.calibration)
        blob = json.dumps({"source": self._digest("source", self.source()), "cal": self._digests["calibration"],
                           "preset": self.preset, "overrides": _jsonable_overrides(overrides),
                           "kw": {k: str(v) for k, v in sorted(kw.items()) if k != "calibration_cache"},
                           "versions": versions()},
                          sort_keys=True, default=str)
        folder = Path(kw["calibration_cache"])
        return folder / f"{hashlib.sha256(blob.encode()).hexdigest()[:32]}.qdq.onnx"

    def _quantize(self, label: str, suggestions: list[Suggestion], out: Path, max_fixes: int = 16
                  ) -> tuple[Path | None, list[Suggestion], list[Suggestion], list[str]]:
        """Quantize with the suggestions as delivered; each type conflict ORT's mixed-precision fixer raises
        ("Desired producer quant_type for X ...") becomes a suggestion giving X the other activation type on its
        calibrated range, and the file is written again: the quantized model is always the file's.
        Returns (overrides file, the suggestions applied, the fixes among them, the nodes left float)."""
        fixes: list[Suggestion] = []
        default16 = self.preset.startswith("a16")
        while True:
            applied = _with_fixes(suggestions, fixes)
            ov_path, overrides, exclude = self._write_read(label, applied)
            kw = dict(self.quantize_kw) | {"preprocess": False,
                                           "calibration_cache": self.calibration_cache
                                           or Path(self.workdir) / CALIBRATION_CACHE}
            if exclude:
                kw["nodes_to_exclude"] = [*kw.get("nodes_to_exclude", []), *exclude]
            cached = self._quantized(overrides, kw)
            if cached.is_file():  # the same quantization earlier in this run (another label, the HTP check)
                _link_or_copy(cached, out)
                os.utime(cached)  # recently used: kept longest
                self._took("quantize_reused", 0.0)
                return ov_path, applied, fixes, exclude
            t0 = time.perf_counter()
            try:
                res = quantize_for_qnn(self.source(), out, self.calibration, preset=self.preset,
                                       overrides=overrides or None, overwrite=True, **kw)
                if not res.external_data:
                    _link_or_copy(out, cached)
                    _trim_models(cached.parent, max(defaults.TUNE_MODEL_CACHE_MIN_BYTES, defaults.TUNE_MODEL_CACHE_RATIO
                                                    * model_file_bytes(self.source())))
                self._took("quantize", time.perf_counter() - t0)
                return ov_path, applied, fixes, exclude
            except InputError as e:
                m = _CONFLICT.search(str(e))
                self._took("quantize_conflict", time.perf_counter() - t0)
                if not m or len(fixes) >= max_fixes:
                    raise
                name = m.group(1)
                cur = next((s for s in applied if s.tensor == name), None)
                is16 = cur.bitwidth == 16 if cur is not None and cur.bitwidth else default16
                rng = (cur.rmin, cur.rmax) if cur is not None and cur.rmin is not None else self.calibrated().get(name)
                if rng is None or any(f.tensor == name for f in fixes):
                    raise
                fixes.append(Suggestion(name, "a8" if is16 else "a16",
                                        f"type resolved by the quantizer: {name} is produced in the type its "
                                        f"neighbours imply ({8 if is16 else 16}-bit), on its calibrated range",
                                        float(rng[0]), float(rng[1]), node=cur.node if cur else None,
                                        group=cur.group if cur else None))


class _Samples:
    """The evaluation samples of a trial run into memory, yielded in ``order`` (default: sample order) as ``(i,
    record)`` (sample ``i``, one :class:`~ivq_debug.dump.memory.MemoryDump` each; the positions below are places
    in ``order``): on ``runner`` one after the other, or, given ``second`` (a
    factory of a second runner of the same model, a :class:`~ivq_debug.capture.worker.ProcessRunner`), on both at
    once. The x86 HTP emulation runs a session on one core (PP-OCRv4's a16w16 recognizer: ~10 s of one core per
    line) and two sessions of one process one at a time, so the second runner is in another process: two lines
    take about the time of one on two cores; each sample's record is its own run's, the same bits whichever runner
    made it.

    With one runner, this thread runs it. With two, this thread only schedules: it creates the first runner's
    sessions (``runner.prepare()``: compiled, or loaded from the QNN context cache, and stored there), then each
    runner waits for its samples in a one-thread :class:`~concurrent.futures.ThreadPoolExecutor` of its own (the
    second made at its first sample, its sessions loaded from the cache); sample 0 is the first runner's (its
    profile gives the trial's cycles). Each idle runner takes the next free sample, at most :attr:`AHEAD` past the
    awaited one, and the second is handed its next before a record is yielded, so it works during the comparison
    too; as a runner finishes, the other one's record is yielded if it is the awaited one, so neither waits for the
    other. A second runner that cannot be made, exposes other tensors or fails a sample is not used again, and that
    sample is run again on the first, so a failure is the first runner's, as without it. :meth:`close` (after the
    last sample read, an early stop or an error) lets both finish their sample, joins them and closes the second."""

    #: how many samples a runner runs past the one the comparison awaits (records held in memory; 1 keeps both
    #: runners busy, and an early stop waits for at most the one sample each runner started with it)
    AHEAD = 1

    def __init__(self, runner: Any, sink: MemorySink, feeds: Sequence[dict[str, np.ndarray]], part: str,
                 second: Callable[[], Any] | None = None, order: Sequence[int] | None = None) -> None:
        self.runner, self.sink, self.feeds, self.part, self.second = runner, sink, list(feeds), part, second
        #: the sample run at each position (:attr:`Tuner.order`)
        self.order = list(order) if order is not None else list(range(len(self.feeds)))
        if sorted(self.order) != list(range(len(self.feeds))):
            raise ValueError(f"the sample order {self.order} is not a permutation of {len(self.feeds)} samples")
        self._use = second is not None and len(self.feeds) > 1  # False once the second runner is not used
        self._pools = {"first": cf.ThreadPoolExecutor(1, thread_name_prefix="ivq-tune-first-runner"),
                       "second": cf.ThreadPoolExecutor(1, thread_name_prefix="ivq-tune-second-runner")
                       } if self._use else {}
        self._busy: dict[str, tuple[int, cf.Future]] = {}  # runner -> the position it runs, and its record
        self._other: Any = None  # the second runner and its sink, once made (in its pool's thread)
        self._other_sink: MemorySink | None = None
        #: the samples the second runner ran, and its seconds running them
        self.helped: list[int] = []
        self.helped_s = 0.0
        #: the CPU seconds of the second runner's process (a :class:`ProcessRunner`'s; 0 for one in this process)
        self.helped_cpu_s = 0.0

    def _run(self, runner: Any, sink: MemorySink | None, i: int) -> Any:
        """The record of the sample at position ``i`` (:attr:`order`); without ``sink``, ``runner`` records it
        (:meth:`ProcessRunner.record`)."""
        s = self.order[i]
        if sink is None:
            return runner.record(self.feeds[s], sample=s, part=self.part)
        return sink.record(runner, self.feeds[s], s, self.part)

    def _mine(self, i: int) -> Any:
        """Sample ``i`` on the first runner: its record, or its exception (raised when ``i`` is awaited: a
        sample run ahead fails where one after the other would, after the samples before it)."""
        try:
            return self._run(self.runner, self.sink, i)
        except Exception as e:
            return e

    def _theirs_run(self, i: int) -> Any:
        """Sample ``i`` on the second runner (in its pool's thread; made and prepared at its first sample)."""
        if self._other is None:
            self._other = self.second()  # type: ignore[misc]
            if not hasattr(self._other, "record"):  # a runner in this process: its own sink
                self._other_sink = MemorySink(self._other.backend, self._other.info, path=self.sink.path)
            self._other.prepare()
            if [s.output for s in self._other.sites] != [s.output for s in self.runner.sites]:
                raise RuntimeError("the second runner exposes other tensors")
        t0 = time.perf_counter()
        rec = self._run(self._other, self._other_sink, i)
        self.helped.append(self.order[i])
        self.helped_s += time.perf_counter() - t0
        return rec

    def _give(self, who: str, i: int) -> None:
        fn = self._mine if who == "first" else self._theirs_run
        self._busy[who] = (i, self._pools[who].submit(fn, i))

    def _collect(self, mine: dict[int, Any], redo: list[int]) -> None:
        """The records of the runners that finished; a sample the second runner failed goes to ``redo``."""
        for who, (i, f) in list(self._busy.items()):
            if not f.done():
                continue
            del self._busy[who]
            if who == "first" or f.exception() is None:
                mine[i] = f.result()
            else:  # not used again; the sample runs on the first (a failure is the first runner's)
                self._use = False
                redo.append(i)

    def _dispatch(self, free: int, reach: int, redo: list[int], second_only: bool = False) -> int:
        """Give idle runners the samples before position ``reach`` (``redo`` first); the next free position."""
        for who in ("second",) if second_only else ("first", "second"):
            if who in self._busy or (who == "second" and not self._use):
                continue
            if who == "first" and redo:
                self._give(who, redo.pop(0))
            elif free < min(len(self.feeds), reach):
                self._give(who, free)
                free += 1
        return free

    def _one(self) -> Iterator[tuple[int, Any]]:
        """One runner, in this thread."""
        for i in range(len(self.feeds)):
            interrupt.raise_if_signalled()
            rec = self._mine(i)
            if isinstance(rec, Exception):
                raise rec
            yield self.order[i], rec

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if not self._use:
            yield from self._one()
            return
        n, free = len(self.feeds), 0  # free: the next position nobody has taken
        mine: dict[int, Any] = {}  # records (or exceptions) not yielded yet
        redo: list[int] = []  # positions the second runner failed, for the first
        try:
            self.runner.prepare()  # its sessions, compiled or loaded (and cached for the second runner)
            self._give("first", 0)
            free = 1
            for want in range(n):
                while want not in mine:
                    interrupt.raise_if_signalled()
                    free = self._dispatch(free, want + self.AHEAD + 1, redo)
                    cf.wait([f for _, f in self._busy.values()], timeout=1.0, return_when=cf.FIRST_COMPLETED)
                    self._collect(mine, redo)
                interrupt.raise_if_signalled()
                rec = mine.pop(want)
                if isinstance(rec, Exception):
                    raise rec
                free = self._dispatch(free, want + self.AHEAD + 2, redo, second_only=True)
                yield self.order[want], rec
        finally:
            for rec in mine.values():
                if not isinstance(rec, Exception):
                    rec.close()
            self.close()

    def close(self) -> None:
        """Let both runners finish their sample, join them, drop the records nobody read, close the second."""
        for pool in self._pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        for _i, f in self._busy.values():
            if not f.cancelled() and f.exception() is None and not isinstance(f.result(), Exception):
                f.result().close()
        self._busy = {}
        if self._other is not None:
            self._other.close()
            self.helped_cpu_s += getattr(self._other, "cpu_s", 0.0)
            self._other = None


def one_trial(tuner: Tuner, label: str, suggestions: Sequence[Suggestion] = ()) -> Trial:
    """One tune trial as every search runs a lever (``bench/bench_loop.py`` times it against one capture of the
    same model and inputs; name and signature kept stable, ``docs/tune.md``): quantize the float model with
    ``suggestions`` (the calibration cached per quantizer setting), run each evaluation sample once on the
    tuner's backend and compare it in memory with the reference, no dump written. The trial's figures are those
    of a whole capture compared afterwards, for the tensors it measures (:meth:`Tuner.measured`: the watched
    tensors, the model outputs, the suggestions' tensors; ``Trial.sqnr_table`` holds those). The checkpoint is
    not read: a trial of a configuration already run is run again (``tuner.resume`` is ignored)."""
    return replace(tuner, resume=False, _checkpoint=tuner._ckpt(), _ran=set()).trial(label, list(suggestions),
                                                                                     keep_dump=False)


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as the same file as ``src`` (a hard link; a copy across file systems), replaced atomically."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _trim_models(folder: Path, budget: float) -> None:
    """The run's model cache within ``budget`` bytes: the least recently used models go first."""
    models = []
    for p in folder.glob("*.qdq.onnx"):
        try:
            st = p.stat()
        except OSError:
            continue
        models.append((st.st_mtime, st.st_size, p))
    total = sum(m[1] for m in models)
    for _, size, p in sorted(models)[:-1]:  # the newest stays
        if total <= budget:
            break
        p.unlink(missing_ok=True)
        total -= size


def _remove_profiles(prof: Path) -> None:
    """A trial's QNN profile files (``<label>.profile.csv`` and ``.plain.csv``), read into its figures."""
    for extra in (prof, *prof.parent.glob(glob.escape(prof.name[:-len(".csv")]) + ".*.csv")):
        extra.unlink(missing_ok=True)


def _pairs_naming(pairs: list[Any], names: Collection[str]) -> list[Any]:
    """The pairs naming one of ``names`` (reference or test side), and the last pair in execution order."""
    last = max(pairs, key=lambda p: p.ref.order, default=None)
    end = last.ref.name if last is not None else None
    return [p for p in pairs if p.ref.name == end or p.ref.name in names or p.test.name in names]


def _with_fixes(suggestions: Sequence[Suggestion], fixes: Sequence[Suggestion]) -> list[Suggestion]:
    """The suggestions with the resolved types replacing the entries of the same tensors."""
    names = {f.tensor for f in fixes}
    return [s for s in suggestions if s.tensor not in names] + list(fixes)


def worst_sqnr(cmp: Any, running: dict[str, float] | None = None) -> dict[str, float]:
    """``{tensor: worst SQNR over the records}`` of a comparison (reference and test names): what a trial keeps.
    ``running``: the figures of earlier comparisons, lowered in place where this one is worse (and returned)."""
    t = cmp.table
    out: dict[str, float] = {}
    if not t.empty:
        for col in ("ref_name", "test_name"):
            g = t.groupby(col)["sqnr_db"].min()
            out.update({str(k): float(v) for k, v in g.items() if v == v})
    if running is None:
        return out
    for k, v in out.items():
        running[k] = min(v, running.get(k, math.inf))
    return running


def sample_scores(cmp: Any, names: Collection[str]) -> dict[int, float]:
    """Each sample's score in a comparison: its lowest SQNR over the pairs naming one of ``names`` (reference or
    test name), finite ones only, in sample order; empty without a comparison table."""
    t = cmp.table if cmp is not None else None
    if t is None or t.empty or "sample" not in t.columns:
        return {}
    rows = t.loc[t["ref_name"].isin(names) | t["test_name"].isin(names)]
    return {int(i): float(v) for i, v in rows.groupby("sample")["sqnr_db"].min().items() if math.isfinite(v)}


def per_sample(cmp: Any, watch: Sequence[str]) -> dict[str, dict[str, float]]:
    """``{watched tensor: {"mean": dB, "worst": dB, "n": samples}}`` over the evaluation samples
    (:func:`sample_scores` of each)."""
    import pandas as pd

    out: dict[str, dict[str, float]] = {}
    for w in watch:
        v = pd.Series(list(sample_scores(cmp, [w]).values()), dtype=float)
        if len(v):
            out[w] = {"mean": float(v.mean()), "worst": float(v.min()), "n": len(v)}
    return out


def preprocessed_model(float_model: str | os.PathLike, folder: Path,
                       samples: Sequence[dict[str, np.ndarray]] | None = None) -> Path | None:
    """``<folder>/preprocessed.onnx``: the float model as the quantizer takes it (the intake — with the calibration
    ``samples``, the dims they fix and the shape chains that folds, as ``ivq quantize`` does — then ORT's
    ``qnn_preprocess_model``: :func:`~ivq_debug.qnn.quantize.preprocess_float_model`), or None when that
    changes nothing."""
    out = folder / "preprocessed.onnx"
    return out if preprocess_float_model(float_model, out, samples) else None


def _outputs(d: Dump, names: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """The graph outputs ``names`` of each record of a dump, by (sample, step)."""
    per = []
    for rid in d.records.sort_values(["sample", "step"])["rid"]:
        have = {e.name: e for e in d.tensors(rid)}
        per.append({o: d.read(have[o]) for o in names if o in have})
    return per


def _score(fn: Callable[[list[dict[str, np.ndarray]]], Any], per: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """A user task metric on the graph outputs of every evaluation sample (``task`` for a bare number, else
    its keys)."""
    try:
        v = fn(per)
    except Exception as e:  # the user's function: report it on one line
        raise InputError(f"the task metric failed: {type(e).__name__}: {one_line(e, 200)}") from None
    if isinstance(v, Mapping):
        return {f"task {k}": float(x) for k, x in v.items()}
    return {"task": float(v)}


_CONFLICT = re.compile(r"Desired producer quant_type for (.+?) doesn't match existing type")


# ---------------------------------------------------------------------------------------------- evaluation set
#: with one evaluation sample, hold out this share of the calibration samples (at least one) for evaluation
HOLDOUT_SHARE = 0.25
#: the fewest calibration samples a held-out split is made from
HOLDOUT_MIN_CALIBRATION = 4


def evaluation_split(calibration: Sequence[dict[str, np.ndarray]], feeds: Sequence[dict[str, np.ndarray]]
                     ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], dict[str, Any]]:
    """The evaluation set a tune verifies on: every evaluation input; with only one, the last
    :data:`HOLDOUT_SHARE` of the calibration samples are held out (no longer calibrated on) and evaluated too.

    Returns (calibration samples to quantize with, evaluation feeds, a description with ``warning``): the first
    ``calibration_samples`` of the calibration data stay, so ``ivq quantize --max-samples N`` reproduces a
    delivered model. With one input and fewer than :data:`HOLDOUT_MIN_CALIBRATION` calibration samples nothing is
    held out and the warning says the figures come from one sample.
    """
    cal, ev = list(calibration), list(feeds)
    info: dict[str, Any] = {"inputs": len(ev), "held_out": 0, "calibration_samples": len(cal), "warning": None}
    if len(ev) == 1:
        if len(cal) >= HOLDOUT_MIN_CALIBRATION:
            k = max(1, int(len(cal) * HOLDOUT_SHARE))
            ev += cal[len(cal) - k:]
            cal = cal[: len(cal) - k]
            info |= {"held_out": k, "calibration_samples": len(cal),
                     "warning": f"one evaluation input: the last {k} of {len(calibration)} calibration samples are "
                                f"held out and evaluated too (trials calibrate on the first {len(cal)}; `ivq quantize "
                                f"--max-samples {len(cal)}` reproduces the delivered model)"}
        else:
            info["warning"] = (f"one evaluation input and {len(cal)} calibration sample(s), too few to hold any "
                               "out: every figure comes from one sample, which flatters (give more --inputs)")
    info["samples"] = len(ev)
    return cal, ev, info


# ---------------------------------------------------------------------------------------------- verify
def candidate_sets(suggestions: Sequence[Suggestion]) -> list[tuple[str, list[Suggestion]]]:
    """The sets :func:`verify` tries, in order: all; weights only and activations only (when both); each pattern
    group (largest priority first); the top half; the top one. Duplicates are dropped."""
    sug = sorted(suggestions, key=lambda s: -s.priority)
    out: list[tuple[str, list[Suggestion]]] = [("all", sug)]
    w = [s for s in sug if s.is_weight]
    a = [s for s in sug if not s.is_weight]
    if w and a:
        out += [("weights only", w), ("activations only", a)]
    grouped: dict[str, list[Suggestion]] = {}
    for s in sug:
        if s.group:
            grouped.setdefault(s.group, []).append(s)
    if len(grouped) > 1 or (grouped and len(next(iter(grouped.values()))) < len(sug)):
        out += [(f"group {g}", ss) for g, ss in grouped.items()]
    if len(sug) > 2:
        out.append(("top half", sug[: (len(sug) + 1) // 2]))
    if len(sug) > 1:
        out.append(("top one", sug[:1]))
    seen: set[tuple[str, ...]] = set()
    uniq = []
    for name, ss in out:
        k = tuple(sorted(s.tensor + "|" + s.action for s in ss))
        if k not in seen:
            seen.add(k)
            uniq.append((name, ss))
    return uniq


def _json_number(v: Any) -> float | None:
    """A number of a checkpoint (``json_safe`` writes inf / NaN as ``"inf"``, ``"-inf"``, ``"nan"``) as a float:
    a resumed ``--sweep`` compared ``"inf"`` with a float (``TypeError``, exit 1)."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return v


def judge(before: Trial, after: Trial, watch: Sequence[str]) -> str | None:
    """Why ``after`` must not be recommended (None: it may): it failed, it lowers a watched tensor's SQNR, or
    it lowers a task metric."""
    if after.error:
        return f"the trial failed: {after.error}"
    for w in watch:
        b, a = before.sqnr(w), after.sqnr(w)
        if b is not None and a is not None and a < b:
            return f"lowers {w} from {b:.2f} to {a:.2f} dB SQNR"
        if b is not None and a is None:
            return f"{w} is missing from the trial's capture"
    for k, b in before.task.items():
        a = after.task.get(k)
        if isinstance(b, (int, float)) and isinstance(a, (int, float)) and a < b:
            return f"lowers {k} from {b:.4g} to {a:.4g}"
    return None


def verify(tuner: Tuner, suggestions: list[Suggestion], watch: Sequence[str] = (),
           before: Trial | None = None, *, candidates: Sequence[tuple[str, list[Suggestion]]] | None = None,
           max_candidates: int = MAX_CANDIDATES) -> TuneReport:
    """Baseline vs candidate override sets; the first that lowers no watched SQNR (default: the final output)
    and no task metric is recommended, the others are refused with their reason (module docstring)."""
    before = before or tuner.trial("before", [])
    if before.error:
        raise RunError(f"the baseline trial failed: {before.error}")
    watch = list(watch) or _default_watch(before)
    tuner = tuner.watching(watch)
    cands = list(candidates) if candidates is not None else candidate_sets(suggestions)
    cands, refused = split_legal(cands, tuner.source(), tuner.preset, tuner.target)  # never tried: illegal
    checks: list[dict[str, Any]] = []
    for i, (name, sset) in enumerate(cands[:max_candidates]):
        tr = tuner.trial("after" if i == 0 else f"candidate{i + 1}", list(sset))
        why = judge(before, tr, watch)
        if why is None:
            why, check = confirm_on_target(tuner, before, tr, watch)
            checks.append(check)
            if why is None:
                return TuneReport(before, tr, watch, refused=refused, backend=tuner.backend, format=tuner.fmt,
                                  steps=[{"candidate": name, "label": tr.label, "kept": True}], target_check=check)
        refused.append({"candidate": name, "label": tr.label, "overrides": [s.tensor for s in sset],
                        "reason": why, "watch": {w: [before.sqnr(w), tr.sqnr(w)] for w in watch},
                        "task": {k: [before.task.get(k), tr.task.get(k)] for k in tr.task}})
    return TuneReport(before, replace(before, suggestions=[]), watch, refused=refused, recommended=False,
                      backend=tuner.backend, format=tuner.fmt, target_check=checks[-1] if checks else {})


def confirm_on_target(tuner: Tuner, before: Trial, after: Trial, watch: Sequence[str],
                      after_tuner: Tuner | None = None) -> tuple[str | None, dict]:
    """Before a set verified on CPU-QDQ is recommended for HTP (``tuner.target == "qnn"``): its model compiled
    and measured once on HTP over the evaluation set, with the baseline's. Returns (why it must not be
    recommended or None, the figures): HTP refuses it (the whole reason), or a watched tensor / task metric is
    worse on HTP than the baseline's on HTP. Without the QNN EP here the set is not refused, and the figures
    say it was not checked. Trials that ran on the target already are their own check. ``after_tuner``: the tuner
    (quantizer knobs) that made ``after``, when not ``tuner`` (a global lever of :mod:`ivq_debug.tune.search`)."""
    if tuner.backend == tuner.target or tuner.target != "qnn":
        return None, {"backend": tuner.target, "checked": True, "same_as_trials": True}
    st = qnn_ep_status()
    if not st.available:
        return None, {"backend": "qnn", "checked": False, "reason": f"QNN EP unavailable: {st.reason}"}
    htp = replace(tuner, backend="qnn", runner_factory=None, _checkpoint=tuner._ckpt())
    htp_after = replace(after_tuner or tuner, backend="qnn", runner_factory=None, _checkpoint=tuner._ckpt())
    b = htp.trial("htp-before", list(before.suggestions), keep_dump=False)
    a = htp_after.trial(f"htp-{after.label}", list(after.suggestions), keep_dump=False,
                        stop=None if b.error else refused_already(before, after, b, watch))
    figs = {w: {"cpu": [before.sqnr(w), after.sqnr(w)], "htp": [b.sqnr(w), a.sqnr(w)]} for w in watch}
    check = {"backend": "qnn", "checked": True, "session": a.session, "watch": figs,
             "samples": {"before": b.samples, "after": a.samples},
             "task": {k: {"cpu": [before.task.get(k), after.task.get(k)], "htp": [b.task.get(k), a.task.get(k)]}
                      for k in after.task}}
    if b.error:
        check["error"] = b.error
        return f"the baseline does not run on QNN HTP: {b.error}", check
    if a.error:
        check["error"] = a.error
        return f"QNN HTP refuses the set: {a.error}", check
    if a.stopped:
        check["stopped"] = a.stopped | {"why": "the samples run refuse it already: a worst SQNR only falls as "
                                                "samples are added"}
    why = judge(b, a, watch)
    check["not_held"] = not_held(check)
    if why is None and check["not_held"]:  # what CPU-QDQ verified is not what HTP delivers: the next set is tried
        why = held_refusal(check["not_held"])
    elif why is not None:
        why = f"on QNN HTP: {why}"
    if a.stopped:  # (never None: the check stops only on a refusal the samples run make certain)
        why = (why or "refused on QNN HTP") + (f" (on the first {a.stopped['samples']} of {a.stopped['of']} "
                                               "evaluation samples: the others cannot change it)")
    return why, check


def refused_already(before: Trial, after: Trial, htp_before: Trial, watch: Sequence[str]
                    ) -> Callable[[Mapping[str, float]], bool]:
    """The ``stop`` of a set's HTP check (:meth:`Tuner.trial`): True once the samples run on HTP refuse the set
    whatever the others give — a watched tensor's worst SQNR there below the baseline's on HTP (:func:`judge`), or
    its gain on HTP short of its CPU-QDQ gain as :func:`not_held` reads it. A worst SQNR only falls as samples are
    added, so the refusal stands; the HTP check of a set that is recommended always runs every sample (PP-OCRv4's
    a16w16: refused after its first line instead of 12 lines of 16-bit HTP emulation, 470 s at load 12-16)."""
    def stop(worst: Mapping[str, float]) -> bool:
        for w in watch:
            hb, ha, cb, ca = htp_before.sqnr(w), worst.get(w), before.sqnr(w), after.sqnr(w)
            if hb is None or ha is None:
                continue
            if ha < hb:
                return True
            if cb is not None and ca is not None and ca - cb > 0 and ha - hb < HOLD_SHARE * (ca - cb) \
                    and (ca - cb) - (ha - hb) >= HOLD_MIN_DB:
                return True
        return False

    return stop


def held_refusal(lines: Sequence[str]) -> str:
    """The refusal of a set that does not hold on HTP (:func:`not_held`'s lines)."""
    return f"does not hold on QNN HTP (less than {HOLD_SHARE:.0%} of its CPU-QDQ gain): " + "; ".join(lines)


#: a set verified on CPU-QDQ *holds* on HTP when it keeps at least this share of its CPU-QDQ gain there
HOLD_SHARE = 0.5
#: ... or loses less than this many dB of a watched SQNR's CPU-QDQ gain (a 0.5 dB gain that is 0.25 dB on HTP holds)
HOLD_MIN_DB = 1.0


def not_held(check: Mapping[str, Any]) -> list[str]:
    """The figures of a target check (:func:`confirm_on_target`: ``watch`` and ``task``, each ``{"cpu": [before,
    after], "htp": [before, after]}``) whose gain on HTP is less than :data:`HOLD_SHARE` of the gain on CPU-QDQ, one
    line each (a watched SQNR also losing at least :data:`HOLD_MIN_DB`). Such a set may be no worse than the baseline on HTP, but what CPU-QDQ measured does not carry over
    (PP-OCRv4's a16w16 read 12 of 12 lines on CPU-QDQ and 1 of 12 on the emulated HTP): it is refused
    (:func:`held_refusal`) and the next candidate tried."""
    out = []
    for figs, floor in ((check.get("watch") or {}, HOLD_MIN_DB), (check.get("task") or {}, 0.0)):
        for name, f in figs.items():
            (cb, ca), (hb, ha) = f.get("cpu") or (None, None), f.get("htp") or (None, None)
            if not all(isinstance(v, (int, float)) for v in (cb, ca, hb, ha)):
                continue
            if ca - cb > 0 and ha - hb < HOLD_SHARE * (ca - cb) and (ca - cb) - (ha - hb) >= floor:
                out.append(f"{name}: {cb:.4g} -> {ca:.4g} on CPU-QDQ, {hb:.4g} -> {ha:.4g} on QNN HTP")
    return out


def _default_watch(trial: Trial) -> list[str]:
    t = trial.comparison.table
    if t.empty:
        return []
    return [t.sort_values("order").iloc[-1]["ref_name"]]


def greedy(tuner: Tuner, suggestions: list[Suggestion], watch: Sequence[str], *, budget_sqnr_db: float,
           min_gain_db: float = 0.5, max_trials: int = 24, progress: bool = True) -> TuneReport:
    """Add suggestions one at a time while they help the watched tensors, until the budget is met.

    A suggestion is kept when the worst watched SQNR improves by at least ``min_gain_db`` and no task metric
    drops. A kept 16-bit entry whose own tensor stays below the budget is retried as fp16 (its node left
    unquantized).
    """

    watch = list(watch)
    tuner = tuner.watching(watch)
    before = tuner.trial("before", [])
    if before.error:
        raise RunError(f"the baseline trial failed: {before.error}")

    def score(tr: Trial) -> float:
        vals = [tr.sqnr(w) for w in watch]
        vals = [v for v in vals if v is not None]
        return min(vals) if vals else -math.inf

    best, best_score = before, score(before)
    active: list[Suggestion] = []
    steps: list[dict[str, Any]] = [{"step": 0, "label": "before", "score_db": best_score, "kept": True}]
    refused: list[dict[str, Any]] = []
    n = 0
    queue = list(suggestions)
    it = track(queue, "tuning", total=len(queue)) if progress else queue
    for s in it:
        if best_score >= budget_sqnr_db or n >= max_trials:
            break
        illegal = forbidden([*active, s], tuner.source(), tuner.preset, tuner.target)
        if illegal:
            refused.append({"candidate": f"+{s.tensor} {s.action}", "label": None,
                            "reason": refusal(illegal, tuner.target)})
            continue
        n += 1
        tr = tuner.trial(f"step{n}", [*active, s])
        sc = score(tr)
        why = judge(best, tr, ())
        keep = why is None and sc >= best_score + min_gain_db
        steps.append({"step": n, "label": tr.label, "added": s.tensor, "action": s.action, "score_db": sc,
                      "kept": keep, "error": tr.error})
        if not keep and why:
            refused.append({"candidate": f"+{s.tensor} {s.action}", "label": tr.label, "reason": why})
        if keep:
            active.append(s)
            best, best_score = tr, sc
            own = tr.sqnr(s.tensor)
            if s.bitwidth == 16 and not s.is_weight and own is not None and own < budget_sqnr_db and s.node \
                    and n < max_trials:
                n += 1
                fp = replace(s, action="fp16", reason=s.reason + "; still below budget at 16-bit → fp16")
                tr2 = tuner.trial(f"step{n}", [*active[:-1], fp])
                sc2 = score(tr2)
                keep2 = judge(best, tr2, ()) is None and sc2 >= best_score + min_gain_db
                steps.append({"step": n, "label": tr2.label, "added": s.tensor, "action": "fp16",
                              "score_db": sc2, "kept": keep2, "error": tr2.error})
                if keep2:
                    active[-1] = fp
                    best, best_score = tr2, sc2
    check: dict[str, Any] = {}
    if best is not before:
        why, check = confirm_on_target(tuner, before, best, watch)
        if why is not None:
            refused.append({"candidate": "greedy set", "label": best.label, "reason": why})
            best = replace(before, suggestions=[])
    return TuneReport(before, best, watch, steps, refused=refused, recommended=best.label != before.label,
                      backend=tuner.backend, format=tuner.fmt, target_check=check)


def prune_workdir(workdir: str | os.PathLike, keep: Sequence[Path | None]) -> int:
    """After a finished tune, keep only what the report needs: the checkpoint, the overrides files, the
    preprocessed model, the QDQ models in ``keep`` (the baseline's, the recommended one) with their external-data
    files, and the job shards of a search or sweep; the dumps, profiles, calibration capture and cache, job folders and other trial models go (a rerun with ``--resume`` re-captures what it needs). Returns
    the bytes left in ``workdir``."""
    wd = Path(workdir)
    models = [Path(k) for k in (*keep, wd / "preprocessed.onnx") if k is not None and Path(k).is_file()]
    # a kept model keeps its external-data files (a large QDQ model's ``<name>.data``: its weights)
    kept = {p.resolve() for m in models for p in (m, *external_files(load_model(m), m.parent))}
    for folder in (wd / CALIBRATION_CACHE, wd / "search" / "jobs", wd / "sweep" / "jobs"):
        shutil.rmtree(folder, ignore_errors=True)
    for p in wd.iterdir() if wd.is_dir() else []:
        if not p.is_file() or p.resolve() in kept or p.name in (CHECKPOINT, "preprocessed.onnx"):
            continue
        if p.name.endswith((".overrides.json", ".rationale.md", EXCLUDE_SUFFIX)):
            continue
        if p.suffix in (".h5", ".onnx", ".csv", ".log", ".data"):
            p.unlink(missing_ok=True)
    return sum(f.stat().st_size for f in wd.rglob("*") if f.is_file())


def calibration_digest(cal: Any) -> str:
    """The calibration data's identity in keys: a folder's files, a file, or the samples' digests."""
    if isinstance(cal, (str, os.PathLike)):
        p = Path(cal)
        if p.is_dir():
            return job_key(files={f.name: sha256_file(f) for f in sorted(p.iterdir()) if f.is_file()})
        return sha256_file(p)
    if isinstance(cal, Mapping):
        cal = [cal]
    return job_key(samples=[{k: input_digest(v) for k, v in sorted(s.items())} for s in cal])


def dump_digest(path: str | os.PathLike) -> str:
    """The dump's content digest (:meth:`~ivq_debug.dump.reader.Dump.content_digest`, the one the replay's
    shards use too): two captures of the same data agree; their files do not (provenance, time)."""
    with open_dump(path) as d:
        return d.content_digest()
