"""``ivq demo``: the whole story on the embedded reference VLM.

1. load the shipped reference (or a user checkpoint folder) through ``from_pretrained``;
2. export it split like a deployment (vision+projector, prefill, decode; static shapes), verified against
   PyTorch (fp32 ``max_abs <= 1e-5``);
3. quantize every part for QNN (a8w8 and a16w8) with a calibration set of task images (prefill / decode
   calibration feeds recorded from the fp32 scheduler);
4. capture, step by step with teacher forcing: PyTorch, ORT fp32, ORT CPU-QDQ (exact fake-quant) and QNN HTP
   (emulated on x86_64) at a8w8 and a16w8 (each HTP run is judged against the CPU-QDQ run of the same models:
   the three-way ``backend_divergence`` verdict); plus two injected faults: a vision part quantized a8w8 whose
   projector encodings cover only a tenth of the range its calibration should have seen (a calibration
   set that missed the projector's input range; LLM at a16w8), and a scheduler whose decode positions
   restart at 0;
5. measure caption accuracy per backend, diff everything and name the faults;
6. tune the projector fault: suggest overrides, re-quantize, re-capture on HTP, before/after;
7. write ``golden/demo-*.h5``, ``reports/demo.html`` and ``reports/demo.json`` and print what was found.

The caption accuracy runs on a second thread while the captures run, and the tune there while the diffs after
the projector's (one job after the other: the tune's baseline reads the accuracy's memo); their time is in ONNX
Runtime and the HTP emulator, which release the GIL. ``timings_s`` gives each step's own seconds (``accuracy``
and ``tune`` overlap ``capture`` and ``diff``; ``wait`` is the main thread's wait for them); ``docs/scale.md``
"The demo (issue 33)" has the profile.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.api import compare
from ivq_debug.capture.base import Selection, make_runner
from ivq_debug.capture.base import capture as capture_samples
from ivq_debug.capture.torch.hooks import default_selection
from ivq_debug.comparator import Budgets
from ivq_debug.diagnose.projector import PROJECTOR_TOKENS, _has
from ivq_debug.dump import open_dump
from ivq_debug.errors import UsageError, require_extra
from ivq_debug.inputfiles import sha256_file_once
from ivq_debug.jsonio import json_safe
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.onnxgraph.sites import scope_of
from ivq_debug.outputs import atomic_write_text
from ivq_debug.qnn.encodings import encodings_from_qdq_model
from ivq_debug.qnn.quantize import quantize_for_qnn
from ivq_debug.report import write_report
from ivq_debug.tune.suggest import suggest, write_suggestions
from ivq_debug.tune.verify import Tuner, verify
from ivq_debug.vlm import pipeline
from ivq_debug.vlm.manifest import model_attrs
from ivq_debug.vlm.task import CaptionAccuracy, caption_accuracy, make_samples

DUMPS = ("torch", "ort-fp32", "cpu-qdq-a8w8", "cpu-qdq-a16w8", "htp-a8w8", "htp-a16w8", "htp-projector-miss",
         "ort-fp32-restart")
#: the faults of an M-RoPE / Qwen3-VL model, captured on ORT fp32 when the model has them:
#: dump key -> (scheduler knobs, what the model needs, comparison label)
MODEL_FAULTS: dict[str, tuple[dict[str, str], str, str]] = {
    "ort-fp32-rope-delta": ({"positions": "mrope_text_len"}, "mrope",
                            "fault: rope delta dropped (fp32 → fp32 decoding at S + k − 1)"),
    "ort-fp32-deepstack-dropped": ({"deepstack": "dropped"}, "deepstack",
                                   "fault: DeepStack dropped (fp32 → fp32 without the DeepStack features)"),
    "ort-fp32-deepstack-early": ({"deepstack": "before_layer"}, "deepstack",
                                 "fault: DeepStack one layer early (fp32 → fp32, feature k before layer k)"),
    "ort-fp32-mrope-sectioned": ({"mrope_layout": "sectioned"}, "interleaved",
                                 "fault: sectioned M-RoPE (fp32 → fp32 with Qwen2-VL's rotary layout)"),
}


@dataclass
class DemoResult:
    """What the demo produced and measured."""

    dumps: dict[str, Path] = field(default_factory=dict)
    report: Path | None = None
    summary: Path | None = None
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)
    tune: Any = None
    comparisons: dict[str, Any] = field(default_factory=dict)
    findings: dict[str, list[Any]] = field(default_factory=dict)
    export_max_abs: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


class _Recorder:
    """Runner wrapper that keeps a copy of every feed (calibration data for the LLM parts)."""

    def __init__(self, inner: Any, store: list[dict[str, np.ndarray]]) -> None:
        self.inner, self.store = inner, store
        self.backend, self.info = inner.backend, inner.info

    def run(self, feeds: dict[str, np.ndarray], writer: Any = None) -> dict[str, np.ndarray]:
        self.store.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return self.inner.run(feeds, writer)


def _owned(path: Path) -> bool:
    """True when ``path`` is absent or an output of an earlier demo (safe to replace)."""
    if not path.exists():
        return True
    if path.suffix == ".h5":
        try:
            with open_dump(path) as d:
                return bool(d.model.get("demo"))
        except Exception:
            return False
    try:
        head = path.read_text(errors="replace")[:4000]
    except OSError:
        return False
    return "ivq-demo/1" in head or "ivq-debug" in head


def _check_outputs(paths: list[Path], force: bool) -> None:
    for p in paths:
        if not force and not _owned(p):
            raise UsageError("exists and was not written by ivq demo; pass --force to replace it", p)


def run_demo(
    model: str = "internvl-tiny",
    *,
    golden: str | os.PathLike = "golden",
    reports: str | os.PathLike = "reports",
    workdir: str | os.PathLike = "work/demo",
    n_capture: int = 2,
    n_eval: int = 16,
    n_calib: int = 16,
    exporter: str = "legacy",
    force: bool = False,
    log: Callable[[str], None] = print,
) -> DemoResult:
    """Run the demo; returns the paths and the figures (see module docstring)."""

    t_all = time.perf_counter()
    res = DemoResult()
    golden, reports, workdir = Path(golden), Path(reports), Path(workdir)
    dump_paths = {k: golden / f"demo-{k}.h5" for k in (*DUMPS, *MODEL_FAULTS)}
    report_path = reports / "demo.html"
    summary_path = reports / "demo.json"
    _check_outputs([*dump_paths.values(), report_path, summary_path], force)
    for module in ("torch", "transformers", "pandas", "onnxruntime_qnn"):  # before any folder is made
        require_extra(module, "`ivq demo`")
    for d in (golden, reports, workdir):
        d.mkdir(parents=True, exist_ok=True)

    def tick(name: str, t0: float) -> None:
        res.timings[name] = round(time.perf_counter() - t0, 2)

    # 1-2. load + export -----------------------------------------------------------------------------------
    t0 = time.perf_counter()
    prep = pipeline.prepare(model, workdir, exporter=exporter, n_samples=max(n_eval, n_capture), overwrite=True,
                            variants="auto")
    res.export_max_abs = {f"{c.part}": c.worst for c in prep.export.checks}
    log(f"exported {model} ({exporter}, bucket {prep.bucket}): "
        + ", ".join(f"{k} max_abs {v:.1e}" for k, v in res.export_max_abs.items()))
    tick("export", t0)
    samples = prep.samples
    bucket = prep.bucket
    model_info = {"demo": True, "model": str(model), "bucket": bucket, "exporter": exporter,
                  "rope_theta": float(getattr(prep.loaded.model.config.text_config, "rope_theta", 0) or
                                      (prep.loaded.model.config.text_config.rope_parameters or {}).get("rope_theta", 0)),
                  **model_attrs(prep.folder)}  # the HF config: M-RoPE layout and sections for the diagnostics

    # 3. calibration + quantization ------------------------------------------------------------------------
    t0 = time.perf_counter()
    calib = make_samples(n_calib, bucket, seed=99)
    fp32 = pipeline.scheduler(prep)
    store: dict[str, list[dict[str, np.ndarray]]] = {"vision": [], "prefill": [], "decode": []}
    rec = {p: _Recorder(r, store[p]) for p, r in fp32.runners.items()}
    recorder = type(fp32)(fp32.spec, rec, "correct", fp32.max_new_tokens)
    for s in calib:
        recorder.generate(s.image)
    qdq: dict[str, dict[str, Path]] = {"a8w8": {}, "a16w8": {}}
    for preset in ("a8w8", "a16w8"):
        for part, path in prep.paths.items():
            out = workdir / f"{part}.{preset}.qdq.onnx"
            quantize_for_qnn(path, out, store[part], preset=preset, overwrite=True)
            qdq[preset][part] = out
    miss = projector_miss_overrides(prep.paths["vision"], store["vision"], workdir,
                                    calibrated=qdq["a8w8"]["vision"])
    out = workdir / "vision.a8w8.projector-miss.qdq.onnx"
    quantize_for_qnn(prep.paths["vision"], out, store["vision"], preset="a8w8", overrides=miss, overwrite=True)
    qdq["projector-miss"] = dict(qdq["a16w8"], vision=out)
    log(f"quantized vision/prefill/decode at a8w8 and a16w8 with {n_calib} calibration images "
        f"({sum(len(v) for v in store.values())} recorded part feeds)")
    tick("quantize", t0)

    # 5. caption accuracy and 6. tune, on a second thread: the caption accuracy while the captures run, the tune while the
    # diffs after the projector's run (their sessions spend their time in ONNX Runtime and the HTP emulator, which
    # release the GIL; the captures' dump writes and the diffs' bookkeeping hold it) --------------------------------
    ev, cap = samples[:n_eval], samples[:n_capture]
    captions = _Captions(prep, ev)
    plain: dict[str, Callable[[], CaptionAccuracy]] = {
        "fp32": lambda: captions.of(pipeline.scheduler(prep)),
        **{f"htp-{tag}": (lambda tag=tag: captions.htp(qdq[tag])) for tag in ("a8w8", "a16w8", "projector-miss")},
        "fp32-restart": lambda: captions.of(pipeline.scheduler(prep, positions="restart"))}

    def accuracy() -> dict[str, dict[str, float]]:
        t = time.perf_counter()
        out = {name: f().as_dict() for name, f in plain.items()}
        tick("accuracy", t)
        return out

    def tune(cmp: Any) -> Any:
        t = time.perf_counter()
        out = _tune_projector(cmp, prep, qdq, miss, store, dump_paths["ort-fp32"], cap, captions, workdir / "tune",
                              log)
        tick("tune", t)
        return out

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ivq-demo")  # one job after the other
    try:
        accuracy_job = pool.submit(accuracy)
        t0 = time.perf_counter()
        faults = _capture_all(res, prep, fp32, qdq, cap, dump_paths, model_info, workdir, log)
        tick("capture", t0)

        # 5. diffs, findings; the projector's first: the tune starts from it --------------------------------------
        t0 = time.perf_counter()
        pairs, expected = _pairs(dump_paths, faults)
        projector = next(k for k in pairs if "projector" in k)
        cmps: dict[str, Any] = {}
        for lbl in (projector, *(k for k in pairs if k != projector)):
            a, b, budgets = pairs[lbl]
            cmps[lbl] = compare(a, b, budgets=budgets, progress=False, expected=expected.get(lbl))
            if lbl == projector:
                tune_job = pool.submit(tune, cmps[lbl])
        res.comparisons = {k: cmps[k] for k in pairs}
        res.findings = {k: c.findings for k, c in res.comparisons.items()}
        tick("diff", t0)
        t0 = time.perf_counter()
        res.accuracy = accuracy_job.result()
        log("caption exact match on " + f"{len(ev)} eval images: "
            + ", ".join(f"{k} {v['exact_match']:.2f}" for k, v in res.accuracy.items()))
        res.tune = tune_job.result()
        tick("wait", t0)  # for the second thread, after the diffs
    except BaseException:
        captions.stop.set()  # an exception or a signal here: the thread ends at its next image
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

    # 7. report -----------------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    main_label = "deployment (fp32 → HTP a8w8)"
    extra = {k: v for k, v in res.comparisons.items() if k != main_label}
    res.report = write_report(res.comparisons[main_label], report_path, extra_comparisons=extra,
                                  title=f"ivq demo: {model}, fp32 → QNN HTP a8w8 (emulated)", overwrite=True)
    tick("report", t0)
    res.timings["total"] = round(time.perf_counter() - t_all, 2)
    _write_summary(res, summary_path)
    res.summary = summary_path
    return res


def _capture_all(res: DemoResult, prep: Any, fp32: Any, qdq: dict[str, dict[str, Path]], cap: list[Any],
                 dump_paths: dict[str, Path], model_info: dict[str, Any], workdir: Path,
                 log: Callable[[str], None]) -> dict[str, tuple[dict[str, str], str, str]]:
    """Step 4 of the demo: capture every dump (into ``res.dumps``); returns the model's own faults it captured."""
    forced = [fp32.generate(s.image).tokens for s in cap]  # teacher forcing keeps steps comparable
    sel = Selection()

    def ort_factory(paths: dict[str, Path] | None = None) -> Callable[[str, Any], Any]:
        def f(part: str, path: Any) -> Any:
            return make_runner("onnx", paths[part] if paths else path, selection=sel)
        return f

    def htp_factory(paths: dict[str, Path], tag: str) -> Callable[[str, Any], Any]:
        def f(part: str, path: Any) -> Any:
            return make_runner("qnn", paths[part], selection=sel, profiling_level="detailed",
                               profiling_path=workdir / f"{tag}.{part}.profile.csv", overwrite=True)
        return f

    def capture(key: str, sched: Any) -> None:
        def generate(w: Any, i: int, s: Any) -> None:
            sched.generate(s.image, sample=i, writer=w, forced_tokens=forced[i])

        capture_samples(sched, cap, dump_paths[key], record=generate, model=model_info, overwrite=True,
                        progress=None)
        res.dumps[key] = dump_paths[key]
        log(f"captured {key}: {dump_paths[key]}")

    ts = pipeline.torch_reference(prep, selection=default_selection())
    capture("torch", ts)
    capture("ort-fp32", pipeline.scheduler(prep, ort_factory()))
    capture("cpu-qdq-a8w8", pipeline.scheduler(prep, ort_factory(qdq["a8w8"])))
    capture("cpu-qdq-a16w8", pipeline.scheduler(prep, ort_factory(qdq["a16w8"])))
    for tag in ("a8w8", "a16w8", "projector-miss"):
        capture(f"htp-{tag}", pipeline.scheduler(prep, htp_factory(qdq[tag], tag)))
    capture("ort-fp32-restart", pipeline.scheduler(prep, ort_factory(), positions="restart"))
    spec = fp32.spec
    has = {"mrope": spec.mrope, "deepstack": bool(spec.deepstack), "interleaved": spec.mrope_layout == "interleaved"}
    faults = {k: v for k, v in MODEL_FAULTS.items() if has[v[1]]}
    for key, (knobs, _, _) in faults.items():
        capture(key, pipeline.scheduler(prep, ort_factory(), **knobs))
    return faults


