"""Per-tensor statistics of a model over a calibration set, as jobs whose shards merge exactly (issue 15).

``ivq calib-stats MODEL.onnx --calibration DATA -o stats.json`` runs the model (ONNX Runtime CPU, the exact
reference at ``optimization="disable"``) on every calibration sample and reports, per selected float tensor, the
count, min, max, mean, std and percentiles of its values over the whole set and, given the encodings of a quantized
model, its *calibration coverage*: the share of its values inside the encoding's representable range (and the
clipped share, the clipping SNR and the grid SNR of :class:`~ivq_debug.encoding_fit.EncodingAccumulator`).

The samples are cut into jobs of ``samples_per_job`` (:mod:`ivq_debug.executor`: content-hash keys, one JSON shard
each, resumable, retried once, a local process pool or a Ray cluster). A job never holds the activations of more
than one tensor: the runner hands each tensor to a :class:`StatsSink`, which reduces it to its accumulators and lets
it go (with ``max_outputs_per_run``, the runner itself computes at most that many tensors per piece of the graph).
The driver holds the calibration *inputs* (read and checked once, hashed per sample) and sends each job its own.

**Two passes, so that histograms merge exactly.** Histograms add exactly only on the same edges in every shard, and
no job knows a tensor's range over the whole set before it runs. So:

1. the *range* pass: each job reduces every tensor to a :class:`~ivq_debug.dump.stats.StatsAccumulator` without
   a histogram; merged, it gives each tensor's exact min and max over the set;
2. the *statistics* pass: the edges are fixed from that range, ``linspace(min, nextafter(max, +inf), bins + 1)``
   (:func:`histogram_edges`: every value falls inside, none in the under/overflow bins), their SHA-256 is part of
   every job's key and shard, and each job reduces every tensor to a StatsAccumulator on those edges (and to an
   EncodingAccumulator per encoding).

The range pass costs one more forward per sample; it is itself resumable and its shards are small. Edges from a
guess (a given range, the encodings) would send the values outside the guess into the under/overflow bins, where
percentiles are lost; edges per job cannot be added.

**Merge.** The shards of a pass must agree (:func:`~ivq_debug.executor.merge_check`) on the model's SHA-256, the
calibration set's (over the per-sample input digests), the selection, the versions and, in the statistics pass,
the bins, edges and encodings; the states are added in job order. Counts, min, max, histogram and clipped counts
are exact; the float64 sums equal one pass over every sample up to the order of their additions (1e-12 relative,
``tests/test_calib_stats.py``); the same jobs give the same numbers on any executor, to the bit.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.capture.base import Selection, make_runner
from ivq_debug.dump.contract import input_digest
from ivq_debug.dump.stats import StatsAccumulator, flat_blocks
from ivq_debug.encoding_fit import EncodingAccumulator
from ivq_debug.errors import InputError, UsageError, one_line
from ivq_debug.executor import Executor, Job, LocalExecutor, RunReport, job_key, merge_check, versions
from ivq_debug.inputfiles import regular_file, sha256_file
from ivq_debug.jsonio import json_safe
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.qnn.encodings import encodings_from_qdq_model, read_encodings
from ivq_debug.qnn.quantize import load_calibration

#: the ``ivq-calib-stats/1`` document (:meth:`CalibStats.to_json`, ``ivq calib-stats -o``)
SCHEMA = "ivq-calib-stats/1"
#: the shard fields that must agree across a pass's jobs (:func:`~ivq_debug.executor.merge_check`)
SHARD_FIELDS = ("kind", "model_sha256", "calibration_sha256", "selection", "versions", "bins", "edges_sha256",
                "encodings_sha256")
_COUNT = {"type": "integer", "minimum": 0}
_FINITE = {"type": "number", "x-finite": True}
_FINITE0 = {"type": "number", "minimum": 0, "x-finite": True}
#: a calib-stats shard's ``result`` (:meth:`StatsAccumulator.state` without edges and
#: :meth:`EncodingAccumulator.state` per tensor): counts non-negative integers, sums finite (squares non-negative),
#: ``min`` ≤ ``max`` and both finite once a value was counted (an empty tensor's are +inf / -inf), never NaN;
#: an encoding's range ordered with a positive step. Shards are untrusted: checked before the merge reads them.
SHARD_RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "calib-stats shard result",
    "required": ["tensors", "fits"],
    "properties": {
        "tensors": {"type": "object", "additionalProperties": {
            "type": "object",
            "required": ["count", "nonfinite", "sum", "sumsq", "min", "max"],
            "properties": {"count": _COUNT, "nonfinite": _COUNT, "sum": _FINITE, "sumsq": _FINITE0,
                           "min": {"type": "number", "x-finite": "not-nan"},
                           "max": {"type": "number", "x-finite": "not-nan"},
                           "hist": {"type": ["array", "null"], "items": _COUNT}},
            "if": {"properties": {"count": {"minimum": 1}}},
            "then": {"properties": {"min": _FINITE, "max": _FINITE}, "x-ordered": [["min", "max"]]},
        }},
        "fits": {"type": "object", "additionalProperties": {
            "type": "object",
            "required": ["lo", "hi", "step", "zp", "qmin", "qmax", "n", "clipped", "clip_sq", "sig_sq", "n_inf", "s1",
                         "s2", "noise"],
            "properties": {"lo": _FINITE, "hi": _FINITE, "step": {**_FINITE, "exclusiveMinimum": 0}, "zp": _FINITE,
                           "qmin": {"type": "integer"}, "qmax": {"type": "integer"}, "n": _COUNT, "clipped": _COUNT,
                           "n_inf": _COUNT, "clip_sq": _FINITE0, "sig_sq": _FINITE0, "s1": _FINITE, "s2": _FINITE0,
                           "noise": _FINITE0},
            "x-ordered": [["lo", "hi"], ["qmin", "qmax"], ["clipped", "n"], ["n_inf", "n"]],
        }},
    },
}
#: the bounds of ``bins`` (a shard holds ``bins + 2`` counts per tensor)
MAX_BINS = 1 << 16


# ------------------------------------------------------------------------------------------ reducing as they come
class StatsSink:
    """A :class:`~ivq_debug.capture.base.RecordSink` that reduces every selected float tensor (and model input) to
    its accumulators as the runner hands it over, and keeps nothing else: a :class:`StatsAccumulator` per tensor
    (on ``edges[name]`` when edges are given) and an :class:`EncodingAccumulator` per tensor of ``encodings``
    (name -> the dump's encoding dict, per tensor)."""

    def __init__(self, selection: Selection, edges: Mapping[str, Sequence[float]] | None = None,
                 encodings: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.selection = selection
        self.edges = edges
        self.encodings = dict(encodings or {})
        self.stats: dict[str, StatsAccumulator] = {}
        self.fits: dict[str, EncodingAccumulator] = {}
        self.record: str | None = None

    @property
    def current_record(self) -> str | None:
        """The sample being run."""
        return self.record

    def has(self, name: str, kind: str = "tensor") -> bool:
        """Nothing is stored: never."""
        return False

    def add_input(self, name: str, value: Any, *, role: str | None = None, reason: str | None = None) -> None:
        """Reduce a model input (when selected)."""
        self._reduce(name, value, None)

    def add_tensor(self, name: str, value: Any, **facts: Any) -> None:
        """Reduce a captured tensor (when selected and float)."""
        self._reduce(name, value, facts.get("op_type"))

    def update_backend_info(self, **info: Any) -> None:
        """Not kept."""

    def set_meta(self, name: str, value: Any) -> None:
        """Not kept."""

    def add_table(self, name: str, table: Any) -> None:
        """Not kept."""

    def _reduce(self, name: str, value: Any, op_type: str | None) -> None:
        a = np.asarray(value)
        if a.dtype.kind != "f" or not self.selection.accepts(name, op_type):
            return
        acc = self.stats.get(name)
        if acc is None:
            if self.edges is not None and name not in self.edges:
                raise UsageError(f"tensor {name!r} was not seen by the range pass (the model or the samples changed)")
            acc = self.stats[name] = StatsAccumulator(None if self.edges is None else np.asarray(self.edges[name]))
            enc = self.encodings.get(name)
            fit = EncodingAccumulator.for_encoding(dict(enc)) if enc is not None else None
            if fit is not None:
                self.fits[name] = fit
        fit = self.fits.get(name)
        for block in flat_blocks(a):
            acc.update(block)
            if fit is not None:
                fit.update(block)


def histogram_edges(lo: float, hi: float, bins: int) -> np.ndarray:
    """The fixed edges of a tensor whose values span ``[lo, hi]``: ``linspace(lo, nextafter(hi, +inf), bins + 1)``
    (``hi`` falls in the last inner bin), duplicates removed where the range has fewer than ``bins`` float steps;
    ``[0, 1]`` for a tensor without a finite value."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return np.array([0.0, 1.0])
    top = float(np.nextafter(hi, math.inf))
    e = np.unique(np.linspace(lo, top, int(bins) + 1))
    return e if e.size >= 2 else np.array([lo, top])


def histogram_percentiles(acc: StatsAccumulator, qs: Iterable[float]) -> dict[str, float | None]:
    """Percentiles ``qs`` (0-100) read from an accumulator's histogram: linear inside the bin that holds the rank,
    clamped to ``[min, max]`` (within one bin width of the exact percentile); ``None`` without finite values."""
    qs = list(qs)
    if acc.hist is None or acc.edges is None or acc.count == 0:
        return {f"p{q:g}": None for q in qs}
    h = acc.hist
    cum = np.cumsum(h)
    out: dict[str, float | None] = {}
    for q in qs:
        target = q / 100.0 * acc.count
        k = int(np.searchsorted(cum, target, side="left"))
        if k == 0:
            v = acc.min  # the under-flow bin (empty when the edges come from the range pass)
        elif k >= h.size - 1:
            v = acc.max
        else:
            lo, hi = float(acc.edges[k - 1]), float(acc.edges[k])
            inside = int(h[k])
            v = lo + (hi - lo) * ((target - int(cum[k - 1])) / inside if inside else 0.0)
        out[f"p{q:g}"] = min(max(v, acc.min), acc.max)
    return out


# ------------------------------------------------------------------------------------------ jobs
#: per worker process: the runner of the last job (the jobs of one run share it)
_WORKER: dict[tuple[Any, ...], Any] = {}


def _selection(doc: Mapping[str, Any]) -> Selection:
    return Selection(include=tuple(doc["include"]), exclude=tuple(doc["exclude"]))


def _runner(model_path: str, selection: Mapping[str, Any], max_outputs_per_run: int | None) -> Any:
    key = (model_path, tuple(selection["include"]), tuple(selection["exclude"]), max_outputs_per_run)
    runner = _WORKER.get(key)
    if runner is None:
        for old in _WORKER.values():
            old.close()
        _WORKER.clear()
        runner = _WORKER[key] = make_runner("onnx", model_path, selection=_selection(selection),
                                            max_outputs_per_run=max_outputs_per_run)
    return runner


def _stats_job(model_path: str, selection: dict[str, Any], feeds: list[dict[str, np.ndarray]],
               max_outputs_per_run: int | None = None, edges: dict[str, list[float]] | None = None,
               encodings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One job: the model run on ``feeds``, every selected tensor reduced as it comes; the shard's JSON (the
    accumulators' states without their edges, which the merge holds)."""
    runner = _runner(model_path, selection, max_outputs_per_run)
    sink = StatsSink(_selection(selection), edges, encodings)
    for i, f in enumerate(feeds):
        sink.record = str(i)
        runner.run(f, sink)
    tensors = {}
    for name, acc in sink.stats.items():
        st = acc.state()
        st.pop("edges")
        tensors[name] = st
    return {"tensors": tensors, "fits": {n: f.state() for n, f in sink.fits.items()}}


def sample_digest(feeds: Mapping[str, np.ndarray]) -> str:
    """A calibration sample's digest: its inputs' :func:`~ivq_debug.dump.contract.input_digest` by name."""
    return job_key(**{k: input_digest(v) for k, v in sorted(feeds.items())})


def _merge(report: RunReport, jobs: list[Job], edges: Mapping[str, list[float]] | None
           ) -> tuple[dict[str, StatsAccumulator], dict[str, EncodingAccumulator]]:
    """The shards of one pass, checked and added in job order."""
    docs = [report.load(j.key, SHARD_RESULT_SCHEMA) for j in jobs]
    merge_check(docs, SHARD_FIELDS)
    stats: dict[str, StatsAccumulator] = {}
    fits: dict[str, EncodingAccumulator] = {}
    for doc in docs:
        try:
            r = doc["result"]
            for name, st in r["tensors"].items():
                if edges is not None and name not in edges:
                    raise ValueError(f"tensor {name!r} has no edges from the range pass")
                acc = StatsAccumulator.from_state({**st, "edges": None if edges is None else edges[name]})
                if name in stats:
                    stats[name].merge(acc)
                else:
                    stats[name] = acc
            for name, st in r["fits"].items():
                fit = EncodingAccumulator.from_state(st)
                if name in fits:
                    fits[name].merge(fit)
                else:
                    fits[name] = fit
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"not a calib-stats shard ({one_line(e, 200)})", report.shards[doc["key"]]) from None
    return stats, fits


# ------------------------------------------------------------------------------------------ the result
@dataclass
class CalibStats:
    """Per-tensor statistics over a calibration set and, with encodings, per-tensor coverage (module docstring)."""

    model: dict[str, Any]
    calibration: dict[str, Any]
    bins: int
    selection: dict[str, Any]
    stats: dict[str, StatsAccumulator]
    fits: dict[str, EncodingAccumulator] = field(default_factory=dict)
    encodings: dict[str, Any] | None = None  # source, bitwidth by tensor, unmatched and not measured names
    min_coverage: float = defaults.CALIB_MIN_COVERAGE
    percentiles: tuple[float, ...] = defaults.CALIB_PERCENTILES
    jobs: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per tensor, in the order the model computes them: count, non-finite count, min, max, mean, std,
        the percentiles and, with an encoding, ``coverage`` (share inside its range), ``clipped_fraction``,
        ``clip_snr_db``, ``grid_snr_db``, ``enc_min``, ``enc_max``."""
        out = []
        for name, acc in self.stats.items():
            r = acc.result()
            row: dict[str, Any] = {"tensor": name, "count": acc.count, "nonfinite": acc.nonfinite,
                                   "min": r["min"], "max": r["max"], "mean": r["mean"], "std": r["std"],
                                   **histogram_percentiles(acc, self.percentiles)}
            fit = self.fits.get(name)
            if fit is not None:
                f = fit.result()
                row.update(coverage=None if f["clipped_fraction"] is None else 1.0 - f["clipped_fraction"],
                           clipped_fraction=f["clipped_fraction"], clip_snr_db=f["clip_snr_db"],
                           grid_snr_db=f["grid_snr_db"], enc_min=f["enc_min"], enc_max=f["enc_max"])
            out.append(row)
        return out

    @property
    def table(self) -> Any:
        """:meth:`rows` as a pandas DataFrame (the ``[analysis]`` extra)."""
        import pandas as pd

        return pd.DataFrame(self.rows())

    def low_coverage(self) -> list[dict[str, Any]]:
        """The rows whose coverage is below ``min_coverage``, lowest first."""
        low = [r for r in self.rows() if r.get("coverage") is not None and r["coverage"] < self.min_coverage]
        return sorted(low, key=lambda r: r["coverage"])

    def histogram(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(edges, counts)`` of one tensor's histogram (``bins`` inner counts on ``bins + 1`` edges)."""
        acc = self.stats[name]
        assert acc.edges is not None and acc.hist is not None
        return acc.edges, acc.hist[1:-1]

    def to_json(self) -> dict[str, Any]:
        """The ``ivq-calib-stats/1`` document: model, calibration set, selection, every tensor's row and its
        histogram (edges and inner counts), the coverage summary, the jobs."""
        rows = self.rows()
        for row in rows:
            edges, counts = self.histogram(row["tensor"])
            row["histogram"] = {"edges": edges.tolist(), "counts": counts.tolist()}
        doc: dict[str, Any] = {
            "schema": SCHEMA, "model": self.model, "calibration": self.calibration, "bins": self.bins,
            "selection": self.selection, "percentiles": list(self.percentiles), "tensors": rows, "jobs": self.jobs}
        if self.encodings is not None:
            doc["coverage"] = {**self.encodings, "min_coverage": self.min_coverage, "measured": len(self.fits),
                               "low": [{"tensor": r["tensor"], "coverage": r["coverage"]} for r in self.low_coverage()]}
        return json_safe(doc)


# ------------------------------------------------------------------------------------------ the run
def read_activation_encodings(source: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str], str]:
    """The per-tensor activation encodings of a QDQ model (``.onnx``) or an encodings / overrides JSON file (any
    format of :mod:`ivq_debug.qnn.encodings`), as the dump's encoding dicts by tensor name; the encodings that
    cannot be measured (per-channel, float, no scale) with the reason; a description of the source."""
    p = regular_file(source, "encodings")
    encs = encodings_from_qdq_model(p) if p.suffix.lower() == ".onnx" else read_encodings(p)
    usable: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name, e in encs.activations.items():
        if e.is_float:
            skipped[name] = f"float{e.bitwidth}: no integer range"
        elif e.per_channel:
            skipped[name] = "per-channel"
        elif not e.scale:
            skipped[name] = "no scale (a range only)"
        else:
            usable[name] = e.to_dump()
    return usable, skipped, f"{'QDQ model' if p.suffix.lower() == '.onnx' else encs.format + ' encodings'} {p}"


