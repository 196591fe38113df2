"""What every capture backend shares: the tensors to capture, the runner interface, the one capture loop, and
the registry of backends.

A backend is one folder under ``capture/`` (``onnxrt/``, ``qnn_ep/``, ``qnn_net_run/``, ``torch/``). Runner
backends are registered in :data:`BACKENDS`: ``ivq capture <backend>`` takes its choices from it and every
command that needs a runner calls :func:`make_runner`. :func:`capture` is the loop every capture goes through
(CLI, tuner, demo, API): a dump writer, one record per sample, the runner's info copied into the dump.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ivq_debug import defaults, interrupt
from ivq_debug.console import track
from ivq_debug.dump import DumpWriter
from ivq_debug.dump.contract import CONTRACT_META, host_platform, model_precision
from ivq_debug.errors import UsageError
from ivq_debug.inputfiles import sha256_file_once
from ivq_debug.onnxgraph import intake
from ivq_debug.onnxgraph.load import Model, load_model


@dataclass
class Selection:
    """Which tensors to capture.

    Args:
        include: glob patterns on tensor names / module paths (``*`` = everything).
        exclude: glob patterns to drop (applied after ``include``).
        op_types: only tensors produced by these op types / module classes (``None`` = any).
        exclude_op_types: drop tensors produced by these op types / module classes.
    """

    include: Sequence[str] = ("*",)
    exclude: Sequence[str] = ()
    op_types: Sequence[str] | None = None
    exclude_op_types: Sequence[str] = field(default_factory=tuple)
    skip_attention_probs: bool = False
    skip_views: bool = False

    def accepts(self, name: str, op_type: str | None = None) -> bool:
        """True when a tensor of this name and producer op type is selected.

        ``skip_attention_probs`` drops attention probabilities (ONNX ``Softmax`` outputs; the ``[1]`` output of
        torch attention modules): the largest tensors of a VLM (1.5 GiB per tile at InternVL2-2B scale) and
        rarely the culprit. ``skip_views`` drops outputs of ops that only move data (``defaults.VIEW_OPS``),
        byte-for-byte copies of their input.
        """
        if not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        if any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
            return False
        if self.skip_attention_probs and (op_type == "Softmax" or (name.endswith("[1]") and "atten" in name)):
            return False
        if self.skip_views and op_type is not None and op_type in defaults.VIEW_OPS:
            return False
        if self.op_types is not None and (op_type is None or op_type not in self.op_types):
            return False
        return not (op_type is not None and op_type in self.exclude_op_types)

    def filter(self, items: Iterable[tuple[str, str | None]]) -> list[str]:
        """Names of the ``(name, op_type)`` items this selection accepts."""
        return [n for n, t in items if self.accepts(n, t)]


class RecordSink(Protocol):
    """The writer methods a runner calls while it runs (a :class:`~ivq_debug.dump.DumpWriter` is one).

    The caller opens the record (``begin_record``); the runner adds the record's inputs and the tensors it
    captures, and the facts it learns while running (backend info, ``/meta`` values, tables).
    """

    @property
    def current_record(self) -> str | None:
        """The open record's id."""
        ...

    def has(self, name: str, kind: str = "tensor") -> bool:
        """Whether the current record already holds ``name`` (``kind``: ``tensor`` or ``input``)."""
        ...

    def add_input(self, name: str, value: Any, *, role: str | None = None, reason: str | None = None) -> None:
        """Store one of the record's model inputs (``role``: its contract role, :mod:`ivq_debug.dump.contract`)."""
        ...

    def add_tensor(self, name: str, value: Any, **facts: Any) -> None:
        """Store one captured tensor (``op_type``, ``order``, ``scope``, ``encoding``, ``raw``)."""
        ...

    def update_backend_info(self, **info: Any) -> None:
        """Merge keys into the dump's backend info."""
        ...

    def set_meta(self, name: str, value: Any) -> None:
        """Store a JSON value under ``/meta/<name>``."""
        ...

    def add_table(self, name: str, table: Any) -> None:
        """Store a small table (e.g. ``profiling``)."""
        ...


