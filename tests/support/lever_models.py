"""A model only a *combination* of quantizer levers recovers (issue 29): two error sources of equal weight.

``x`` (1×16×4×4) is split in two heads whose outputs are concatenated:

* head A: a 1×1 Conv whose weight has one outlier entry (``outlier``× the rest; the only entry of its output
  channel) on an input channel that is ~0 at run time: its per-tensor 8-bit scale rounds every other weight
  coarsely (**per-channel** fixes it; 16-bit activations do not);
* head B: ReLU then a 1×1 Conv, fed by an input channel that is a constant ``big`` the Conv ignores: the 8-bit
  activation grid of ``x`` and of the ReLU output is set by it and the informative values get few steps
  (**16-bit activations** fix it; per-channel weights do not).

With the defaults (measured on ORT CPU-QDQ, 4 evaluation samples, 8 calibration samples): baseline a8w8 15.1 dB,
per-channel +3.1, a16w8 +2.1, a16w8 + per-channel +15.0 dB; a16w16 also recovers it (+15.1) at twice the weight
bytes (the tests assert the numbers of their own runs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build_two_causes(path: Path, *, outlier: float = 40.0, big: float = 100.0, seed: int = 0) -> Path:
    """Write the model (module docstring) to ``path``."""
    rng = np.random.default_rng(seed)
    wa = (rng.standard_normal((16, 8, 1, 1)) * 0.3).astype(np.float32)
    wa[0, :] = 0.0
    wa[0, 7] = outlier
    wb = (rng.standard_normal((16, 8, 1, 1)) * 0.3).astype(np.float32)
    wb[:, 7] = 0.0
    inits = [numpy_helper.from_array(wa, "wa"), numpy_helper.from_array(wb, "wb"),
             numpy_helper.from_array(np.array([8, 8], np.int64), "split")]
    nodes = [helper.make_node("Split", ["x", "split"], ["xa", "xb"], axis=1, name="split"),
             helper.make_node("Conv", ["xa", "wa"], ["ya"], name="conv_a"),
             helper.make_node("Relu", ["xb"], ["rb"], name="relu_b"),
             helper.make_node("Conv", ["rb", "wb"], ["yb"], name="conv_b"),
             helper.make_node("Concat", ["ya", "yb"], ["y"], axis=1, name="cat")]
    return save_graph(path, nodes, inits, [1, 16, 4, 4], [1, 32, 4, 4], opset=17, name="two_causes")


def save_graph(path: Path, nodes: list, inits: list, x_shape: list[int], y_shape: list[int], *, opset: int,
               name: str = "g") -> Path:
    """One float input ``x``, one float output ``y``: the graph checked and saved to ``path``."""
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


def two_causes_sample(seed: int, big: float = 100.0) -> dict[str, np.ndarray]:
    """One input: normal values, channel 7 ~0 (head A's outlier weight reads it), channel 15 the constant ``big``."""
    x = np.random.RandomState(seed).randn(1, 16, 4, 4).astype(np.float32)
    x[0, 7] *= 0.001
    x[0, 15] = big
    return {"x": x}


def two_causes_trial_inputs(folder: Path, *, evaluation: int) -> dict:
    """What a trial on the model needs, in ``folder``: ``model``, ``cal`` (8 samples, seeds 0-7), ``feeds``
    (``evaluation`` samples, seeds 100+) and ``ref`` (their float reference dump, ORT)."""
    from ivq_debug.capture.base import Selection, capture, make_runner

    model = build_two_causes(Path(folder) / "two.onnx")
    feeds = [two_causes_sample(100 + i) for i in range(evaluation)]
    ref = capture(make_runner("onnx", model, selection=Selection()), feeds, Path(folder) / "ref.h5", progress=None)
    return {"model": model, "cal": [two_causes_sample(i) for i in range(8)], "feeds": feeds, "ref": ref}


def two_causes_files(folder: Path, *, evaluation: int = 4) -> dict:
    """What ``ivq tune`` reads for the model, as a user has it in ``folder``: ``model``, the calibration folder
    ``cal`` (8 ``.npz`` samples, seeds 0-7) and ``evals``, the ``--inputs FILE`` arguments of ``evaluation``
    samples (seeds 100+)."""
    folder = Path(folder)
    model = build_two_causes(folder / "two.onnx")
    (folder / "cal").mkdir(exist_ok=True)
    for i in range(8):
        np.savez(folder / "cal" / f"{i:02d}.npz", **two_causes_sample(i))
    evals: list = []
    for i in range(evaluation):
        np.savez(folder / f"eval{i}.npz", **two_causes_sample(100 + i))
        evals += ["--inputs", folder / f"eval{i}.npz"]
    return {"model": model, "cal": folder / "cal", "evals": evals}
