"""weight_range_spread on a real conv whose output-channel ranges spread > 1000x (and not once per-channel)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ivq_debug.diagnose.weight_spread import weight_range_spread, weight_spreads
from ivq_debug.qnn.quantize import quantize_for_qnn


def build_conv(tmp: Path, spread: float = 3000.0) -> Path:
    """Conv(3→16) → ReLU → Conv(16→8) whose first conv's channel 3 is ``spread``x its smallest (channels 0-3, as
    a folded BatchNorm leaves them), which the second conv scales back up: they carry as much signal as the rest."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 8, 3, padding=1))
    with torch.no_grad():
        w = m[0].weight
        w.copy_(torch.randn_like(w) * 0.1)
        m[0].bias.zero_()
        w[4] *= 30.0
        w[:4] *= 30.0 / spread
        m[2].weight[:, :4] *= spread / 30.0
    path = tmp / "conv.onnx"
    torch.onnx.export(m.eval(), (torch.zeros(1, 3, 16, 16),), str(path), input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False)
    return path


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> Path:
    return build_conv(tmp_path_factory.mktemp("spread"))


def test_spread_of_a_conv_weight(conv: Path, tmp_path: Path) -> None:
    t = weight_spreads(conv).set_index("weight")
    assert t.loc["0.weight", "spread"] > 1000 and set(t.loc["0.weight", "worst_channels"][:4]) == {0, 1, 2, 3}
    assert t.loc["2.weight", "spread"] < 100
    f = weight_range_spread(conv)
    assert [x.where["tensor"] for x in f] == ["0.weight"] and f[0].severity == "error"
    cal = [{"x": np.random.RandomState(i).randn(1, 3, 16, 16).astype(np.float32)} for i in range(4)]
    per_tensor = quantize_for_qnn(conv, tmp_path / "pt.onnx", cal).model_path
    q = weight_spreads(per_tensor).set_index("weight")
    assert q.loc["0.weight", "zero_channels"] == 4  # its smallest channels are rounded away at 8 bits
    assert [x.where["tensor"] for x in weight_range_spread(per_tensor)] == ["0.weight"]
    per_channel = quantize_for_qnn(conv, tmp_path / "pc.onnx", cal, per_channel=True).model_path
    assert weight_range_spread(per_channel) == []


def test_dead_channels_are_counted_and_left_out_of_the_figures(conv: Path, tmp_path: Path) -> None:
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(conv))
    init = next(i for i in m.graph.initializer if i.name == "2.weight")
    w = numpy_helper.to_array(init).copy()
    w[0] = 0.0  # a dead channel
    w[1] = 1e-40  # float32 noise (a denormal): the "1.5e39×" of issue 28
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    onnx.save(m, str(tmp_path / "dead.onnx"))
    t = weight_spreads(tmp_path / "dead.onnx").set_index("weight")
    assert t.loc["2.weight", "zero_channels"] == 2
    assert t.loc["2.weight", "spread"] < 100 and t.loc["2.weight", "min_bits"] >= 0
    assert not set(t.loc["2.weight", "worst_channels"][:2]) & {0, 1}
