"""Three-way comparison: the backend's error measured against the error quantization alone implies.

A comparison ``ref → test`` (fp32 → a backend) says how far the backend is from fp32; on a quantized model
that mixes the error the quantization itself implies with what the backend adds on top. Given a third dump
``expected`` of the same inputs (CPU-QDQ: the exact fake-quant of the same QDQ model on ONNX Runtime CPU),
each tensor pair of the comparison that ``expected`` also holds is streamed once, the three tensors block by
block, and gets (definitions pinned in ``docs/metrics.md``):

================== ======================================================================================
rel_l2_test        ‖t − r‖₂ / ‖r‖₂ (backend vs fp32)
rel_l2_expected    ‖e − r‖₂ / ‖r‖₂ (CPU-QDQ vs fp32)
ratio_l2           rel_l2_test / rel_l2_expected
rel_linf_test      max|t − r| / max|r|
rel_linf_expected  max|e − r| / max|r|
ratio_linf         rel_linf_test / rel_linf_expected
bc                 Bhattacharyya coefficient of the |t − r| and |e − r| histograms
                   (:class:`ivq_debug.metrics.ErrorHistogram`, bins from the reference's scale)
================== ======================================================================================

Statuses: ``ok``; ``identical`` (both errors 0: ratio 1); ``expected_exact`` (CPU-QDQ has no error but the
backend has: ratio +inf); ``zero_norm`` (‖r‖ = 0: undefined); ``non_finite`` (a NaN/Inf in a block: undefined);
``shape_mismatch``. This module only measures; :mod:`ivq_debug.diagnose.backend` concludes.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.align.matcher import align
from ivq_debug.comparator.contract import ContractCheck, check_contract
from ivq_debug.console import track
from ivq_debug.dump.reader import Dump, Entry, open_dump
from ivq_debug.jsonio import as_float
from ivq_debug.metrics import (
    SHAPE_TEST_MIN_VALUES,
    ErrorHistogram,
    MetricAccumulator,
    bhattacharyya,
    rel_linf,
)

NUMERIC = ("rel_l2_test", "rel_l2_expected", "ratio_l2", "rel_linf_test", "rel_linf_expected", "ratio_linf", "bc")
#: the float64 sums behind the ratios (pooled per layer by :meth:`ThreeWay.layers`)
SUMS = ("n", "sum_r2", "sum_t2", "sum_e2", "max_r", "max_t", "max_e")
COLUMNS = ["sample", "part", "step", "order", "ref_name", "test_name", "expected_name", *NUMERIC, "status", *SUMS]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` for errors: 1 when both are 0, +inf when only ``b`` is, None when either is undefined."""
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


@dataclass
class _Triple:
    """One streaming pass over (r, t, e) blocks: a :class:`~ivq_debug.metrics.MetricAccumulator` per side
    (test and expected, each against the reference), fed the block's errors into the two histograms. A
    block with a non-finite value or sum marks the triple ``non_finite`` and adds nothing."""

    hist_t: ErrorHistogram
    hist_e: ErrorHistogram
    t: MetricAccumulator = field(default_factory=MetricAccumulator)
    e: MetricAccumulator = field(default_factory=MetricAccumulator)
    max_r: float = 0.0
    nonfinite: bool = False

    def update(self, r: np.ndarray, t: np.ndarray, e: np.ndarray) -> None:
        bt, be = MetricAccumulator(), MetricAccumulator()
        ht, he = ErrorHistogram(self.hist_t.scale), ErrorHistogram(self.hist_e.scale)
        r64 = bt.update(r, t, ht)
        max_r = float(np.abs(r64).max()) if r64.size else 0.0  # before the next update reuses the buffer
        be.update(r, e, he)
        if (bt.nonfinite_ref or bt.nonfinite_test or be.nonfinite_test
                or not all(math.isfinite(x) for x in (bt.sum_r2, bt.sum_sq_err, be.sum_sq_err))):
            self.nonfinite = True
            return
        self.t.merge(bt)
        self.e.merge(be)
        self.max_r = max(self.max_r, max_r)
        self.hist_t.merge(ht)
        self.hist_e.merge(he)

    def result(self) -> dict[str, Any]:
        out = {"n": self.t.n, "sum_r2": self.t.sum_r2, "sum_t2": self.t.sum_sq_err, "sum_e2": self.e.sum_sq_err,
               "max_r": self.max_r, "max_t": self.t.max_abs, "max_e": self.e.max_abs}
        if self.nonfinite:
            return {**out, **dict.fromkeys(NUMERIC), "status": "non_finite"}
        out.update(metrics_from_sums(out["n"], out["sum_r2"], out["sum_t2"], out["sum_e2"], self.max_r,
                                     out["max_t"], out["max_e"], self.hist_t.counts, self.hist_e.counts))
        out["hist_t"], out["hist_e"] = self.hist_t.counts, self.hist_e.counts
        return out


