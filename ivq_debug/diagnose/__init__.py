"""Diagnostics: small registered units that read a :class:`~ivq_debug.comparator.Comparison` and return findings.

Each unit is a :class:`Diagnostic`: the finding ``kind`` it emits (``docs/findings.md``), a ``rank`` (how telling
its finding is: a cause before a symptom; the headline of a comparison is its error finding of lowest rank) and
``run(cmp) -> list[Finding]``. :data:`DIAGNOSTICS` is the one list; :func:`diagnose` runs it. Adding a diagnostic
is a function and one line here. Units that need more than the comparison (the introduced-error replay needs the
QDQ model, :mod:`ivq_debug.diagnose.replay`) are listed with ``run=None`` so their findings still rank.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ivq_debug.diagnose.backend import backend_divergence
from ivq_debug.diagnose.basic import (
    cpu_fallback,
    first_divergence,
    fp64,
    merge_repeats,
    non_finite,
    token_divergence,
)
from ivq_debug.diagnose.deepstack import deepstack_findings
from ivq_debug.diagnose.findings import Finding, severity_rank
from ivq_debug.diagnose.hazards import resolution_collapse, saturation
from ivq_debug.diagnose.platform import platform_findings
from ivq_debug.diagnose.positions import position_findings
from ivq_debug.diagnose.preprocess import preprocess_findings
from ivq_debug.diagnose.projector import projector_findings
from ivq_debug.diagnose.rope_layout import mrope_layout_findings


@dataclass(frozen=True)
class Diagnostic:
    """One registered diagnostic."""

    kind: str
    rank: int
    run: Callable[[Any], list[Finding]] | None
    doc: str = ""
    also: tuple[str, ...] = ()  # other kinds this unit emits (registered with run=None)


def positions(cmp: Any) -> list[Finding]:
    """Position-id offsets of every sample's decode steps (direct, else inferred from the KV cache)."""
    samples = sorted({k[0] for k in cmp.test.record_keys()})
    return [f for s in samples for f in position_findings(cmp.ref, cmp.test, sample=s)]


def preprocess_findings_of(cmp: Any) -> list[Finding]:
    """Vision inputs that differ: range, normalization or resize."""
    return preprocess_findings(cmp.ref, cmp.test)


def deepstack(cmp: Any) -> list[Finding]:
    """DeepStack residual-stream jumps of the reference missing from the test or at another layer / rows."""
    return deepstack_findings(cmp.ref, cmp.test)


def mrope_layout(cmp: Any) -> list[Finding]:
    """The M-RoPE layout the test's prefill keys were rotated with, when it is not the model's."""
    return mrope_layout_findings(cmp.ref, cmp.test)


#: every diagnostic, most telling first (``rank``)
DIAGNOSTICS: tuple[Diagnostic, ...] = (
    Diagnostic("preprocess_mismatch", 0, preprocess_findings_of, "pixel values differ before the vision tower"),
    Diagnostic("projector_drift", 0, projector_findings, "the projector's error grows out of the vision tower's"),
    Diagnostic("position_id_offset", 1, positions, "decode positions differ from the model's rule"),
    Diagnostic("mrope_layout", 1, mrope_layout, "prefill keys rotated with another M-RoPE layout"),
    Diagnostic("deepstack_missing", 1, deepstack, "DeepStack features not added to the LLM",
               ("deepstack_misrouted",)),
    Diagnostic("deepstack_misrouted", 1, None, "DeepStack features added after another layer or at other rows "
               "(found by the deepstack_missing unit)"),
    Diagnostic("resolution_collapse", 2, resolution_collapse, "an encoding's step is coarser than the signal"),
    Diagnostic("cpu_fallback", 3, cpu_fallback, "QNN nodes that ran on the CPU"),
    Diagnostic("platform_kernel", 3, platform_findings, "kernels that differ between two platforms (same model)"),
    Diagnostic("backend_divergence", 4, backend_divergence,
               "layers where the backend departs from CPU-QDQ (ivq-diff --expected)"),
    Diagnostic("introduced_error", 5, None, "units that introduce the error (ivq diagnose: replay)"),
    Diagnostic("accumulated_error", 5, None, "no unit over budget, the output is: where the error accumulates "
               "(ivq diagnose: replay)"),
    Diagnostic("weight_range_spread", 6, None, "per-tensor weights whose channel ranges spread (needs the model)"),
    Diagnostic("saturation", 7, saturation, "values outside the encoding's range"),
    Diagnostic("non_finite", 8, non_finite, "NaN / Inf in a dump"),
    Diagnostic("fp64_op", 9, fp64, "float64 tensors (no QNN fp64 path)"),
    Diagnostic("token_divergence", 10, token_divergence, "the first step whose chosen token differs"),
    Diagnostic("first_divergence", 11, first_divergence, "the first tensor over the budgets"),
    Diagnostic("replay_approximate", 12, None, "replayed units the backend computes differently in the full graph"),
)
_RANK = {d.kind: d.rank for d in DIAGNOSTICS}


def rank_of(kind: str) -> int:
    """A finding kind's rank (lower = more telling)."""
    return _RANK.get(kind, len(_RANK))


def order(findings: Iterable[Finding]) -> list[Finding]:
    """Most severe first, then most telling (rank), stable otherwise."""
    return sorted(findings, key=lambda f: (-severity_rank(f.severity), rank_of(f.kind)))


def diagnose(cmp: Any, kinds: Iterable[str] | None = None) -> list[Finding]:
    """Run the registered diagnostics (``kinds``: only these) on a comparison; repeats merged, :func:`order`-ed."""
    want = set(kinds) if kinds is not None else None
    out: list[Finding] = []
    for d in DIAGNOSTICS:
        if d.run is not None and (want is None or want & {d.kind, *d.also}):
            out.extend(d.run(cmp))
    return order(merge_repeats(out))


def headline(findings: Iterable[Finding]) -> Finding | None:
    """The most telling of some findings (lowest rank; the first of equals)."""
    ranked = sorted(findings, key=lambda f: rank_of(f.kind))
    return ranked[0] if ranked else None


class _Package(types.ModuleType):
    """This package as ``ivq.diagnose``: importing a subpackage makes it the parent's attribute (``ivq_debug.diagnose``
    is then this module, not the lazily exported API function), so calling it is :func:`ivq_debug.api.diagnose`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """:func:`ivq_debug.api.diagnose` (resolved on call, as ``ivq_debug._LAZY`` does: the API imports this
        package)."""
        return importlib.import_module("ivq_debug.api").diagnose(*args, **kwargs)


sys.modules[__name__].__class__ = _Package

__all__ = ["DIAGNOSTICS", "Diagnostic", "Finding", "diagnose", "headline", "order", "rank_of"]
