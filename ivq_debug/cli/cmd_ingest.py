"""``ivq ingest``: a device's run folders into a golden dump.

``ivq ingest qnn-net-run OUTPUT_DIR (--graph NET.json | --model PART.onnx) -o OUT.h5``: one qnn-net-run run.
``ivq ingest session --prefill DIR --decode DIR [--vision DIR] --model-dir PARTS/ -o S.h5``: a device session
(vision, prefill and decode calls of one or more samples) in one dump (``docs/device-sessions.md``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ivq_debug.capture.qnn_net_run.ingest import (
    SESSION_PARTS,
    NetRunCapture,
    SessionSpec,
    capture_net_run,
    capture_net_run_model,
    capture_session,
)
from ivq_debug.cli.common import escape, write_json
from ivq_debug.console import console, results, status
from ivq_debug.errors import EXIT_FAIL, EXIT_OK, UsageError


def parse_dims(specs: Sequence[str]) -> dict[str, int]:
    """``--dim NAME=VALUE`` values: dynamic axes to pin."""
    out = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value.isdigit() or int(value) < 1:
            raise UsageError(f"--dim takes NAME=VALUE with a positive integer, got {spec!r}")
        out[name] = int(value)
    return out


def add_folder_arguments(p: argparse.ArgumentParser) -> None:
    """How the files of a folder are read (``qnn-net-run`` with ``--model``, ``session``)."""
    p.add_argument("--native-inputs", action="store_true",
                   help="input files are in the graph's dtypes (qnn-net-run --use_native_input_files); "
                        "default float32, cast to the graph's input types")
    p.add_argument("--allow-outside-inputs", action="store_true",
                   help="read input_list.txt paths that leave the folder holding it, and raw files / Result "
                        "folders that are symlinks leaving the output folder (refused by default)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                   help="pin a dynamic axis that the byte sizes, the graph's shape inference and the config leave "
                        "open (the error lists every such axis with its candidates); repeatable")
    p.add_argument("--missing-input", action="append", default=[], metavar="[PART:]NAME",
                   help="a graph input the device did not feed, for input lists of bare paths (name:=path lists "
                        "just leave it out); recorded in the dump as not fed; repeatable")


def add_part_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model-dir`` and the per-part overrides (``ingest session``, ``reference``)."""
    p.add_argument("--model-dir", metavar="PARTS/",
                   help="folder of the ONNX parts (export.json parts, else vision*.onnx, prefill*.onnx, decode*.onnx)")
    for part in SESSION_PARTS:
        p.add_argument(f"--{part}-model", metavar="FILE.onnx", help=f"the {part} graph (overrides --model-dir)")
    p.add_argument("--config", metavar="config.json",
                   help="the model's HF config.json (rope_theta, head_dim, mrope_section); default PARTS/config.json")


