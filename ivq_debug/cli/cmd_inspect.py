"""``ivq ls DUMP`` and ``ivq show DUMP NAME``: read the manifest, never the tensors (show reads one)."""

from __future__ import annotations

import argparse

from ivq_debug.cli.common import escape, parse_record
from ivq_debug.cli.render import FORMATS, emit, entry_panel, manifest_table, records_table, resolve_format
from ivq_debug.console import console, results
from ivq_debug.dump import open_dump
from ivq_debug.errors import EXIT_OK


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ls`` / ``show``."""
    p.add_argument("dump", help="golden dump (.h5)")
    if name == "ls":
        p.add_argument("--kind", choices=["tensor", "input"], help="only tensors or only inputs")
        p.add_argument("--limit", type=int, default=None, help="at most N rows")
        p.add_argument("--records", action="store_true", help="list the records instead of tensors")
        p.add_argument("--format", choices=FORMATS, default=None,
                       help="table (default on a terminal: fits its width, long names shortened in the middle), "
                            "tsv (default when piped: one row per line, names whole) or json")
    else:
        p.add_argument("name", help="tensor name (as listed by ivq ls)")
        p.add_argument("--record", help="record: rid (r000001) or sample/part/step (0/decode/3)")
        p.add_argument("--input", action="store_true", help="NAME is a model input")
        p.add_argument("--values", type=int, default=0, metavar="N", help="also print the first N values")


def execute(args: argparse.Namespace) -> int:
    """Run ``ls`` or ``show``."""

    con = results()
    with open_dump(args.dump) as d:
        if args.command == "ls":
            table = records_table(d) if args.records else manifest_table(d, args.limit, args.kind)
            emit(con, [table], resolve_format(args.format, con))
            if not d.complete:
                console().print(f"[yellow]incomplete dump:[/yellow] {escape('; '.join(d.incomplete_reasons))}")
            return EXIT_OK
        e = d.entry(args.name, parse_record(args.record), "input" if args.input else "tensor")
        d.dataset(e)  # checked against the manifest (and read) before anything is printed: one error line
        arr = d.head(e, args.values)[0] if args.values else None  # N values read, not the declared size
        con.print(entry_panel(d, e))
        if arr is not None:
            import numpy as np

            con.print(escape(np.array2string(arr, precision=6, threshold=args.values)))
    return EXIT_OK
