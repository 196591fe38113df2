"""Deliver what was verified (issue 29): the types the quantizer resolves while a trial quantizes are in the
delivered overrides file, and ``ivq quantize --overrides <delivered file>`` reproduces the verified model's
encodings exactly (the CLI path a user takes), in the QNN converter formats too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from ivq_debug.onnxgraph.load import load_model
from ivq_debug.qnn.encodings import encodings_from_qdq_model
from ivq_debug.tune.verify import Tuner
from tests.support.cli import ivq_cli


def build_gap(d: Path) -> Path:
    """Conv → ReLU → Conv → GlobalAveragePool → Flatten → Gemm (the shape of the CNN whose delivered file
    `ivq quantize` refused: "Desired producer quant_type for …GlobalAveragePool… doesn't match")."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    path = d / "gap.onnx"
    torch.onnx.export(m.eval(), (torch.zeros(1, 3, 8, 8),), str(path), input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False)
    return path


def reproduces(model: Path, cal: Path, wd: Path, tmp: Path, *knobs: str) -> dict:
    """Re-apply ``wd/overrides.json`` with ``ivq quantize`` (the tune's knobs); the encodings of the model the tune
    verified and of the re-quantized one, which must be identical."""
    rep = json.loads((wd / "tune.json").read_text())
    verified = Path(rep["after"]["qdq_model"])
    out = tmp / f"requant-{wd.name}.onnx"
    ev = rep["evaluation"]
    if ev["held_out"]:  # the tune calibrated on the first N samples (the rest held out for evaluation)
        knobs = (*knobs, "--max-samples", str(ev["calibration_samples"]))
    ov = wd / "overrides.json"  # a lever of knobs alone delivers no file: the flags are the delivery
    assert ivq_cli("quantize", model, "--calibration", cal, *(["--overrides", ov] if ov.exists() else []), "-o", out,
                   *knobs) == 0
    a, b = encodings_from_qdq_model(load_model(verified)), encodings_from_qdq_model(load_model(out))
    assert a.activations.keys() == b.activations.keys() and a.params.keys() == b.params.keys()
    for name in a.activations:
        assert a.activations[name] == b.activations[name], name
    for name in a.params:
        assert a.params[name] == b.params[name], name
    return rep


def user_files(d: Path, shape: tuple[int, ...], *, calibration: int, evaluation_seed: int) -> dict[str, Path]:
    """A calibration folder of seeded ``x`` samples (seeds 0..calibration-1) and one evaluation sample, as a user
    has them."""
    (d / "cal").mkdir()
    for i in range(calibration):
        np.savez(d / "cal" / f"{i}.npz", x=np.random.RandomState(i).randn(*shape).astype(np.float32))
    np.savez(d / "eval.npz", x=np.random.RandomState(evaluation_seed).randn(*shape).astype(np.float32))
    return {"cal": d / "cal", "eval": d / "eval.npz"}