@runtime_checkable
class Runner(Protocol):
    """Runs one model part; optionally streams its intermediate tensors into a dump.

    ``run`` returns the model's own outputs by name. When ``writer`` is given, the runner writes its
    captured intermediate tensors into the writer's current record (the caller opens the record and
    stores the inputs it cares about).
    """

    backend: str
    info: dict[str, Any]

    def run(self, feeds: dict[str, np.ndarray], writer: RecordSink | None = None) -> dict[str, np.ndarray]: ...


class Closing:
    """Context-manager support for runners: ``with make_runner(...) as r:`` releases its sessions on exit."""

    def close(self) -> None:
        """Release what the runner holds (sessions)."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ the capture loop
def model_facts(model: str | os.PathLike, part: str = "model") -> dict[str, Any]:
    """What a dump records about the model file it captured: resolved path, SHA-256, part."""
    return {"path": str(Path(model).resolve()), "sha256": sha256_file_once(model), "part": part}


def run_identity(runner: Any, part: str = "model") -> dict[str, Any]:
    """The contract identity of a capture (``/meta/contract``, :mod:`ivq_debug.dump.contract`): per part, the
    model file that ran (path, SHA-256, precision), plus the backend and the host platform. A scheduler's (or a
    replay's) ``runners`` give one entry per part; a runner without a model file (torch) gives none."""
    subs = getattr(runner, "runners", None)
    items = subs.items() if isinstance(subs, Mapping) else [(part, runner)]
    models = {}
    for p, r in items:
        path = getattr(r, "model_path", None)
        inner = getattr(r, "ort", None) or getattr(r, "inner", None)
        source = getattr(r, "source", None) or getattr(inner, "source", None)
        if isinstance(source, Model) and source.path is None:  # built in memory: no file ran
            continue
        proto = getattr(r, "model", None)
        proto = proto if proto is not None else getattr(inner, "model", None)
        path = path if path is not None else getattr(inner, "model_path", None)
        if path is None or not Path(path).is_file():
            continue
        models[p] = {"path": str(Path(path).resolve()), "sha256": sha256_file_once(path),
                     "precision": model_precision(proto) if hasattr(proto, "graph") else None}
    return {"backend": getattr(runner, "backend", None), "models": models, "platform": host_platform()}


#: writes one sample into the open writer: ``(writer, index, sample)``
RecordFn = Callable[[DumpWriter, int, Any], None]


def capture(
    runner: Any,
    samples: Sequence[Any],
    path: str | os.PathLike,
    *,
    part: str = "model",
    model: Mapping[str, Any] | None = None,
    record: RecordFn | None = None,
    overwrite: bool = False,
    summary_only: bool = False,
    progress: str | None = "capturing",
) -> Path:
    """Capture ``samples`` with ``runner`` into a dump at ``path``; returns the path.

    Each sample becomes record ``(i, part, 0)`` through ``runner.run(sample, writer)`` (the sample is the feeds
    dict); pass ``record`` to write a sample otherwise (e.g. a scheduler's prefill and decode steps). The
    runner's ``backend`` names the dump and its ``info`` is the dump's backend info, copied again at the end
    (what the runner learned while running: sessions, partitions, exposure check). The dump appears under
    ``path`` only when complete (an exception leaves nothing behind).
    """
    def run_one(w: DumpWriter, i: int, sample: Any) -> None:
        w.begin_record(sample=i, part=part, step=0)
        runner.run(sample, w)

    write = record or run_one
    items = track(samples, progress, total=len(samples)) if progress else samples
    with DumpWriter(path, backend=runner.backend, backend_info=runner.info, model=dict(model or {}),
                    overwrite=overwrite, summary_only=summary_only) as w:
        for i, sample in enumerate(items):
            interrupt.raise_if_signalled()
            write(w, i, sample)
        w.update_backend_info(**runner.info)
        w.set_meta(CONTRACT_META, run_identity(runner, part))
    return Path(path)


