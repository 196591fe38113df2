"""``ivq diagnose REF.h5 TEST.h5 --model M.qdq.onnx``: introduced vs inherited error per QDQ unit."""

from __future__ import annotations

import argparse
from functools import partial

from rich.table import Table

from ivq_debug import defaults
from ivq_debug.capture.base import make_runner
from ivq_debug.cli.common import escape, fmt_num, parse_record, write_json
from ivq_debug.comparator import compare
from ivq_debug.console import results
from ivq_debug.diagnose.replay import replay
from ivq_debug.dump import check_writable, open_dump
from ivq_debug.errors import EXIT_FAIL, EXIT_OK


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq diagnose``."""
    p.add_argument("ref", help="float reference dump (.h5): the replay's inputs and targets")
    p.add_argument("test", help="free-running test dump of the same inputs (.h5): the cumulative error")
    p.add_argument("--model", required=True, help="the QDQ model the test backend ran")
    p.add_argument("--backend", choices=["cpu", "qnn"], default="cpu",
                   help="replay backend: cpu (exact fake-quant, ORT_DISABLE_ALL) or qnn (QNN HTP)")
    p.add_argument("--optimization", default="disable", choices=["disable", "basic", "extended", "all"],
                   help="cpu: ORT graph optimization level of the replay (all: dynamic INT8 units run fused, "
                        "DynamicQuantizeMatMul / MatMulIntegerToFloat, as a deployment runs them)")
    p.add_argument("--record", help="record to replay: sample/part/step (default: the first)")
    p.add_argument("--nodes", default=None, help="only these compute nodes or output tensors (comma-separated)")
    p.add_argument("--budget-sqnr", type=float, default=None, metavar="DB",
                   help="introduced SQNR below which a unit breaks the budget (default 40)")
    p.add_argument("--top", type=int, default=10, help="units to print")
    p.add_argument("--json", metavar="OUT", help="write the replay table and findings as JSON ('-': stdout)")
    p.add_argument("--force", action="store_true", help="overwrite --json")


def execute(args: argparse.Namespace) -> int:
    """Replay and print; exit 1 when a unit breaks the budget."""
    if args.json and args.json != "-":
        check_writable(args.json, args.force)
    ref, test = open_dump(args.ref), open_dump(args.test)
    cmp = compare(ref, test)  # the cumulative error per tensor (no diagnostics needed)
    factory = (partial(make_runner, "qnn") if args.backend == "qnn"
               else partial(make_runner, "onnx", optimization=args.optimization))

    budget = args.budget_sqnr if args.budget_sqnr is not None else defaults.DIVERGENCE_SQNR_DB
    r = replay(args.model, ref, record=parse_record(args.record), runner_factory=factory, cumulative=cmp,
               budget_sqnr_db=budget, nodes=args.nodes.split(",") if args.nodes else None)
    con = results(json_to_stdout=args.json == "-")
    t = Table(title=f"introduced vs inherited error ({r.backend}, record {r.record}); worst {args.top} by "
                    f"introduced SQNR", title_justify="left", header_style="bold")
    for c in ("#", "tensor", "op", "introduced dB", "cumulative dB", "inherited share"):
        t.add_column(c, justify="left" if c in ("tensor", "op") else "right", overflow="fold")
    for i, (_, row) in enumerate(r.worst(args.top).iterrows(), 1):
        t.add_row(str(i), escape(row["tensor"]), escape(row["op_type"]), fmt_num(row["intro_sqnr_db"]),
                  fmt_num(row["cum_sqnr_db"]), fmt_num(row["inherited_share"]))
    con.print(t)
    fb = r.first_breaking
    con.print(f"{len(r.table)} units replayed in {r.batches} batch(es); skipped {len(r.skipped)}")
    if fb:
        con.print(f"[bold red]first unit over budget[/bold red] ({budget:g} dB): {escape(fb['tensor'])} "
                  f"introduces {fmt_num(fb['intro_sqnr_db'])} dB (cumulative {fmt_num(fb.get('cum_sqnr_db'))} dB)")
    else:
        con.print(f"[green]no unit introduces more error than the budget ({budget:g} dB)[/green]")
    if args.json:
        write_json(r.to_json(), args.json, overwrite=args.force)
    return EXIT_FAIL if fb else EXIT_OK
