"""The notebook API: the stages composed (capture -> dump -> align -> compare -> diagnose).

``import ivq_debug as ivq`` exposes these lazily (``ivq.compare``, ``ivq.capture``, ``ivq.diagnose``); each stage
also has its own
module (:mod:`ivq_debug.capture.base`, :mod:`ivq_debug.comparator`, :mod:`ivq_debug.diagnose`) for callers
that want one stage alone. The CLI is a script of these calls.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from threading import Event
from types import SimpleNamespace
from typing import Any

from ivq_debug import comparator, defaults
from ivq_debug.align.preprocess import check_outputs, quantizer_reference
from ivq_debug.arrays import read_arrays
from ivq_debug.capture.base import Selection, make_runner, model_facts, sample_shapes
from ivq_debug.capture.base import capture as capture_runner
from ivq_debug.comparator.contract import backend_pair, check_common_records, check_contract
from ivq_debug.comparator.threeway import three_way
from ivq_debug.console import status
from ivq_debug.diagnose import diagnose as run_diagnostics
from ivq_debug.diagnose.replay import ReplayResult, replay, replay_records
from ivq_debug.diagnose.verdict import build_verdict
from ivq_debug.dump import Dump, open_dump
from ivq_debug.errors import UsageError
from ivq_debug.executor import Executor
from ivq_debug.forked import fork_call
from ivq_debug.onnxgraph.load import Model, load

#: ``ivq.diagnose`` backends: the replay's runner backend for each
REPLAY_BACKENDS = {"cpu": "onnx", "qnn": "qnn"}


def compare(
    ref: Dump | str | os.PathLike,
    test: Dump | str | os.PathLike,
    *,
    expected: Dump | str | os.PathLike | None = None,
    allow_input_mismatch: bool = False,
    k: float | None = None,
    diagnose: bool = True,
    fail_on: str = defaults.DIFF_FAIL_ON,
    **options: Any,
) -> comparator.Comparison:
    """Check the contract, align two dumps, compute the pinned metrics of every pair, measure the three-way
    ratios against ``expected``, run the registered diagnostics into ``findings`` and set ``verdict``.

    Args:
        ref: the reference dump (fp32).
        test: the test dump (a backend).
        expected: the CPU-QDQ dump of the same QDQ model and inputs: ``cmp.three_way`` gets the per-layer
            ratios ``err(test vs ref) / err(expected vs ref)`` (:mod:`ivq_debug.comparator.threeway`), the
            ``backend_divergence`` diagnostic reads them with ratio limit ``k`` (default
            ``defaults.BACKEND_DIVERGENCE_K``).
            Without ``expected`` and without declared budgets, when ``ref`` is the ORT CPU-QDQ capture of the QDQ
            model ``test`` ran on a backend (:func:`~ivq_debug.comparator.contract.backend_pair`), the backend
            check runs by default (``cmp.backend_check``: ``backend_divergence`` where a tensor departs from
            CPU-QDQ by more than ``defaults.BACKEND_CHECK_LSB_RMSE`` 8-bit steps rms and
            ``defaults.BACKEND_CHECK_MAX_SQNR_DB``).
        allow_input_mismatch: compare even when the dumps were not fed the same inputs (the contract,
            :mod:`ivq_debug.comparator.contract`); otherwise that raises :class:`~ivq_debug.errors.ContractError`
            before any metric.
        diagnose: run the diagnostics.
        fail_on: the finding severity that fails the verdict (``error``, ``warning``, ``never``).
        options: those of :func:`ivq_debug.comparator.compare` (``budgets``, ``rank_by``, ``mapping``,
            ``records``, ``only_records``, ``progress``, ``block_bytes``, ``workers``).
    """
    ref_d, test_d, exp_d, contract, exp_contract = contracted(ref, test, expected, allow_input_mismatch,
                                                              options.get("records"))
    return _compared(ref_d, test_d, exp_d, contract, exp_contract, k=k, diagnose=diagnose, fail_on=fail_on,
                     **options)


def contracted(ref: Dump | str | os.PathLike, test: Dump | str | os.PathLike,
                expected: Dump | str | os.PathLike | None, allow_input_mismatch: bool, records: Any
                ) -> tuple[Dump, Dump, Dump | None, Any, Any]:
    """:func:`compare`'s dumps opened and its input contracts checked (a broken one raises
    :class:`~ivq_debug.errors.ContractError` before any metric): ``(ref, test, expected, contract, its
    contract with expected)``."""
    ref_d = ref if isinstance(ref, Dump) else open_dump(ref)
    test_d = test if isinstance(test, Dump) else open_dump(test)
    exp_d = None if expected is None else expected if isinstance(expected, Dump) else open_dump(expected)
    check_common_records(ref_d, test_d, records=records)
    if exp_d is not None:
        check_common_records(ref_d, exp_d, sides=("ref", "expected"), records=records)
    contract = check_contract(ref_d, test_d, records=records)
    contract.allowed = allow_input_mismatch
    contract.raise_if_broken()
    exp_contract = None
    if exp_d is not None:
        exp_contract = check_contract(ref_d, exp_d, sides=("ref", "expected"), records=records)
        exp_contract.allowed = allow_input_mismatch
        exp_contract.raise_if_broken()
    return ref_d, test_d, exp_d, contract, exp_contract


def checked(cmp: comparator.Comparison, ref_d: Dump, test_d: Dump, contract: Any, *, budgets: Any = None,
            expected: bool = False) -> comparator.Comparison:
    """What :func:`compare` adds to the comparison of two dumps whose contract held (:func:`contracted`), and
    ``ivq diff`` of two models in memory too (:func:`ivq_debug.modeldiff.compare_models`): the contract, and the
    backend check when REF is TEST's QDQ model on CPU-QDQ (without budgets or an ``expected`` dump)."""
    cmp.contract = contract
    pair = backend_pair(ref_d, test_d) if not expected and not budgets else None
    if pair is not None:  # REF is TEST's QDQ model on CPU-QDQ: the backend check runs by default
        cmp.backend_check = {**pair, "lsb_rmse": defaults.BACKEND_CHECK_LSB_RMSE,
                             "max_sqnr_db": defaults.BACKEND_CHECK_MAX_SQNR_DB}
    return cmp


