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

from ivq_debug import comparator
from ivq_debug.capture.base import Selection, make_runner, model_facts, sample_shapes
from ivq_debug.capture.base import capture as capture_runner
from ivq_debug.diagnose import diagnose as run_diagnostics
from ivq_debug.dump import Dump
from ivq_debug.util import read_arrays


def compare(
    ref: Dump | str | os.PathLike,
    test: Dump | str | os.PathLike,
    *,
    diagnose: bool = True,
    **options: Any,
) -> comparator.Comparison:
    """Align two dumps, compute the pinned metrics of every pair and (``diagnose``) run the registered
    diagnostics into ``findings``.

    ``options`` are those of :func:`ivq_debug.comparator.compare` (``budgets``, ``rank_by``, ``mapping``,
    ``records``, ``progress``, ``block_bytes``, ``workers``).
    """
    cmp = comparator.compare(ref, test, **options)
    if diagnose:
        cmp.findings.extend(run_diagnostics(cmp))
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