def _pairs(d: dict[str, Path], faults: dict[str, tuple[dict[str, str], str, str]]
           ) -> tuple[dict[str, tuple[Path, Path, Budgets]], dict[str, Path]]:
    """The demo's comparisons (label -> reference, test, budgets) and, for the three-way verdicts, each HTP run's
    CPU-QDQ run of the same QDQ models (label -> expected; ``backend_divergence``)."""
    pairs = {
        "export (torch → ORT fp32)": (d["torch"], d["ort-fp32"], Budgets.from_args(preset="export")),
        "quantization (fp32 → CPU-QDQ a8w8)": (d["ort-fp32"], d["cpu-qdq-a8w8"], Budgets.from_args(min_sqnr=20)),
        "backend (CPU-QDQ → HTP a8w8)": (d["cpu-qdq-a8w8"], d["htp-a8w8"], Budgets.from_args(min_sqnr=30)),
        "deployment (fp32 → HTP a8w8)": (d["ort-fp32"], d["htp-a8w8"], Budgets.from_args(min_sqnr=20)),
        "deployment (fp32 → HTP a16w8)": (d["ort-fp32"], d["htp-a16w8"], Budgets()),
        "fault: projector calibration miss (fp32 → HTP, projector encodings cover 1/10 of its range)":
            (d["ort-fp32"], d["htp-projector-miss"], Budgets()),
        "fault: positions restart (fp32 → fp32 with restarted decode positions)":
            (d["ort-fp32"], d["ort-fp32-restart"], Budgets.from_args(min_sqnr=40)),
        **{label: (d["ort-fp32"], d[key], Budgets.from_args(min_sqnr=40)) for key, (_, _, label) in faults.items()},
    }
    expected = {"deployment (fp32 → HTP a8w8)": d["cpu-qdq-a8w8"], "deployment (fp32 → HTP a16w8)": d["cpu-qdq-a16w8"]}
    return pairs, expected


