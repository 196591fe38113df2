"""``ivq tune MODEL --calibration C --inputs X.npz -o WORKDIR``: suggest overrides, verify them, recommend the
first set that does not make the verified backend worse (docs/tune.md)."""

from __future__ import annotations

import argparse
import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from ivq_debug.arrays import read_arrays
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.cli.common import add_qnn_target_arguments, comma_list, escape, fmt_num, write_json
from ivq_debug.cli.jobs import add_executor_arguments, executor_from_args
from ivq_debug.cli.render import Col, TableData, emit, resolve_format
from ivq_debug.console import results, status, warn
from ivq_debug.diagnose.replay import replay
from ivq_debug.dump import open_dump
from ivq_debug.errors import EXIT_FAIL, EXIT_OK, RunError, UsageError, require_extra
from ivq_debug.onnxgraph.inputs import check_feeds
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.outputs import atomic_write_text
from ivq_debug.plots import frontier
from ivq_debug.qnn.encodings import read_encodings
from ivq_debug.qnn.quantize import CALIBRATE_METHODS, load_calibration
from ivq_debug.tune.search import COMBINATIONS, Lever, global_levers, lever_label, search, unit_levers
from ivq_debug.tune.suggest import from_encodings, read_overrides, suggest, write_suggestions
from ivq_debug.tune.sweep import (
    DEFAULT_GROUPS,
    MIN_GAIN_DB,
    PRECISIONS,
    TaskMetric,
    quantized_activations,
    suggestion_groups,
    sweep,
)
from ivq_debug.tune.verify import (
    CHECKPOINT,
    MAX_CANDIDATES,
    Tuner,
    evaluation_split,
    greedy,
    load_task_metric,
    prune_workdir,
    verify,
)
from ivq_debug.validate import check_outputs

