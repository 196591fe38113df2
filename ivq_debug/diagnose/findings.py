"""Findings: what the diagnostics conclude, as data.

Each finding has a stable ``kind`` (contract, see ``docs/findings.md``), a severity, where it is
(record, step, tensor), evidence numbers and a suggested action.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = (
    "first_divergence",
    "introduced_error",
    "accumulated_error",
    "projector_drift",
    "preprocess_mismatch",
    "position_id_offset",
    "mrope_layout",
    "deepstack_missing",
    "deepstack_misrouted",
    "saturation",
    "resolution_collapse",
    "cpu_fallback",
    "non_finite",
    "fp64_op",
    "token_divergence",
    "weight_range_spread",
    "replay_approximate",
    "platform_kernel",
    "backend_divergence",
)
SEVERITIES = ("info", "warning", "error")


@dataclass
class Finding:
    """One diagnostic conclusion."""

    kind: str
    severity: str
    message: str
    where: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    suggestion: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def severity_rank(sev: str) -> int:
    """0 for info … 2 for error."""
    return SEVERITIES.index(sev)