def projector_tensors(model_path: Path) -> set[str]:
    """Activation tensors of the projector (``mlp1`` / ``multi_modal_projector`` / ``merger``): its nodes'
    outputs and their non-constant inputs (the projector's input range)."""

    m = load_model(model_path)
    inits = {i.name for i in m.graph.initializer}
    consts = {o for n in m.graph.node if n.op_type == "Constant" for o in n.output}
    out: set[str] = set()
    for n in m.graph.node:
        if _has(scope_of(n) or "", PROJECTOR_TOKENS):
            out.update(o for o in n.output if o)
            out.update(i for i in n.input if i and i not in inits and i not in consts)
    return out


#: the injected projector fault: its encodings cover this share of the range calibration should have seen
PROJECTOR_MISS_RANGE = 0.1


def projector_miss_overrides(vision: Path, calib: list[Any], workdir: Path,
                             calibrated: Path | None = None) -> dict[str, Any]:
    """ORT overrides that reproduce a projector calibration miss: every projector activation's range is the
    one a normal calibration gives, shrunk to ``PROJECTOR_MISS_RANGE`` (a calibration set that saw only a
    tenth of the projector's real input range); the rest of the vision tower keeps its calibration.

    ``calibrated``: ``vision`` already quantized a8w8 with ``calib`` (the demo has it: quantizing it again gave
    the same bytes); without it, it is quantized into ``workdir``."""
    if calibrated is None:
        calibrated = workdir / "vision.a8w8.calibrated.qdq.onnx"
        quantize_for_qnn(vision, calibrated, calib, preset="a8w8", overwrite=True)
    encs = encodings_from_qdq_model(load_model(calibrated))
    out: dict[str, Any] = {}
    for name in projector_tensors(vision):
        e = encs.activations.get(name)
        if e is None or not e.scale:
            continue
        lo, hi = e.grid_range()
        out[name] = [{"rmin": np.array(lo[0] * PROJECTOR_MISS_RANGE, np.float32),
                      "rmax": np.array(hi[0] * PROJECTOR_MISS_RANGE, np.float32)}]
    return out


