"""A comparison made one record at a time, joined into the comparison of the whole capture.

A capture held in memory (:class:`~ivq_debug.dump.memory.MemorySink`) is compared record by record as its samples
run, and each record's values are dropped once compared: a tune trial against its reference
(:meth:`ivq_debug.tune.verify.Tuner.compare_in_memory`), ``ivq diff A.onnx B.onnx`` (:mod:`ivq_debug.modeldiff`).
Each record goes through :func:`~ivq_debug.comparator.compare` with one ``memo`` shared across the records (the
alignment's value checks, made on the first record holding a pair, as a whole alignment makes them);
:class:`RecordwiseComparison` joins the per-record tables and alignments in record order into the
:class:`~ivq_debug.comparator.Comparison` :func:`~ivq_debug.comparator.compare` of the whole capture gives: the
same rows, the same pairs, the same unmatched tensors (``tests/tune/test_trial.py``,
``tests/cli/test_diff_models.py``).
"""

from __future__ import annotations

from typing import Any

from ivq_debug.align.matcher import Alignment, Pair
from ivq_debug.comparator.comparison import Comparison
from ivq_debug.dump.reader import Dump, Entry


class RecordwiseComparison:
    """The per-record comparisons of a capture, in record order (:meth:`add`), joined by :meth:`result`."""

    def __init__(self) -> None:
        self.memo: dict[Any, Any] = {}  # the alignment's value checks, shared across the records
        self._tables: list[Any] = []
        self._pairs: list[Pair] = []
        self._unmatched_ref: list[Entry] = []
        self._unmatched_test: list[Entry] = []
        self._last: Comparison | None = None

    def add(self, cmp: Comparison, record: tuple[int, str, int] | None = None) -> None:
        """One record's comparison (made with :attr:`memo`). ``record``: its key, when the reference dump holds
        other records too (their tensors are not unmatched: they are another record's)."""
        self._tables.append(cmp.table)
        self._pairs += cmp.alignment.pairs
        self._unmatched_ref += [e for e in cmp.alignment.unmatched_ref if record is None or e.record == record]
        self._unmatched_test += cmp.alignment.unmatched_test
        self._last = cmp

    def result(self, ref: Dump, test: Dump) -> Comparison:
        """The comparison of every record added, with ``ref`` and ``test`` as its dumps."""
        import pandas as pd

        assert self._last is not None, "at least one record was compared"
        full = [t for t in self._tables if len(t)]
        table = pd.concat(full, ignore_index=True) if full else self._tables[0]
        al = Alignment(self._pairs, self._unmatched_ref, self._unmatched_test, [], [])
        return Comparison(ref, test, table, al, self._last.budgets, self._last.rank_by)
