"""``ivq report REF.h5 TEST.h5 -o OUT.html``: the self-contained HTML report, plus optional exports.

Exports: ``--perfetto`` (the QNN profiling timeline as Chrome / Perfetto trace JSON), ``--model-explorer``
(per-tensor error as Model Explorer node data), ``--junit`` (JUnit XML of the budget checks). Budgets are
those of ``ivq-diff``. Exit 0 when everything was written (``--check``: 1 when a tensor breaks a budget,
like ``ivq-diff``); 2 usage, 3 unreadable input.
"""

from __future__ import annotations

import argparse

from ivq_debug.api import compare
from ivq_debug.capture.base import make_runner
from ivq_debug.cli.common import comma_list, escape
from ivq_debug.cli.diff import add_budget_arguments
from ivq_debug.comparator import Budgets
from ivq_debug.console import results
from ivq_debug.diagnose.replay import replay
from ivq_debug.dump import open_dump
from ivq_debug.errors import EXIT_FAIL, EXIT_OK, UsageError
from ivq_debug.metrics import METRICS
from ivq_debug.qnn.profiling import profiling_tables
from ivq_debug.report import write_junit, write_model_explorer, write_perfetto, write_report
from ivq_debug.report.html import comparison_label
from ivq_debug.validate import check_model, read_name_map


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq report``."""
    p.add_argument("ref", help="reference dump (.h5)")
    p.add_argument("test", help="test dump (.h5); its profiling table feeds the timeline")
    p.add_argument("-o", "--output", required=True, metavar="OUT.html", help="the HTML report to write")
    p.add_argument("--title", help="report title")
    p.add_argument("--replay", metavar="QDQ.onnx",
                   help="replay each QDQ node unit of this model on REF's tensors: introduced vs inherited error "
                        "(REF must be the float reference)")
    p.add_argument("--replay-on", choices=["cpu", "htp"], default="cpu",
                   help="backend of the replay: ORT CPU-QDQ (default) or QNN HTP")
    p.add_argument("--extra", nargs=2, action="append", default=[], metavar=("REF2.h5", "TEST2.h5"),
                   help="another comparison shown side by side (repeatable), e.g. float.h5 cpu-qdq.h5")
    p.add_argument("--model", metavar="MODEL.onnx",
                   help="the ONNX model TEST ran: re-joins profiled ops to tensors and keys the Model Explorer "
                        "overlay by node (default: the join stored by the capture, else TEST's QNN op trace; a "
                        "path recorded inside a dump is never opened)")
    p.add_argument("--perfetto", metavar="OUT.json", help="write the profiling timeline as Perfetto trace JSON")
    p.add_argument("--model-explorer", metavar="OUT.json", help="write a Model Explorer node-data overlay")
    p.add_argument("--overlay-metric", default="sqnr_db", choices=list(METRICS), metavar="METRIC",
                   help="metric of the overlay (one of ivq_debug.metrics.METRICS; checked before the report is written)")
    p.add_argument("--junit", metavar="OUT.xml", help="write JUnit XML of the budget checks")
    add_budget_arguments(p)  # the same thresholds as ivq-diff, parsed by Budgets.from_args
    p.add_argument("--map", metavar="MAP.json", help="explicit {ref_name: test_name} pairs")
    p.add_argument("--records", metavar="PARTS", help="only these parts, comma-separated (e.g. prefill,decode)")
    p.add_argument("--drilldowns", type=int, default=None, metavar="N", help="worst layers drilled into (6)")
    p.add_argument("--max-rows", type=int, default=None, metavar="N", help="layer-table rows (2000)")
    p.add_argument("--max-points", type=int, default=None, metavar="N", help="points per chart series (400)")
    p.add_argument("--check", action="store_true", help="exit 1 when a tensor breaks a budget (like ivq-diff)")
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")


def execute(args: argparse.Namespace) -> int:
    """Compare, write the report and the requested exports; returns the exit code."""
    check_model(args.model)
    budgets = Budgets.from_args(args.min_sqnr, args.min_cosine, args.max_abs, args.budget, args.preset)
    mapping = read_name_map(args.map) if args.map else None
    parts = set(comma_list(args.records, "--records") or []) or None
    records = (lambda k: k[1] in parts) if parts else None
    ref, test = open_dump(args.ref), open_dump(args.test)
    if args.perfetto and not profiling_tables(test.table_names()):
        raise UsageError("--perfetto needs a test dump with a profiling table (capture with profiling on)", test.path)
    cmp = compare(ref, test, budgets=budgets, rank_by=args.rank_by, mapping=mapping, records=records)
    extras = {}
    for r2, t2 in args.extra:
        c2 = compare(open_dump(r2), open_dump(t2), budgets=budgets, rank_by=args.rank_by, mapping=mapping,
                     records=records)
        label = comparison_label(c2)
        extras[label if label not in extras else f"{label} ({len(extras) + 1})"] = c2
    rp = None
    if args.replay:
        factory = (lambda path: make_runner("qnn", path)) if args.replay_on == "htp" else None
        rp = replay(args.replay, cmp.ref, runner_factory=factory, cumulative=cmp)
    options = {k: v for k, v in (("drilldowns", args.drilldowns), ("max_rows", args.max_rows),
                                 ("max_points", args.max_points)) if v is not None}
    write_report(cmp, args.output, replay=rp, extra_comparisons=extras or None, title=args.title,
                 overwrite=args.force, model=args.model, **options)
    written = [f"report: {args.output}"]
    if args.perfetto:
        write_perfetto(cmp, args.perfetto, model=args.model, overwrite=args.force)
        written.append(f"perfetto: {args.perfetto}")
    if args.model_explorer:
        write_model_explorer(cmp, args.model_explorer, metric=args.overlay_metric, model=args.model,
                             overwrite=args.force)
        written.append(f"model explorer: {args.model_explorer}")
    if args.junit:
        write_junit(cmp, args.junit, overwrite=args.force)
        written.append(f"junit: {args.junit}")
    s = cmp.summary
    verdict = "[bold green]PASS[/bold green]" if cmp.passed else f"[bold red]FAIL[/bold red] {s['failed']} tensor(s) over budget"
    results().print(f"{verdict} · {escape(' · '.join(written))}")
    return EXIT_FAIL if (args.check and not cmp.passed) else EXIT_OK