#: ``--search``: the frontier plot (gain vs cost of every lever), beside ``tune.json``
FRONTIER_SVG = "frontier.svg"


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``ivq tune``."""
    p.add_argument("model", help="float ONNX model")
    p.add_argument("--calibration", required=True, help="calibration data (see ivq quantize); the only source of "
                                                        "calibrated and widened ranges")
    p.add_argument("--inputs", action="append", required=True, metavar="X.npz",
                   help="evaluation inputs, one .npz per sample (repeatable): scored only, never calibrated on")
    p.add_argument("-o", "--workdir", required=True, help="folder for trial models, checkpoint and results (and dumps with --keep-dumps)")
    p.add_argument("--reference", help="float reference dump of the same inputs (default: the float model run with ORT "
                                       "in memory as the trials read it; --keep-dumps writes WORKDIR/reference.h5)")
    p.add_argument("--overrides", help="verify this overrides file instead of suggesting one")
    p.add_argument("--preset", default="a8w8", choices=["a8w8", "a16w8", "a16w16"])
    p.add_argument("--backend", default="qnn", choices=["qnn", "cpu"],
                   help="verify on QNN HTP (emulated on x86_64; default) or ORT CPU-QDQ")
    p.add_argument("--optimization", default="disable", choices=["disable", "basic", "extended", "all"],
                   help="qnn: ORT graph optimization level of every HTP session (as ivq capture qnn; 'all' folds "
                        "Shape -> Reshape chains HTP refuses); recorded in each trial")
    add_qnn_target_arguments(p, "qnn: ")
    p.add_argument("--fast-compile", action="store_true",
                   help="qnn: QNN's faster, less optimized finalization (recorded)")
    p.add_argument("--per-channel", action="store_true", help="quantizer knob: per-channel weights in every trial")
    p.add_argument("--calibrate-method", default="minmax", choices=sorted(CALIBRATE_METHODS),
                   help="quantizer knob: the calibration method of every trial")
    p.add_argument("--tensors", action="append", default=[], metavar="GLOB",
                   help="only suggest overrides for tensors / weights matching this glob (repeatable)")
    p.add_argument("--watch", action="append", default=[], metavar="TENSOR",
                   help="tensor(s) whose SQNR is the end-to-end figure (default: the last output)")
    p.add_argument("--task-metric", metavar="MODULE:FUNCTION",
                   help="a function scoring the model outputs (a list of {output: array}, one per input; higher "
                        "is better); MODULE is an importable module or a .py file")
    p.add_argument("--no-diagnose", action="store_true",
                   help="suggest from the comparison only (no introduced-error replay of the baseline)")
    p.add_argument("--greedy", action="store_true", help="add suggestions one at a time while they help")
    p.add_argument("--search", action="store_true",
                   help="measure the whole lever space — global knobs (per-channel, a16w8, both, a16w16, calibration "
                        "method), the diagnosis' pattern groups, unit fixes, combinations — and choose by gain per "
                        "cost under --max-size / --max-cycles / --target-metric; prints the frontier (docs/tune.md)")
    p.add_argument("--max-size", type=float, default=None, metavar="RATIO",
                   help="--search: the largest model size as a ratio of the baseline's (e.g. 1.5)")
    p.add_argument("--max-cycles", type=float, default=None, metavar="RATIO",
                   help="--search: the largest emulated HTP cycles as a ratio of the baseline's (QNN trials)")
    p.add_argument("--target-metric", type=float, default=None, metavar="VALUE",
                   help="--search: the value to reach, the cheapest lever reaching it wins: the task metric with "
                        "--task-metric, else the worst watched SQNR (dB)")
    p.add_argument("--combinations", type=int, default=None, metavar="N",
                   help=f"--search: extra trials of the combination step (the best lever within the budget with the "
                        f"unit levers of its own CPU-QDQ diagnosis, then grown greedily by the other levers, ranked "
                        f"by gain per cost; default {COMBINATIONS}, 0: none)")
    p.add_argument("--no-early-stop", action="store_true",
                   help="--search: run every lever on every evaluation sample (by default a lever stops at the sample "
                        "that proves it lowers a watched tensor or cannot be chosen; the choice is the same)")
    p.add_argument("--frontier", action="store_true",
                   help="--search with trials on the target: measure the frontier in full (a lever that cannot be "
                        "chosen still runs every sample unless a lever of no greater cost scored above it; slower: "
                        "on HTP the frontier's 16-bit levers run every line). By default such a lever stops once it "
                        "cannot be chosen and a frontier mark it could overturn reads '?'; the choice is the same")
    p.add_argument("--sweep", action="store_true",
                   help="layer group x precision: each candidate one job (re-quantize, capture, compare), the best "
                        "set picked from the shards and verified (docs/tune.md); resumable")
    p.add_argument("--groups", default=str(DEFAULT_GROUPS), metavar="N|suggest",
                   help="--sweep: N consecutive blocks of the quantized activations (default %(default)s), or "
                        "'suggest': the suggestions' pattern groups")
    p.add_argument("--precisions", default=",".join(PRECISIONS), metavar="P[,P]",
                   help=f"--sweep: precisions to try per group ({', '.join(PRECISIONS)}; default %(default)s)")
    p.add_argument("--min-gain", type=float, default=MIN_GAIN_DB, metavar="DB",
                   help="--sweep: the least gain of the worst watched SQNR that makes a candidate eligible")
    add_executor_arguments(p, "the --sweep candidates and the --search levers", "one after the other in this process")
    p.add_argument("--budget", type=float, default=None, metavar="DB",
                   help="target SQNR of the watched tensors (greedy and sweep stop there; exit 1 when missed)")
    p.add_argument("--max-candidates", type=int, default=MAX_CANDIDATES, metavar="N",
                   help="candidate sets to try before giving up (each is one trial; default %(default)s)")
    p.add_argument("--format", default="legacy", choices=["legacy", "1.0.0", "ort"],
                   help="overrides file format (every trial writes and reads it back)")
    p.add_argument("--keep-dumps", action="store_true",
                   help="write and keep every trial's dump (the reference's too) and keep every trial model (default: "
                        "no dump is written; a finished run keeps the checkpoint, the overrides files and the "
                        "baseline's and recommended QDQ models)")
    p.add_argument("--resume", action="store_true", help="reuse the finished trials of WORKDIR/trials/checkpoint.json")
    p.add_argument("--force", action="store_true", help="reuse a non-empty workdir, overwriting its files")


def execute(args: argparse.Namespace) -> int:
    """Run the loop: every input is read and checked before the workdir is created; a workdir this run
    created is removed when it fails or is interrupted before it finished a trial (then the checkpoint or a shard
    keeps it for ``--resume``)."""
    wd = Path(args.workdir)
    if wd.exists() and any(wd.iterdir()) and not (args.force or args.resume):
        raise UsageError("workdir is not empty; pass --force to reuse it (or --resume to reuse its trials)", wd)
    if args.max_candidates < 1:
        raise UsageError("--max-candidates must be >= 1")
    if sum(map(bool, (args.sweep, args.greedy, args.search))) > 1:
        raise UsageError("--sweep, --greedy and --search are three searches: choose one")
    if not args.search and (any(v is not None for v in (args.max_size, args.max_cycles, args.target_metric,
                                                         args.combinations)) or args.no_early_stop
                            or args.frontier):
        raise UsageError("--max-size, --max-cycles, --target-metric, --combinations, --no-early-stop and --frontier "
                         "are for --search")
    for flag, v in (("--max-size", args.max_size), ("--max-cycles", args.max_cycles)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise UsageError(f"{flag} must be a positive ratio, got {v}")
    if not (args.sweep or args.search) and (args.executor or args.workers is not None or args.ray_address):
        raise UsageError("--executor, --workers and --ray-address are for --sweep and --search")
    if args.backend == "qnn":  # before any work: exit 5 naming the extra, not a failed baseline trial
        require_extra("onnxruntime_qnn", "`ivq tune --backend qnn` (the default; --backend cpu verifies on ORT CPU-QDQ)")
    executor = executor_from_args(args, implied=True) if args.sweep or args.search else None
    metric = load_task_metric(args.task_metric) if args.task_metric else None
    if metric is not None and (args.sweep or args.search):
        metric = TaskMetric(args.task_metric)  # a worker loads it again by its spec
    model = load_model(args.model)
    feeds = [read_arrays(p) for p in args.inputs]
    check_feeds(feeds, model, args.inputs)
    calibration, _ = load_calibration(args.calibration, model)
    if args.overrides:
        read_encodings(args.overrides, model=args.model)  # checked now; read for the trials below
    if args.reference:
        open_dump(args.reference).close()
    inputs = [args.model, args.calibration, *args.inputs, args.overrides, args.reference]
    outputs = ["overrides.json", "overrides.rationale.md", "tune.json",
               *([] if args.reference or not args.keep_dumps else ["reference.h5"]),
               *([FRONTIER_SVG] if args.search else [])]
    check_outputs([wd / n for n in outputs], inputs, overwrite=True,  # even --force never replaces an input
                  folders_exist=False)  # the workdir is made below (and removed if this run fails)
    missing = [d for d in (wd, *wd.parents) if not d.exists()]  # innermost first
    wd.mkdir(parents=True, exist_ok=True)
    if not args.resume:  # --force reuses the folder, not an earlier run's results: only --resume reads its shards
        for kind in ("sweep", "search"):
            shutil.rmtree(wd / "trials" / kind / "shards", ignore_errors=True)
    try:
        return _tune(args, wd, calibration, feeds, metric, executor)
    except BaseException:
        # an interrupted or failed run keeps what it finished (the checkpoint, the trials, a sweep's shards):
        # `--resume` continues from there; only a run that finished nothing removes the folders it created
        if (wd / "trials" / CHECKPOINT).exists() or any(
                any((wd / "trials" / kind / "shards").glob("*.json")) for kind in ("sweep", "search")):
            raise
        if missing:  # the folders this run created, nothing else
            shutil.rmtree(missing[-1], ignore_errors=True)
        raise


def _tune(args: argparse.Namespace, wd: Path, calibration: Any, feeds: list[dict], metric: Any,
          executor: Any = None) -> int:
    kw: dict[str, Any] = {"calibrate_method": args.calibrate_method}
    if args.per_channel:
        kw["per_channel"] = True
    calibration, feeds, evaluation = evaluation_split(calibration, feeds)
    session = {k: v for k, v in (("soc_model", args.soc_model), ("htp_arch", args.htp_arch),
                                 ("fast_compile", args.fast_compile or None)) if v is not None}
    # the float reference: the user's dump, the one --keep-dumps keeps, else made in memory as the trials read it
    ref = Path(args.reference) if args.reference else wd / "reference.h5" if args.keep_dumps else None
    tuner = Tuner(Path(args.model), calibration, feeds, ref,
                  wd / "trials", preset=args.preset, quantize_kw=kw, backend=args.backend, fmt=args.format,
                  output_metric=metric, resume=args.resume, target="qnn", optimization=args.optimization,
                  qnn_session=session, evaluation=evaluation, keep_dumps=args.keep_dumps,
                  watch=tuple(args.watch))  # a resumed run's checkpoint is checked here
    if evaluation["warning"]:
        warn(evaluation["warning"])
    if ref is not None and not args.reference and not (args.resume and ref.exists()):
        with status("reference: the float model on the evaluation inputs (ORT CPU)"):
            capture(make_runner("onnx", tuner.source(), selection=Selection()), feeds, ref,
                    overwrite=True, progress=None)
    con = results()  # the results (tables, verdict lines) go to stdout
    where = "QNN HTP" if args.backend == "qnn" else "ORT CPU-QDQ"
    with status(f"baseline: quantize, capture on {where}, compare"):
        before = tuner.trial("before", [])
    if before.error:  # the whole reason: the refusal is what the user has to act on
        raise RunError(f"the baseline trial failed on {where} (optimization {args.optimization}): {before.error}")
    if args.sweep:
        return _sweep(args, con, tuner, before, executor, where, wd)
    if args.search:
        return _search(args, con, tuner, before, where, wd, executor)
    sug = _suggestions(args, tuner, before)
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
        with status(f"verifying {len(sug)} override(s) on {where}"):
            rep = verify(tuner, sug, watch or (), before=before, max_candidates=args.max_candidates)
    path = md = None
    if rep.recommended and rep.after.suggestions:
        path, md = _write_overrides(args, tuner, rep, wd)
    doc = rep.to_dict()
    write_json(doc | {"evaluation": tuner.evaluation, "workdir": _prune(args, tuner, rep, wd),
                      "timings": tuner.timing_summary()}, str(wd / "tune.json"),
               overwrite=True)
    _print(con, rep, where)
    if not rep.recommended:
        con.print(f"[bold red]no override set recommended[/bold red]: each of the {len(rep.refused)} candidate "
                  f"set(s) tried was refused: worse on {where}, refused or not held on QNN HTP, or failed (each reason "
                  f"above; {escape(wd / 'tune.json')})")
        return EXIT_FAIL
    con.print(f"overrides: {escape(path)} · rationale: {escape(md)} · results: {escape(wd / 'tune.json')}")
    return _budget(con, rep, args.budget)


def _suggestions(args: argparse.Namespace, tuner: Tuner, before: Any, with_replay: bool = False,
                 lever: Lever | None = None) -> Any:
    """The suggestions: from ``--overrides``, else from the baseline's comparison (and its replay; returned too
    with ``with_replay``). ``lever``: the comparison is that lever's trial (the search's start), replayed
    whatever ``--no-diagnose`` says, its knobs the quantizer's."""
    if args.overrides and lever is None:
        encs, nodes = read_overrides(args.overrides, load_model(tuner.source()))
        return from_encodings(encs, nodes)
    with status("calibration ranges: the float model on the calibration data"):
        ranges = tuner.calibration_ranges()
    rp = None
    if not args.no_diagnose or lever is not None:
        with status(f"introduced error: replaying the units of {lever.name if lever else 'the baseline'} (CPU-QDQ)"):
            rp = replay(before.qdq_model, before.comparison.ref, cumulative=before.comparison,
                        float_model=tuner.source(), progress=False)
    sug = suggest(before.comparison, rp, ranges=ranges, float_model=tuner.source(), tensors=args.tensors,
                  per_channel=lever.per_channel if lever else args.per_channel,
                  preset=lever.preset if lever else args.preset, backend=tuner.target)
    before.release()  # the sample the diagnosis read goes (its figures stay)
    return (sug, rp) if with_replay else sug


