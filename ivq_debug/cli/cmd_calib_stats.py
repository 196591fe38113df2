"""``ivq calib-stats MODEL.onnx --calibration DATA -o stats.json``: per-tensor statistics over a calibration set and,
with ``--encodings``, per-tensor calibration coverage, as resumable jobs (:mod:`ivq_debug.calib_stats`).

Exit 1 when a tensor's coverage is below ``--min-coverage`` or a job failed twice (the failures listed, the
completed shards kept).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from ivq_debug import defaults
from ivq_debug.calib_stats import calib_stats
from ivq_debug.cli.common import escape, fmt_num, write_json
from ivq_debug.cli.jobs import add_executor_arguments, executor_from_args
from ivq_debug.console import results
from ivq_debug.errors import EXIT_FAIL, EXIT_OK, UsageError
from ivq_debug.executor import LocalExecutor


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq calib-stats``."""
    p.add_argument("model", help="the float ONNX model the calibration set runs through (ORT CPU)")
    p.add_argument("--calibration", required=True,
                   help="calibration data, as ivq quantize reads it: a folder (one .npz/.npy/.png per sample), an "
                        ".npz (leading axis = samples) or an .npy")
    p.add_argument("-o", "--output", required=True, help="the ivq-calib-stats/1 JSON to write ('-': stdout)")
    p.add_argument("--tensors", action="append", default=None, metavar="GLOB",
                   help="tensor names to reduce (repeatable; model inputs included; default every float tensor)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="tensor names to skip")
    p.add_argument("--encodings", default=None, metavar="QDQ.onnx|ENC.json",
                   help="a QDQ model or an encodings / overrides JSON: per-tensor coverage of its activation "
                        "encodings (the share of calibration values inside each range)")
    p.add_argument("--min-coverage", type=float, default=defaults.CALIB_MIN_COVERAGE, metavar="F",
                   help=f"exit 1 when a tensor's coverage is below F (default {defaults.CALIB_MIN_COVERAGE:g})")
    p.add_argument("--bins", type=int, default=defaults.CALIB_BINS,
                   help=f"histogram bins per tensor, on edges fixed by a first range pass (default "
                        f"{defaults.CALIB_BINS})")
    p.add_argument("--samples-per-job", type=int, default=defaults.CALIB_SAMPLES_PER_JOB, metavar="N",
                   help=f"calibration samples per job (default {defaults.CALIB_SAMPLES_PER_JOB})")
    p.add_argument("--max-samples", type=int, default=None, metavar="N", help="use the first N samples only")
    p.add_argument("--max-outputs-per-run", type=int, default=None, metavar="N",
                   help="compute at most N tensors per piece of the graph (bounds a job's memory)")
    add_executor_arguments(p, "the calibration samples", "local --workers 1, in this process. The numbers are the "
                                                         "same on every executor")
    p.add_argument("--shards", default=None, metavar="DIR",
                   help="keep one shard per job in DIR; a rerun skips the jobs done (default: a temporary folder)")
    p.add_argument("--top", type=int, default=20,
                   help="tensors to print (the lowest coverage first with --encodings, else in model order)")
    p.add_argument("--force", action="store_true", help="overwrite the output")


def execute(args: argparse.Namespace) -> int:
    """Run the two passes, write the document, print the table; exit 1 on low coverage."""
    if args.shards and Path(args.shards).resolve() == Path(args.calibration).resolve():
        raise UsageError("--shards must not be the calibration folder", args.shards)
    executor = executor_from_args(args) or LocalExecutor(1)
    r = calib_stats(args.model, args.calibration, include=args.tensors or ("*",), exclude=args.exclude,
                    encodings=args.encodings, bins=args.bins, samples_per_job=args.samples_per_job,
                    max_samples=args.max_samples, max_outputs_per_run=args.max_outputs_per_run,
                    min_coverage=args.min_coverage, executor=executor, shards=args.shards)
    write_json(r.to_json(), args.output, overwrite=args.force)  # before anything is printed
    con = results(json_to_stdout=args.output == "-")
    rows = r.rows()
    cov = r.encodings is not None
    shown = sorted(rows, key=lambda x: (x.get("coverage") is None, x.get("coverage") or 0.0)) if cov else rows
    t = Table(title=f"{len(rows)} tensor(s) over {r.calibration['samples']} calibration sample(s); "
                    f"{min(args.top, len(rows))} shown", title_justify="left", header_style="bold")
    cols = ["tensor", "count", "min", "max", "mean", "std", "p0.1", "p50", "p99.9"]
    cols += ["coverage", "clipped", "enc min", "enc max"] if cov else []
    for c in cols:
        t.add_column(c, justify="left" if c == "tensor" else "right", overflow="fold")
    for row in shown[:args.top]:
        cells = [escape(row["tensor"]), str(row["count"])] + [fmt_num(row[k]) for k in
                                                               ("min", "max", "mean", "std", "p0.1", "p50", "p99.9")]
        if cov:
            cells += [fmt_num(row.get(k)) for k in ("coverage", "clipped_fraction", "enc_min", "enc_max")]
        t.add_row(*cells)
    con.print(t)
    j = r.jobs
    con.print(f"{j['total']} job(s) on {j['executor']} ({j['samples_per_job']} sample(s) each, two passes): "
              f"{j['resumed']} resumed from shards, {len(j['retried'])} retried"
              + (f"; shards in {escape(j['shards'])}" if j["shards"] else ""))
    if not cov:
        return EXIT_OK
    e = r.encodings
    assert e is not None
    con.print(f"coverage of {len(r.fits)} encoding(s) from {escape(e['source'])}"
              + (f"; {len(e['unmatched'])} name(s) not among the selected tensors" if e["unmatched"] else "")
              + (f"; {len(e['not_measured'])} not measured (per-channel, float or no scale)"
                 if e["not_measured"] else ""))
    low = r.low_coverage()
    for row in low[:10]:
        con.print(f"[bold red]low coverage[/bold red] {escape(row['tensor'])}: {100 * row['coverage']:.2f} % of its "
                  f"calibration values inside [{fmt_num(row['enc_min'])}, {fmt_num(row['enc_max'])}] (values span "
                  f"[{fmt_num(row['min'])}, {fmt_num(row['max'])}])")
    if low:
        con.print(f"{len(low)} tensor(s) below --min-coverage {args.min_coverage:g}")
        return EXIT_FAIL
    con.print(f"[green]every measured encoding covers at least {100 * args.min_coverage:g} % of its calibration "
              f"values[/green]")
    return EXIT_OK
