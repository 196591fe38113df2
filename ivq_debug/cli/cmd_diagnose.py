"""``ivq diagnose REF.h5 TEST.h5 --model M.qdq.onnx``: who introduced the error, per QDQ unit and per pattern.

The headline names the pattern whose fix changes the output most (counterfactual runs of the whole model with it
put back to float, ``docs/findings.md``), with its effect and the fix by cause; the table lists the worst units
under both attributions ("where it starts") with the effect of those measured.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from rich.table import Table

from ivq_debug.align.preprocess import check_outputs, quantizer_reference
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.cli.common import comma_list, escape, fmt_num, parse_record, write_json
from ivq_debug.cli.jobs import add_executor_arguments, executor_from_args
from ivq_debug.comparator import compare
from ivq_debug.console import results, status
from ivq_debug.diagnose.replay import ATTRIBUTIONS, replay, replay_records
from ivq_debug.dump import open_dump
from ivq_debug.errors import EXIT_FAIL, EXIT_OK
from ivq_debug.onnxgraph.load import load_model


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq diagnose``."""
    p.add_argument("ref", help="float reference dump (.h5): the replay's inputs and targets")
    p.add_argument("test", help="free-running test dump of the same inputs (.h5): the cumulative error")
    p.add_argument("--model", required=True, help="the QDQ model the test backend ran")
    p.add_argument("--float-model", help="the float model REF was captured from: its weights and, when the QDQ "
                                         "model was made by ORT's QNN flow, its preprocessed graph as reference")
    p.add_argument("--backend", choices=["cpu", "qnn"], default="cpu",
                   help="replay backend: cpu (exact fake-quant, ORT_DISABLE_ALL) or qnn (QNN HTP)")
    p.add_argument("--optimization", default="disable", choices=["disable", "basic", "extended", "all"],
                   help="cpu: ORT graph optimization level of the replay (all: dynamic INT8 units run fused, "
                        "DynamicQuantizeMatMul / MatMulIntegerToFloat, as a deployment runs them)")
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
    p.add_argument("--top", type=int, default=10, help="units to print")
    p.add_argument("--json", metavar="OUT", help="write the replay table and findings as JSON ('-': stdout)")
    p.add_argument("--force", action="store_true", help="overwrite --json")


def execute(args: argparse.Namespace) -> int:
    """Replay and print; exit 1 when a unit breaks the budget, or none does but the part's output does."""
    ref, test = open_dump(args.ref), open_dump(args.test)
    con = results(json_to_stdout=args.json == "-")
    # cpu at ORT_DISABLE_ALL: the replay's own exact fake-quant session; another level (dynamic INT8 units fused, as a
    # deployment runs them) or QNN HTP: the units run on that backend, the shadow copies stay on the exact CPU path
    factory = (partial(make_runner, "qnn") if args.backend == "qnn"
               else partial(make_runner, "onnx", optimization=args.optimization) if args.optimization != "disable"
               else None)
    rec = "all" if args.record == "all" else parse_record(args.record)
    executor = executor_from_args(args, implied=bool(args.shards))

    # the cumulative error of the records the replay uses only (the others are not replayed): for a session dump
    # the first record that holds the model's inputs (the vision record for the vision part), not the first record
    chosen = set(replay_records(args.model, ref, rec))
    only = (lambda k: k in chosen) if chosen & set(test.record_keys()) else None

    def run(reference: Any) -> Any:
        cmp = compare(reference, test, records=only)  # the cumulative error per tensor (no diagnostics needed)
        return replay(args.model, reference, record=rec, runner_factory=factory, cumulative=cmp,
                      budget_sqnr_db=args.budget_sqnr, nodes=comma_list(args.nodes, "--nodes"),
                      attribution=args.attribution, float_model=args.float_model, lift=not args.no_lift,
                      executor=executor, shards=args.shards)

    r = run(ref)
    note = None
    if r.skipped and args.float_model:  # tensors neither the reference nor the lineage name: the preprocessing
        tmp = Path(tempfile.mkdtemp(prefix=".ivq-diagnose-", dir=Path(args.model).resolve().parent))
        try:
            pre, how = quantizer_reference(args.float_model, args.model, tmp)
            if pre is not None and pre != Path(args.float_model):
                feeds = [{e.name: ref.read(e) for e in ref.tensors(rid, kind="input")}
                         for rid in ref.records.sort_values(["sample", "step"])["rid"]]
                with status("reference: the float model through the quantizer's preprocessing"):
                    pre_ref = open_dump(capture(make_runner("onnx", pre, selection=Selection()), feeds,
                                                tmp / "reference.h5", progress=None))
                chk = check_outputs(ref, pre_ref, [o.name for o in load_model(pre).graph.output])
                if chk["ok"]:
                    r = run(pre_ref)
                    note = (f"reference: {how}; its outputs equal the user's within {chk['max_rel']:.1e} "
                            f"(tolerance {chk['rtol']:g})")
                else:
                    why = chk.get("why") or "max relative difference {:.2g}".format(chk["max_rel"])
                    note = f"preprocessed reference rejected ({why})"
            else:
                note = f"no preprocessed reference: {how}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    findings = r.findings()
    if args.json:  # written before anything is printed: a full disk is then the only stderr line
        write_json(r.to_json(), args.json, overwrite=args.force)
    other = "iso" if args.attribution == "local" else "local"
    t = Table(title=f"introduced error ({r.backend}, {len(r.records)} record(s) from {r.record}); worst {args.top} "
                    f"by {args.attribution}", title_justify="left", header_style="bold")
    for c in ("#", "tensor", "op", f"{args.attribution} dB", f"{other} dB", "weight share", "effect dB",
              "cumulative dB", "inherited"):
        t.add_column(c, justify="left" if c in ("tensor", "op") else "right", overflow="fold")
    for i, (_, row) in enumerate(r.worst(args.top).iterrows(), 1):
        flag = " ≈" if row.get("approximate") else ""
        t.add_row(str(i), escape(row["tensor"]) + flag, escape(row["op_type"]), fmt_num(row["intro_sqnr_db"]),
                  fmt_num(row[f"{other}_sqnr_db"]), fmt_num(row["weight_share"]), fmt_num(row.get("effect_gain_db")),
                  fmt_num(row["cum_sqnr_db"]),
                  fmt_num(row["inherited_share"]))
    con.print(t)
    if note:
        con.print(escape(note))
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
    return EXIT_FAIL if r.first_breaking or r.accumulation is not None else EXIT_OK