def _start_diagnosis(args: argparse.Namespace) -> Any:
    """The search's combination step's first round (``search.grow`` ``units``): the start lever's own diagnosis —
    its model compared whole on ORT CPU-QDQ (as the replay runs; in memory, a dump with ``--keep-dumps``) in
    ``search/diagnosis/<lever>/``, replayed,
    suggested — as unit levers at its knobs; the folder goes afterwards (kept with ``--keep-dumps``)."""
    def units(vt: Tuner, lever: Lever) -> list[Lever]:
        folder = Path(vt.workdir) / "search" / "diagnosis"
        cpu = replace(vt.worker(folder / lever_label(lever)), backend="cpu", runner_factory=None)
        try:
            with status(f"the diagnosis of {lever.name}: its model compared whole (CPU-QDQ)"):
                tr = cpu.trial("start", list(lever.suggestions), keep_dump=args.keep_dumps, whole=True)
            if tr.error:
                warn(f"the diagnosis of {lever.name} failed ({tr.error}); its unit levers are not tried")
                return []
            sug, rp = _suggestions(args, cpu, tr, with_replay=True, lever=lever)
            return [u for u in unit_levers(vt, sug, rp) if u.kind == "unit"]
        finally:
            if not args.keep_dumps:
                shutil.rmtree(folder, ignore_errors=True)
    return units