@pytest.fixture(scope="module")
def gap(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("deliver")
    model = build_gap(d)
    user_files(d, (1, 3, 8, 8), calibration=6, evaluation_seed=50)
    ranges = Tuner(model, str(d / "cal"), [], d / "none.h5", d / "ranges", resume=False,
                   preprocess=False).calibration_ranges()
    names = [n.output[0] for n in onnx.load(str(model)).graph.node]
    conv2, pool = names[2], names[3]
    lo, hi = ranges[pool]
    span = hi - lo
    # a hand-written file: 16 bits on the second conv's output, the pool output kept at 8 bits on a wider range;
    # ORT's mixed-precision fixer wants the pool output in its producer's type
    doc = {"activation_encodings": {
        conv2: [{"bitwidth": 16, "min": float(ranges[conv2][0]), "max": float(ranges[conv2][1]), "dtype": "int"}],
        pool: [{"bitwidth": 8, "min": float(lo - 0.05 * span), "max": float(hi + 0.05 * span), "dtype": "int"}]},
        "param_encodings": {}}
    (d / "hand.json").write_text(json.dumps(doc))
    return {"model": model, "cal": d / "cal", "eval": d / "eval.npz", "hand": d / "hand.json", "pool": pool}


def test_a_resolved_type_is_delivered_and_reapplies(gap, tmp_path: Path) -> None:
    # the hand-written file does not quantize as it is (what the user met after `ivq tune`)
    assert ivq_cli("quantize", gap["model"], "--calibration", gap["cal"], "--overrides", gap["hand"], "-o",
                   tmp_path / "raw.onnx") == 3
    wd = tmp_path / "t"
    code = ivq_cli("tune", gap["model"], "--calibration", gap["cal"], "--inputs", gap["eval"], "-o", wd,
                   "--backend", "cpu", "--overrides", gap["hand"])
    rep = json.loads((wd / "tune.json").read_text())
    assert code == 0 and rep["recommended"], rep["refused"]
    assert [f["tensor"] for f in rep["resolved_types"]] == [gap["pool"]]
    assert {o["tensor"]: o["action"] for o in rep["overrides"]}[gap["pool"]] == "a16"  # the type the trial used
    delivered = json.loads((wd / "overrides.json").read_text())
    assert delivered["activation_encodings"][gap["pool"]][0]["bitwidth"] == 16
    reproduces(gap["model"], gap["cal"], wd, tmp_path)


@pytest.mark.parametrize("fmt", ["1.0.0", "ort"])
def test_every_format_delivers_the_same_model(gap, tmp_path: Path, fmt: str) -> None:
    wd = tmp_path / fmt
    assert ivq_cli("tune", gap["model"], "--calibration", gap["cal"], "--inputs", gap["eval"], "-o", wd,
                   "--backend", "cpu", "--overrides", gap["hand"], "--format", fmt) == 0
    reproduces(gap["model"], gap["cal"], wd, tmp_path)


# ------------------------------------------------------------------ every path that recommends
# verify (the default) is covered above and in test_tune_cli.py, the search in test_search.py; the greedy mode and
# the sweep here. The conv's first weight spreads its channels 3000x (tests/diagnose/test_weight_spread.py).
@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> dict:
    from tests.diagnose.test_weight_spread import build_conv

    d = tmp_path_factory.mktemp("deliver-conv")
    model = build_conv(d)
    return {"model": model, **user_files(d, (1, 3, 16, 16), calibration=8, evaluation_seed=99)}


@pytest.mark.parametrize("fmt", ["legacy", "1.0.0"])
def test_the_greedy_mode_delivers_the_model_it_verified(conv, tmp_path: Path, fmt: str) -> None:
    wd = tmp_path / fmt
    code = ivq_cli("tune", conv["model"], "--calibration", conv["cal"], "--inputs", conv["eval"], "-o", wd,
                   "--backend", "cpu", "--preset", "a16w8", "--greedy", "--budget", "40", "--format", fmt)
    rep = reproduces(conv["model"], conv["cal"], wd, tmp_path, "--preset", "a16w8")
    assert code == 1 and rep["recommended"]  # the budget (40 dB) is missed, the set that helped is delivered
    assert [(o["tensor"], o["action"]) for o in rep["overrides"]] == [("2.weight", "w16")]
    kept = [s["label"] for s in rep["steps"] if s["kept"]]
    assert len(kept) > 1 and Path(rep["after"]["qdq_model"]).name == f"{kept[-1]}.qdq.onnx"  # the last kept step


@pytest.mark.parametrize("fmt", ["legacy", "1.0.0", "ort"])
def test_the_sweep_delivers_the_model_it_verified_a_float_node_included(conv, tmp_path: Path, fmt: str) -> None:
    """The sweep's pick leaves a node float: QNN files say so with a float encoding of its output, ORT files with
    the ``nodes_to_exclude`` sidecar; ``ivq quantize --overrides`` leaves the same node float (it quantized it,
    and an ORT file of fp16 entries alone did not read back, before)."""
    wd = tmp_path / fmt
    code = ivq_cli("tune", conv["model"], "--calibration", conv["cal"], "--inputs", conv["eval"], "-o", wd,
                   "--backend", "cpu", "--preset", "a8w8", "--sweep", "--groups", "2", "--format", fmt)
    rep = reproduces(conv["model"], conv["cal"], wd, tmp_path, "--preset", "a8w8")
    assert code == 0 and rep["sweep"]["chosen"] == ["g02-fp16"]
    assert [(o["tensor"], o["action"], o["node"]) for o in rep["overrides"]] == [("y", "fp16", "/2/Conv")]
    assert (wd / "overrides.json.nodes_to_exclude.json").exists() is (fmt == "ort")
    floated = load_model(tmp_path / f"requant-{wd.name}.onnx")
    conv2 = next(n for n in floated.graph.node if n.name == "/2/Conv")
    assert not conv2.input[1].endswith("_DequantizeLinear_Output")  # its weight stays float


@pytest.mark.slow  # 13 levers and their combinations (~35 s on 2 loaded cores)
def test_the_search_delivers_the_model_it_verified_in_the_1_0_0_format(conv, tmp_path: Path) -> None:
    """The search's choice (its knobs plus an overrides file) in the QNN 1.0.0 format (``legacy``:
    ``tests/tune/test_search.py``)."""
    wd = tmp_path / "search"
    assert ivq_cli("tune", conv["model"], "--calibration", conv["cal"], "--inputs", conv["eval"], "-o", wd,
                   "--backend", "cpu", "--preset", "a8w8", "--search", "--no-diagnose", "--format", "1.0.0") == 0
    rep = json.loads((wd / "tune.json").read_text())
    assert rep["recommended"] and rep["overrides"] and (wd / "overrides.json").exists()
    assert json.loads((wd / "overrides.json").read_text())["version"] == "1.0.0"
    reproduces(conv["model"], conv["cal"], wd, tmp_path, *rep["search"]["command"].split())
