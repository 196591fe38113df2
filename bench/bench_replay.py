"""The introduced-error replay on transformers' ViT: its cost against one capture, and the x² pattern figures.

``speed``: a 12-block ViT at ViT-S widths (hidden 384, 6 heads, MLP 1536, 224² images, 16² patches: 197 tokens;
an 83 MiB single-file float model, above the 64 MiB in-place loading threshold), quantized a8w8 with ORT's QNN
flow, 4 evaluation images (issue 22's setting). Each step runs in its own process and is timed: ``ivq capture onnx``
of the float model and of the QDQ model (CPU-QDQ), and ``ivq diagnose`` (compare of the 4 records + replay of
every unit of the first under both attributions + the patterns' output share) against the user's float model. It
prints the ratio ``diagnose / capture(QDQ)``.

``workers``: the same model and dumps (or, with ``--model scale``, the scale benchmark's InternVL2-2B-shaped
model of ``bench/bench_scale.py`` at ``--scale S``, quantized a8w8 on its input), ``ivq diagnose --no-lift``
(compare + replay of the first record) in this process's loop, then as jobs on each ``--executor`` (``local`` with
``--workers N``, repeatable: ``--workers 1 --workers 2``; ``ray``: a local Ray cluster started for the run, its
start-up included), each in its own process: wall time, replay time, and the check that every JSON document equals
the in-process one but for its wall time and session count (issue 15); exit 1 when one differs.

``x2``: the 4-block ViT of ``tests/support/vit.py`` whose x² encodings are set by outlier channels: the headline
pattern under ``local`` and ``iso``, the worst SQNR of each, and the output share of lifting each (CPU-QDQ).

    python bench/bench_replay.py speed [--workdir DIR] [--layers 12] [--images 4]
    python bench/bench_replay.py workers [--workdir DIR] [--layers 12] [--images 4] [--executor local|ray ...]
                                         [--workers N ...] [--model vit|scale] [--scale S]
    python bench/bench_replay.py x2 [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/common.py
from common import ivq_env, load_avg, run_measured  # noqa: E402


def _ivq(wd: Path, step: str, *args: object) -> float:
    """Run ``ivq ARGS`` in its own process (exit 0 or 1: 1 = a unit over budget); its wall time (s)."""
    m = run_measured([sys.executable, "-m", "ivq_debug", *map(str, args)], log=wd / "logs" / step,
                     env=ivq_env(ROOT), ok_codes=(0, 1))
    if not m.ok:
        raise SystemExit(f"{step} failed: {m.why()}")
    return m.seconds


def _vit(wd: Path, layers: int, images: int) -> tuple[Path, Path, list]:
    """The ViT-S float model, its a8w8 QDQ model and the ``--inputs`` arguments of the evaluation images."""
    import numpy as np

    from ivq_debug.qnn.quantize import quantize_for_qnn
    from tests.support import vit

    wd.mkdir(parents=True, exist_ok=True)
    fm = wd / "vit.onnx"
    if not fm.exists():
        vit.build(wd, layers=layers, hidden=384, heads=6, mlp=1536, size=224, patch=16)
    q = wd / "vit.qdq.onnx"
    if not q.exists():
        quantize_for_qnn(fm, q, vit.calibration(4, size=224))
    inputs = []
    for i in range(images):
        np.savez(wd / f"eval{i}.npz", **vit.image(7 + i, size=224))
        inputs += ["--inputs", wd / f"eval{i}.npz"]
    return fm, q, inputs


def speed(wd: Path, layers: int, images: int) -> dict:
    fm, q, inputs = _vit(wd, layers, images)
    t_ref = _ivq(wd, "capture-float", "capture", "onnx", fm, *inputs, "-o", wd / "ref.h5", "--force")
    t_cap = _ivq(wd, "capture-qdq", "capture", "onnx", q, *inputs, "-o", wd / "test.h5", "--force")
    t_diag = _ivq(wd, "diagnose", "diagnose", wd / "ref.h5", wd / "test.h5", "--model", q, "--float-model", fm,
                  "--json", wd / "diagnose.json", "--force")
    doc = json.loads((wd / "diagnose.json").read_text())
    return {"float_model_mib": round(fm.stat().st_size / 2**20, 1), "units": len(doc["units"]),
            "skipped": len(doc["skipped"]), "sessions": doc["sessions"], "replay_s": doc["seconds"],
            "capture_float_s": round(t_ref, 2), "capture_qdq_s": round(t_cap, 2), "diagnose_s": round(t_diag, 2),
            "ratio": round(t_diag / t_cap, 2), "load": load_avg()}


def _scale_model(wd: Path, scale: str) -> tuple[Path, Path, list]:
    """The scale benchmark's model (``bench_scale.py``'s build step, in its own process), its a8w8 QDQ model
    (``ivq quantize``, calibrated on the benchmark's input) and the ``--inputs`` arguments."""
    from bench_scale import _self_cmd, config_for_scale

    wd.mkdir(parents=True, exist_ok=True)
    fm, inputs = wd / "ref.onnx", wd / "inputs.npz"
    if not fm.exists():
        from dataclasses import asdict

        m = run_measured(_self_cmd("build", {"config": asdict(config_for_scale(scale)), "dir": str(wd)}),
                         log=wd / "logs" / "build")
        if not m.ok:
            raise SystemExit(f"build failed: {m.why()}")
    q = wd / "ref.qdq.onnx"
    if not q.exists():
        _ivq(wd, "quantize", "quantize", fm, "-o", q, "--calibration", inputs, "--preset", "a8w8")
    return fm, q, ["--inputs", inputs]


def workers(wd: Path, fm: Path, q: Path, inputs: list, executors: list[str], pool_sizes: list[int],
            capture_args: list[str]) -> dict:
    if not (wd / "test.h5").exists():
        _ivq(wd, "capture-float", "capture", "onnx", fm, *inputs, "-o", wd / "ref.h5", "--force", *capture_args)
        _ivq(wd, "capture-qdq", "capture", "onnx", q, *inputs, "-o", wd / "test.h5", "--force", *capture_args)
    runs: dict[str, list[str]] = {"in-process": []}
    for ex in executors:
        if ex == "local":
            runs.update({f"local-{n}": ["--executor", "local", "--workers", str(n)] for n in pool_sizes})
        else:
            runs[ex] = ["--executor", ex]
    out: dict = {"load_before": load_avg()}
    docs = {}
    for name, extra in runs.items():
        js = wd / f"diagnose-{name}.json"
        wall = _ivq(wd, f"diagnose-{name}", "diagnose", wd / "ref.h5", wd / "test.h5", "--model", q, "--float-model",
                    fm, "--no-lift", "--json", js, "--force", *extra)
        doc = json.loads(js.read_text())
        out[name] = {"wall_s": round(wall, 2), "replay_s": doc.pop("seconds"), "sessions": doc.pop("sessions")}
        docs[name] = doc
    out["units"] = len(docs["in-process"]["units"])
    out["identical"] = {k: v == docs["in-process"] for k, v in docs.items() if k != "in-process"}
    out["load_after"] = load_avg()
    return out


def x2(wd: Path) -> dict:
    import ivq_debug as ivq
    from ivq_debug.capture.base import Selection, capture, make_runner
    from ivq_debug.diagnose.replay import replay
    from ivq_debug.qnn.quantize import quantize_for_qnn
    from tests.support import vit

    wd.mkdir(parents=True, exist_ok=True)
    fm = vit.build(wd, layers=4, outliers=True, name="vit_x2")
    q = quantize_for_qnn(fm, wd / "vit_x2.qdq.onnx", vit.calibration(bright=3.0), overwrite=True).model_path
    ev = [vit.image(7, bright=1.0)]
    ref = capture(make_runner("onnx", fm, selection=Selection()), ev, wd / "ref.h5", overwrite=True, progress=None)
    test = capture(make_runner("onnx", q, selection=Selection()), ev, wd / "test.h5", overwrite=True, progress=None)
    cmp = ivq.compare(ref, test, progress=False)
    out = {"final_output_sqnr_db": round(float(cmp.table.sort_values("order").iloc[-1]["sqnr_db"]), 2)}
    for att in ("local", "iso"):
        r = replay(q, ref, cumulative=cmp, attribution=att, float_model=fm, progress=False)
        h = r.findings()[0]
        out[att] = {"headline": h.evidence["label"], "over_budget": f"{h.evidence['over_budget']} of "
                    f"{h.evidence['units']}", "worst_db": round(float(h.evidence["worst"]["intro_sqnr_db"]), 2),
                    "output_error_share": round(h.evidence["output_error_share"] or 0.0, 3)}
    out["load"] = load_avg()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["speed", "workers", "x2"])
    p.add_argument("--workdir", default="/tmp/ivq-bench-replay")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--images", type=int, default=4, help="evaluation images captured (the replay uses the first)")
    p.add_argument("--executor", action="append", choices=["local", "ray"], default=None,
                   help="workers: the executors to run besides the in-process loop (repeatable; default both)")
    p.add_argument("--workers", action="append", type=int, default=None, metavar="N",
                   help="workers: the local pool sizes (repeatable; default 1 and 2)")
    p.add_argument("--model", choices=["vit", "scale"], default="vit",
                   help="workers: the ViT-S (default) or the scale benchmark's model")
    p.add_argument("--scale", default="1", help="--model scale: bench_scale.py's --scale")
    a = p.parse_args(argv)
    wd = Path(a.workdir) / a.what
    if a.what == "speed":
        res = speed(wd, a.layers, a.images)
    elif a.what == "workers":
        if a.model == "scale":
            wd = wd / f"scale-{a.scale}"
            fm, q, inputs = _scale_model(wd, a.scale)
            capture_args = ["--max-outputs-per-run", "64"]  # bounded memory (docs/scale.md)
        else:
            fm, q, inputs = _vit(wd, a.layers, a.images)
            capture_args = []
        res = workers(wd, fm, q, inputs, a.executor or ["local", "ray"], a.workers or [1, 2], capture_args)
        res["model"] = f"scale {a.scale}" if a.model == "scale" else f"ViT-S {a.layers} blocks"
    else:
        res = x2(wd)
    print(json.dumps(res, indent=1))
    return 0 if all(res.get("identical", {}).values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
