"""The programmatic entry of the reference story (used by ``ivq demo``).

::

    from ivq_debug.vlm import pipeline
    prep = pipeline.prepare("internvl-tiny", "work/", bucket=112, exporter="legacy")
    prep.paths        # {"vision": …/vision_b112.onnx, "prefill": …, "decode": …}
    sched = pipeline.scheduler(prep)                       # ORT CPU fp32, correct positions
    pipeline.evaluate(sched, prep.samples).exact_match     # caption accuracy
    feeds = pipeline.calibration_feeds(prep)               # per-part feeds for QDQ calibration
    sched_qnn = pipeline.scheduler(prep, runner_factory=my_htp_factory)   # same loop, other backend
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.errors import UsageError
from ivq_debug.vlm.build import DEFAULT_BUCKET, family
from ivq_debug.vlm.export import DEFAULT_EXPORTER, ExportResult, export_parts
from ivq_debug.vlm.load import load_vlm
from ivq_debug.vlm.manifest import model_attrs
from ivq_debug.vlm.scheduler import PositionsPolicy, Scheduler, collect_feeds, evaluate
from ivq_debug.vlm.task import CaptionAccuracy, Sample, eval_set, make_samples
from ivq_debug.vlm.torch_generate import torch_scheduler

__all__ = ["Prepared", "calibration_feeds", "capture_run", "evaluate", "prepare", "scheduler", "torch_reference"]


@dataclass
class Prepared:
    """An exported reference model ready to schedule."""

    model_name: str
    folder: Path
    bucket: int
    exporter: str
    export: ExportResult
    samples: list[Sample]
    loaded: Any = None  # the LoadedVLM (torch model) it was exported from
    paths: dict[str, Path] = field(default_factory=dict)  # part -> ONNX graph


def prepare(
    model: str | os.PathLike = "internvl-tiny",
    workdir: str | os.PathLike = "ivq-work",
    bucket: int = DEFAULT_BUCKET,
    exporter: str = DEFAULT_EXPORTER,
    n_samples: int = 16,
    verify: bool = True,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    variants: Sequence[str] | str = (),
) -> Prepared:
    """Load ``model``, export its three parts for ``bucket`` into ``workdir/<name>-<exporter>/``.

    Returns the part paths, the export checks and ``n_samples`` samples of the fixed eval set.
    ``variants`` adds fault-variant graphs (``"mrope_sectioned"``; see :func:`export_parts`); ``"auto"``: the
    ones the model's family has (the sectioned prefill of an interleaved M-RoPE model).
    """

    loaded = load_vlm(model, trust_remote_code=trust_remote_code)
    if isinstance(variants, str):
        if variants != "auto":
            raise UsageError(f"variants takes a list of variant names or 'auto', got {variants!r}")
        variants = ("mrope_sectioned",) if family(loaded.model).mrope_layout == "interleaved" else ()
    name = Path(os.fspath(model)).name
    folder = Path(workdir) / f"{name}-{exporter}-b{bucket}"
    res = export_parts(
        loaded.model, folder, buckets=[bucket], exporter=exporter, verify=verify, overwrite=overwrite,
        model_id=os.fspath(model), variants=variants,
    )
    paths = {p.part: Path(p.path) for p in res.parts if p.variant is None}
    return Prepared(os.fspath(model), folder, bucket, exporter, res, eval_set(bucket, n_samples), loaded, paths)


def scheduler(
    prepared: Prepared, runner_factory: Callable[[str, Any], Any] | None = None,
    positions: PositionsPolicy | str = "correct", max_new_tokens: int | None = None, **knobs: Any,
) -> Scheduler:
    """A :class:`Scheduler` over the prepared export (default runners: ORT CPU fp32).

    ``knobs``: ``deepstack=`` / ``mrope_layout=`` of :meth:`Scheduler.from_export`.
    """
    return Scheduler.from_export(prepared.folder, prepared.bucket, runner_factory, positions, max_new_tokens, **knobs)


def torch_reference(prepared: Prepared, positions: PositionsPolicy | str = "correct", **kw: Any) -> Scheduler:
    """The torch scheduler of the prepared model (same loop and record keys as ORT)."""

    return torch_scheduler(prepared.loaded.model, prepared.bucket, positions, **kw)


def calibration_feeds(
    prepared: Prepared, n_samples: int = 8, seed: int = 99, forced: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Realistic per-part feeds for QDQ calibration: ``n_samples`` task images (disjoint seed from the
    eval set) run through the fp32 ORT scheduler; ``{"vision": [...], "prefill": [...], "decode": [...]}``."""

    return collect_feeds(scheduler(prepared), make_samples(n_samples, prepared.bucket, seed), forced)


def evaluate_samples(sched: Scheduler, samples: Sequence[Sample], writer: Any = None) -> CaptionAccuracy:
    """Alias of :func:`ivq_debug.vlm.scheduler.evaluate`."""
    return evaluate(sched, samples, writer)


def capture_run(
    folder: str | os.PathLike, bucket: int, images: Sequence[Any], path: str | os.PathLike, *,
    forced: Sequence[Sequence[int]] | None = None, runner_factory: Callable[[str, Any], Any] | None = None,
    overwrite: bool = False, **knobs: Any,
) -> Path:
    """Capture every tensor of a scheduled generation per image (ORT CPU by default) into the dump ``path``.

    ``forced``: per image, the tokens to teacher-force (e.g. a clean run's, so the steps of a faulty run
    compare with it); ``knobs``: the scheduler's fault knobs (``positions=``, ``deepstack=``,
    ``mrope_layout=``). The dump's model attributes are the export's (:func:`~ivq_debug.vlm.manifest.model_attrs`:
    the HF config the diagnostics read).
    """
    def ort(part: str, p: Any) -> Any:
        return make_runner("onnx", p, selection=Selection())

    sched = Scheduler.from_export(folder, bucket, runner_factory or ort, **knobs)

    def record(w: Any, i: int, image: Any) -> None:
        sched.generate(image, sample=i, writer=w, forced_tokens=forced[i] if forced is not None else None)

    return capture(sched, list(images), path, model=model_attrs(folder), record=record, overwrite=overwrite,
                   progress=None)
