"""``ivq diagnose REF.h5 TEST.h5 --model M.qdq.onnx``: who introduced the error, per QDQ unit and per pattern.

The headline names the pattern whose fix changes the output most (counterfactual runs of the whole model with it
put back to float, ``docs/findings.md``), with its effect and the fix by cause; the table lists the worst units
under both attributions ("where it starts") with the effect of those measured.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from ivq_debug import api
from ivq_debug.cli.common import comma_list, escape, fmt_num, parse_record, write_json
from ivq_debug.cli.jobs import add_executor_arguments, executor_from_args
from ivq_debug.cli.sessions import (
    add_onnx_session_arguments,
    add_optimization_argument,
    add_qnn_session_arguments,
    session_options,
)
from ivq_debug.console import results
from ivq_debug.diagnose.replay import ATTRIBUTIONS, ReplayResult
from ivq_debug.errors import EXIT_FAIL, EXIT_OK


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq diagnose``."""
    p.add_argument("ref", help="float reference dump (.h5): the replay's inputs and targets")
    p.add_argument("test", help="free-running test dump of the same inputs (.h5): the cumulative error")
    p.add_argument("--model", required=True, help="the QDQ model the test backend ran")
    p.add_argument("--float-model", help="the float model REF was captured from: its weights and, when the QDQ "
                                         "model was made by ORT's QNN flow, its preprocessed graph as reference")
    p.add_argument("--backend", choices=["cpu", "qnn"], default="cpu",
                   help="replay backend: cpu (exact fake-quant, ORT_DISABLE_ALL) or qnn (QNN HTP)")
    add_optimization_argument(p, "ORT graph optimization level of the replayed units (cpu: all runs dynamic INT8 "
                                 "units fused, DynamicQuantizeMatMul / MatMulIntegerToFloat, as a deployment runs "
                                 "them; qnn: the level before QNN partitions, as in ivq capture qnn)")
    add_onnx_session_arguments(p, "cpu: ")
    add_qnn_session_arguments(p, "qnn: ")
    p.add_argument("--attribution", choices=list(ATTRIBUTIONS), default="local",
                   help="rank by local (producer-charged, default) or iso (input re-quantization included)")
    p.add_argument("--record", help="record(s) to replay: sample/part/step, or 'all' (default: the first record "
                        "whose inputs fit the model; 'all': every such record, e.g. all decode steps of a session)")
    p.add_argument("--nodes", default=None, help="only these compute nodes or output tensors (comma-separated)")
    p.add_argument("--budget-sqnr", type=float, default=None, metavar="DB",
                   help="introduced SQNR below which a unit breaks the budget (default: by the model's activation "
                        "bits, 20 dB at 8 bits, 40 dB at 16)")
    p.add_argument("--no-lift", action="store_true",
                   help="do not measure the effect on the output (the counterfactual runs: one run of the whole model "
                        "per pattern / unit measured, on the replay's backend)")
    add_executor_arguments(p, "the replay's batches", "one loop in this process. The numbers are the same to the "
                                                          "bit")
    p.add_argument("--shards", default=None, metavar="DIR",
                   help="with --executor: keep one shard per batch in DIR; a rerun skips the batches done "
                        "(default: a temporary folder)")
    p.add_argument("--allow-input-mismatch", action="store_true",
                   help="diagnose even when the dumps were not fed the same inputs (else exit 6, as ivq-diff)")
    p.add_argument("--top", type=int, default=10, help="units to print")
    p.add_argument("--json", metavar="OUT", help="write the replay table and findings as JSON ('-': stdout)")
    p.add_argument("--force", action="store_true", help="overwrite --json")