# ------------------------------------------------------------------------------------------ backends
@dataclass(frozen=True)
class Backend:
    """A registered runner backend.

    Attributes:
        name: the CLI name (``ivq capture <name>``).
        help: one line for ``--help``.
        runner: ``"module:Class"`` of the runner (imported on use: backends load heavy libraries).
        options: keyword arguments beyond the common ones (``selection``, ``optimization``,
            ``max_outputs_per_run``, ``threads``, ``input_shapes``) that the runner accepts from the command line.
        static_shapes: the backend runs only static shapes (a dynamic input dim the samples do not fix is an
            error before any session is made).
    """

    name: str
    help: str
    runner: str
    options: tuple[str, ...] = ()
    static_shapes: bool = False

    def runner_class(self) -> type:
        """The runner class (imports its module)."""
        mod, cls = self.runner.split(":")
        return getattr(importlib.import_module(mod), cls)


#: runner backends by CLI name; add a backend here and it is a choice of ``ivq capture``
BACKENDS: dict[str, Backend] = {
    "onnx": Backend("onnx", "ONNX Runtime CPU EP (float or CPU-QDQ reference)",
                    "ivq_debug.capture.onnxrt.runner:OrtRunner",
                    ("partition", "exposure", "verify", "session_config")),
    "qnn": Backend("qnn", "QNN HTP via onnxruntime-qnn (Qualcomm's emulation on x86_64)",
                   "ivq_debug.capture.qnn_ep.runner:QnnHtpRunner",
                   ("exposure", "verify", "soc_model", "htp_arch", "allow_cpu_fallback", "profiling_level",
                    "profiling_path", "overwrite", "config", "require_bit_identical", "drop_unexposable",
                    "op_trace_dir", "json_graph_dir", "max_probes", "channels_last", "qnn_cache", "fast_compile"),
                   static_shapes=True),
}
_COMMON = ("selection", "optimization", "max_outputs_per_run", "threads", "input_shapes")


def make_runner(backend: str, model: str | os.PathLike | Model, **options: Any) -> Any:
    """A runner of a registered backend for ``model`` (a path, or a loaded :class:`~ivq_debug.onnxgraph.load.Model`:
    its proto goes to ONNX Runtime in memory, the file is not read again); ``None`` options are left at the
    runner's default.

    Raises:
        UsageError: unknown backend, or an option the backend does not take (named).
    """
    b = BACKENDS.get(backend)
    if b is None:
        raise UsageError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    given = {k: v for k, v in options.items() if v is not None}
    bad = sorted(set(given) - set(_COMMON) - set(b.options))
    if bad:
        raise UsageError(f"backend {backend!r} does not take {', '.join(bad)}")
    return b.runner_class()(model, **given)


def sample_shapes(backend: str, model: str | os.PathLike | Model, samples: Sequence[Mapping[str, Any]],
                  flag: str = "--inputs") -> dict[str, tuple[int, ...]]:
    """``input_shapes`` for a runner of ``backend`` on ``model`` from the samples it will run
    (:func:`ivq_debug.onnxgraph.intake.input_shapes`): dims every sample agrees on are fixed; on a backend with
    ``static_shapes`` a dim they leave open is a :class:`UsageError` naming the input, the axis and ``flag``."""
    b = BACKENDS.get(backend)
    if b is None:
        raise UsageError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    try:
        return intake.input_shapes(load_model(model), samples, required=b.static_shapes, flag=flag,
                                   why=f" ({b.name} runs static shapes only)" if b.static_shapes else "")
    except UsageError as e:
        raise UsageError(e.message, model.origin if isinstance(model, Model) else model) from None


def runner_factory(backend: str = "onnx", **options: Any) -> Callable[[str, str | os.PathLike], Any]:
    """A factory ``(part, model_path) -> runner`` for a split model's scheduler (every part on ``backend``).

    Pass ``selection=Selection()`` to capture every intermediate tensor into the dump; without it only the graph
    outputs are stored.
    """
    def factory(part: str, model_path: str | os.PathLike) -> Any:
        return make_runner(backend, model_path, **options)

    return factory
