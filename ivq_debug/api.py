"""The notebook API: the stages composed (capture -> dump -> align -> compare -> diagnose).

``import ivq_debug as ivq`` exposes these lazily (``ivq.compare``, ``ivq.capture``); each stage also has its own
module (:mod:`ivq_debug.capture.base`, :mod:`ivq_debug.comparator`, :mod:`ivq_debug.diagnose`) for callers that
want one stage alone. The CLI is a script of these calls.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ivq_debug import comparator, defaults
from ivq_debug.capture.base import Selection, make_runner, model_facts, sample_shapes
from ivq_debug.capture.base import capture as capture_runner
from ivq_debug.comparator.contract import backend_pair, check_common_records, check_contract
from ivq_debug.comparator.threeway import three_way
from ivq_debug.diagnose import diagnose as run_diagnostics
from ivq_debug.diagnose.verdict import build_verdict
from ivq_debug.dump import Dump, open_dump
from ivq_debug.util import read_arrays


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
            ``records``, ``progress``, ``block_bytes``, ``workers``).
    """
    ref_d = ref if isinstance(ref, Dump) else open_dump(ref)
    test_d = test if isinstance(test, Dump) else open_dump(test)
    exp_d = None if expected is None else expected if isinstance(expected, Dump) else open_dump(expected)
    records = options.get("records")
    check_common_records(ref_d, test_d, records=records)
    if exp_d is not None:
        check_common_records(ref_d, exp_d, sides=("ref", "expected"), records=records)
    contract = check_contract(ref_d, test_d, records=records)
    contract.allowed = allow_input_mismatch
    contract.raise_if_broken()
    if exp_d is not None:
        exp_contract = check_contract(ref_d, exp_d, sides=("ref", "expected"), records=records)
        exp_contract.allowed = allow_input_mismatch
        exp_contract.raise_if_broken()
    cmp = comparator.compare(ref_d, test_d, **options)
    cmp.contract = contract
    pair = backend_pair(ref_d, test_d) if exp_d is None and not options.get("budgets") else None
    if pair is not None:  # REF is TEST's QDQ model on CPU-QDQ: the backend check runs by default
        cmp.backend_check = {**pair, "lsb_rmse": defaults.BACKEND_CHECK_LSB_RMSE,
                             "max_sqnr_db": defaults.BACKEND_CHECK_MAX_SQNR_DB}
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
