"""Compare two dumps: align, stream metrics per tensor pair, rank, find the first divergence.

A comparison only measures: the pinned metrics (:mod:`ivq_debug.metrics`) and the encoding fit
(:mod:`ivq_debug.encoding_fit`) of every aligned pair, in one streaming pass. Diagnostics read the
resulting :class:`Comparison` (:mod:`ivq_debug.diagnose`); :func:`ivq_debug.compare` composes the two.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.align.matcher import Alignment, Pair, align
from ivq_debug.comparator.budgets import Budget, Budgets
from ivq_debug.comparator.ranking import default_rank_metric
from ivq_debug.console import track
from ivq_debug.dump.reader import Dump, open_dump
from ivq_debug.encoding_fit import EncodingAccumulator
from ivq_debug.errors import UsageError
from ivq_debug.executor import size_runs
from ivq_debug.jsonio import as_float, json_safe
from ivq_debug.metrics import (
    HIGHER_IS_BETTER,
    METRICS,
    SHAPE_MISMATCH,
    MetricAccumulator,
    one_blas_thread,
    sort_key,
)

SCHEMA = "ivq-diff/1"

COLUMNS = [
    "sample", "part", "step", "order", "ref_name", "test_name", "match", "op_type", "test_op_type", "scope",
    "shape", "test_shape", "numel", "ref_dtype", "test_dtype", "status", *METRICS, "nonfinite_ref",
    "nonfinite_test", "sampled", "clipped_fraction", "clip_snr_db", "grid_snr_db", "enc_step", "passed", "violations",
]


def is_logits(name: str) -> bool:
    """True when a tensor name looks like logits (see ``defaults.LOGITS_PATTERNS``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in defaults.LOGITS_PATTERNS)


