"""``ivq reference SESSION.h5 --model-dir PARTS/ -o REF.h5``: the reference run of a device session.

The session's ONNX parts replayed on ONNX Runtime CPU with the device's own inputs, the model's positions
and the reference's own cache, teacher-forced on the device's tokens
(:mod:`ivq_debug.capture.qnn_net_run.reference`); then ``ivq-diff REF.h5 SESSION.h5`` names the position
offset and the first wrong step (``docs/device-sessions.md``).
"""

from __future__ import annotations

import argparse

from ivq_debug.capture.qnn_net_run.reference import build_reference
from ivq_debug.cli.cmd_ingest import add_part_model_arguments, part_models
from ivq_debug.cli.common import escape
from ivq_debug.console import results, status
from ivq_debug.errors import EXIT_OK, UsageError


def _grid(value: str | None) -> tuple[int, int, int] | None:
    if value is None:
        return None
    try:
        t, h, w = (int(x) for x in value.split(","))
    except ValueError:
        raise UsageError(f"--grid-thw takes T,H,W (e.g. 1,8,8), got {value!r}") from None
    if min(t, h, w) < 1:
        raise UsageError("--grid-thw values must be positive")
    return t, h, w


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq reference``."""
    p.add_argument("session", help="the device session dump (ivq ingest session)")
    add_part_model_arguments(p)
    p.add_argument("-o", "--output", required=True, help="the reference dump to write (.h5)")
    p.add_argument("--grid-thw", metavar="T,H,W", help="M-RoPE: the image's patch grid when the vision inputs do "
                                                       "not tell it (a non-square image)")
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads")
    p.add_argument("--force", action="store_true", help="overwrite the output dump")


def execute(args: argparse.Namespace) -> int:
    """Build the reference dump."""
    with status("replaying the device session on ORT CPU"):
        run = build_reference(args.session, args.output, model_dir=args.model_dir, models=part_models(args),
                              config=args.config, grid_thw=_grid(args.grid_thw), overwrite=args.force,
                              threads=args.threads)
    con = results()
    samples = sorted(run.positions)
    con.print(f"wrote {escape(run.path)}: {len(run.records)} record(s) of {len(samples)} sample(s)")
    for part, m in run.parts.items():
        con.print(f"  {part}: {escape(m)}")
    con.print("  config: " + (escape(run.config_source) if run.config_source else "none"))
    for s in samples:
        pos = run.positions[s]
        dec = pos["decode"]
        first = min(dec) if dec else None
        con.print(f"  sample {s}: {pos['rule']}, rope_delta {pos['rope_delta']}"
                  + (f", decode step {first} at position {dec[first][0]} .. step {max(dec)} at {dec[max(dec)][0]}"
                     if dec else "")
                  + ("" if run.image_rows.get(s) is None else
                     f", image rows {run.image_rows[s][0]}..{run.image_rows[s][1] - 1} from the reference's vision"))
    return EXIT_OK
