"""``ivq demo``: the whole story on the embedded reference VLM (see :mod:`ivq_debug.demo`)."""

from __future__ import annotations

import argparse

from ivq_debug.cli.common import escape
from ivq_debug.cli.render import Col, TableData, emit, resolve_format
from ivq_debug.console import console, results
from ivq_debug.demo import run_demo
from ivq_debug.diagnose import headline
from ivq_debug.errors import EXIT_OK
from ivq_debug.vlm.load import REFERENCE_DIR


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq demo``."""
    shipped = ", ".join(sorted(d.name for d in REFERENCE_DIR.iterdir() if (d / "ivq_reference.json").is_file()))
    p.add_argument("--model", default="internvl-tiny",
                   help=f"shipped reference ({shipped}) or a checkpoint folder saved with save_pretrained")
    p.add_argument("--golden", default="golden", help="folder for the golden dumps")
    p.add_argument("--reports", default="reports", help="folder for demo.html and demo.json")
    p.add_argument("--workdir", default="work/demo", help="folder for exported and quantized models")
    p.add_argument("--exporter", default="legacy", choices=["legacy", "dynamo"])
    p.add_argument("--samples", type=int, default=2, help="images captured layer by layer, step by step")
    p.add_argument("--eval", type=int, default=16, help="images for the caption accuracy")
    p.add_argument("--force", action="store_true", help="replace outputs not written by an earlier demo")


def execute(args: argparse.Namespace) -> int:
    """Run the demo and print what it found."""
    con = console()
    con.print(f"[bold]ivq demo[/bold]: {escape(args.model)} → ONNX Runtime → QNN HTP (x86_64 emulation)")
    res = run_demo(args.model, golden=args.golden, reports=args.reports, workdir=args.workdir,
                   n_capture=args.samples, n_eval=args.eval, exporter=args.exporter, force=args.force,
                   log=lambda m: con.print(f"  {escape(m)}"))
    rows = []
    for label, c in res.comparisons.items():
        errs = [f for f in c.findings if f.severity == "error"]
        head = headline(errs)
        rest = sorted({f.kind for f in errs} - ({head.kind} if head else set()))
        where = ""
        if head:
            rec = head.where.get("record") or {}
            loc = head.where.get("tensor") or head.where.get("node") or f"{rec.get('part')} step {rec.get('step')}"
            where = f" @ {loc}"
        rows.append({"comparison": label, "pairs": c.summary["pairs"], "min_sqnr_db": c.summary["min_sqnr_db"],
                     "diagnosis": f"{head.kind}{where}" if head else "clean", "other": ", ".join(rest) or "-"})
    cols = [Col("comparison", "comparison", "name"), Col("pairs", "pairs", "num", drop=2, fmt=str),
            Col("min SQNR dB", "min_sqnr_db", "num"), Col("diagnosis (most telling error finding)", "diagnosis", "name"),
            Col("other errors", "other", drop=1)]
    out = results()
    emit(out, [TableData("what the demo found", cols, rows)], resolve_format(None, out))
    out.print("caption exact match: " + ", ".join(f"{k} {v['exact_match']:.2f}" for k, v in res.accuracy.items()))
    out.print(f"golden dumps: {escape(', '.join(str(p) for p in res.dumps.values()))}")
    out.print(f"[bold]report: {escape(res.report)}[/bold] · summary: {escape(res.summary)} · "
              f"{res.timings.get('total', 0):.0f} s")
    return EXIT_OK
