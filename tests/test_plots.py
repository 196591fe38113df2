"""ivq_debug.plots: the notebook figures are the report's SVG charts (one chart layer), displayable in a
notebook, and they show an injected fault where it is."""

from __future__ import annotations

import base64
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ivq_debug import plots
from ivq_debug.api import compare
from ivq_debug.comparator import Budgets
from ivq_debug.dump import DumpWriter
from ivq_debug.errors import UsageError
from ivq_debug.report import render_report
from ivq_debug.report.charts import Svg

LAYERS = 12
BAD = 7  # the layer whose test output carries a large error
STEPS = 3


@pytest.fixture(scope="module")
def cmp(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Reference and test dumps of 12 layers over a prefill and 2 decode steps; layer 7 of the test is off
    by 30 % noise (about 10 dB), the others by 0.1 % (about 60 dB)."""
    d = tmp_path_factory.mktemp("plots")
    rng = np.random.default_rng(3)
    ref = {f"layer{i:02d}": rng.standard_normal((8, 32)).astype(np.float32) for i in range(LAYERS)}
    paths = []
    for side in ("ref", "test"):
        p = d / f"{side}.h5"
        with DumpWriter(p, backend=side, command="pytest plots") as w:
            for step in range(STEPS):
                w.begin_record(sample=0, part="prefill" if step == 0 else "decode", step=step)
                for i, (name, v) in enumerate(ref.items()):
                    x = v * (1 + step)
                    if side == "test":
                        x = x + (0.3 if i == BAD else 1e-3) * x.std() * rng.standard_normal(x.shape).astype(np.float32)
                    w.add_tensor(name, x, op_type="MatMul")
        paths.append(p)
    return compare(paths[0], paths[1], budgets=Budgets.from_args(min_sqnr=30), progress=False)


def _png_pixels(svg: str) -> np.ndarray:
    """The RGB pixels of the (only) PNG embedded in a heatmap SVG (8-bit RGB, filter 0 rows)."""
    data = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", svg).group(1))
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + 3 * w)
    return raw[:, 1:].reshape(h, w, 3)


def test_figures_are_svg_a_notebook_displays(cmp: Any) -> None:
    for fig in (plots.error_vs_depth(cmp), plots.step_heatmap(cmp),
                plots.drilldown(cmp, f"layer{BAD:02d}", (0, "decode", 2))):
        assert isinstance(fig, Svg) and fig._repr_svg_().startswith("<svg") and fig.endswith("</svg>")


def test_depth_chart_is_the_reports_chart_and_marks_the_fault(cmp: Any) -> None:
    fig = plots.error_vs_depth(cmp, "prefill")
    inner = ["<svg " + m for m in re.findall(r'<svg x="0" y="[0-9.]+" (class="chart".*?</svg>)', str(fig))]
    assert len(inner) == 1  # one (sample, part) group
    lines = re.findall(r'<polyline points="[^"]+"', inner[0])
    report = render_report(cmp)
    assert lines and all(ln in report for ln in lines)  # the report draws the very same lines
    assert re.sub(r'<a href="#L[0-9]+">|</a>', "", report).count(inner[0]) == 1  # and chart (but markers link)
    # red markers (over budget) are exactly the faulty layer's, with its SQNR in the tooltip
    red = re.findall(r'fill="#d62728" stroke="#fff" stroke-width="0.6"><title>([^<]*)</title>', inner[0])
    sqnr = float(cmp.table.query("part == 'prefill' and ref_name == 'layer07'")["sqnr_db"].iloc[0])
    assert len(red) == 1 and red[0].startswith(f"layer{BAD:02d} ") and f"{sqnr:.4g}" in red[0]
    assert 5 < sqnr < 20


def test_step_heatmap_colours_the_faulty_column_red(cmp: Any) -> None:
    px = _png_pixels(plots.step_heatmap(cmp)).astype(int)
    assert px.shape == (STEPS - 1, LAYERS, 3)  # decode steps × layers
    red = (px[..., 0] > 150) & (px[..., 2] < 120)
    assert red[:, BAD].all() and not red[:, [i for i in range(LAYERS) if i != BAD]].any()


def test_drilldown_scatter_and_histograms(cmp: Any) -> None:
    fig = plots.drilldown(cmp, f"layer{BAD:02d}", (0, "prefill", 0), max_points=100)
    assert fig.count("<svg ") == 4  # the frame + two histograms + a scatter
    assert fig.count('r="1.7"') == 100  # scatter points, evenly strided
    with pytest.raises(UsageError, match="no aligned tensor"):
        plots.drilldown(cmp, "nope")
    with pytest.raises(UsageError, match="no records of part"):
        plots.error_vs_depth(cmp, "vision")


def test_saved_svg_is_a_standalone_file(cmp: Any, tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    p = tmp_path / "depth.svg"
    p.write_text(str(plots.error_vs_depth(cmp)))
    root = ET.parse(p).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(root.findall("{http://www.w3.org/2000/svg}svg")) == 2  # prefill and decode charts, stacked


def test_frontier_joins_the_frontier_and_marks_the_ineligible_red() -> None:
    rows = [{"lever": "per-channel", "gain_db": 3.0, "cost": 0.05, "eligible": True, "frontier": False, "status": "ok"},
            {"lever": "a16w8", "gain_db": 2.0, "cost": 0.06, "eligible": True, "frontier": False, "status": "ok"},
            {"lever": "unit all", "gain_db": 3.3, "cost": 0.03, "eligible": True, "frontier": True, "status": "ok"},
            {"lever": "a16w8 + per-channel", "gain_db": 15.0, "cost": 0.11, "eligible": True, "frontier": True,
             "status": "chosen"},
            {"lever": "calibration percentile", "gain_db": -0.7, "cost": 0.0, "eligible": False, "frontier": False,
             "status": "lowers y"},
            {"lever": "a8w16", "gain_db": None, "cost": None, "eligible": False, "frontier": False,
             "status": "not run by QNN"}]
    svg = str(plots.frontier({"table": rows, "chosen": "a16w8 + per-channel", "cost_basis": "cycles"}))
    assert svg.startswith("<svg") and "HTP cycles" in svg
    assert svg.count("<circle") == 5 and "a8w16" not in svg  # a lever without figures is not drawn
    line = re.findall(r'<polyline points="([^"]+)"', svg)
    assert len(line) == 1 and len(line[0].split()) == 2  # the frontier's two levers, joined; the others are not
    xs = [float(p.split(",")[0]) for p in line[0].split()]
    assert xs == sorted(xs)  # by cost
    assert "a16w8 + per-channel (chosen)" in svg
    assert svg.count('fill="#d62728"') == 1  # the one lever that lowers the output, in red
    with pytest.raises(UsageError):
        plots.frontier({"table": rows[-1:]})