def _compared(ref_d: Dump, test_d: Dump, exp_d: Dump | None, contract: Any, exp_contract: Any, *, k: float | None,
              diagnose: bool, fail_on: str, **options: Any) -> comparator.Comparison:
    """:func:`compare` after its contracts (:func:`contracted`): the metrics, the three-way ratios, the
    diagnostics and the verdict."""
    cmp = comparator.compare(ref_d, test_d, **options)
    checked(cmp, ref_d, test_d, contract, budgets=options.get("budgets"), expected=exp_d is not None)
    if exp_d is not None:
        cmp.three_way = three_way(cmp, exp_d, k=k, progress=options.get("progress", False),
                                  block_bytes=options.get("block_bytes", defaults.COMPARE_BLOCK_BYTES),
                                  workers=options.get("workers"))
        cmp.three_way.contract = exp_contract
    if diagnose:
        cmp.findings.extend(run_diagnostics(cmp))
    cmp.verdict = build_verdict(cmp, fail_on=fail_on)
    return cmp


def capture(
    model: str | os.PathLike,
    inputs: Sequence[dict[str, Any] | str | os.PathLike],
    output: str | os.PathLike,
    *,
    backend: str = "onnx",
    part: str = "model",
    overwrite: bool = False,
    summary_only: bool = False,
    **options: Any,
) -> Path:
    """Capture every selected tensor of an ONNX model into a dump, one record per input sample.

    ``inputs``: feeds dicts, or ``.npz`` / ``.npy`` paths (read without pickles). ``backend``: a name of
    :data:`ivq_debug.capture.base.BACKENDS` (``onnx``, ``qnn``); ``options`` go to its runner (``selection``,
    ``optimization``, ``max_outputs_per_run``, ``soc_model``, ...; default: every tensor). Returns the dump path.
    """
    samples = [read_arrays(x) if isinstance(x, str | os.PathLike) else dict(x) for x in inputs]
    options.setdefault("selection", Selection())
    if "input_shapes" not in options:  # dynamic dims every sample agrees on are fixed (QNN: must be)
        options["input_shapes"] = sample_shapes(backend, model, samples, flag="inputs") or None
    runner = make_runner(backend, model, **options)
    return capture_runner(runner, samples, output, part=part, overwrite=overwrite, summary_only=summary_only,
                          model=model_facts(model, part))


