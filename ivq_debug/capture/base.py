"""What every capture backend shares: the selection of tensors to capture and the runner interface."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


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
        if self.skip_views and op_type is not None:
            from ivq_debug.defaults import VIEW_OPS

            if op_type in VIEW_OPS:
                return False
        if self.op_types is not None and (op_type is None or op_type not in self.op_types):
            return False
        return not (op_type is not None and op_type in self.exclude_op_types)

    def filter(self, items: Iterable[tuple[str, str | None]]) -> list[str]:
        """Names of the ``(name, op_type)`` items this selection accepts."""
        return [n for n, t in items if self.accepts(n, t)]


@runtime_checkable
class Runner(Protocol):
    """Runs one model part; optionally streams its intermediate tensors into a dump.

    ``run`` returns the model's own outputs by name. When ``writer`` is given, the runner writes its
    captured intermediate tensors into the writer's current record (the caller opens the record and
    stores the inputs it cares about).
    """

    backend: str
    info: dict[str, Any]

    def run(self, feeds: dict[str, np.ndarray], writer: Any = None) -> dict[str, np.ndarray]: ...
