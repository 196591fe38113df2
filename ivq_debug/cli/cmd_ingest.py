"""``ivq ingest qnn-net-run OUTPUT_DIR --graph NET.json -o OUT.h5``: a device run into a golden dump."""

from __future__ import annotations

import argparse

from ivq_debug.capture.qnn_net_run.ingest import capture_net_run
from ivq_debug.cli.common import escape
from ivq_debug.console import console, status
from ivq_debug.errors import EXIT_FAIL, EXIT_OK, UsageError
from ivq_debug.validate import check_outputs


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq ingest``."""
    p.add_argument("source", choices=["qnn-net-run"], help="what to ingest")
    p.add_argument("output_dir", help="qnn-net-run --output_dir (holding Result_N/ or <graph>/Result_N/)")
    p.add_argument("--graph", action="append", required=True, metavar="NET.json",
                   help="QNN graph JSON (<model>_net.json, ORT dump_json_qnn_graph output or context-binary JSON); "
                        "repeat for multi-graph runs")
    p.add_argument("--model", help="the ONNX model: maps sanitized QNN names back to ONNX names (recommended)")
    p.add_argument("--profiling", help="profiling file (QNN EP CSV, qnn-profile-viewer text or Chrome trace)")
    p.add_argument("-o", "--output", required=True, help="dump to write (.h5)")
    p.add_argument("--as-steps", action="store_true", help="Result_N are decode steps (default: samples)")
    p.add_argument("--first-step", type=int, default=1, help="step number of Result_0 with --as-steps")
    p.add_argument("--part", action="append", default=[], metavar="GRAPH=PART",
                   help="record part of a graph (vision, prefill, decode, model)")
    p.add_argument("--strict", action="store_true", help="fail on the first problem instead of writing an "
                   "incomplete dump")
    p.add_argument("--allow-outside-inputs", action="store_true",
                   help="read raw files and Result folders that are symlinks leaving OUTPUT_DIR (refused by default)")
    p.add_argument("--device", default=None, help="provenance: device / SoC the run came from")
    p.add_argument("--force", action="store_true", help="overwrite the output dump")


def execute(args: argparse.Namespace) -> int:
    """Run the ingest; exit 1 when the dump had to be marked incomplete."""
    check_outputs([args.output], [args.output_dir, *args.graph, args.model, args.profiling], args.force)
    parts = {}
    for spec in args.part:
        if "=" not in spec:
            raise UsageError(f"--part takes GRAPH=PART, got {spec!r}")
        g, p = spec.split("=", 1)
        parts[g] = p
    info = {"device": args.device} if args.device else None
    with status("ingesting qnn-net-run output"):
        cap = capture_net_run(args.output_dir, args.output, args.graph if len(args.graph) > 1 else args.graph[0],
                              model=args.model, profiling=args.profiling, strict=args.strict,
                              as_steps=args.as_steps, first_step=args.first_step, parts=parts or None,
                              overwrite=args.force, backend_info=info, allow_outside=args.allow_outside_inputs)
    con = console()
    con.print(f"wrote {escape(cap.path)}: {cap.n_tensors} tensors in {len(cap.records)} record(s)"
              + (f", {cap.profiling_rows} profiling rows" if cap.profiling_rows else ""))
    if not cap.complete:
        for pr in cap.problems[:10]:
            con.print(f"[yellow]incomplete:[/yellow] {escape(pr)}")
        return EXIT_FAIL
    return EXIT_OK