def diagnose(
    ref: Dump | str | os.PathLike,
    test: Dump | str | os.PathLike,
    model: str | os.PathLike | Model,
    *,
    backend: str = "cpu",
    float_model: str | os.PathLike | Model | None = None,
    record: Any = None,
    nodes: Sequence[str] | None = None,
    attribution: str = "local",
    budget_sqnr_db: float | None = None,
    lift: bool = True,
    allow_input_mismatch: bool = False,
    executor: Executor | None = None,
    shards: str | os.PathLike | None = None,
    progress: bool = True,
    **runner_options: Any,
) -> ReplayResult:
    """Who introduced the error (``ivq diagnose``): the test dump's cumulative error per tensor (:func:`compare`,
    the input contract included), then each QDQ unit of ``model`` replayed alone on ``backend``
    (:func:`~ivq_debug.diagnose.replay.replay`).

    Args:
        ref: the float reference dump: the replay's inputs and targets.
        test: the free-running test dump of the same inputs: the cumulative error. Dumps fed different inputs
            raise :class:`~ivq_debug.errors.ContractError` (exit 6) unless ``allow_input_mismatch``.
        model: the QDQ model the test backend ran (a path or a loaded :class:`~ivq_debug.onnxgraph.load.Model`:
            the file is read once for every stage).
        backend: ``cpu`` (exact fake-quant at ``optimization="disable"``; another level runs the units as ORT
            fuses them) or ``qnn`` (QNN HTP); the shadow copies stay on the exact CPU path.
        float_model: the float model ``ref`` was captured from: its weights (lift, weight spreads) and, when units
            have no reference and the QDQ model was made by ORT's QNN flow, its preprocessed graph captured on
            ``ref``'s inputs as the reference (kept when its outputs equal the user's; ``result.note`` says which).
        record: the record(s) to replay: a key ``(sample, part, step)``, a record id, ``"all"``, or None (the first
            record whose inputs fit the model).
        nodes, attribution, budget_sqnr_db, lift, executor, shards, progress: those of
            :func:`~ivq_debug.diagnose.replay.replay`.
        runner_options: the backend's session options, as ``make_runner`` / ``ivq capture`` take them
            (``optimization``, ``session_config``; ``soc_model``, ``htp_arch``, ``allow_cpu_fallback``,
            ``qnn_cache``, ``fast_compile``).
    """
    if backend not in REPLAY_BACKENDS:
        raise UsageError(f"unknown replay backend {backend!r} ({', '.join(REPLAY_BACKENDS)})")
    factory = replay_factory(backend, **runner_options)
    # on the exact CPU path the comparison runs beside the replay: in a child forked before any file is open
    # (forked.py), else in a thread (_PendingComparison)
    child = (_ForkedComparison.start(ref, test, record, allow_input_mismatch)
             if factory is None and not isinstance(ref, Dump) and not isinstance(test, Dump) else None)
    try:
        return _diagnose(ref, test, model, factory, child, float_model=float_model, record=record, nodes=nodes,
                         attribution=attribution, budget_sqnr_db=budget_sqnr_db, lift=lift,
                         allow_input_mismatch=allow_input_mismatch, executor=executor, shards=shards,
                         progress=progress)
    finally:
        if child is not None:
            child.close()