def pair_metrics(ref: Dump, test: Dump, pair: Pair, block_bytes: int = defaults.COMPARE_BLOCK_BYTES, *,
                 fit: bool = True, metrics: bool = True) -> dict[str, Any]:
    """Stream the metrics and the encoding fit of one aligned pair (bounded memory: one block of each side at a
    time). ``fit`` False leaves the fit out; ``metrics`` False gives the fit alone, reading the reference only:
    the same blocks cast the same way, so the same fit to the bit as both in one pass."""
    a, b = pair.ref, pair.test
    logits = is_logits(a.name) or is_logits(b.name)
    acc = MetricAccumulator(logits=logits)
    enc = EncodingAccumulator.for_encoding(b.encoding) if fit else None  # how the test encoding fits the reference
    sampled = False
    if a.size != b.size:
        out: dict[str, Any] = dict.fromkeys(METRICS)
        out.update(status=SHAPE_MISMATCH, nonfinite_ref=None, nonfinite_test=None, sampled=False)
        return out if metrics else {}
    if not (metrics or enc):
        return {}

    def feed(ra: np.ndarray, tb: np.ndarray | None) -> None:
        r64 = acc.update(ra, tb) if tb is not None else np.asarray(ra, dtype=np.float64).reshape(-1)
        if enc is not None:
            enc.update(r64)  # the reference block cast to float64 (MetricAccumulator.update's cast)

    if a.stored != "full" or b.stored != "full":
        sampled = True
        feed(ref.read_sample(a), test.read_sample(b) if metrics else None)
    else:  # stream both in C order, block by block (shapes may differ when element counts agree)
        item = max(ref.stored_dtype(a).itemsize, test.stored_dtype(b).itemsize)
        row = a.shape[-1] if (logits and a.shape) else 1
        n = max(row, (block_bytes // item) // row * row)
        blocks = ref.iter_flat(a, n, reuse=True)
        for ra, tb in (zip(blocks, test.iter_flat(b, n, reuse=True), strict=True) if metrics
                       else ((r, None) for r in blocks)):
            if logits and row > 1:
                ra, tb = ra.reshape(-1, row), tb.reshape(-1, row) if tb is not None else None
            feed(ra, tb)
    res = acc.result(b.encoding) if metrics else {}
    if metrics:
        res["sampled"] = sampled
    if enc is not None:
        e = enc.result()
        res.update(clipped_fraction=e["clipped_fraction"], clip_snr_db=e["clip_snr_db"], grid_snr_db=e["grid_snr_db"],
                   enc_step=e["enc_step"])
    return res


#: the encoding-fit columns of a comparison's table (:mod:`ivq_debug.encoding_fit`)
FIT_COLUMNS = ("clipped_fraction", "clip_snr_db", "grid_snr_db", "enc_step")


@dataclass
class Comparison:
    """The result of comparing two dumps.

    Attributes:
        table: pandas DataFrame, one row per aligned tensor pair in execution order (records in
            (sample, part, step) order), with the pinned metrics, status and budget verdicts.
        alignment: the :class:`~ivq_debug.align.matcher.Alignment` (pairs and unmatched entries).
        budgets: the thresholds applied.
        rank_by: the metric :meth:`worst` sorts by.
        findings: diagnostic findings (``Finding`` objects).
    """

    ref: Dump
    test: Dump
    table: Any
    alignment: Alignment
    budgets: Budgets
    rank_by: str = defaults.RANK_METRIC
    findings: list[Any] = field(default_factory=list)
    regressions: list[dict[str, Any]] | None = None
    contract: Any = None  # comparator.contract.ContractCheck (ivq.compare checks it before any metric)
    three_way: Any = None  # comparator.threeway.ThreeWay (ivq.compare(..., expected=CPU-QDQ))
    backend_check: dict[str, Any] | None = None  # REF is TEST's QDQ model on CPU-QDQ (ivq.compare sets it)
    verdict: Any = None  # diagnose.verdict.Verdict (pass/fail and why)
    #: made with ``fit=False``: the table's pairs, whose encoding-fit columns are NaN until :meth:`fit_encodings`
    unfitted: list[Pair] | None = None

    def fit_encodings(self, block_bytes: int = defaults.COMPARE_BLOCK_BYTES) -> None:
        """Fill the encoding-fit columns (:data:`FIT_COLUMNS`) of a comparison made with ``fit=False``, each to the
        value the comparison made with the fit gives (:func:`pair_metrics` on the same blocks); nothing to do
        otherwise."""
        import pandas as pd

        if self.unfitted is None:
            return
        with one_blas_thread:
            fits = [pair_metrics(self.ref, self.test, p, block_bytes, metrics=False) for p in self.unfitted]
        t = self.table
        for c in FIT_COLUMNS:
            vals = pd.Series([f.get(c) for f in fits], index=t.index, dtype=object)
            t[c] = pd.to_numeric(vals, errors="coerce").astype("float64")
        self.unfitted = None

    # ---------------------------------------------------------------- views
    def worst(self, n: int = defaults.TOP_N, by: str | None = None):
        """The ``n`` worst rows by a metric (non-finite and mismatched first)."""
        by = by or self.rank_by
        if by not in METRICS:
            raise UsageError(f"unknown metric {by!r} (known: {', '.join(METRICS)})")
        t = self.table
        if t.empty:
            return t
        keys = [sort_key(by, v, s) for v, s in zip(t[by], t["status"], strict=True)]
        return t.assign(_k=keys).sort_values("_k", kind="stable").drop(columns="_k").head(n)

    @property
    def divergence_budgets(self) -> Budgets:
        """The budgets that define divergence: the given ones, else ``sqnr_db >= DIVERGENCE_SQNR_DB``."""
        if self.budgets:
            return self.budgets
        return Budgets([Budget("sqnr_db", "min", defaults.DIVERGENCE_SQNR_DB)])

    def _diverged(self) -> Any:
        """Per row: breaks the divergence budgets. With budgets that is ``~passed``; without, the default
        budget ``sqnr_db >= DIVERGENCE_SQNR_DB`` (pattern ``*``) as :meth:`Budget.violated` judges a table row,
        vectorized: identical and empty rows never break it, an undefined SQNR (NaN in the table) compares
        false, as it did row by row."""
        import pandas as pd

        t = self.table
        if self.budgets or not len(t):
            return ~t["passed"]
        sqnr = t["sqnr_db"].to_numpy(dtype=np.float64)
        exempt = t["status"].isin(("identical", "empty")).to_numpy()
        return pd.Series(~exempt & (sqnr < defaults.DIVERGENCE_SQNR_DB), index=t.index)

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        """The first tensor in execution order that breaks the (divergence) budgets, as a dict."""
        t = self.table
        if t.empty:
            return None
        hits = t[self._diverged()]
        if hits.empty:
            return None
        return _row_dict(hits.iloc[0])

    def first_divergences(self):
        """Per record: the first diverging tensor (DataFrame, one row per record that diverges)."""
        t = self.table
        if t.empty:
            return t
        hits = t[self._diverged()]
        return hits.groupby(["sample", "part", "step"], sort=False).head(1)

    def by_record(self):
        """Per record (per step): tensor count, worst SQNR, largest max_abs, failures, logits metrics."""
        import pandas as pd

        t = self.table
        if t.empty:
            return pd.DataFrame()
        g = t.groupby(["sample", "part", "step"], sort=False)
        out = g.agg(
            tensors=("ref_name", "size"),
            min_sqnr_db=("sqnr_db", "min"),
            max_abs=("max_abs", "max"),
            failed=("passed", lambda s: int((~s).sum())),
        )
        lg = t[t["top1"].notna()].groupby(["sample", "part", "step"], sort=False).agg(
            top1=("top1", "min"), kl=("kl", "max")
        )
        return out.join(lg).reset_index()

    @property
    def passed(self) -> bool:
        """No budget violation (or, with a baseline, no regression)."""
        if self.regressions is not None:
            return not self.regressions
        return bool(self.table["passed"].all()) if len(self.table) else True

    @property
    def unmatched(self) -> dict[str, Any]:
        """Unmatched tensors per side (counts and names) and unmatched records."""
        al = self.alignment
        return {
            "ref": {"count": len(al.unmatched_ref), "names": [e.name for e in al.unmatched_ref]},
            "test": {"count": len(al.unmatched_test), "names": [e.name for e in al.unmatched_test]},
            "ref_records": [list(k) for k in al.unmatched_ref_records],
            "test_records": [list(k) for k in al.unmatched_test_records],
            "fraction": al.unmatched_fraction,
        }

    @property
    def summary(self) -> dict[str, Any]:
        """Counts and headline numbers."""
        t = self.table
        fin = t["sqnr_db"].replace([math.inf], np.nan) if len(t) else t
        return {
            "pairs": len(t),
            "records": int(t.groupby(["sample", "part", "step"]).ngroups) if len(t) else 0,
            "failed": int((~t["passed"]).sum()) if len(t) else 0,
            "identical": int((t["status"] == "identical").sum()) if len(t) else 0,
            "non_finite": int((t["status"] == "non_finite").sum()) if len(t) else 0,
            "min_sqnr_db": as_float(fin.min()) if len(t) else None,
            "max_max_abs": as_float(t["max_abs"].max()) if len(t) else None,
            "rank_by": self.rank_by,
            "budgets": self.budgets.describe(),
            "passed": self.passed,
            "complete": {"ref": self.ref.complete, "test": self.test.complete},
            "match_methods": t["match"].value_counts().to_dict() if len(t) else {},
        }

    # ---------------------------------------------------------------- export
    def to_json(self, top: int | None = None) -> dict[str, Any]:
        """The ``ivq-diff/1`` JSON document (layers worst first; ``top`` limits them)."""
        rows = self.worst(len(self.table) if top is None else top).to_dict("records")
        layers = [_layer_json_from_dict(_clean(d)) for d in rows]
        doc = {
            "schema": SCHEMA,
            "ref": _dump_json(self.ref),
            "test": _dump_json(self.test),
            "summary": self.summary,
            "first_divergence": _layer_json_from_dict(self.first_divergence),
            "layers": layers,
            "unmatched": self.unmatched,
            "findings": [f.to_dict() for f in self.findings],
        }
        if self.regressions is not None:
            doc["regressions"] = self.regressions
        if self.backend_check is not None:
            doc["backend_check"] = self.backend_check
        _extend_json(self, doc)
        return json_safe(doc)

    def __repr__(self) -> str:
        s = self.summary
        return (
            f"Comparison(pairs={s['pairs']}, failed={s['failed']}, min_sqnr_db={s['min_sqnr_db']}, "
            f"unmatched ref/test={len(self.alignment.unmatched_ref)}/{len(self.alignment.unmatched_test)})"
        )


def _extend_json(cmp: Comparison, doc: dict[str, Any]) -> None:
    """The contract, three-way and verdict blocks; with inputs known to differ, every layer says so."""
    if cmp.contract is not None:
        doc["contract"] = cmp.contract.to_dict()
        if cmp.contract.status == "broken":
            for layer in doc["layers"] + [doc["first_divergence"] or {}]:
                layer["contract"] = "inputs differ (--allow-input-mismatch)"
    if cmp.three_way is not None:
        doc["three_way"] = cmp.three_way.to_json()
    if cmp.verdict is not None:
        doc["verdict"] = cmp.verdict.to_dict()


def _row_dict(row: Any) -> dict[str, Any]:
    return _clean(row.to_dict())


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    """A table row as a dict with NaN (an undefined metric) as None."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _layer_json_from_dict(d: dict[str, Any] | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {
        "ref_name": d["ref_name"],
        "test_name": d["test_name"],
        "record": {"sample": int(d["sample"]), "part": d["part"], "step": int(d["step"])},
        "order": int(d["order"]),
        "op_type": d.get("op_type"),
        "test_op_type": d.get("test_op_type"),
        "scope": d.get("scope"),
        "shape": list(d["shape"]),
        "match": d["match"],
        "metrics": {m: d.get(m) for m in METRICS if d.get(m) is not None},
        "status": d["status"],
        "passed": bool(d["passed"]),
        "violations": d["violations"],
    }


def _dump_json(d: Dump) -> dict[str, Any]:
    return {
        "path": str(d.path),
        "backend": d.backend,
        "backend_info": d.backend_info,
        "model": d.model,
        "created": d.created,
        "complete": d.complete,
        "tensors": len([e for e in d.entries if e.kind == "tensor"]),
    }


def compare(
    ref: Dump | str | os.PathLike,
    test: Dump | str | os.PathLike,
    *,
    budgets: Budgets | None = None,
    rank_by: str | None = None,
    mapping: dict[str, str] | None = None,
    records: Callable[[tuple[int, str, int]], bool] | None = None,
    progress: bool = True,
    block_bytes: int = defaults.COMPARE_BLOCK_BYTES,
    workers: int | None = None,
    memo: dict[Any, Any] | None = None,
    select: Callable[[list[Pair]], list[Pair]] | None = None,
    only_records: bool = False,
    fit: bool = True,
) -> Comparison:
    """Align two dumps and compute the pinned metrics for every aligned tensor pair.

    Args:
        ref: reference dump (path or opened :class:`Dump`); the signal of every metric.
        test: test dump.
        budgets: thresholds; rows get ``passed`` / ``violations`` from them.
        rank_by: metric for :meth:`Comparison.worst` (default: ``lsb_rmse`` when both dumps are quantized,
            else ``sqnr_db``; :mod:`ivq_debug.comparator.ranking`).
        mapping: explicit ``{ref_name: test_name}`` pairs tried before the automatic strategies.
        records: keep only records whose ``(sample, part, step)`` the predicate accepts.
        progress: show a progress bar on a terminal.
        block_bytes: bytes per block when streaming a tensor.
        workers: tensor pairs compared in parallel threads (default ``min(4, cores)``); uncompressed
            tensors are read without the HDF5 lock, so reads and metrics overlap.
        memo: the alignment's value checks shared across calls (:func:`~ivq_debug.align.matcher.align`): a
            capture compared one record at a time aligns as the whole capture would.
        only_records: with ``records``, align no record after the last one ``records`` accepts (the records kept
            are aligned as in the whole alignment; the unmatched tensors then leave out the later records): a
            caller that reads only the kept records' pairs (``ivq diagnose``).
        select: narrows the aligned pairs whose metrics are computed (the alignment is made on every tensor
            first, so a pair's metrics do not depend on it): a tune trial measures the tensors its report reads.
        fit: compute the encoding fit (:data:`FIT_COLUMNS`); without it those columns are NaN until
            :meth:`Comparison.fit_encodings` (a caller that reads them only sometimes: ``ivq diagnose``, whose
            replay reads them only when no unit breaks the budget, ``docs/scale.md``, fifth pass).
    """
    if rank_by is not None and rank_by not in METRICS:
        raise UsageError(f"unknown metric {rank_by!r} (known: {', '.join(METRICS)})")
    ref_d = ref if isinstance(ref, Dump) else open_dump(ref)
    test_d = test if isinstance(test, Dump) else open_dump(test)
    rank_by = rank_by or default_rank_metric(ref_d, test_d)
    budgets = budgets or Budgets()
    al = align(ref_d, test_d, mapping, memo, until=records if only_records else None)
    pairs = al.pairs
    if records is not None:
        pairs = [p for p in pairs if records(p.ref.record)]
        al = Alignment(pairs, al.unmatched_ref, al.unmatched_test, al.unmatched_ref_records,
                       al.unmatched_test_records)
    if select is not None:
        pairs = select(pairs)
    rows = []
    workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
    # BLAS held at one thread for the whole comparison (the pinned sums; entered once, not per dot)
    with one_blas_thread, ThreadPoolExecutor(max_workers=workers) as pool:
        # runs of consecutive pairs, one task each, at most 4 x workers in flight: each worker holds one block of
        # each side at a time, and only the small metric dicts wait for the ones before them
        def run(batch: list[Pair]) -> list[dict[str, Any]]:
            return [pair_metrics(ref_d, test_d, p, block_bytes, fit=fit) for p in batch]

        results = (m for ms in _ordered_map(pool, run, _batches(pairs, block_bytes), 4 * workers) for m in ms)
        it = track(zip(pairs, results, strict=True), "comparing", total=len(pairs)) if progress else zip(
            pairs, results, strict=True)
        for p, m in it:
            rows.append(_row(p, m, budgets))
    import pandas as pd  # (imported after the alignment: ivq diagnose's replay waits for the pairs, not the table)

    table = pd.DataFrame(rows, columns=COLUMNS)

    for c in (*METRICS, *FIT_COLUMNS):
        table[c] = pd.to_numeric(table[c], errors="coerce").astype("float64")
    table["passed"] = table["passed"].astype(bool)
    return Comparison(ref_d, test_d, table, al, budgets, rank_by, unfitted=None if fit else pairs)


def _row(p: Pair, m: dict[str, Any], budgets: Budgets) -> dict[str, Any]:
    viol = budgets.check(p.ref.name, m)
    return {
        "sample": p.ref.sample, "part": p.ref.part, "step": p.ref.step, "order": p.ref.order,
        "ref_name": p.ref.name, "test_name": p.test.name, "match": p.match,
        "op_type": p.ref.op_type or p.test.op_type, "test_op_type": p.test.op_type,
        "scope": p.ref.scope or p.test.scope, "shape": p.ref.shape, "test_shape": p.test.shape,
        "numel": p.ref.size, "ref_dtype": p.ref.dtype, "test_dtype": p.test.dtype,
        **m, "passed": not viol, "violations": [b.describe() for b in viol],
    }


def _batches(pairs: list[Pair], block_bytes: int, most: int = 32) -> list[list[Pair]]:
    """The pairs cut into runs of consecutive pairs of about ``block_bytes`` of reference values (at most ``most``
    pairs; a larger pair alone), the comparator's tasks. A ViT of 12 blocks has 1,936 pairs of 0.1-1.2 MB: one
    task per pair cost a future, a queue hand-off and a wake-up of the main thread each, and left a worker idle
    whenever the oldest pair was the slow one; each pair's metrics are computed as before, one pair at a time."""
    return size_runs(pairs, lambda p: p.ref.nbytes, block_bytes, most)


def _ordered_map(pool: Any, fn: Callable[[Any], Any], items: list[Any], window: int):
    """``pool.map`` with at most ``window`` tasks in flight, results in order."""
    pending: deque = deque()
    it = iter(items)
    for x in it:
        pending.append(pool.submit(fn, x))
        if len(pending) >= window:
            break
    for x in it:
        yield pending.popleft().result()
        pending.append(pool.submit(fn, x))
    while pending:
        yield pending.popleft().result()


def _key(d: dict[str, Any]) -> tuple[Any, ...]:
    r = d["record"]
    return (r["sample"], r["part"], r["step"], d["ref_name"])


def regressions_against(cmp: Comparison, baseline: dict[str, Any], metric: str | None = None) -> list[dict[str, Any]]:
    """Layers that got worse than a stored ``ivq-diff/1`` result.

    A layer regresses when its rank metric got worse by more than the tolerance
    (``REGRESSION_TOL_DB`` for SQNR, ``REGRESSION_TOL_REL`` relative otherwise), or when it breaks a
    budget it did not break in the baseline. Layers absent from the baseline are not regressions.
    """
    if baseline.get("schema") != SCHEMA:
        raise UsageError(f"baseline is not an {SCHEMA} document (schema={baseline.get('schema')!r})")
    metric = metric or cmp.rank_by
    base = {_key(layer): layer for layer in baseline.get("layers", [])}
    out = []
    for d in cmp.table.to_dict("records"):
        cur = _layer_json_from_dict(_clean(d))
        old = base.get(_key(cur))
        if old is None:
            continue
        reasons = []
        ov, nv = _to_float(old["metrics"].get(metric)), _to_float(cur["metrics"].get(metric))
        if ov is not None and nv is not None and math.isfinite(ov):
            if metric == "sqnr_db":
                worse = ov - nv > defaults.REGRESSION_TOL_DB
            elif HIGHER_IS_BETTER[metric]:
                worse = nv < ov - abs(ov) * defaults.REGRESSION_TOL_REL
            else:
                worse = nv > ov + abs(ov) * defaults.REGRESSION_TOL_REL + 1e-12
            if worse:
                reasons.append(f"{metric} {ov:.6g} -> {nv:.6g}")
        elif ov is not None and nv is None and cur["status"] in ("non_finite", "shape_mismatch"):
            reasons.append(f"status {old['status']} -> {cur['status']}")
        new_viol = sorted(set(cur["violations"]) - set(old.get("violations", [])))
        if new_viol:
            reasons.append("new violations: " + ", ".join(new_viol))
        if reasons:
            out.append({"ref_name": cur["ref_name"], "record": cur["record"], "reasons": reasons,
                        "baseline": old["metrics"], "current": cur["metrics"]})
    return out


def _to_float(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, str):
        return {"inf": math.inf, "-inf": -math.inf}.get(v)
    return float(v)
