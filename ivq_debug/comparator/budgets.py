"""Thresholds ("budgets") that turn metrics into pass / fail.

A budget is ``metric >= value`` or ``metric <= value``, optionally for tensor names matching a glob
pattern. For one metric, the most specific matching pattern wins (longest pattern without wildcards
first), so ``--max-abs 0.02 --budget '*logits*:max_abs<=0.1'`` relaxes only the logits.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ivq_debug import defaults
from ivq_debug.errors import UsageError
from ivq_debug.metrics import HIGHER_IS_BETTER

_SPEC = re.compile(r"^(?P<pattern>.+):(?P<metric>[a-z_0-9]+)\s*(?P<op>>=|<=)\s*(?P<value>[-+0-9.eEinf]+)$")


@dataclass(frozen=True)
class Budget:
    """One threshold."""

    metric: str
    op: str  # "min" (metric >= value) or "max" (metric <= value)
    value: float
    pattern: str = "*"
    source: str = field(default="", compare=False)  # where it was declared (--min-sqnr, --preset export, --budget)

    def __post_init__(self) -> None:
        if self.metric not in HIGHER_IS_BETTER:
            raise UsageError(f"unknown metric {self.metric!r} in budget (known: {', '.join(HIGHER_IS_BETTER)})")
        if self.op not in ("min", "max"):
            raise UsageError(f"budget op must be 'min' or 'max', got {self.op!r}")

    def violated(self, value: float | None, status: str) -> bool:
        """True when a metric value breaks this budget.

        Identical and empty tensors never do; an undefined value (non-finite values, mismatched shapes,
        an all-zero reference with a non-zero error) always does; a metric that does not apply (``top1``
        on a non-logits tensor, ``lsb_rmse`` without an encoding) does not.
        """
        if status in ("identical", "empty"):
            return False
        if value is None:
            return status in ("non_finite", "shape_mismatch", "zero_norm")
        return value < self.value if self.op == "min" else value > self.value

    def describe(self) -> str:
        """``metric>=value`` text, with the pattern when it is not ``*``."""
        s = f"{self.metric}{'>=' if self.op == 'min' else '<='}{self.value:g}"
        return s if self.pattern == "*" else f"{self.pattern}:{s}"

    @staticmethod
    def parse(spec: str) -> Budget:
        """Parse ``PATTERN:METRIC>=VALUE`` or ``PATTERN:METRIC<=VALUE``."""
        m = _SPEC.match(spec.strip())
        if not m:
            raise UsageError(f"bad budget {spec!r}; expected PATTERN:METRIC>=VALUE or PATTERN:METRIC<=VALUE")
        try:
            value = float(m.group("value"))
        except ValueError:
            raise UsageError(f"bad number in budget {spec!r}") from None
        return Budget(m.group("metric"), "min" if m.group("op") == ">=" else "max", value, m.group("pattern"))


def _specificity(pattern: str) -> tuple[int, int]:
    wild = sum(pattern.count(c) for c in "*?[")
    return (-wild, len(pattern))


@dataclass
class Budgets:
    """A set of budgets; :meth:`check` returns the violated ones for a tensor."""

    items: list[Budget] = field(default_factory=list)

    @classmethod
    def from_args(
        cls,
        min_sqnr: float | None = None,
        min_cosine: float | None = None,
        max_abs: float | None = None,
        budgets: list[str] | None = None,
        preset: str | None = None,
    ) -> Budgets:
        """Build from CLI-style arguments (global thresholds, pattern budgets, a named preset)."""
        items: list[Budget] = []
        if preset:
            if preset not in defaults.PRESETS:
                raise UsageError(f"unknown preset {preset!r} (known: {', '.join(defaults.PRESETS)})")
            items += [Budget(m, op, v, source=f"--preset {preset}") for m, (op, v) in defaults.PRESETS[preset].items()]
        if min_sqnr is not None:
            items.append(Budget("sqnr_db", "min", min_sqnr, source="--min-sqnr"))
        if min_cosine is not None:
            items.append(Budget("cosine", "min", min_cosine, source="--min-cosine"))
        if max_abs is not None:
            items.append(Budget("max_abs", "max", max_abs, source="--max-abs"))
        items += [replace(Budget.parse(s), source="--budget") for s in budgets or []]
        return cls(items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def effective(self, name: str) -> list[Budget]:
        """The budgets that apply to ``name``: per metric, the most specific matching pattern."""
        best: dict[str, Budget] = {}
        for b in self.items:
            if not fnmatch.fnmatchcase(name, b.pattern):
                continue
            cur = best.get(b.metric)
            if cur is None or _specificity(b.pattern) > _specificity(cur.pattern):
                best[b.metric] = b
        return list(best.values())

    def check(self, name: str, metrics: dict[str, Any]) -> list[Budget]:
        """Budgets violated by a tensor's metrics."""
        status = metrics.get("status", "ok")
        return [b for b in self.effective(name) if b.violated(metrics.get(b.metric), status)]

    def describe(self) -> list[str]:
        """Text of every budget."""
        return [b.describe() for b in self.items]

    def applied(self) -> list[dict[str, Any]]:
        """Every budget as applied: metric, comparison, value, name pattern, where it was declared."""
        return [{"metric": b.metric, "op": ">=" if b.op == "min" else "<=", "value": b.value, "pattern": b.pattern,
                 "source": b.source or "api", "text": b.describe()} for b in self.items]