def metrics_from_sums(n: int, sum_r2: float, sum_t2: float, sum_e2: float, max_r: float, max_t: float,
                      max_e: float, hist_t: np.ndarray | None, hist_e: np.ndarray | None) -> dict[str, Any]:
    """The three-way metrics and status from the float64 sums of one tensor (or of a layer pooled over records).

    The shape test needs ``SHAPE_TEST_MIN_VALUES`` values: ``bc`` is None below (two histograms of a
    handful of values overlap by chance or not at all)."""
    out: dict[str, Any] = dict.fromkeys(NUMERIC)
    if n == 0 or sum_r2 == 0:
        out["status"] = "zero_norm" if n else "empty"
        return out
    nr = math.sqrt(sum_r2)
    out["rel_l2_test"], out["rel_l2_expected"] = math.sqrt(sum_t2) / nr, math.sqrt(sum_e2) / nr
    out["rel_linf_test"], out["rel_linf_expected"] = rel_linf(max_t, max_r), rel_linf(max_e, max_r)
    out["ratio_l2"] = ratio(out["rel_l2_test"], out["rel_l2_expected"])
    out["ratio_linf"] = ratio(out["rel_linf_test"], out["rel_linf_expected"])
    if hist_t is not None and hist_e is not None and n >= SHAPE_TEST_MIN_VALUES:
        out["bc"] = bhattacharyya(hist_t, hist_e)
    if sum_t2 == 0 and sum_e2 == 0:
        out["status"] = "identical"
    elif sum_e2 == 0:
        out["status"] = "expected_exact"
    else:
        out["status"] = "ok"
    return out


def _scale(e: Entry) -> float:
    lo, hi = as_float(e.stats.get("min")), as_float(e.stats.get("max"))
    vals = [abs(v) for v in (lo, hi) if v is not None and math.isfinite(v)]
    return max(vals) if vals else 1.0


