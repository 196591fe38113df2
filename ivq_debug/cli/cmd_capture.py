"""``ivq capture onnx|qnn MODEL --inputs X.npz -o OUT.h5``: capture per-layer tensors into a dump."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ivq_debug.arrays import read_arrays
from ivq_debug.capture.base import BACKENDS, Selection, capture, make_runner, model_facts, sample_shapes
from ivq_debug.cli.common import comma_list, escape, fmt_bytes
from ivq_debug.cli.sessions import (
    add_onnx_session_arguments,
    add_optimization_argument,
    add_qnn_session_arguments,
    session_options,
)
from ivq_debug.console import console, results
from ivq_debug.errors import EXIT_OK, UsageError
from ivq_debug.onnxgraph.inputs import check_feeds


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq capture``: one sub-command per registered backend, each with the common flags and its
    own (``ivq capture onnx --help`` lists no QNN flag, ``ivq capture qnn --help`` no ONNX Runtime-only one)."""
    sub = p.add_subparsers(dest="backend", metavar="BACKEND", required=True, parser_class=type(p))
    for b in BACKENDS.values():
        sp = sub.add_parser(b.name, help=b.help, description=f"ivq capture {b.name}: {b.help}")
        _common_arguments(sp)
        BACKEND_ARGUMENTS.get(b.name, lambda _p: None)(sp)


def _common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model (.onnx; a QDQ model for qnn)")
    p.add_argument("--inputs", action="append", required=True, metavar="X.npz",
                   help="model inputs, one .npz per sample (keys = input names; a .npy is one input named after the "
                        "file); repeat for several samples. Pickled (object) arrays are refused")
    p.add_argument("-o", "--output", required=True, help="dump to write (.h5; its folder must exist)")
    p.add_argument("--part", default="model", help="record part name (vision, prefill, decode, model)")
    p.add_argument("--include", action="append", default=None, metavar="GLOB", help="tensor names to capture")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="tensor names to skip")
    p.add_argument("--op-types", default=None, help="only tensors produced by these op types (comma-separated)")
    p.add_argument("--skip-attention-probs", action="store_true",
                   help="do not capture attention probabilities (Softmax outputs): the largest tensors of a VLM")
    p.add_argument("--skip-views", action="store_true",
                   help="do not capture outputs of data-movement ops (Reshape, Transpose, ...): copies of their input")
    p.add_argument("--max-outputs-per-run", type=int, default=None, metavar="N",
                   help="capture in groups of at most N tensors (bounds memory); on the CPU EP each group is a "
                        "consecutive subgraph, so the capture still costs one forward (default on the CPU EP: "
                        "groups of about 1 GiB when a record's tensors would take more)")
    add_optimization_argument(p, "ORT graph optimization level (default disable: exact reference, every node output). "
                                 "Above disable only the tensors of the optimized graph are exposed (no fusion is "
                                 "stopped) and the model outputs are checked bit-identical with and without the "
                                 "exposure; recorded in the dump (a comparison warns when the two sides differ)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op threads (default: ONNX Runtime's, one per core); recorded in the dump")
    p.add_argument("--summary-only", action="store_true", help="store statistics and sampled values only")
    p.add_argument("--force", action="store_true", help="overwrite the output dump")


def _onnx_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--whole-model-runs", action="store_true",
                   help="with --max-outputs-per-run, run the whole model once per group instead of subgraphs")
    add_onnx_session_arguments(p)


def _qnn_arguments(p: argparse.ArgumentParser) -> None:
    add_qnn_session_arguments(p)
    p.add_argument("--profiling", choices=["off", "basic", "detailed"], default="off", help="QNN profiling")


#: the flags only one backend takes (``ivq capture <backend> --help``), by registered backend name
BACKEND_ARGUMENTS: dict[str, Any] = {"onnx": _onnx_arguments, "qnn": _qnn_arguments}


def runner_options(args: argparse.Namespace) -> dict[str, Any]:
    """The runner keyword arguments the command line gives (``None``: the runner's default)."""
    sel = Selection(
        include=args.include or ("*",), exclude=args.exclude,
        op_types=comma_list(args.op_types, "--op-types"),
        skip_attention_probs=args.skip_attention_probs, skip_views=args.skip_views,
    )
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1")
    opts: dict[str, Any] = {"selection": sel, "max_outputs_per_run": args.max_outputs_per_run,
                            "threads": args.threads, **session_options(args, args.backend)}
    if args.backend == "onnx":
        opts["partition"] = False if args.whole_model_runs else None
    else:
        opts["overwrite"] = args.force
        if args.profiling != "off":
            opts.update(profiling_level=args.profiling, profiling_path=Path(args.output).with_suffix(".profile.csv"))
    return opts


def execute(args: argparse.Namespace) -> int:
    """Run the capture."""
    samples = [read_arrays(p) for p in args.inputs]
    if args.max_outputs_per_run is not None and args.max_outputs_per_run < 1:
        raise UsageError("--max-outputs-per-run must be >= 1")
    shapes = sample_shapes(args.backend, args.model, samples)
    runner = make_runner(args.backend, args.model, input_shapes=shapes or None, **runner_options(args))
    check_feeds(samples, runner.model, args.inputs)
    capture(runner, samples, args.output, part=args.part, model=model_facts(args.model, args.part), overwrite=args.force,
            summary_only=args.summary_only)
    con = console()
    for line in runner.info.get("fixed_dims", []):
        con.print(f"[yellow]note:[/yellow] intake: fixed {escape(line)}")
    results().print(f"wrote {escape(args.output)}: {len(runner.sites)} tensors × {len(samples)} sample(s) "
                    f"({runner.backend}), {fmt_bytes(Path(args.output).stat().st_size)}")
    opt = runner.info.get("optimized_graph")
    if opt and opt["dropped"]:
        con.print(f"{opt['dropped']} selected tensor(s) do not exist in the optimized graph "
                  f"({args.optimization}): not exposed, so no fusion is stopped")
    check = runner.info.get("exposure_check")
    if check is not None and not check["bit_identical"]:
        con.print(f"[yellow]warning:[/yellow] exposing the tensors changed the model outputs (max abs "
                  f"{check['max_abs']:.3g}): the captured tensors are not exactly what the deployment computes")
    return EXIT_OK
