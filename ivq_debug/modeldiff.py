"""Two ONNX models compared in memory: ``ivq diff A.onnx B.onnx --inputs X.npz …`` (issue 33).

What ``ivq capture onnx A`` and ``ivq capture onnx B`` on the same ``--inputs`` followed by ``ivq-diff`` compute,
without writing or reading a dump: each model runs on ONNX Runtime's CPU EP with every tensor exposed (the runner
``ivq capture onnx`` makes, with its default options: :func:`ivq_debug.cli.cmd_capture.runner_options`) into
memory (:class:`~ivq_debug.dump.memory.MemorySink`), one sample at a time; the sample's two records are aligned
and compared with the comparator ``ivq-diff`` uses (:func:`ivq_debug.comparator.compare`, the alignment's value
checks shared across records: :class:`~ivq_debug.comparator.records.RecordwiseComparison`), then their values are
dropped. The contract check, the backend check and the diagnostics then read the whole comparison as
:func:`ivq_debug.compare` does, so the ``ivq-diff/1`` document, the verdict and the exit code are those of the
dump path, every metric to the bit, apart from the two dumps' paths and creation times
(``tests/cli/test_diff_models.py``).

Memory: at most one sample's tensors of each model are held (:class:`HeldCapture`), with both sessions; ORT
``qdq_loss_debug`` holds every sample's activations of both models. A later read of a sample no longer held (a
diagnostic or the HTML report reading values) runs that sample's forward again (ORT CPU gives the same bits run
after run) and holds it instead.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ivq_debug import __version__, comparator, interrupt
from ivq_debug.api import checked, contracted
from ivq_debug.capture.base import make_runner, model_facts, run_identity, sample_shapes
from ivq_debug.comparator.records import RecordwiseComparison
from ivq_debug.console import track
from ivq_debug.diagnose import diagnose as run_diagnostics
from ivq_debug.dump.contract import CONTRACT_META
from ivq_debug.dump.memory import MemoryDump, MemorySink
from ivq_debug.dump.reader import Entry
from ivq_debug.onnxgraph.inputs import check_feeds

T = TypeVar("T")
U = TypeVar("U")


class HeldCapture:
    """One ONNX model run on the samples into memory, the values of one sample held at a time.

    :meth:`hold` runs sample ``i`` (record ``(i, part, 0)``, the record ``ivq capture onnx`` writes) and drops the
    tensors of the sample held before; the records' listing (entries, record meta, tables, ``/meta``) and every
    record's inputs (the feeds, which the caller holds anyway) stay: the ``preprocess_mismatch`` diagnostic reads
    every record's pixels, which cost a forward of each sample on each side again (1.2 of 6.5 s on the ViT).
    :meth:`dump` is a :class:`~ivq_debug.dump.reader.Dump` over one record or all of them.

    Args:
        runner: the model's runner (every tensor exposed).
        feeds: the samples, one dict each.
        model: the model file (its facts are the dump's ``model``).
        part: the record part name.
    """

    def __init__(self, runner: Any, feeds: Sequence[Mapping[str, np.ndarray]], model: str | Path,
                 part: str = "model") -> None:
        self.runner, self.feeds, self.part = runner, list(feeds), part
        self.sink = MemorySink(runner.backend, runner.info, path=f"{model} (in memory)")
        self.model = model_facts(model, part)
        self.created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        self.command, self.host = " ".join(sys.argv), f"{getpass.getuser()}@{socket.gethostname()}"
        self._rids: dict[int, str] = {}
        self._held: int | None = None
        self._lock = threading.Lock()
        #: forwards run (one per sample, more when a value was read again after its sample was dropped)
        self.forwards = 0

    def hold(self, i: int) -> None:
        """Hold sample ``i``'s values (run it; the sample held before is dropped first)."""
        with self._lock:
            self._hold(i)

    def _hold(self, i: int) -> None:
        if self._held == i:
            return
        arrays = self.sink._arrays  # one sample's tensors at a time: the ones held go before the next sample runs
        for key in [k for k in arrays if k[1] != "input"]:  # (the inputs are the samples' feeds: kept)
            del arrays[key]
        self._held = None
        if i not in self._rids:
            self._rids[i] = self.sink.begin_record(sample=i, part=self.part, step=0)
            self.runner.run(dict(self.feeds[i]), self.sink)
        else:  # read again after it was dropped: its values, under the record's id
            again = MemorySink(self.runner.backend, self.runner.info)
            again.begin_record(sample=i, part=self.part, step=0)
            self.runner.run(dict(self.feeds[i]), again)
            rid = self._rids[i]
            for (_, kind, key), arr in again._arrays.items():
                self.sink._arrays[(rid, kind, key)] = arr
        self.forwards += 1
        self._held = i

    def array(self, entry: Entry) -> np.ndarray:
        """The values of ``entry`` (its sample held first)."""
        with self._lock:
            self._hold(entry.sample)
            return self.sink._arrays[(entry.rid, entry.kind, entry.key)]

    def finish(self) -> None:
        """After the last sample: what a capture writes at the end (the runner's info again, the contract
        identity; :func:`ivq_debug.capture.base.capture`)."""
        self.sink.update_backend_info(**self.runner.info)
        self.sink.set_meta(CONTRACT_META, run_identity(self.runner, self.part))

    def dump(self, sample: int | None = None) -> HeldDump:
        """The records so far as a dump: sample ``sample``'s record alone, or all (None)."""
        return HeldDump(self, None if sample is None else self._rids[sample])


class HeldDump(MemoryDump):
    """A :class:`~ivq_debug.dump.memory.MemoryDump` over a :class:`HeldCapture`'s records: a value of a sample not
    held is made again (:meth:`HeldCapture.array`)."""

    def __init__(self, held: HeldCapture, rid: str | None = None) -> None:
        super().__init__(held.sink)
        if rid is not None:
            self._records = [r for r in self._records if r["rid"] == rid]
            self._entries = [e for e in self._entries if e.rid == rid]
        self.model = dict(held.model)
        self.created, self.tool_version, self.command, self._host = held.created, __version__, held.command, held.host
        self._held = held

    @property
    def attrs(self) -> dict[str, Any]:
        """What a capture's root attributes would say (the HTML report's dump card reads them)."""
        return {**super().attrs, "created": self.created, "tool_version": self.tool_version, "command": self.command,
                "host": self._host, "n_records": len(self._records), "n_tensors": len(self._entries)}

    def _array(self, entry: Entry) -> np.ndarray:
        arr = self._arrays.get((entry.rid, entry.kind, entry.key))
        return arr if arr is not None else self._held.array(entry)

    def close(self) -> None:
        """(The values belong to the :class:`HeldCapture`.)"""


def held_capture(model: str | Path, samples: Sequence[Mapping[str, np.ndarray]], sources: Sequence[Any],
                 part: str = "model", options: Mapping[str, Any] | None = None) -> HeldCapture:
    """``model`` ready to run on ``samples`` as ``ivq capture onnx MODEL --inputs SOURCES`` runs it: the input
    shapes the samples fix, the runner (``options``: :func:`ivq_debug.cli.cmd_capture.runner_options`), the
    samples checked against the model's inputs (:class:`~ivq_debug.errors.InputError` naming the file)."""
    shapes = sample_shapes("onnx", model, samples)
    runner = make_runner("onnx", model, input_shapes=shapes or None, **dict(options or {}))
    check_feeds(samples, runner.model, sources)
    return HeldCapture(runner, samples, model, part)


def _both(pool: ThreadPoolExecutor, ref: Callable[[], T], test: Callable[[], U]) -> tuple[T, U]:
    """``ref()`` here and ``test()`` in ``pool``'s thread, at once: ORT releases the GIL while it makes or runs a
    session, so one model's work overlaps the other's Python side (a forward's tensors handed to the sink, a QDQ
    model's values dequantized). Each session runs as alone (its own threads; the same bits: the bench's identity
    check). An error is the reference's first, as its capture runs first on the dump path."""
    theirs = pool.submit(test)
    try:
        mine = ref()
    except BaseException:
        wait([theirs])
        raise
    return mine, theirs.result()


def compare_models(
    ref_model: str | Path,
    test_model: str | Path,
    samples: Sequence[Mapping[str, np.ndarray]],
    *,
    sources: Sequence[Any] | None = None,
    part: str = "model",
    options: Mapping[str, Any] | None = None,
    budgets: comparator.Budgets | None = None,
    rank_by: str | None = None,
    mapping: dict[str, str] | None = None,
    records: Callable[[tuple[int, str, int]], bool] | None = None,
    allow_input_mismatch: bool = False,
    diagnose: bool = True,
    progress: bool = True,
) -> comparator.Comparison:
    """Run both models on every sample and compare them in memory (module docstring): what
    :func:`ivq_debug.compare` of their two ``ivq capture onnx`` dumps gives.

    Args:
        ref_model: the reference model (.onnx; the float one).
        test_model: the test model (.onnx, e.g. its QDQ model).
        samples: the inputs, one dict per sample (record ``(i, part, 0)``).
        sources: the file each sample came from (named in errors).
        part: the record part name.
        options: the runner options (:func:`ivq_debug.cli.cmd_capture.runner_options`; default: every tensor).
        budgets, rank_by, mapping, records: as :func:`ivq_debug.comparator.compare`.
        allow_input_mismatch, diagnose: as :func:`ivq_debug.compare`.
        progress: a progress bar on a terminal.

    Raises:
        InputError: a model or a sample that cannot run (exit 3); ContractError: the models were not fed the same
            inputs (exit 6, unless ``allow_input_mismatch``); AlignmentError: no common record (``records``).
    """
    sources = list(sources) if sources is not None else [f"sample {i}" for i in range(len(samples))]
    joined = RecordwiseComparison()
    steps = range(len(samples))
    with ThreadPoolExecutor(1, thread_name_prefix="ivq-diff-test-model") as pool:
        ref, test = _both(pool, lambda: held_capture(ref_model, samples, sources, part, options),
                          lambda: held_capture(test_model, samples, sources, part, options))
        for i in track(steps, "running and comparing", total=len(steps)) if progress else steps:
            interrupt.raise_if_signalled()
            _both(pool, lambda i=i: ref.hold(i), lambda i=i: test.hold(i))
            joined.add(comparator.compare(ref.dump(i), test.dump(i), budgets=budgets, rank_by=rank_by,
                                          mapping=mapping, records=records, progress=False, memo=joined.memo))
    ref.finish()
    test.finish()
    # what ivq.compare checks and adds, on the whole listing (the records' inputs, the sessions)
    ref_d, test_d, _, contract, _ = contracted(ref.dump(), test.dump(), None, allow_input_mismatch, records)
    cmp = checked(joined.result(ref_d, test_d), ref_d, test_d, contract, budgets=budgets)
    if diagnose:
        cmp.findings.extend(run_diagnostics(cmp))
    return cmp