def _diagnose(ref: Any, test: Any, model: Any, factory: Any, child: _ForkedComparison | None, *, float_model: Any,
              record: Any, nodes: Any, attribution: str, budget_sqnr_db: float | None, lift: bool,
              allow_input_mismatch: bool, executor: Executor | None, shards: Any, progress: bool) -> ReplayResult:
    """:func:`diagnose` once its runner factory is known and its comparison's child (if any) forked."""
    ref_d = ref if isinstance(ref, Dump) else open_dump(ref)
    test_d = test if isinstance(test, Dump) else open_dump(test)
    qdq = load(model)
    fmodel = load(float_model) if float_model is not None else None
    keys = _replayed(qdq, ref_d, test_d, record)
    only = _only(keys)

    def run(reference: Dump, allow: bool) -> ReplayResult:
        cmp_args = _cmp_args(only, allow)
        if factory is not None:  # another backend: the comparison first, then the replay
            cmp = compare(reference, test_d, **cmp_args)
            return replay(qdq, reference, record=record, runner_factory=factory, cumulative=cmp,
                          budget_sqnr_db=budget_sqnr_db, nodes=nodes, attribution=attribution, float_model=fmodel,
                          lift=lift, executor=executor, shards=shards, progress=progress)
        with ThreadPoolExecutor(1, thread_name_prefix="ivq-compare") as pool:
            cmp = (child.pending(reference, test_d, keys, allow) if child is not None and reference is ref_d else
                   _PendingComparison.start(pool, reference, test_d, **cmp_args))
            return replay(qdq, reference, record=record, runner_factory=factory, cumulative=cmp,
                          budget_sqnr_db=budget_sqnr_db, nodes=nodes, attribution=attribution, float_model=fmodel,
                          lift=lift, executor=executor, shards=shards, progress=progress)

    r = run(ref_d, allow_input_mismatch)
    if r.skipped and fmodel is not None:  # tensors neither the reference nor the lineage name: the preprocessing
        tmp = Path(tempfile.mkdtemp(prefix=".ivq-diagnose-", dir=qdq.folder))
        try:
            pre_ref, note = _preprocessed_reference(ref_d, fmodel, qdq, tmp)
            if pre_ref is not None:  # fed ref's own inputs: the contract is the one checked above
                r = run(pre_ref, True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        r.note = note
    return r


def _replayed(qdq: Model, ref_d: Dump, test_d: Dump, record: Any) -> set[Any] | None:
    """The records of the cumulative comparison: those the replay replays (the first record holding the model's
    inputs by default: a session dump's vision record for the vision part; every record with "all"), as keys
    ``(sample, part, step)``; None (every record) when the test dump has none of them."""
    keys = set(replay_records(qdq, ref_d, record))
    return keys if keys & set(test_d.record_keys()) else None


def _guessed(ref_d: Dump, test_d: Dump, record: Any) -> set[Any] | bool | None:
    """The records :func:`_replayed` most likely gives before the model is loaded: the first record (by default) or
    every record (``"all"``) of the reference, as :func:`~ivq_debug.diagnose.refs.record_ids` orders them (a part's
    model may hold its inputs only in later records: then :func:`_replayed` differs); False for a record named."""
    if record is not None and record != "all":
        return False
    keys = sorted(ref_d.record_keys(), key=lambda k: (k[0], k[2], k[1]))
    guess = set(keys[:1] if record is None else keys)
    return guess if guess & set(test_d.record_keys()) else None


def _only(keys: set[Any] | None) -> Any:
    """:func:`compare`'s ``records`` predicate of the replayed records ``keys`` (None: every record)."""
    return None if keys is None else keys.__contains__


def _cmp_args(only: Any, allow: bool) -> dict[str, Any]:
    """:func:`compare`'s options in :func:`diagnose` (the encoding fit is left to the replay, which reads it only
    when no unit breaks the budget)."""
    return dict(records=only, only_records=True, allow_input_mismatch=allow, diagnose=False, fit=False)


class _ForkedComparison:
    """The comparison of :func:`diagnose` in a forked child (:mod:`ivq_debug.forked`), forked at the start of
    :func:`diagnose`, only when this process runs no other thread (a lock another thread held would stay held in the
    child). The child opens the two dumps and, while the parent loads the model, compares them for the records the
    replay most likely replays (:func:`_guessed`: the first record by default, every record with ``"all"``); the
    parent then sends the records it replays (:func:`_replayed`). Each comparison sends its pairs once aligned,
    before its metrics (the parent keeps those of its records); the same records: the comparison made is sent;
    others: the child compares again for them (the value checks of the first alignment kept: ``align``'s
    ``memo``). The child checks the contract and compares as the thread of
    :class:`_PendingComparison` does; the comparison goes back without its dumps (the parent's are put back). So the
    alignment, the metrics and their imports run on the core the parent's own start leaves idle (``docs/scale.md``,
    eighth pass)."""

    def __init__(self, forked: Any) -> None:
        self.forked = forked
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # read from the start: a child blocked sending its pairs would not go on to their metrics
        threading.Thread(target=self._read, name="ivq-compare-child", daemon=True).start()

    def _read(self) -> None:
        """The child's messages into the inbox, to its comparison or its error (raised where it is read)."""
        try:
            while True:
                kind, value = self.forked.recv()
                self._inbox.put((kind, value))
                if kind == "comparison":
                    return
        except BaseException as e:
            self._inbox.put(("error", e))

    @classmethod
    def start(cls, ref: Any, test: Any, record: Any, allow: bool) -> _ForkedComparison | None:
        """The child comparing the dumps at ``ref`` and ``test`` for the replayed records of ``record``, or None (no
        fork on this platform, or other threads in this process)."""
        if threading.active_count() > 1:
            return None

        def compared(channel: Any) -> None:
            ref_d, test_d = open_dump(ref), open_dump(test)
            memo: dict[Any, Any] = {}

            def comparison(keys: set[Any] | None) -> Any:
                only = _only(keys)
                cmp_args = {k: v for k, v in _cmp_args(only, allow).items() if k != "allow_input_mismatch"}
                ref2, test2, _, contract, _ = contracted(ref_d, test_d, None, allow, only)

                def select(pairs: list[Any]) -> list[Any]:  # the pairs for these records, before any metric
                    channel.send("pairs", (keys, pairs))
                    return pairs

                cmp = _compared(ref2, test2, None, contract, None, k=None, fail_on=defaults.DIFF_FAIL_ON,
                                select=select, progress=False, memo=memo, **cmp_args)
                return dataclasses.replace(cmp, ref=None, test=None)

            guess, made = _guessed(ref_d, test_d, record), None
            if guess is not False:
                try:
                    made = comparison(guess)
                except Exception:  # (for other records it may hold: said when they are the ones replayed)
                    made = None
            _, keys = channel.recv()  # the replayed records (:func:`_replayed`)
            channel.send("comparison", comparison(keys) if made is None or keys != guess else made)

        forked = fork_call(compared)
        return cls(forked) if forked is not None else None

    def pending(self, ref_d: Dump, test_d: Dump, keys: set[Any] | None, allow: bool) -> _PendingComparison:
        """The comparison as :class:`_PendingComparison` gives it, read from the child in a thread, of the records
        ``keys`` (None: every record). The contract is checked here first (a broken one stops the diagnose before
        any replay, as the thread's does)."""
        only = _only(keys)
        contracted(ref_d, test_d, None, allow, only)
        self.forked.send("records", keys)
        fut: Future[Any] = Future()
        aligned = Event()
        pairs: list[Any] = []

        def follow() -> None:
            while True:
                kind, value = self._inbox.get()
                if kind == "pairs":  # the first for these records (a guess of other records: left)
                    if value[0] == keys and not aligned.is_set():
                        pairs.extend(value[1])
                        aligned.set()
                elif kind == "error":  # raised where the comparison is read
                    fut.set_exception(value)
                    return
                else:
                    value.ref, value.test = ref_d, test_d
                    fut.set_result(value)
                    return

        threading.Thread(target=follow, name="ivq-compare-pending", daemon=True).start()
        return _PendingComparison(fut, aligned, pairs, ref_d, test_d)

    def close(self) -> None:
        """End the child (done or not) and reap it."""
        self.forked.close()


class _PendingComparison:
    """The comparison of :func:`diagnose` on the exact CPU path, computed in a thread while the replay runs: its
    reference and test dumps at once, its aligned pairs (``alignment.pairs``) once aligned, every other attribute
    (``table``, ...) from the finished comparison, each waiting for it and raising what it raised. The input
    contract is checked before the thread starts (a broken one stops the diagnose before any replay). The replay
    links to the pairs only for a tensor the reference does not name (:class:`~ivq_debug.diagnose.refs.RefIndex`)
    and reads the table after its shadow and effect runs (``replay``), so the alignment and the pairs' metrics run
    beside them: on ``bench/bench_loop.py``'s 12-block ViT the alignment (0.4-0.8 s) and the 485 pairs' metrics
    (1.5-1.9 s of CPU) on the core ONNX Runtime's runs leave idle (``docs/scale.md``, fourth and fifth passes)."""

    def __init__(self, future: Any, aligned: Event, pairs: list[Any], ref: Dump, test: Dump) -> None:
        self._future = future
        self._aligned = aligned
        self._pairs = pairs
        self.ref, self.test = ref, test

    @classmethod
    def start(cls, pool: ThreadPoolExecutor, ref: Dump, test: Dump, *, allow_input_mismatch: bool = False,
              fail_on: str = defaults.DIFF_FAIL_ON, **options: Any) -> _PendingComparison:
        """:func:`compare` of ``ref`` and ``test`` (``diagnose``, ``records``, ...: its options): the contract
        checked here, the rest started on ``pool``."""
        ref_d, test_d, _, contract, _ = contracted(ref, test, None, allow_input_mismatch, options.get("records"))
        aligned = Event()
        pairs: list[Any] = []

        def select(p: list[Any]) -> list[Any]:
            pairs.extend(p)
            aligned.set()
            return p

        fut = pool.submit(_compared, ref_d, test_d, None, contract, None, k=None, fail_on=fail_on, select=select,
                          progress=False, **options)
        return cls(fut, aligned, pairs, ref_d, test_d)

    @property
    def alignment(self) -> Any:
        """The aligned pairs (``.pairs``), once aligned; what the comparison raised, when it ended before."""
        while not self._aligned.wait(0.02):
            if self._future.done():
                self._future.result()  # raises what it raised
                break
        return SimpleNamespace(pairs=self._pairs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._future.result(), name)


def replay_factory(backend: str, **options: Any) -> Any:
    """The replay's runner factory for ``backend`` (``cpu`` / ``qnn``) and its session options: None for the exact
    CPU path (``cpu`` with no option beyond ``optimization="disable"``), else ``make_runner`` with every option."""
    given = {k: v for k, v in options.items() if v is not None and not (k == "optimization" and v == "disable")}
    if backend == "cpu" and not given:
        return None
    return functools.partial(make_runner, REPLAY_BACKENDS[backend], **given)


def _preprocessed_reference(ref: Dump, float_model: Model, qdq: Model, folder: Path) -> tuple[Dump | None, str]:
    """The float model through the quantizer's preprocessing, captured on ``ref``'s inputs into ``folder``, when
    it is identified and its outputs equal the user's (``align.preprocess``); and what was done."""
    pre, how = quantizer_reference(float_model, qdq, folder)
    if pre is None or pre == float_model.path:
        return None, f"no preprocessed reference: {how}"
    feeds = [{e.name: ref.read(e) for e in ref.tensors(rid, kind="input")}
             for rid in ref.records.sort_values(["sample", "step"])["rid"]]
    pm = load(pre)
    with status("reference: the float model through the quantizer's preprocessing"):
        pre_ref = open_dump(capture_runner(make_runner("onnx", pm, selection=Selection()), feeds,
                                           folder / "reference.h5", progress=None))
    chk = check_outputs(ref, pre_ref, [o.name for o in pm.proto.graph.output])
    if not chk["ok"]:
        why = chk.get("why") or "max relative difference {:.2g}".format(chk["max_rel"])
        return None, f"preprocessed reference rejected ({why})"
    return pre_ref, (f"reference: {how}; its outputs equal the user's within {chk['max_rel']:.1e} "
                     f"(tolerance {chk['rtol']:g})")
