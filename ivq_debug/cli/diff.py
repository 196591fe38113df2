"""``ivq-diff``: compare two golden dumps for regression CI (contract: ``docs/cli.md``); given two ONNX models and
``--inputs`` instead, run both and compare them in memory (:mod:`ivq_debug.modeldiff`: the same document as
``ivq capture onnx`` ×2 + ``ivq-diff``, no dump written).

Exit codes: 0 pass · 1 a threshold or regression failed, or a finding at ``--fail-on`` severity (default:
error) · 2 usage error · 3 an input is unreadable or corrupt (a dump, a model, an ``--inputs`` file, a sample the
model refuses) · 4 alignment left more unmatched tensors than allowed · 6 contract: the dumps were not fed the same
inputs (checked before any metric; ``--allow-input-mismatch`` compares anyway). Errors are one line on stderr; the
verdict line says why a run passed or failed (:mod:`ivq_debug.diagnose.verdict`).
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from ivq_debug import __version__, defaults
from ivq_debug.api import compare
from ivq_debug.arrays import read_arrays
from ivq_debug.cli import cmd_capture
from ivq_debug.cli.common import check_args, comma_list, escape, exit_with, write_json
from ivq_debug.cli.render import FORMATS, comparison_report, emit, print_line, resolve_format
from ivq_debug.comparator import Budgets, Comparison, regressions_against
from ivq_debug.console import results
from ivq_debug.diagnose.verdict import FAIL_ON, build_verdict, failing_findings
from ivq_debug.dump import open_dump
from ivq_debug.errors import EXIT_FAIL, EXIT_OK, AlignmentError, UsageError
from ivq_debug.modeldiff import compare_models
from ivq_debug.report import write_report
from ivq_debug.validate import read_baseline, read_name_map

__all__ = ["FAIL_ON", "add_budget_arguments", "add_diff_arguments", "execute_diff", "failing_findings", "main"]


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
    p.add_argument("--rank-by", default=None, metavar="METRIC",
                   help=f"ranking metric (default: {defaults.RANK_METRIC_QUANTIZED} when both dumps are quantized, "
                        f"else {defaults.RANK_METRIC}; docs/metrics.md)")


def add_diff_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``ivq-diff`` (shared by ``ivq diff``)."""
    p.add_argument("ref", help="reference dump (.h5), or a model (.onnx) with --inputs")
    p.add_argument("test", help="test dump (.h5), or a model (.onnx) with --inputs")
    p.add_argument("--inputs", action="append", default=None, metavar="X.npz",
                   help="with two models (.onnx): the inputs both run, as `ivq capture onnx --inputs` takes them "
                        "(one .npz per sample, repeat for several); each sample runs on both and is compared in "
                        "memory, no dump written (the same result as the two captures and their diff)")
    p.add_argument("--part", default=None, help="with two models: the record part name (default model)")
    p.add_argument("--json", metavar="OUT", help="write the ivq-diff/1 JSON result ('-' for stdout)")
    p.add_argument("--report", metavar="OUT.html", help="write the self-contained HTML report")
    add_budget_arguments(p)
    p.add_argument("--baseline", metavar="PREV.json", help="fail only on regressions against this ivq-diff/1 result")
    p.add_argument("--expected", metavar="CPUQDQ.h5",
                   help="the CPU-QDQ dump of the same inputs: per-layer ratio of TEST's error to its error "
                        "(backend_divergence, docs/findings.md)")
    p.add_argument("--max-ratio", type=float, metavar="K",
                   help=f"with --expected: a layer departs when its error ratio exceeds K "
                        f"(default {defaults.BACKEND_DIVERGENCE_K})")
    p.add_argument("--allow-input-mismatch", action="store_true",
                   help="compare even when the dumps were not fed the same inputs (else exit 6); every layer "
                        "row then says so")
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
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="table (default on a terminal: fits its width, long names shortened in the middle), tsv "
                        "(default when piped: one row per line, names whole) or json (the ivq-diff/1 document on "
                        "stdout, as --json -); the verdict is the last line in table and tsv")


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


def two_models(args: argparse.Namespace) -> bool:
    """True when REF and TEST are ONNX models (compared in memory on ``--inputs``), False for two dumps;
    :class:`UsageError` for one of each, or for model-only flags given with dumps."""
    models = [str(p).lower().endswith(".onnx") for p in (args.ref, args.test)]
    if models[0] != models[1]:
        raise UsageError("give two dumps (.h5) or two models (.onnx), not one of each")
    if not models[0]:
        for flag, given in (("--inputs", getattr(args, "inputs", None)), ("--part", getattr(args, "part", None))):
            if given:
                raise UsageError(f"{flag} applies to two models (.onnx); dumps hold their inputs")
        return False
    if not getattr(args, "inputs", None):
        raise UsageError("two models (.onnx) are compared on --inputs X.npz (one per sample)")
    if getattr(args, "expected", None):
        raise UsageError("--expected reads the reference's values of every record after the comparison: capture "
                         "the dumps (ivq capture onnx ... -o) and diff those")
    return True