def execute(args: argparse.Namespace) -> int:
    """Replay and print; exit 1 when a unit breaks the budget, or none does but the part's output does."""
    con = results(json_to_stdout=args.json == "-")
    r = api.diagnose(args.ref, args.test, args.model, backend=args.backend, float_model=args.float_model,
                     record="all" if args.record == "all" else parse_record(args.record),
                     nodes=comma_list(args.nodes, "--nodes"), attribution=args.attribution,
                     budget_sqnr_db=args.budget_sqnr, lift=not args.no_lift,
                     allow_input_mismatch=args.allow_input_mismatch,
                     executor=executor_from_args(args, implied=bool(args.shards)), shards=args.shards,
                     **session_options(args, api.REPLAY_BACKENDS[args.backend]))
    if args.json:  # written before anything is printed: a full disk is then the only stderr line
        write_json(r.to_json(), args.json, overwrite=args.force)
    render(con, r, args.top)
    return EXIT_FAIL if r.first_breaking or r.accumulation is not None else EXIT_OK


def render(con: Any, r: ReplayResult, top: int) -> None:
    """Print a replay: the worst units under both attributions, how the reference was chosen, what ran, the
    skipped units and the findings."""
    findings = r.findings()
    att = r.attribution
    other = "iso" if att == "local" else "local"
    t = Table(title=f"introduced error ({r.backend}, {len(r.records)} record(s) from {r.record}); worst {top} "
                    f"by {att}", title_justify="left", header_style="bold")
    for c in ("#", "tensor", "op", f"{att} dB", f"{other} dB", "weight share", "effect dB", "cumulative dB",
              "inherited"):
        t.add_column(c, justify="left" if c in ("tensor", "op") else "right", overflow="fold")
    for i, (_, row) in enumerate(r.worst(top).iterrows(), 1):
        flag = " ≈" if row.get("approximate") else ""
        t.add_row(str(i), escape(row["tensor"]) + flag, escape(row["op_type"]), fmt_num(row["intro_sqnr_db"]),
                  fmt_num(row[f"{other}_sqnr_db"]), fmt_num(row["weight_share"]), fmt_num(row.get("effect_gain_db")),
                  fmt_num(row["cum_sqnr_db"]),
                  fmt_num(row["inherited_share"]))
    con.print(t)
    if r.note:
        con.print(escape(r.note))
    con.print(f"{len(r.table)} units replayed in {r.batches} batch(es), {r.sessions} session(s), {r.seconds:.1f} s; "
              f"skipped {len(r.skipped)}")
    if r.jobs:
        con.print(f"{r.jobs['total']} job(s) on {r.jobs['executor']}: {r.jobs['resumed']} resumed from shards, "
                  f"{len(r.jobs['retried'])} retried" + (f"; shards in {escape(r.jobs['shards'])}"
                                                         if r.jobs["shards"] else ""))
    if r.effects:
        b = r.effects["base"]
        con.print(f"effect on the output ({escape(b['backend'])}): {r.effects['runs']} run(s) of the whole model, "
                  f"{r.effects['seconds']:.1f} s ({r.effects['resumed']} from shards); output SQNR as quantized "
                  f"{fmt_num(b['sqnr_db'])} dB")
    for node, why in list(r.skipped_reasons.items())[:10]:
        con.print(f"  skipped {escape(node)}: {escape(why)}")
    for f in findings:
        color = {"error": "bold red", "warning": "yellow"}.get(f.severity, "cyan")
        con.print(f"[{color}]{f.kind}[/{color}] {escape(f.message)}")
        if f.suggestion:
            con.print(f"  fix: {escape(f.suggestion)}")
        fb = f.evidence.get("first_over_budget")
        if fb and (f.evidence.get("over_budget") or 0) > 1:  # the pattern's own first unit over budget
            con.print(f"  first unit over budget in this pattern: {escape(fb['tensor'])} at "
                      f"{fmt_num(fb['intro_sqnr_db'])} dB")
    if not any(f.kind in ("introduced_error", "accumulated_error") for f in findings):
        con.print(f"[green]no unit introduces more error than the budget ({r.budget_sqnr_db:g} dB)[/green]")