def _sweep(args: argparse.Namespace, con: Any, tuner: Tuner, before: Any, executor: Any, where: str,
           wd: Path) -> int:
    """``--sweep``: the candidates as jobs, the results table, the chosen set's overrides and ``tune.json``."""
    if args.groups == "suggest":
        groups: Any = suggestion_groups(_suggestions(args, tuner, before), quantized_activations(tuner, before))
        if not groups:
            con.print("[green]nothing to sweep: no suggestion names an activation[/green]")
            return EXIT_OK
    else:
        try:
            groups = int(args.groups)
        except ValueError:
            raise UsageError(f"--groups wants a number or 'suggest', got {args.groups!r}") from None
    res = sweep(tuner, groups=groups, precisions=comma_list(args.precisions, "--precisions") or [],
                watch=args.watch, budget_sqnr_db=args.budget, min_gain_db=args.min_gain, executor=executor,
                before=before, tensors=args.tensors)
    rep = res.report
    path = md = None
    if rep.recommended and rep.after.suggestions:
        path, md = _write_overrides(args, tuner, rep, wd)
    write_json(res.to_dict() | {"evaluation": tuner.evaluation}, str(wd / "tune.json"), overwrite=True)
    out = results()
    num = ("tensors", "sqnr_db", "gain_db", "cost", "efficiency", "rank")
    cols = [Col(head, key, "num" if key in num else "text", drop={"cost": 3, "efficiency": 2, "tensors": 1}.get(key, 0))
            for head, key in (("group", "group"), ("precision", "precision"), ("overrides", "tensors"),
                              ("SQNR dB", "sqnr_db"), ("gain dB", "gain_db"), ("cost", "cost"),
                              ("gain/cost", "efficiency"), ("rank", "rank"), ("status", "status"))]
    emit(out, [TableData(f"sweep: {len(res.groups)} group(s) x {', '.join(res.precisions)} on {where} (gain per "
                         f"relative {'cycles' if res.cost_basis == 'cycles' else 'model bytes'})", cols,
                         res.table.to_dict("records"))], resolve_format(None, out))
    j = res.jobs
    out.print(f"{j['total']} job(s) on {j['executor']}: {j['run']} run, {j['resumed']} resumed from shards, "
              f"{len(j['retried'])} retried; shards in {escape(j['shards'])}")
    _print(out, rep, where)
    if not rep.recommended:
        why = "no candidate gains" if not res.chosen else "the chosen set made it worse"
        out.print(f"[bold red]no override set recommended[/bold red]: {why} (see {escape(wd / 'tune.json')})")
        return EXIT_FAIL
    out.print(f"chosen: {', '.join(res.chosen)} · overrides: {escape(path)} · rationale: {escape(md)} · results: "
              f"{escape(wd / 'tune.json')}")
    return _budget(out, rep, args.budget)


