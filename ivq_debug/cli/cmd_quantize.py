"""``ivq quantize MODEL -o OUT.qdq.onnx --calibration SRC``: QDQ model for QNN (ORT's QNN helpers)."""

from __future__ import annotations

import argparse

from ivq_debug.cli.common import escape, write_json
from ivq_debug.console import console, results, status
from ivq_debug.dump import check_writable
from ivq_debug.errors import EXIT_OK
from ivq_debug.qnn.quantize import quantize_for_qnn


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq quantize``."""
    p.add_argument("model", help="float ONNX model")
    p.add_argument("-o", "--output", required=True, help="QDQ model to write")
    p.add_argument("--calibration", required=True,
                   help="calibration data: a folder (one .npz/.npy/.png per sample), an .npz (leading axis = "
                        "samples) or an .npy")
    p.add_argument("--preset", default="a8w8", choices=["a8w8", "a16w8", "a16w16"], help="activation/weight bits")
    p.add_argument("--per-channel", action="store_true", help="per-channel weights (Conv/Gemm)")
    p.add_argument("--overrides", help="quantization overrides (QNN legacy / 1.0.0, AIMET 2.x or ORT JSON)")
    p.add_argument("--max-samples", type=int, default=None, help="use at most N calibration samples")
    p.add_argument("--json", metavar="OUT", help="write the result (effective quantization included) as JSON "
                                                "('-': stdout)")
    p.add_argument("--force", action="store_true", help="overwrite the output model")


def effective_line(effective: dict) -> str:
    """``activations uint16 x12 · weights uint8 x6 (per-channel 2) · biases int32 x3``."""
    counts = effective.get("counts", {})
    parts = []
    for role, label in (("activation", "activations"), ("weight", "weights"), ("bias", "biases"),
                        ("constant", "other constants")):
        if role in counts:
            txt = ", ".join(f"{dt} x{n}" for dt, n in sorted(counts[role].items()))
            if role == "weight" and effective.get("per_channel_weights"):
                txt += f" (per-channel {effective['per_channel_weights']})"
            parts.append(f"{label} {txt}")
    return " · ".join(parts) or "nothing quantized"


def execute(args: argparse.Namespace) -> int:
    """Quantize."""

    if args.json and args.json != "-":
        check_writable(args.json, args.force)
    with status(f"quantizing {args.model} ({args.preset})"):
        r = quantize_for_qnn(args.model, args.output, args.calibration, preset=args.preset,
                             per_channel=args.per_channel, overrides=args.overrides, max_samples=args.max_samples,
                             overwrite=args.force)
    if args.json:
        write_json(r.to_dict(), args.json, overwrite=args.force)
    con = results(json_to_stdout=args.json == "-")
    con.print(f"wrote {escape(r.model_path)}: {r.preset} ({r.activation_type}/{r.weight_type}), "
              f"{r.calibration_samples} calibration sample(s) from {escape(r.calibration_source)}, "
              f"{r.quantize_nodes} Q / {r.dequantize_nodes} DQ nodes, {r.overrides} override(s), {r.seconds:.2f} s")
    con.print(f"effective: {escape(effective_line(r.effective))}")
    for m in r.effective.get("mismatches", []):
        con.print(f"[bold yellow]preset did not hold:[/bold yellow] {escape(m)}")
    for w in r.warnings:
        console().print(f"[yellow]note:[/yellow] {escape(w)}")
    return EXIT_OK
