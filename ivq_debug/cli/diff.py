"""``ivq-diff``: compare two golden dumps for regression CI (contract: ``docs/cli.md``).

Exit codes: 0 pass · 1 a threshold or regression failed, or a finding at ``--fail-on`` severity (default:
error) · 2 usage error · 3 an input is unreadable or corrupt · 4 alignment left more unmatched tensors than
allowed. Errors are one line on stderr; the verdict line says why a run failed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ivq_debug import defaults
from ivq_debug.api import compare
from ivq_debug.cli.common import escape, run, write_json
from ivq_debug.cli.render import comparison_report
from ivq_debug.comparator import Budgets, regressions_against
from ivq_debug.console import results
from ivq_debug.diagnose.findings import SEVERITIES, Finding, severity_rank
from ivq_debug.dump import check_writable, open_dump
from ivq_debug.errors import EXIT_FAIL, EXIT_OK, InputError, UsageError
from ivq_debug.report import write_report

#: ``--fail-on`` choices: the lowest finding severity that fails the run (``never``: findings never fail)
FAIL_ON = ("error", "warning", "never")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise UsageError(message)


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """Thresholds and ranking (``ivq-diff``, ``ivq report``); parse with :meth:`Budgets.from_args`."""
    p.add_argument("--min-sqnr", type=float, metavar="DB", help="fail a tensor whose SQNR is below DB")
    p.add_argument("--min-cosine", type=float, metavar="C", help="fail a tensor whose cosine is below C")
    p.add_argument("--max-abs", type=float, metavar="X", help="fail a tensor whose max |t-r| exceeds X")
    p.add_argument("--budget", action="append", default=[], metavar="PATTERN:METRIC>=V",
                   help="per-name-pattern budget, e.g. '*lm_head*:sqnr_db>=20' (repeatable)")
    p.add_argument("--preset", choices=sorted(defaults.PRESETS), help="named threshold preset")
    p.add_argument("--rank-by", default=defaults.RANK_METRIC, metavar="METRIC", help="ranking metric")


def add_diff_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``ivq-diff`` (shared by ``ivq diff``)."""
    p.add_argument("ref", help="reference dump (.h5)")
    p.add_argument("test", help="test dump (.h5)")
    p.add_argument("--json", metavar="OUT", help="write the ivq-diff/1 JSON result ('-' for stdout)")
    p.add_argument("--report", metavar="OUT.html", help="write the self-contained HTML report")
    add_budget_arguments(p)
    p.add_argument("--baseline", metavar="PREV.json", help="fail only on regressions against this ivq-diff/1 result")
    p.add_argument("--top", type=int, default=defaults.TOP_N, metavar="N", help="worst layers to print")
    p.add_argument("--max-unmatched", default=None, metavar="N|F",
                   help="allowed unmatched tensors on the smaller side: a count, or a fraction < 1 "
                        f"(default {defaults.MAX_UNMATCHED_FRACTION})")
    p.add_argument("--map", metavar="MAP.json", help="explicit {ref_name: test_name} pairs")
    p.add_argument("--records", metavar="PARTS", help="only these parts, comma-separated (e.g. prefill,decode)")
    p.add_argument("--fail-on", choices=FAIL_ON, default=defaults.DIFF_FAIL_ON,
                   help="fail (exit 1) on findings of this severity or worse (default: error; with --baseline, "
                        "only findings the baseline did not have)")
    p.add_argument("--force", action="store_true", help="overwrite existing --json/--report outputs")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the verdict line")


def load_json(path: str, what: str) -> Any:
    """Read a JSON file; one-line :class:`InputError` naming it when missing or invalid."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"no such {what} file", p)
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"not valid JSON ({e.__class__.__name__}: line {getattr(e, 'lineno', '?')})", p) from None


def parse_allowance(value: str | None) -> int | float | None:
    """``--max-unmatched``: ``N`` (a count) or ``F`` with a decimal point (a fraction when < 1)."""
    if value is None:
        return None
    try:
        v = float(value)
    except ValueError:
        raise UsageError(f"--max-unmatched takes a count or a fraction, got {value!r}") from None
    if not v >= 0:
        raise UsageError("--max-unmatched must be >= 0")
    if "." in value and v < 1:
        return v  # a fraction of the smaller side
    return int(v) if v.is_integer() else v


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


def verdict_reasons(cmp: Any, failing: list[Finding]) -> list[str]:
    """Why a diff fails, one phrase per cause (empty: it passes)."""
    reasons = []
    if cmp.regressions is not None:
        if cmp.regressions:
            reasons.append(f"{len(cmp.regressions)} regression(s)")
    elif not cmp.passed:
        reasons.append(f"{cmp.summary['failed']} tensor(s) over budget")
    if failing:
        by_kind: dict[str, list[Finding]] = {}
        for f in failing:
            by_kind.setdefault(f.kind, []).append(f)
        parts = []
        for kind, fs in by_kind.items():
            rec = fs[0].where.get("record") or {}
            at = f" ({rec.get('part')} step {rec.get('step')})" if rec else ""
            parts.append(f"{kind}{at}" + (f" x{len(fs)}" if len(fs) > 1 else ""))
        sevs = sorted({f.severity for f in failing}, key=severity_rank, reverse=True)
        reasons.append(f"{len(failing)} {'/'.join(sevs)} finding(s): {', '.join(parts)}")
    return reasons


def execute_diff(args: argparse.Namespace) -> int:
    """Run a diff from parsed arguments; returns the exit code."""

    for out in (args.json, args.report):
        if out and out != "-":
            check_writable(out, args.force)
    budgets = Budgets.from_args(args.min_sqnr, args.min_cosine, args.max_abs, args.budget, args.preset)
    mapping = load_json(args.map, "mapping") if args.map else None
    baseline = load_json(args.baseline, "baseline") if args.baseline else None
    ref = open_dump(args.ref)
    test = open_dump(args.test)
    parts = set(args.records.split(",")) if args.records else None
    cmp = compare(ref, test, budgets=budgets, rank_by=args.rank_by, mapping=mapping,
                  records=(lambda k: k[1] in parts) if parts else None)
    if baseline is not None:
        cmp.regressions = regressions_against(cmp, baseline)
    allowance = parse_allowance(args.max_unmatched)
    fail_on = getattr(args, "fail_on", defaults.DIFF_FAIL_ON)
    failing = failing_findings(cmp.findings, fail_on, baseline)
    reasons = verdict_reasons(cmp, failing)
    if args.json:
        doc = cmp.to_json()
        doc["verdict"] = {"passed": not reasons, "fail_on": fail_on, "reasons": reasons,
                          "failing_findings": [f.kind for f in failing]}
        write_json(doc, args.json, overwrite=args.force)
    if args.report:

        write_report(cmp, args.report, overwrite=args.force)
    con = results(json_to_stdout=args.json == "-")
    if not args.quiet:
        for r in comparison_report(cmp, args.top):
            con.print(r)
    cmp.alignment.check(allowance)
    ok = not reasons
    con.print(("[bold green]PASS[/bold green]" if ok else f"[bold red]FAIL[/bold red] {escape('; '.join(reasons))}")
              + (f" · json: {args.json}" if args.json and args.json != "-" else "")
              + (f" · report: {args.report}" if args.report else ""))
    return EXIT_OK if ok else EXIT_FAIL


def _main(argv: list[str]) -> int:
    p = _Parser(prog="ivq-diff", description="Compare two golden dumps for regression CI (docs/cli.md).")
    add_diff_arguments(p)
    return execute_diff(p.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    raise SystemExit(run("ivq-diff", _main, argv))


if __name__ == "__main__":
    main()