def _search(args: argparse.Namespace, con: Any, tuner: Tuner, before: Any, where: str, wd: Path,
            executor: Any = None) -> int:
    """``--search``: every lever measured, the frontier table, the chosen lever's knobs and overrides."""
    rp = None
    if args.overrides:
        encs, nodes = read_overrides(args.overrides, load_model(tuner.source()))
        sug = from_encodings(encs, nodes)
    else:
        sug, rp = _suggestions(args, tuner, before, with_replay=True)
    levers = global_levers(tuner) + unit_levers(tuner, sug, rp)
    task = next(iter(before.task), None) if args.task_metric else None
    with status(f"search: {len(levers)} lever(s) and their combinations on {where}"):
        res = search(tuner, before, levers, watch=args.watch, max_size=args.max_size, max_cycles=args.max_cycles,
                     target=args.target_metric, target_task=task, executor=executor,
                     combinations=COMBINATIONS if args.combinations is None else args.combinations,
                     diagnosis=None if args.overrides else _start_diagnosis(args),
                     early_stop=not args.no_early_stop, frontier=args.frontier)
    rep = res.report
    path = None
    if rep.recommended and rep.after.suggestions:
        path, _ = _write_overrides(args, tuner, rep, wd, preset=res.chosen.preset)
    doc = res.to_dict()
    if any(r["gain_db"] is not None and r["cost"] is not None for r in res.table):
        atomic_write_text(wd / FRONTIER_SVG, str(frontier(res)), overwrite=True)
        doc["search"]["plot"] = FRONTIER_SVG
    write_json(doc | {"evaluation": tuner.evaluation, "workdir": _prune(args, tuner, rep, wd),
                      "timings": tuner.timing_summary()}, str(wd / "tune.json"),
               overwrite=True)
    out = results()
    cols = [Col("lever", "lever", "name"), Col("kind", "kind", drop=3), Col("knobs", "knobs", drop=4),
            Col("overrides", "overrides", "num", drop=5), Col("SQNR dB", "sqnr_db", "num"),
            Col("gain dB", "gain_db", "num"), Col(f"cost ({res.cost_basis})", "cost", "num", drop=2),
            Col("gain/cost", "efficiency", "num", drop=1), Col("frontier", "mark"),
            Col("status", "status")]
    rows = sorted(({**r, "mark": "*" if r["frontier"] else "?" if r.get("frontier_open") else ""}
                   for r in res.table), key=lambda r: (r["cost"] is None, r["cost"] or 0.0, -(r["gain_db"] or 0.0)))
    open_ = any(r["mark"] == "?" for r in rows)
    emit(out, [TableData(f"search: {len(res.table)} lever(s) on {where}, gain vs relative {res.cost_basis} "
                         "(* the frontier" + ("; ? a lever stopped early may beat it: --frontier settles it"
                                              if open_ else "") + ")", cols, rows)], resolve_format(None, out))
    _print(out, rep, where)
    if not rep.recommended:
        out.print(f"[bold red]no lever recommended[/bold red]: none gains within the budget and holds on "
                  f"{where} (see {escape(wd / 'tune.json')})")
        return EXIT_FAIL
    held = tuner.evaluation.get("held_out")
    cmd = (f"ivq quantize MODEL --calibration CALIBRATION {res.chosen.command()}"
           + (f" --overrides {path}" if path else "")
           + (f" --max-samples {tuner.evaluation['calibration_samples']}" if held else ""))
    out.print(f"chosen: {escape(res.chosen.name)} · reproduce: {escape(cmd)} · results: {escape(wd / 'tune.json')}"
              + (f" · frontier plot: {escape(wd / FRONTIER_SVG)}" if "plot" in doc["search"] else ""))
    if args.target_metric is not None:
        worst = min((rep.after.sqnr(w) or -1e9) for w in rep.watch) if task is None else rep.after.task.get(task)
        if worst is None or worst < args.target_metric:
            out.print(f"[bold red]target missed[/bold red]: {fmt_num(worst)} < {args.target_metric:g}")
            return EXIT_FAIL
    return _budget(out, rep, args.budget)