def part_models(args: argparse.Namespace) -> dict[str, Path]:
    """The ``--<part>-model`` files given."""
    return {part: Path(v) for part in SESSION_PARTS if (v := getattr(args, f"{part}_model", None))}


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq ingest`` (sub-commands ``qnn-net-run`` and ``session``)."""
    sub = p.add_subparsers(dest="source", metavar="SOURCE", parser_class=type(p))
    q = sub.add_parser("qnn-net-run", help="one qnn-net-run output folder",
                       description="One qnn-net-run run (Result_N folders) into a dump.")
    q.add_argument("output_dir", help="qnn-net-run --output_dir (Result_N/ or <graph>/Result_N/), or the run "
                                      "folder holding input_list.txt and output/")
    q.add_argument("--graph", action="append", metavar="NET.json",
                   help="QNN graph JSON (<model>_net.json, ORT dump_json_qnn_graph output or context-binary JSON): "
                        "QNN layouts, native dtypes, encodings; repeat for multi-graph runs. Without it, names, "
                        "dtypes and shapes come from --model")
    q.add_argument("--model", help="the ONNX model: maps sanitized QNN names back to ONNX names; alone (no --graph) "
                                   "it describes the files and input_list.txt is read")
    q.add_argument("--input-list", metavar="FILE", help="the input list (default: input_list.txt of the folder or "
                                                        "its parent); --model only")
    add_folder_arguments(q)
    q.add_argument("--config", metavar="config.json", help="the model's HF config.json, stored in the dump")
    q.add_argument("--profiling", help="profiling file (QNN EP CSV, qnn-profile-viewer text or Chrome trace)")
    q.add_argument("--as-steps", action="store_true",
                   help="Result_N are decode steps first-step + N (default: samples)")
    q.add_argument("--first-step", type=int, default=1,
                   help="step of Result_0 with --as-steps (default 1: decode call k is step k; 0 is the prefill)")
    q.add_argument("--part", action="append", default=[], metavar="[GRAPH=]PART",
                   help="record part (vision, prefill, decode, model): GRAPH=PART per graph with --graph, PART "
                        "with --model")
    q.add_argument("--strict", action="store_true", help="with --graph: fail on the first problem instead of "
                   "writing an incomplete dump (--model always fails)")
    _common(q)
    s = sub.add_parser("session", help="a device session: vision, prefill and decode folders in one dump",
                       description="A device session (docs/device-sessions.md): vision (step 0), prefill (step 0) "
                                   "and decode calls (step k >= 1) of each sample in one dump.")
    s.add_argument("--spec", metavar="SESSION.json", help="a session spec (schema ivq-session/1); flags override it")
    for part in SESSION_PARTS:
        s.add_argument(f"--{part}", action="append", default=[], metavar="DIR",
                       help=f"the {part} run folder (input_list.txt, inputs/, output/Result_N); one per sample, or "
                            f"one holding every sample's calls")
    add_part_model_arguments(s)
    add_folder_arguments(s)
    _common(s)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, help="dump to write (.h5)")
    p.add_argument("--json", metavar="OUT.json", help="write the file -> tensor mapping and unmatched files "
                                                      "(ivq-ingest/1; '-' for stdout)")
    p.add_argument("--device", default=None, help="provenance: device / SoC the run came from")
    p.add_argument("--force", action="store_true", help="overwrite the output dump (and --json)")


def _qnn_net_run(args: argparse.Namespace, info: dict | None) -> NetRunCapture:
    if not args.graph and not args.model:
        raise UsageError("give --model PART.onnx (names, dtypes and shapes from the ONNX graph) or --graph NET.json")
    if args.graph:
        for opt in ("input_list", "config", "missing_input"):
            if getattr(args, opt):
                raise UsageError(f"--{opt.replace('_', '-')} is read with --model alone (without --graph)")
        parts = {}
        for spec in args.part:
            if "=" not in spec:
                raise UsageError(f"--part takes GRAPH=PART with --graph, got {spec!r}")
            g, p = spec.split("=", 1)
            parts[g] = p
        return capture_net_run(args.output_dir, args.output, args.graph if len(args.graph) > 1 else args.graph[0],
                               model=args.model, profiling=args.profiling, strict=args.strict,
                               as_steps=args.as_steps, first_step=args.first_step, parts=parts or None,
                               overwrite=args.force, backend_info=info, allow_outside=args.allow_outside_inputs)
    if args.profiling:
        raise UsageError("--profiling needs --graph (the profile is joined through the QNN graph)")
    if len(args.part) > 1 or any("=" in p for p in args.part):
        raise UsageError("--part takes one PART with --model (one graph)")
    return capture_net_run_model(args.output_dir, args.output, args.model, part=args.part[0] if args.part else "model",
                                 as_steps=args.as_steps, first_step=args.first_step, input_list=args.input_list,
                                 native_inputs=args.native_inputs, allow_outside_inputs=args.allow_outside_inputs,
                                 dims=parse_dims(args.dim), config=args.config, overwrite=args.force,
                                 missing_inputs=args.missing_input,
                                 backend_info=info)


def session_spec(args: argparse.Namespace) -> SessionSpec:
    """The session spec of ``ivq ingest session``: ``--spec`` with the flags given on top."""
    spec = SessionSpec.from_json(args.spec, args.allow_outside_inputs) if args.spec else SessionSpec({})
    for part in SESSION_PARTS:
        if getattr(args, part):
            spec.folders[part] = [Path(f) for f in getattr(args, part)]
    if args.model_dir:
        spec.model_dir = Path(args.model_dir)
    spec.models.update(part_models(args))
    if args.config:
        spec.config = Path(args.config)
    spec.native_inputs = spec.native_inputs or args.native_inputs
    spec.allow_outside_inputs = spec.allow_outside_inputs or args.allow_outside_inputs
    spec.dims.update(parse_dims(args.dim))
    spec.missing_inputs += [m for m in args.missing_input if m not in spec.missing_inputs]
    return spec


def _inputs(args: argparse.Namespace, spec: SessionSpec | None) -> list[str | Path | None]:
    """Every file or folder the ingest reads (no output may replace one of them, even with ``--force``)."""
    if spec is None:
        return [args.output_dir, *(args.graph or ()), args.model, args.profiling, args.input_list, args.config]
    return [args.spec, *(f for fs in spec.folders.values() for f in fs), spec.model_dir, *spec.models.values(),
            spec.config]


def extra_inputs(args: argparse.Namespace) -> list[str | Path | None]:
    """What the ingest reads besides its options (a session spec's folders and models): for the one output check
    (:func:`~ivq_debug.cli.common.check_args_io`)."""
    if not args.source:
        return []
    return _inputs(args, session_spec(args) if args.source == "session" else None)


def execute(args: argparse.Namespace) -> int:
    """Run the ingest; exit 1 when a --graph ingest had to write an incomplete dump."""
    if not args.source:
        raise UsageError("ivq ingest needs a source: qnn-net-run or session (ivq ingest SOURCE --help)")
    spec = session_spec(args) if args.source == "session" else None
    info = {"device": args.device} if args.device else None
    with status(f"ingesting {args.source} folders"):
        cap = _qnn_net_run(args, info) if spec is None else capture_session(
            spec, args.output, overwrite=args.force, backend_info=info)
    if args.json:
        write_json(cap.to_json(), args.json, overwrite=args.force)
    con = results(json_to_stdout=args.json == "-")
    samples = sorted({k[0] for k in cap.records})
    decode = sum(1 for k in cap.records if k[1] == "decode")
    con.print(f"wrote {escape(cap.path)}: {cap.n_tensors} tensors in {len(cap.records)} record(s) of "
              f"{len(samples)} sample(s)" + (f", {decode} decode step(s)" if decode else "")
              + (f", {cap.profiling_rows} profiling rows" if cap.profiling_rows else ""))
    for part, m in cap.parts.items():
        con.print(f"  {part}: {escape(m)}")
    if cap.config_source or cap.llm:  # the hint only where a KV-cache position check can run
        con.print("  config: " + (escape(cap.config_source) if cap.config_source else
                                  "none (pass --config config.json: the KV-cache position check needs rope_theta)"))
    for part, names in cap.not_fed.items():
        con.print(f"  not fed by the device ({part}): {escape(', '.join(names))}")
    if cap.unmatched:
        console().print(f"[yellow]{len(cap.unmatched)} file(s) matched no tensor[/yellow], first: "
                        f"{escape(cap.unmatched[0]['file'])} ({escape(cap.unmatched[0]['reason'])})")
    if not cap.complete:
        for pr in cap.problems[:10]:
            console().print(f"[yellow]incomplete:[/yellow] {escape(pr)}")
        return EXIT_FAIL
    return EXIT_OK
