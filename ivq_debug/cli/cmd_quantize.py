"""``ivq quantize MODEL -o OUT.onnx``: a QDQ model for QNN (``--calibration``, ORT's QNN helpers), or a dynamic
INT8 model for ONNX Runtime on CPU (``--dynamic``, ``quantize_dynamic``: x86_64 and ARM64 boards)."""

from __future__ import annotations

import argparse

from ivq_debug.cli.common import comma_list, escape, write_json
from ivq_debug.console import console, results, status
from ivq_debug.dynamic_quant import WEIGHT_TYPES, quantize_dynamic_model
from ivq_debug.errors import EXIT_OK, UsageError
from ivq_debug.qnn.entropy import ENTROPY_BINS
from ivq_debug.qnn.quantize import CALIBRATE_METHODS, IMAGE_RESIZE, quantize_for_qnn


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq quantize``."""
    p.add_argument("model", help="float ONNX model")
    p.add_argument("-o", "--output", required=True, help="quantized model to write")
    p.add_argument("--calibration",
                   help="QDQ (required without --dynamic): calibration data, a folder (one .npz/.npy/.png per "
                        "sample), an .npz (leading axis = samples) or an .npy")
    p.add_argument("--preset", default="a8w8", choices=["a8w8", "a16w8", "a16w16"], help="QDQ: activation/weight bits")
    p.add_argument("--per-channel", action="store_true", help="per-channel weights (QDQ: Conv/Gemm; dynamic: every "
                                                              "quantized weight)")
    p.add_argument("--calibrate-method", default="minmax", choices=sorted(CALIBRATE_METHODS),
                   help="QDQ: the calibration method (ORT's calibrators; default %(default)s). entropy: ORT's "
                        f"KL-divergence threshold search with {ENTROPY_BINS[0]} histogram bins and {ENTROPY_BINS[1]} "
                        "quantized bins at 8-bit activations (its search vectorized here, ORT's thresholds; "
                        "quantize_static alone passes 128 / 128, i.e. MinMax), clipping outliers; at 16-bit "
                        "activations (a16w8, a16w16) entropy is MinMax, said in a note (docs/tune.md)")
    p.add_argument("--overrides", help="QDQ: quantization overrides (QNN legacy / 1.0.0, AIMET 2.x or ORT JSON)")
    p.add_argument("--max-samples", type=int, default=None, help="QDQ: use at most N calibration samples")
    p.add_argument("--image-resize", default=None, choices=list(IMAGE_RESIZE),
                   help="QDQ: how calibration images are resized to the model's size (Pillow; bicubic and bilinear "
                        "antialiased; default bicubic)")
    p.add_argument("--image-processor", metavar="FOLDER", default=None,
                   help="QDQ: a model folder whose HF image processor (preprocessor_config.json) makes calibration "
                        "images into inputs, as the deployment does")
    p.add_argument("--unfuse-batchnorm", action="store_true",
                   help="QDQ: rewrite each BatchNormalization as Mul + Add by constants before quantizing (the "
                        "emulated QNN HTP computes those closer to float at 16-bit activations; docs/tune.md)")
    p.add_argument("--dynamic", action="store_true",
                   help="dynamic INT8 (onnxruntime quantize_dynamic): weights quantized once, activations at run "
                        "time (DynamicQuantizeLinear + MatMulInteger / ConvInteger); no calibration")
    p.add_argument("--weight-type", default="QInt8", choices=list(WEIGHT_TYPES),
                   help="dynamic: QInt8 (s8 weights, u8s8 kernels; default) or QUInt8 (u8u8)")
    p.add_argument("--reduce-range", action="store_true",
                   help="dynamic: 7-bit weights (avoids the u8s8 int16 saturation of AVX2-only x86 CPUs)")
    p.add_argument("--op-types", default=None, help="dynamic: op types to quantize, comma-separated (default: all "
                                                     "that quantize_dynamic supports)")
    p.add_argument("--exclude-nodes", default=None, help="dynamic: node names kept in float, comma-separated")
    p.add_argument("--json", metavar="OUT", help="write the result (QDQ: the effective quantization included) as "
                                                "JSON ('-': stdout)")
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
    con = results(json_to_stdout=args.json == "-")
    if args.dynamic:
        for flag, given in (("--calibration", args.calibration), ("--overrides", args.overrides),
                            ("--max-samples", args.max_samples), ("--image-resize", args.image_resize),
                            ("--image-processor", args.image_processor),
                            ("--calibrate-method", None if args.calibrate_method == "minmax" else 1),
                            ("--unfuse-batchnorm", args.unfuse_batchnorm or None)):
            if given is not None:
                raise UsageError(f"{flag} applies to QDQ quantization, not --dynamic")
        with status(f"quantizing {args.model} (dynamic, {args.weight_type} weights)"):
            d = quantize_dynamic_model(args.model, args.output, weight_type=args.weight_type,
                                       per_channel=args.per_channel, reduce_range=args.reduce_range,
                                       op_types=comma_list(args.op_types, "--op-types"),
                                       nodes_to_exclude=comma_list(args.exclude_nodes, "--exclude-nodes") or [], overwrite=args.force)
        ops = ", ".join(f"{n} {k}" for k, n in d.integer_ops.items()) or "no integer op"
        left = ", ".join(f"{n} {k}" for k, n in d.float_left.items())
        if args.json:
            write_json(d.to_dict(), args.json, overwrite=args.force)
        con.print(f"wrote {escape(d.model_path)}: dynamic INT8 ({d.weight_type} weights"
                  f"{', per-channel' if d.per_channel else ''}{', reduce_range' if d.reduce_range else ''}), "
                  f"{escape(ops)}, {d.dynamic_quantizers} DynamicQuantizeLinear"
                  + (f"; left in float: {escape(left)}" if left else "") + f", {d.seconds:.2f} s")
        return EXIT_OK
    for flag, given in (("--reduce-range", args.reduce_range), ("--op-types", args.op_types),
                        ("--exclude-nodes", args.exclude_nodes), ("--weight-type", args.weight_type != "QInt8")):
        if given:
            raise UsageError(f"{flag} applies to --dynamic only")
    if not args.calibration:
        raise UsageError("--calibration is required for QDQ quantization (or pass --dynamic)")
    with status(f"quantizing {args.model} ({args.preset})"):
        r = quantize_for_qnn(args.model, args.output, args.calibration, preset=args.preset,
                             per_channel=args.per_channel, overrides=args.overrides, max_samples=args.max_samples,
                             calibrate_method=args.calibrate_method, image_resize=args.image_resize or "bicubic",
                             image_processor=args.image_processor, unfuse_batchnorm=args.unfuse_batchnorm,
                             overwrite=args.force)
    if args.json:
        write_json(r.to_dict(), args.json, overwrite=args.force)
    con.print(f"wrote {escape(r.model_path)}: {r.preset} ({r.activation_type}/{r.weight_type}), "
              f"{r.calibration_samples} calibration sample(s) from {escape(r.calibration_source)}, "
              f"{r.quantize_nodes} Q / {r.dequantize_nodes} DQ nodes, {r.overrides} override(s), {r.seconds:.2f} s")
    con.print(f"effective: {escape(effective_line(r.effective))}")
    for m in r.effective.get("mismatches", []):
        con.print(f"[bold yellow]preset did not hold:[/bold yellow] {escape(m)}")
    for w in r.warnings:
        console().print(f"[yellow]note:[/yellow] {escape(w)}")
    return EXIT_OK
