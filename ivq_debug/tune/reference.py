"""The float reference of a tune, made in memory as the trials read it (issue 33; no ``reference.h5``).

``ivq tune`` without ``--reference`` used to capture the float model on every evaluation sample into a dump
first: on the PP-OCRv4 recognizer with 12 evaluation lines 2.3 GB written once and read back by every trial, which
reads only the tensors it measures (the watched tensors, the model outputs, its suggestions' tensors). A
:class:`LiveReference` instead runs the float model (ORT CPU, every tensor exposed: the runner the capture used)
on one evaluation sample when a comparison first reads a value of that sample, into memory
(:class:`~ivq_debug.dump.memory.MemorySink`), and keeps the arrays the trials' comparisons *measure*, up to a byte
budget (:data:`ivq_debug.defaults.TUNE_REFERENCE_KEEP_BYTES`, an equal share per sample); the rest is dropped after
each comparison and made again by the next forward that needs it. Nothing is written.

What is kept, in this order within the sample's share: the tensors the coming trials measure when they are known
(:meth:`LiveReference.expect`: a search's batch of levers names them all before it runs), what the last *measured*
comparison (a trial's: the watched tensors, the outputs, its suggestions' tensors, the alignment's value checks)
read, every tensor a measured comparison read before, then what a whole comparison read; smallest first within
each. A *whole* comparison (the baseline's, a diagnosis: every tensor) says little of what the trials read. It used
to keep what the last comparison read, up to the budget over all samples: the baseline's whole read filled it
with one sample's tensors, and each lever's new tensors then cost a forward of every line (PP-OCRv4's search on 12
lines: 118 forwards).

What a comparison sees is what the dump held: the same entries (every tensor of the record: the alignment is made
on all of them), the same arrays (the forward of the same session; ORT CPU gives the same bits run after run,
``tests/tune/test_reference.py``), so every figure is the same to the bit as against ``reference.h5``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.capture.base import Selection, make_runner
from ivq_debug.dump import format as fmt
from ivq_debug.dump.contract import input_digest
from ivq_debug.dump.memory import MemoryDump, MemorySink
from ivq_debug.onnxgraph.load import load_model, model_digest


class LiveRecord(MemoryDump):
    """One evaluation sample of a :class:`LiveReference`: a :class:`~ivq_debug.dump.memory.MemoryDump` whose
    values not held are made again (one forward of the float model) on first read."""

    def __init__(self, sink: MemorySink, owner: LiveReference, sample: int) -> None:
        super().__init__(sink)
        self._owner, self._sample = owner, sample
        self.read_keys: set[tuple[str, str, str]] = set()
        self.pinned = False
        #: the tensors the comparison reading this record measures (None: a whole comparison; :meth:`LiveReference.
        #: record`)
        self.measure: Collection[str] | None = None

    def _array(self, entry: Any) -> np.ndarray:
        key = (entry.rid, entry.kind, entry.key)
        if key not in self._arrays:
            with self._owner._lock:  # the comparator reads pairs in threads: one forward per miss
                if key not in self._arrays:
                    self._owner._forward(self._sample)  # this record's values, whole again
        self.read_keys.add(key)
        return super()._array(entry)

    def close(self) -> None:
        """Keep what was read (within the owner's budget) unless pinned; drop the rest."""
        if not self.pinned:
            self._owner._trim(self)


class LiveReference:
    """The float model's tensors on the evaluation samples, made in memory when read (module docstring).

    Args:
        model: the float model the trials quantize (the tuner's source).
        feeds: the evaluation samples, one dict each (record ``(i, part, 0)``).
        part: the record part name.
        keep_bytes: the most bytes of arrays kept between comparisons (over every sample; an equal share each).
    """

    def __init__(self, model: str | Path, feeds: Sequence[dict[str, np.ndarray]], part: str = "model",
                 keep_bytes: int = defaults.TUNE_REFERENCE_KEEP_BYTES) -> None:
        self.model, self.feeds, self.part, self.keep_bytes = Path(model), list(feeds), part, int(keep_bytes)
        self._runner: Any = None
        self._lock = threading.Lock()
        self._records: dict[int, LiveRecord] = {}
        #: ``(kind, key)`` of every tensor a measured comparison read (what the next trials read again)
        self._hot: set[tuple[str, str]] = set()
        #: the keys of the tensors the coming comparisons measure (:meth:`expect`)
        self._expected: set[str] = set()
        #: forwards run (what the kept arrays save: ``tune.json`` ``reference``)
        self.forwards = 0

    def __getstate__(self) -> dict[str, Any]:  # a job sent to another process makes its own
        return {k: v for k, v in self.__dict__.items() if k != "_lock"} | {
            "_runner": None, "_records": {}, "_hot": set(), "_expected": set(), "forwards": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def path(self) -> str:
        return f"<float reference of {self.model.name}, in memory>"

    def digest(self) -> str:
        """What the reference is made of: the model's bytes, the samples, the part (a checkpoint / job key)."""
        h = hashlib.sha256()
        # the model's bytes and its external-data files' (one definition, memoized per file version)
        h.update(json.dumps(model_digest(self.model, load_model(self.model)), sort_keys=True).encode())
        for f in self.feeds:
            h.update(repr(sorted((k, input_digest(v)) for k, v in f.items())).encode())
        h.update(self.part.encode())
        return "live:" + h.hexdigest()

    def expect(self, names: Iterable[str]) -> None:
        """The tensors the coming comparisons measure (a search's batch of levers): kept first from the next
        forward of each sample on."""
        self._expected = {fmt.escape_name(n) for n in names}

    def record(self, i: int, measure: Collection[str] | None = None) -> LiveRecord:
        """Sample ``i``'s reference (its listing made by one forward the first time), read by a comparison that
        measures the tensors ``measure`` (None: every tensor), closed after it."""
        rec = self._records.get(i)
        if rec is None:
            rec = self._forward(i)
        rec.measure = measure
        return rec

    def hold(self, i: int) -> LiveRecord:
        """Sample ``i`` with every value, kept until :meth:`release` (a diagnosis reads all of one record)."""
        rec = self.record(i)
        for e in rec.entries:
            rec._array(e)
        rec.pinned = True
        rec.measure = None
        return rec

    def release(self, i: int) -> None:
        """Let sample ``i``'s values go again (kept within the budget, as after a comparison)."""
        rec = self._records.get(i)
        if rec is not None and rec.pinned:
            rec.pinned = False
            self._trim(rec)

    def kept_bytes(self) -> int:
        """The bytes of arrays held now."""
        return sum(int(a.nbytes) for r in self._records.values() for a in r._arrays.values())

    def _forward(self, i: int) -> LiveRecord:
        if self._runner is None:
            self._runner = make_runner("onnx", self.model, selection=Selection())
        sink = MemorySink(self._runner.backend, self._runner.info, path=self.path)
        sink.begin_record(sample=i, part=self.part, step=0)
        self._runner.run(self.feeds[i], sink)
        self.forwards += 1
        fresh = LiveRecord(sink, self, i)
        old = self._records.get(i)
        if old is None:
            self._records[i] = fresh
            return fresh
        old._arrays = fresh._arrays  # the listing the comparisons hold stays; its values are whole again
        return old

    def _trim(self, rec: LiveRecord) -> None:
        """After a comparison: keep, within the sample's share of the budget, the expected tensors, what this
        comparison read when it measured, what measured comparisons read before, what this one read (module
        docstring)."""
        read, rec.read_keys = rec.read_keys, set()
        measured = rec.measure is not None
        if measured:
            self._hot |= {(k[1], k[2]) for k in read}
        tiers = [[k for k in rec._arrays if k[2] in self._expected], list(read) if measured else [],
                 [k for k in rec._arrays if (k[1], k[2]) in self._hot], list(read)]
        kept: dict[tuple[str, str, str], np.ndarray] = {}
        room = self.keep_bytes // max(1, len(self.feeds))
        for keys in tiers:
            for key in _ordered([k for k in keys if k not in kept], rec._arrays):
                a = rec._arrays[key]
                if a.nbytes <= room:
                    kept[key] = a
                    room -= int(a.nbytes)
        rec._arrays = kept


def _ordered(want: Iterable[tuple[str, str, str]], arrays: dict[tuple[str, str, str], np.ndarray]
             ) -> list[tuple[str, str, str]]:
    """The wanted keys that have an array, smallest first (the most tensors in the budget)."""
    return sorted((k for k in want if k in arrays), key=lambda k: (arrays[k].nbytes, k))