def calib_stats(
    model: str | os.PathLike,
    calibration: Any,
    *,
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    encodings: str | os.PathLike | None = None,
    bins: int = defaults.CALIB_BINS,
    samples_per_job: int = defaults.CALIB_SAMPLES_PER_JOB,
    max_samples: int | None = None,
    max_outputs_per_run: int | None = None,
    min_coverage: float = defaults.CALIB_MIN_COVERAGE,
    executor: Executor | None = None,
    shards: str | os.PathLike | None = None,
    progress: bool = True,
) -> CalibStats:
    """Per-tensor statistics of ``model`` over ``calibration`` (and coverage of ``encodings``), as jobs.

    Args:
        model: the (float) ONNX model.
        calibration: what :func:`~ivq_debug.qnn.quantize.load_calibration` reads (``ivq quantize --calibration``).
        include, exclude: glob patterns on tensor names (model inputs included).
        encodings: a QDQ model or an encodings JSON: per-tensor coverage of its activation encodings.
        bins: histogram bins per tensor (fixed edges from the range pass: module docstring).
        samples_per_job: calibration samples per job.
        max_samples: use the first N samples only.
        max_outputs_per_run: at most N tensors computed per piece of the graph (bounds a job's memory).
        min_coverage: a tensor whose coverage is below this is listed by :meth:`CalibStats.low_coverage`.
        executor: where the jobs run (default :class:`~ivq_debug.executor.LocalExecutor` ``(1)``: this process).
        shards: the shard folder (kept; a rerun skips the jobs whose shard is there); default a temporary one.
        progress: progress bars over jobs.
    """
    if not 2 <= int(bins) <= MAX_BINS:
        raise UsageError(f"--bins must be between 2 and {MAX_BINS}, got {bins}")
    if int(samples_per_job) < 1:
        raise UsageError(f"--samples-per-job must be at least 1, got {samples_per_job}")
    if max_outputs_per_run is not None and int(max_outputs_per_run) < 1:
        raise UsageError("--max-outputs-per-run must be >= 1")
    if not 0.0 <= float(min_coverage) <= 1.0:
        raise UsageError(f"--min-coverage must be between 0 and 1, got {min_coverage}")
    if max_samples is not None and int(max_samples) < 1:
        raise UsageError("--max-samples must be >= 1")
    path = regular_file(model, "model").resolve()
    proto = load_model(path)
    samples, desc = load_calibration(calibration, proto, max_samples=max_samples)
    del proto
    digests = [sample_digest(s) for s in samples]
    sel = {"include": list(include), "exclude": list(exclude)}
    usable: dict[str, Any] = {}
    enc_info: dict[str, Any] | None = None
    if encodings is not None:
        usable, skipped, enc_desc = read_activation_encodings(encodings)
        enc_info = {"source": enc_desc, "not_measured": skipped}
    model_sha = sha256_file(path)
    cal_sha = hashlib.sha256("\n".join(digests).encode()).hexdigest()
    base = {"model_sha256": model_sha, "calibration_sha256": cal_sha, "selection": sel, "versions": versions()}
    per = int(samples_per_job)
    chunks = [(i, samples[i:i + per]) for i in range(0, len(samples), per)]
    executor = executor if executor is not None else LocalExecutor(1)
    common = {"model_path": str(path), "selection": sel, "max_outputs_per_run": max_outputs_per_run}

    def jobs_of(kind: str, meta: dict[str, Any], extra: dict[str, Any]) -> list[Job]:
        meta = {"kind": kind, **base, **meta}
        return [Job(job_key(first=i, samples=digests[i:i + len(chunk)], **meta), _stats_job,
                    {**common, "feeds": chunk, **extra}, meta) for i, chunk in chunks]

    tmp = None
    if shards is None:
        tmp = shards = tempfile.mkdtemp(prefix=".ivq-calib-shards-")
    try:
        range_jobs = jobs_of("calib-range/1", {"bins": None, "edges_sha256": None, "encodings_sha256": None}, {})
        r1 = executor.run(range_jobs, shards, "ranges", progress=progress)
        r1.raise_failures()
        ranges, _ = _merge(r1, range_jobs, None)
        edges = {n: histogram_edges(a.min, a.max, int(bins)).tolist() for n, a in ranges.items()}
        measured = {n: e for n, e in usable.items() if n in ranges}
        stat_jobs = jobs_of("calib-stats/1", {"bins": int(bins), "edges_sha256": job_key(edges=edges),
                                              "encodings_sha256": job_key(encodings=measured)},
                            {"edges": edges, "encodings": measured})
        r2 = executor.run(stat_jobs, shards, "statistics", progress=progress)
        r2.raise_failures()
        stats, fits = _merge(r2, stat_jobs, edges)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if enc_info is not None:
        enc_info["unmatched"] = sorted(n for n in usable if n not in ranges)
    name = type(executor).__name__
    return CalibStats(
        model={"path": str(path), "sha256": model_sha},
        calibration={"source": desc, "sha256": cal_sha, "samples": len(samples)},
        bins=int(bins), selection=sel, stats=stats, fits=fits, encodings=enc_info, min_coverage=float(min_coverage),
        jobs={"executor": name, "total": len(range_jobs) + len(stat_jobs), "samples_per_job": per,
              "resumed": len(r1.skipped) + len(r2.skipped), "retried": sorted(set(r1.retried + r2.retried)),
              "shards": None if tmp is not None else str(shards)})