def _prune(args: argparse.Namespace, tuner: Tuner, rep: Any, wd: Path) -> dict[str, Any]:
    """A finished run keeps what the report needs (``verify.prune_workdir``; the reference dump this run made
    too) unless ``--keep-dumps``; the workdir's size as ``tune.json`` records it."""
    if not args.keep_dumps:
        prune_workdir(tuner.workdir, [rep.before.qdq_model, rep.after.qdq_model])
        if not args.reference:
            (wd / "reference.h5").unlink(missing_ok=True)
    size = sum(f.stat().st_size for f in wd.rglob("*") if f.is_file())
    return {"bytes": size, "model_bytes": Path(args.model).stat().st_size, "pruned": not args.keep_dumps}


def _write_overrides(args: argparse.Namespace, tuner: Tuner, rep: Any, wd: Path,
                     preset: str | None = None) -> tuple[Path, Path]:
    act_bits = 16 if (preset or args.preset).startswith("a16") else 8
    return write_suggestions(rep.after.suggestions, wd / "overrides.json", fmt=args.format, activation_bits=act_bits,
                             float_model=tuner.source(), overwrite=True)


def _budget(con: Any, rep: Any, budget: float | None) -> int:
    if budget is not None:
        worst = min((rep.after.sqnr(w) or -1e9) for w in rep.watch)
        if worst < budget:
            con.print(f"[bold red]budget missed[/bold red]: {worst:.1f} dB < {budget:g} dB")
            return EXIT_FAIL
    return EXIT_OK