def models_comparison(args: argparse.Namespace, budgets: Budgets, mapping: dict[str, str] | None,
                      records: Any) -> Comparison:
    """Two models run on ``--inputs`` and compared in memory (:func:`ivq_debug.modeldiff.compare_models`), each
    run as ``ivq capture onnx MODEL --inputs …`` runs it (that command's runner options at their defaults)."""
    cap = _Parser(prog="ivq capture")
    cmd_capture.add_arguments(cap, "capture")
    defaults_ns = cap.parse_args(["onnx", args.ref, "--inputs", args.inputs[0], "-o", "unused.h5"])
    samples = [read_arrays(p) for p in args.inputs]
    return compare_models(args.ref, args.test, samples, sources=args.inputs, part=args.part or "model",
                          options=cmd_capture.runner_options(defaults_ns), budgets=budgets, rank_by=args.rank_by,
                          mapping=mapping, records=records,
                          allow_input_mismatch=getattr(args, "allow_input_mismatch", False))


def execute_diff(args: argparse.Namespace) -> int:
    """Run a diff from parsed arguments; returns the exit code."""
    budgets = Budgets.from_args(args.min_sqnr, args.min_cosine, args.max_abs, args.budget, args.preset)
    mapping = read_name_map(args.map) if args.map else None
    baseline = read_baseline(args.baseline) if args.baseline else None
    if getattr(args, "max_ratio", None) is not None and not args.max_ratio > 0:
        raise UsageError("--max-ratio must be > 0")
    parts = set(comma_list(args.records, "--records") or []) or None
    fail_on = getattr(args, "fail_on", defaults.DIFF_FAIL_ON)
    records = (lambda k: k[1] in parts) if parts else None
    if two_models(args):
        cmp = models_comparison(args, budgets, mapping, records)
    else:
        expected = open_dump(args.expected) if getattr(args, "expected", None) else None
        cmp = compare(open_dump(args.ref), open_dump(args.test), budgets=budgets, rank_by=args.rank_by,
                      mapping=mapping, records=records, expected=expected, k=getattr(args, "max_ratio", None),
                      allow_input_mismatch=getattr(args, "allow_input_mismatch", False), fail_on=fail_on)
    if baseline is not None:
        cmp.regressions = regressions_against(cmp, baseline)
    allowance = parse_allowance(args.max_unmatched)
    verdict = cmp.verdict = build_verdict(cmp, fail_on=fail_on, baseline=baseline, baseline_path=args.baseline,
                                          max_unmatched=args.max_unmatched)
    fmt = getattr(args, "format", None)
    json_out = "-" if fmt == "json" and not args.json else args.json
    if json_out:
        write_json(cmp.to_json(), json_out, overwrite=args.force)
    if fmt == "json" and args.json and args.json != "-":
        write_json(cmp.to_json(), "-")
    if args.report:
        write_report(cmp, args.report, overwrite=args.force)
    to_stdout = json_out == "-" or fmt == "json"
    con = results(json_to_stdout=to_stdout)
    if not args.quiet:
        emit(con, comparison_report(cmp, args.top), resolve_format(None if fmt == "json" else fmt, con))
    try:
        cmp.alignment.check(allowance)
    except AlignmentError as e:  # the verdict is still the last line of the results
        print_line(con, f"[bold red]FAIL[/bold red]: {escape(e.one_line())}")
        raise
    tw = cmp.three_way
    if tw is not None and cmp.alignment.pairs and not len(tw.table):  # the policy of zero REF/TEST pairs
        e = AlignmentError(f"the --expected dump holds none of the {len(cmp.alignment.pairs)} compared tensors "
                           f"({len(tw.missing)} missing: a dump of another model?); the three-way check compared "
                           f"nothing", args.expected)
        print_line(con, f"[bold red]FAIL[/bold red]: {escape(e.one_line())}")
        raise e
    ok = verdict.passed
    print_line(con, ("[bold green]PASS[/bold green]: " if ok else "[bold red]FAIL[/bold red]: ")
               + escape(verdict.sentence)
               + (f" · json: {escape(args.json)}" if args.json and args.json != "-" else "")
               + (f" · report: {escape(args.report)}" if args.report else ""))
    return EXIT_OK if ok else EXIT_FAIL


def _main(argv: list[str]) -> int:
    p = _Parser(prog="ivq-diff", description="Compare two golden dumps for regression CI, or two ONNX models run on "
                                             "--inputs in memory (docs/cli.md).")
    p.add_argument("--version", action="version", version=f"ivq-debug {__version__}")
    add_diff_arguments(p)
    args = p.parse_args(argv)
    check_args(args, "diff")  # the check of every writer (cli.main runs it for `ivq diff`)
    return execute_diff(args)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point (:func:`~ivq_debug.cli.common.exit_with`)."""
    exit_with("ivq-diff", _main, argv)


if __name__ == "__main__":
    main()
