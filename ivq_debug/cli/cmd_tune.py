"""``ivq tune MODEL --calibration C --inputs X.npz -o WORKDIR``: suggest overrides and verify them on QNN HTP."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from rich.table import Table

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.cli.common import escape, fmt_num, write_json
from ivq_debug.console import console, status
from ivq_debug.dump import open_dump
from ivq_debug.errors import EXIT_FAIL, EXIT_OK, UsageError
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.qnn.encodings import read_encodings
from ivq_debug.qnn.quantize import load_calibration
from ivq_debug.tune.suggest import from_encodings, suggest, write_suggestions
from ivq_debug.tune.verify import Tuner, greedy, verify
from ivq_debug.util import read_arrays
from ivq_debug.validate import check_feeds, check_outputs


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq tune``."""
    p.add_argument("model", help="float ONNX model")
    p.add_argument("--calibration", required=True, help="calibration data (see ivq quantize)")
    p.add_argument("--inputs", action="append", required=True, metavar="X.npz",
                   help="inputs to verify on, one .npz per sample (repeatable)")
    p.add_argument("-o", "--workdir", required=True, help="folder for trial models, dumps and the results")
    p.add_argument("--reference", help="float reference dump of the same inputs (default: captured with ORT)")
    p.add_argument("--overrides", help="verify this overrides file instead of suggesting one")
    p.add_argument("--preset", default="a8w8", choices=["a8w8", "a16w8", "a16w16"])
    p.add_argument("--watch", action="append", default=[], metavar="TENSOR",
                   help="tensor(s) whose SQNR is the end-to-end figure (default: the last output)")
    p.add_argument("--greedy", action="store_true", help="add suggestions one at a time while they help")
    p.add_argument("--budget", type=float, default=None, metavar="DB",
                   help="target SQNR of the watched tensors (greedy stops there; exit 1 when missed)")
    p.add_argument("--format", default="legacy", choices=["legacy", "1.0.0", "ort"], help="overrides file format")
    p.add_argument("--force", action="store_true", help="reuse a non-empty workdir, overwriting its files")


def execute(args: argparse.Namespace) -> int:
    """Run the loop: every input is read and checked before the workdir is created; a workdir this run
    created is removed when it fails."""
    wd = Path(args.workdir)
    if wd.exists() and any(wd.iterdir()) and not args.force:
        raise UsageError("workdir is not empty; pass --force to reuse it", wd)
    model = load_model(args.model)
    feeds = [read_arrays(p) for p in args.inputs]
    check_feeds(feeds, model, args.inputs)
    calibration, _ = load_calibration(args.calibration, model)
    encs = read_encodings(args.overrides, model=args.model) if args.overrides else None
    if args.reference:
        open_dump(args.reference).close()
    inputs = [args.model, args.calibration, *args.inputs, args.overrides, args.reference]
    outputs = ["overrides.json", "overrides.rationale.md", "tune.json", *([] if args.reference else ["reference.h5"])]
    check_outputs([wd / n for n in outputs], inputs, overwrite=True)  # even --force never replaces an input
    missing = [d for d in (wd, *wd.parents) if not d.exists()]  # innermost first
    wd.mkdir(parents=True, exist_ok=True)
    try:
        return _tune(args, wd, calibration, feeds, encs)
    except BaseException:
        if missing:  # the folders this run created, nothing else
            shutil.rmtree(missing[-1], ignore_errors=True)
        raise


def _tune(args: argparse.Namespace, wd: Path, calibration: Any, feeds: list[dict], encs: Any) -> int:
    ref = Path(args.reference) if args.reference else wd / "reference.h5"
    if not args.reference:
        capture(make_runner("onnx", args.model, selection=Selection()), feeds, ref, overwrite=True, progress=None)
    tuner = Tuner(Path(args.model), calibration, feeds, ref, wd / "trials", preset=args.preset)
    con = console()
    with status("baseline: quantize, capture on QNN HTP, compare"):
        before = tuner.trial("before", [])
    if encs is not None:
        sug = from_encodings(encs)
    else:
        sug = suggest(before.comparison)
    if not sug:
        con.print("[green]nothing to tune: no tensor breaks the thresholds[/green]")
        return EXIT_OK
    watch = args.watch or None
    if args.greedy:
        if args.budget is None:
            raise UsageError("--greedy needs --budget")
        rep = greedy(tuner, sug, watch or [before.comparison.table.sort_values("order").iloc[-1]["ref_name"]],
                     budget_sqnr_db=args.budget)
    else:
        with status(f"verifying {len(sug)} override(s)"):
            rep = verify(tuner, sug, watch or (), before=before)
    path, md = write_suggestions(rep.after.suggestions, wd / "overrides.json", fmt=args.format, overwrite=True)
    write_json(rep.to_dict(), str(wd / "tune.json"), overwrite=True)
    t = Table(title="end to end", title_justify="left", header_style="bold")
    for c in ("what", "before", "after", "change"):
        t.add_column(c, justify="left" if c == "what" else "right")
    for _, r in rep.end_to_end.iterrows():
        t.add_row(escape(r["what"]), fmt_num(r["before"]), fmt_num(r["after"]), fmt_num(r["change"]))
    con.print(t)
    t2 = Table(title=f"changed layers ({len(rep.after.suggestions)})", title_justify="left", header_style="bold")
    for c in ("tensor", "action", "SQNR before", "after", "gain dB"):
        t2.add_column(c, justify="left" if c in ("tensor", "action") else "right", overflow="fold")
    for _, r in rep.changed.head(20).iterrows():
        t2.add_row(escape(r["tensor"]), r["action"], fmt_num(r["sqnr_before"]), fmt_num(r["sqnr_after"]),
                   fmt_num(r["gain_db"]))
    con.print(t2)
    con.print(f"overrides: {escape(path)} · rationale: {escape(md)} · results: {escape(wd / 'tune.json')}")
    if args.budget is not None:
        worst = min((rep.after.sqnr(w) or -1e9) for w in rep.watch)
        if worst < args.budget:
            con.print(f"[bold red]budget missed[/bold red]: {worst:.1f} dB < {args.budget:g} dB")
            return EXIT_FAIL
    return EXIT_OK