def triple_metrics(ref: Dump, test: Dump, expected: Dump, a: Entry, b: Entry, c: Entry,
                   block_bytes: int = defaults.COMPARE_BLOCK_BYTES) -> dict[str, Any]:
    """Stream one (reference, test, expected) triple once and return the three-way metrics (module docstring)."""
    if not (a.size == b.size == c.size):
        return {**dict.fromkeys(NUMERIC), **dict.fromkeys(SUMS), "status": "shape_mismatch"}
    s = _scale(a)
    acc = _Triple(ErrorHistogram(s), ErrorHistogram(s))
    if "summary" in (a.stored, b.stored, c.stored):
        acc.update(ref.read_sample(a), test.read_sample(b), expected.read_sample(c))
    else:
        item = max(np.dtype(d.stored_dtype(x)).itemsize for d, x in ((ref, a), (test, b), (expected, c)))
        n = max(1, block_bytes // item)
        for ra, tb, ec in zip(ref.iter_flat(a, n, reuse=True), test.iter_flat(b, n, reuse=True),
                              expected.iter_flat(c, n, reuse=True), strict=True):
            acc.update(ra, tb, ec)
    return acc.result()


@dataclass
class ThreeWay:
    """The three-way measurement attached to a comparison (``cmp.three_way``).

    Attributes:
        expected: the CPU-QDQ (expected) dump.
        table: one row per tensor pair of the comparison that the expected dump also holds (:data:`COLUMNS`).
        missing: ``(record, ref_name)`` of pairs the expected dump lacks.
        contract: the contract check between the reference and the expected dump.
        k: the ratio over which a layer departs (``defaults.BACKEND_DIVERGENCE_K`` unless declared), applied by
            :mod:`ivq_debug.diagnose.backend`.
    """

    expected: Dump
    table: Any
    missing: list[tuple[tuple[int, str, int], str]] = field(default_factory=list)
    contract: ContractCheck | None = None
    k: float = defaults.BACKEND_DIVERGENCE_K
    hists: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    def layers(self):
        """The three-way metrics per layer: the rows of one tensor name in one part pooled over samples and steps
        (sums of squares and histograms added, maxima taken), in execution order; ``records`` counts the rows,
        ``worst`` is the record of the largest per-record ``ratio_l2``. A decode step's tensors hold a few
        dozen values each in small models: their per-record ratios swing by chance, the pooled one does not."""
        import pandas as pd

        if getattr(self, "_layers", None) is not None:
            return self._layers
        out = []
        t = self.table
        for (part, name), g in t.groupby(["part", "ref_name"], sort=False):
            g = g[g["status"] != "shape_mismatch"]
            if g.empty:
                continue
            bad = bool((g["status"] == "non_finite").any())
            g = g[g["status"] != "non_finite"]
            ht = he = None
            for i in g.index:
                h = self.hists.get(int(i))
                if h is not None:
                    ht = h[0].copy() if ht is None else ht + h[0]
                    he = h[1].copy() if he is None else he + h[1]
            m = metrics_from_sums(int(g["n"].sum()), float(g["sum_r2"].sum()), float(g["sum_t2"].sum()),
                                  float(g["sum_e2"].sum()), float(g["max_r"].max()), float(g["max_t"].max()),
                                  float(g["max_e"].max()), ht, he) if len(g) else {
                                      **dict.fromkeys(NUMERIC), "status": "non_finite"}
            if bad:
                m["status"] = "non_finite"
            worst = g.loc[g["ratio_l2"].fillna(-1).idxmax()] if len(g) else None
            out.append({"part": part, "ref_name": name, "order": int(t.loc[g.index, "order"].min()) if len(g) else 0,
                        "records": len(g), "numel": int(g["n"].sum()) if len(g) else 0, **m,
                        "worst": None if worst is None else f"{int(worst['sample'])}/{part}/{int(worst['step'])}"})
        cols = ["part", "ref_name", "order", "records", "numel", *NUMERIC, "status", "worst"]
        self._layers = pd.DataFrame(out, columns=cols)
        return self._layers

    def row_of(self, record: tuple[int, str, int], ref_name: str) -> dict[str, Any] | None:
        """The three-way row of one tensor (None when the expected dump lacks it)."""
        idx = self._index()
        i = idx.get((tuple(record), ref_name))
        return None if i is None else self.table.iloc[i].to_dict()

    def _index(self) -> dict[tuple[tuple[int, str, int], str], int]:
        if not hasattr(self, "_idx"):
            t = self.table
            self._idx = {((int(s), p, int(k)), n): i for i, (s, p, k, n) in
                         enumerate(zip(t["sample"], t["part"], t["step"], t["ref_name"], strict=True))}
        return self._idx

    @property
    def summary(self) -> dict[str, Any]:
        """Counts and the largest ratios (per layer pooled over records, and per single record)."""
        t, lay = self.table, self.layers()

        def top(df: Any, col: str, fn: str = "max") -> float | None:
            v = df[col][np.isfinite(df[col].astype(float))] if len(df) else df.get(col, [])
            return as_float(getattr(v, fn)()) if len(v) else None

        return {"expected": str(self.expected.path), "expected_backend": self.expected.backend, "pairs": len(t),
                "layers": len(lay), "missing": len(self.missing),
                "max_ratio_l2": top(lay, "ratio_l2"), "max_ratio_linf": top(lay, "ratio_linf"),
                "min_bc": top(lay, "bc", "min"), "max_record_ratio_l2": top(t, "ratio_l2"), "k": self.k}

    def to_json(self) -> dict[str, Any]:
        """The ``three_way`` block of ``ivq-diff/1``: summary and one row per tensor (execution order)."""
        rows = []
        for r in self.table.itertuples(index=False):
            d = r._asdict()
            rows.append({"record": {"sample": int(d["sample"]), "part": d["part"], "step": int(d["step"])},
                         "ref_name": d["ref_name"], "expected_name": d["expected_name"], "status": d["status"],
                         **{k: as_float(d[k]) for k in NUMERIC}})
        return {"summary": self.summary, "contract": self.contract.to_dict() if self.contract else None,
                "layers": rows}


def three_way(cmp: Any, expected: Dump | str | os.PathLike, *, k: float | None = None, progress: bool = False,
              block_bytes: int = defaults.COMPARE_BLOCK_BYTES, workers: int | None = None) -> ThreeWay:
    """Measure the comparison ``cmp`` (ref → test) against ``expected`` (module docstring); one pass per triple.

    The expected dump is aligned to the reference with the same strategies as any comparison.
    """
    import pandas as pd

    exp = expected if isinstance(expected, Dump) else open_dump(expected)
    by_ref = {(p.ref.record, p.ref.name): p.test for p in align(cmp.ref, exp).pairs}
    todo, missing = [], []
    for p in cmp.alignment.pairs:
        c = by_ref.get((p.ref.record, p.ref.name))
        if c is None:
            missing.append((p.ref.record, p.ref.name))
        else:
            todo.append((p, c))
    workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))

    def one(item: tuple[Any, Entry]) -> dict[str, Any]:
        p, c = item
        return triple_metrics(cmp.ref, cmp.test, exp, p.ref, p.test, c, block_bytes)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(one, todo)
        it = track(zip(todo, results, strict=True), "three-way", total=len(todo)) if progress else zip(
            todo, results, strict=True)
        rows, hists = [], {}
        for (p, c), m in it:
            h = (m.pop("hist_t", None), m.pop("hist_e", None))
            if h[0] is not None:
                hists[len(rows)] = h
            rows.append({"sample": p.ref.sample, "part": p.ref.part, "step": p.ref.step, "order": p.ref.order,
                         "ref_name": p.ref.name, "test_name": p.test.name, "expected_name": c.name, **m})
    table = pd.DataFrame(rows, columns=COLUMNS)
    for col in (*NUMERIC, *SUMS):
        table[col] = pd.to_numeric(table[col], errors="coerce").astype("float64")
    return ThreeWay(exp, table, missing, check_contract(cmp.ref, exp, sides=("ref", "expected")),
                    defaults.BACKEND_DIVERGENCE_K if k is None else float(k), hists)