class _Captions:
    """Caption accuracy on the eval images; on HTP once per set of QDQ models, by content (the tuner's baseline
    is the projector-miss models the accuracy step ran, byte for byte: their 16 images are not emulated twice).
    ``stop`` ends a run at its next image (set when the demo's main thread fails)."""

    def __init__(self, prep: Any, ev: list[Any]) -> None:
        self.prep, self.ev = prep, ev
        self.stop = threading.Event()
        self._htp: dict[tuple[tuple[str, str], ...], CaptionAccuracy] = {}

    def of(self, sched: Any) -> CaptionAccuracy:
        """Exact match etc. of ``sched``'s captions."""
        texts = []
        for s in self.ev:
            if self.stop.is_set():
                raise CancelledError()
            texts.append(sched.generate(s.image).text)
        return caption_accuracy(texts, [s.caption for s in self.ev])

    def htp(self, paths: dict[str, Path]) -> CaptionAccuracy:
        """:meth:`of` the HTP scheduler of the QDQ ``paths`` (part -> model)."""
        key = tuple(sorted((part, sha256_file_once(p)) for part, p in paths.items()))
        if key not in self._htp:
            self._htp[key] = self.of(pipeline.scheduler(self.prep, _plain_htp(paths)))
        return self._htp[key]


def _tune_projector(cmp: Any, prep: Any, qdq: dict[str, dict[str, Path]], miss: dict[str, Any], store: Any,
                    reference: Path, cap: list[Any], captions: _Captions, workdir: Path,
                    log: Callable[[str], None]) -> Any:
    """Suggest overrides for the projector fault, verify them on HTP with the caption accuracy as task metric."""

    def task(vision_qdq: Path) -> dict[str, Any]:
        acc = captions.htp(dict(qdq["a16w8"], vision=vision_qdq))
        return {f"caption {k}": v for k, v in acc.as_dict().items() if k != "n"}

    fp32 = pipeline.scheduler(prep)
    feeds = [fp32.vision_feeds(s.image) for s in cap]
    tuner = Tuner(prep.paths["vision"], store["vision"], feeds, reference, workdir, preset="a8w8", part="vision",
                  task=task, base_overrides=miss)
    vision = {e.name for e in cmp.test.tensors() if e.part == "vision"}
    # widened ranges come from the calibration data (the float vision part over the calibration images)
    vision_only = [s for s in suggest(cmp, ranges=tuner.calibration_ranges()) if s.tensor in vision]
    if not vision_only:
        log("tune: nothing to suggest for the vision part")
        return None
    rep = verify(tuner, vision_only, ["image_features"])
    if not rep.recommended:
        log("tune: no override set kept the projector output and the captions: " + "; ".join(
            r["reason"] for r in rep.refused))
        return rep
    write_suggestions(rep.after.suggestions, workdir / "overrides.json", float_model=tuner.source(), overwrite=True)
    e2e = rep.end_to_end.set_index("what")
    b, a = e2e.loc["sqnr_db image_features", "before"], e2e.loc["sqnr_db image_features", "after"]
    log(f"tuned the projector fault with {len(vision_only)} override(s) ({workdir / 'overrides.json'}): "
        f"projector output SQNR {b:.1f} → {a:.1f} dB, caption exact match "
        f"{e2e.loc['caption exact_match', 'before']:.2f} → {e2e.loc['caption exact_match', 'after']:.2f}")
    return rep


def _plain_htp(paths: dict[str, Path]) -> Callable[[str, Any], Any]:

    def f(part: str, path: Any) -> Any:
        return make_runner("qnn", paths[part])
    return f


def _write_summary(res: DemoResult, path: Path) -> None:

    doc = {
        "schema": "ivq-demo/1",
        "dumps": {k: str(v) for k, v in res.dumps.items()},
        "report": str(res.report),
        "accuracy": res.accuracy,
        "export_max_abs": res.export_max_abs,
        "timings_s": res.timings,
        "comparisons": {k: {"summary": c.summary, "first_divergence": c.to_json(top=0)["first_divergence"],
                            "findings": [f.to_dict() for f in c.findings],
                            "verdict": c.verdict.to_dict() if c.verdict is not None else None,
                            "contract": c.contract.to_dict() if c.contract is not None else None,
                            "three_way": c.three_way.summary if c.three_way is not None else None}
                        for k, c in res.comparisons.items()},
        "tune": res.tune.to_dict() if res.tune is not None else None,
    }
    atomic_write_text(path, json.dumps(json_safe(doc), indent=1) + "\n", overwrite=True)