def _print(con: Any, rep: Any, where: str) -> None:
    """The refused candidates, the end-to-end table and the changed layers, on stdout (the results)."""
    out = results()
    for r in rep.refused:
        on = "" if "QNN HTP" in r["reason"] or "not run by" in r["reason"] else f" on {where}"
        out.print(f"[yellow]refused[/yellow] {escape(r['candidate'])} ({len(r.get('overrides', []))} override(s)): "
                  f"{escape(r['reason'])}{on}")
    tables = [TableData(f"end to end ({where})", [Col("what", "what", "name"), Col("before", "before", "num"),
                                                    Col("after", "after", "num"), Col("change", "change", "num")],
                        rep.end_to_end.to_dict("records"))]
    if rep.recommended:
        tables.append(TableData(
            f"changed layers ({len(rep.after.suggestions)})",
            [Col("tensor", "tensor", "name"), Col("action", "action", drop=1), Col("SQNR before", "sqnr_before", "num"),
             Col("after", "sqnr_after", "num", drop=2), Col("gain dB", "gain_db", "num")],
            rep.changed.head(20).to_dict("records")))
    emit(out, tables, resolve_format(None, out))
    _print_check(out, rep, where)


def _print_check(con: Any, rep: Any, where: str) -> None:
    """The per-sample spread and, when the trials ran on CPU-QDQ, the recommended set measured on HTP."""
    for side in ("before", "after"):
        for w, v in getattr(rep, side).samples.items():
            if v.get("n", 0) > 1:
                con.print(f"{side}: {escape(w)} over {v['n']} evaluation samples: mean {v['mean']:.2f} dB, worst "
                          f"sample {v['worst']:.2f} dB ({where})")
    chk = rep.target_check or {}
    if chk.get("same_as_trials") or not chk:
        return
    if not chk.get("checked"):
        con.print(f"[yellow]not checked on QNN HTP[/yellow]: {escape(chk.get('reason', ''))}")
        return
    for w, f in (chk.get("watch") or {}).items():
        (cb, ca), (hb, ha) = f["cpu"], f["htp"]
        con.print(f"{escape(w)}: CPU-QDQ {fmt_num(cb)} -> {fmt_num(ca)} dB; QNN HTP {fmt_num(hb)} -> {fmt_num(ha)} dB")
    for k, f in (chk.get("task") or {}).items():
        (cb, ca), (hb, ha) = f["cpu"], f["htp"]
        con.print(f"{escape(k)}: CPU-QDQ {fmt_num(cb)} -> {fmt_num(ca)}; QNN HTP {fmt_num(hb)} -> {fmt_num(ha)}")
    if chk.get("error"):
        con.print(f"[red]QNN HTP[/red]: {escape(chk['error'])}")
