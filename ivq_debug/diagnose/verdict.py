"""The verdict of a comparison: pass or fail, and why, in one sentence (terminal, JSON and report alike).

A run fails for one of these reasons, each named in the sentence:

- **threshold**: a tensor breaks a global threshold (``--min-sqnr``, ``--min-cosine``, ``--max-abs``, a
  ``--preset``);
- **budget**: a tensor breaks a per-name-pattern ``--budget``;
- **regression**: with ``--baseline``, a layer got worse than the stored result (this replaces the two above);
- **finding**: a finding at ``--fail-on`` severity or worse (default ``error``; with a baseline, only findings
  it did not hold);
- **contract**: the two sides were not fed the same inputs. ``ivq-diff`` stops on it before any metric (exit 6);
  a verdict with the mismatch allowed (``--allow-input-mismatch``) says so in its sentence.

Everything the verdict applied is echoed in :attr:`Verdict.applied` as declared (budgets with the flag that
declared them, the baseline and its tolerances, ``--fail-on``, the three-way ``k``), so a CI log shows which
threshold decided, not a default read elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ivq_debug import defaults
from ivq_debug.diagnose.findings import SEVERITIES, Finding, severity_rank

#: ``--fail-on`` choices: the lowest finding severity that fails the run (``never``: findings never fail)
FAIL_ON = ("error", "warning", "never")
#: reason kinds, in the order the sentence names them
REASONS = ("contract", "threshold", "budget", "regression", "finding")


def _finding_key(f: Finding | dict[str, Any]) -> tuple[Any, ...]:
    d = f if isinstance(f, dict) else f.to_dict()
    where = d.get("where") or {}
    return d.get("kind"), where.get("tensor"), where.get("node"), json.dumps(where.get("record"), sort_keys=True)


def failing_findings(findings: list[Finding], fail_on: str, baseline: dict[str, Any] | None = None) -> list[Finding]:
    """The findings that fail a run at ``fail_on`` (``error``, ``warning`` or ``never``); with a baseline
    ``ivq-diff/1`` document, only those it did not hold (same kind, tensor, node and record)."""
    if fail_on == "never":
        return []
    floor = SEVERITIES.index(fail_on)
    out = [f for f in findings if severity_rank(f.severity) >= floor]
    if baseline is not None:
        known = {_finding_key(f) for f in baseline.get("findings") or []}
        out = [f for f in out if _finding_key(f) not in known]
    return out


@dataclass
class Verdict:
    """Pass / fail and why (see the module docstring).

    Attributes:
        passed: the run passes.
        reasons: one ``{"kind", "text"}`` per cause (empty when it passes), kinds from :data:`REASONS`.
        notes: what the reader must know even on a pass (contract unknown, inputs allowed to differ, nothing
            declared to check).
        applied: every threshold as applied (see the module docstring).
        failing_findings: kinds of the findings that fail the run.
        contract: the contract status (``ok``, ``broken``, ``unknown``; ``None`` when not checked).
    """

    passed: bool
    reasons: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    applied: dict[str, Any] = field(default_factory=dict)
    failing_findings: list[str] = field(default_factory=list)
    contract: str | None = None

    @property
    def sentence(self) -> str:
        """Why, in one sentence."""
        if not self.passed:
            body = "; ".join(r["text"] for r in self.reasons)
        else:
            body = self.applied.get("checked") or "nothing failed"
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{body}{notes}"

    def line(self) -> str:
        """``PASS: <sentence>`` or ``FAIL: <sentence>``."""
        return f"{'PASS' if self.passed else 'FAIL'}: {self.sentence}"

    def to_dict(self) -> dict[str, Any]:
        """The ``verdict`` block of ``ivq-diff/1``."""
        return {"passed": self.passed, "line": self.line(), "sentence": self.sentence,
                "reasons": [r["text"] for r in self.reasons], "reason_kinds": [r["kind"] for r in self.reasons],
                "notes": self.notes, "fail_on": self.applied.get("fail_on"), "failing_findings": self.failing_findings,
                "contract": self.contract, "applied": self.applied}


def _first_over(cmp: Any, text: str) -> str:
    t = cmp.table
    hit = t[t["violations"].map(lambda v: text in v)] if len(t) else t
    if hit.empty:
        return ""
    r = hit.iloc[0]
    return f", first {r['ref_name']} ({r['part']} step {int(r['step'])})"


def _budget_reasons(cmp: Any) -> list[dict[str, str]]:
    counts: dict[str, int] = {}
    for v in cmp.table["violations"] if len(cmp.table) else []:
        for text in v:
            counts[text] = counts.get(text, 0) + 1
    out = []
    for b in cmp.budgets.items:
        n = counts.pop(b.describe(), 0)
        if n:
            kind = "threshold" if b.pattern == "*" else "budget"
            src = f" ({b.source})" if b.source else ""
            out.append({"kind": kind, "text": f"{n} tensor(s) break the {kind} {b.describe()}{src}"
                                              f"{_first_over(cmp, b.describe())}"})
    return out


def _finding_reason(failing: list[Finding]) -> dict[str, str]:
    by_kind: dict[str, list[Finding]] = {}
    for f in failing:
        by_kind.setdefault(f.kind, []).append(f)
    parts = []
    for kind, fs in by_kind.items():
        w = fs[0].where or {}
        rec = w.get("record") or {}
        at = f" at {w['tensor']}" if w.get("tensor") and kind in ("backend_divergence", "first_divergence") else ""
        loc = f" ({rec.get('part')} step {rec.get('step')})" if rec else ""
        parts.append(f"{kind}{at}{loc}" + (f" x{len(fs)}" if len(fs) > 1 else ""))
    sevs = sorted({f.severity for f in failing}, key=severity_rank, reverse=True)
    return {"kind": "finding", "text": f"{len(failing)} {'/'.join(sevs)} finding(s): {', '.join(parts)}"}


def build_verdict(cmp: Any, *, fail_on: str = defaults.DIFF_FAIL_ON, baseline: dict[str, Any] | None = None,
                  baseline_path: str | None = None, max_unmatched: Any = None) -> Verdict:
    """The verdict of a comparison (with its findings, contract, three-way and regressions already computed)."""
    if fail_on not in FAIL_ON:
        raise ValueError(f"fail_on must be one of {FAIL_ON}, got {fail_on!r}")
    reasons: list[dict[str, str]] = []
    notes: list[str] = []
    contract = getattr(cmp, "contract", None)
    if contract is not None:
        if contract.status == "broken" and not contract.allowed:
            reasons.append({"kind": "contract", "text": contract.line()})
        elif contract.status == "broken":
            notes.append("inputs differ, compared anyway (--allow-input-mismatch): " + contract.line())
    tw = getattr(cmp, "three_way", None)
    exp = tw.contract if tw is not None else None
    if exp is not None and exp.status == "broken":
        notes.append("expected side inputs differ, compared anyway (--allow-input-mismatch): " + exp.line())
    for c in (contract, exp):
        for w in (getattr(c, "warnings", None) or []) if c is not None else []:
            notes.append(w)
    unknown = [c.sides[1] for c in (contract, exp) if c is not None and c.status == "unknown"]
    if unknown:
        notes.append(f"contract unknown for {' and '.join(unknown)} (a dump lists no input digests): inputs not checked")
    if cmp.regressions is not None:
        if cmp.regressions:
            r0 = cmp.regressions[0]
            reasons.append({"kind": "regression", "text": f"{len(cmp.regressions)} layer(s) regressed against the "
                            f"baseline {baseline_path or ''}".rstrip() + f", first {r0['ref_name']}: "
                            f"{'; '.join(r0['reasons'])}"})
    else:
        reasons += _budget_reasons(cmp)
    failing = failing_findings(cmp.findings, fail_on, baseline)
    if failing:
        reasons.append(_finding_reason(failing))
    checked = []
    if cmp.regressions is not None:
        checked.append(f"no regression against the baseline {baseline_path or ''}".rstrip())
    elif cmp.budgets:
        checked.append(f"{len(cmp.table)} tensor(s) within {', '.join(cmp.budgets.describe())}")
    elif getattr(cmp, "backend_check", None):
        bc = cmp.backend_check
        checked.append(f"backend check against the CPU-QDQ reference (no tensor over {bc['lsb_rmse']:g} 8-bit "
                       f"steps rms below {bc['max_sqnr_db']:g} dB)")
    else:
        checked.append("no threshold, budget or baseline declared")
    checked.append("no finding at --fail-on " + fail_on if fail_on != "never" else "findings not judged (--fail-on never)")
    applied = {
        "checked": ", ".join(checked),
        "budgets": cmp.budgets.applied(),
        "divergence_sqnr_db": None if cmp.budgets else defaults.DIVERGENCE_SQNR_DB,
        "baseline": None if cmp.regressions is None else {
            "path": baseline_path, "metric": cmp.rank_by, "tol_db": defaults.REGRESSION_TOL_DB,
            "tol_rel": defaults.REGRESSION_TOL_REL},
        "fail_on": fail_on,
        "three_way": None if tw is None else {
            "expected": str(tw.expected.path), "k": tw.k, "error_ratio": defaults.BACKEND_DIVERGENCE_ERROR_RATIO,
            "min_rel_err": defaults.BACKEND_DIVERGENCE_MIN_REL_L2},
        "backend_check": getattr(cmp, "backend_check", None),
        "allow_input_mismatch": bool(contract.allowed) if contract is not None else None,
        "rank_by": cmp.rank_by,
        "max_unmatched": max_unmatched,
    }
    return Verdict(not reasons, reasons, notes, applied, [f.kind for f in failing],
                   None if contract is None else contract.status)
