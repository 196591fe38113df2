"""Notebook figures: error vs depth, a layer's drill-down, the decode step × layer heatmap, a tune search's frontier.

The report's own charts (:mod:`ivq_debug.report.charts`, built by the same functions as ``ivq report``'s
sections), returned as :class:`~ivq_debug.report.charts.Svg`: a notebook displays them through
``_repr_svg_``, and ``str(fig)`` is the SVG document to save. No plotting library is involved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ivq_debug.errors import UsageError
from ivq_debug.report.charts import Point, Series, Svg, hstack, line_chart, vstack
from ivq_debug.report.html import MAX_POINTS, chart_context, depth_charts, drilldown_charts, heatmap_charts
from ivq_debug.report.samples import HIST_SAMPLES, pair_samples


def error_vs_depth(cmp: Any, part: str | None = None, *, replay: Any = None, max_points: int = MAX_POINTS) -> Svg:
    """SQNR against execution order, one line per step, one chart per (sample, part) (only ``part`` when
    given), with the budget line; ``replay`` adds the introduced-error series, as in the report."""
    charts = depth_charts(chart_context(cmp, replay=replay, max_points=max_points),
                          None if part is None else [part])[0]
    if not charts:
        raise UsageError(f"no records of part {part!r} in the comparison" if part else "the comparison is empty")
    return vstack([svg for _, _, svg in charts], label="SQNR vs execution order")


def drilldown(cmp: Any, name: str, record: tuple[int, str, int] | None = None, max_points: int = MAX_POINTS) -> Svg:
    """Reference vs test values of one tensor (reference or test name; the first record unless ``record``):
    value histograms, the error histogram and a scatter, on evenly strided same-position samples."""
    t = cmp.table
    hit = (t["ref_name"] == name) | (t["test_name"] == name)
    if record is not None:
        s, p, st = record
        hit &= (t["sample"] == int(s)) & (t["part"] == str(p)) & (t["step"] == int(st))
    rows = list(t.index[hit])
    if not rows:
        raise UsageError(f"no aligned tensor {name!r}" + (f" in record {tuple(record)}" if record else ""))
    row = t.index.get_loc(rows[0])
    samples = pair_samples(cmp, int(row), HIST_SAMPLES)
    if samples is None:
        raise UsageError(f"{name!r}: values not available (the two sides differ in size)")
    return hstack(drilldown_charts(*samples, max_points), label=f"drill-down of {name}")


def step_heatmap(cmp: Any, sample: int = 0, part: str = "decode") -> Svg:
    """Step × layer SQNR map of one sample's ``part`` (layers in execution order, the report's colour ramp)."""
    charts = heatmap_charts(chart_context(cmp), samples=[sample], parts=[part])
    if not charts:
        raise UsageError(f"no {part} records with several steps for sample {sample}")
    return charts[0][2]


def frontier(search: Mapping[str, Any] | Any) -> Svg:
    """Gain vs cost of every lever a tune search measured (``ivq tune --search``): the frontier joined (the
    levers no other beats on both), the other eligible levers, and the ineligible ones in red; each marker's
    tooltip names the lever, its status and figures. ``search``: a
    :class:`~ivq_debug.tune.search.SearchResult` or the ``search`` section of ``tune.json``."""
    doc = search if isinstance(search, Mapping) else search.to_dict()["search"]
    basis = doc.get("cost_basis") or "model_bytes"
    front = Series("frontier", "#2ca02c")
    other = Series("eligible", "#1f77b4", line=False)
    out = Series("not eligible", "#7f7f7f", line=False)
    for r in doc.get("table") or []:
        gain, cost = r.get("gain_db"), r.get("cost")
        if not isinstance(gain, (int, float)) or not isinstance(cost, (int, float)) or not math.isfinite(cost):
            continue
        chosen = r["lever"] == doc.get("chosen")
        p = Point(100.0 * cost, float(gain), title=f"{r['lever']}{' (chosen)' if chosen else ''}: {gain:+.2f} dB, "
                                                    f"cost {100.0 * cost:+.1f} % — {r.get('status', '')}",
                  bad=not r.get("eligible") and not chosen)
        (front if r.get("frontier") else other if r.get("eligible") or chosen else out).points.append(p)
    series = [s for s in (front, other, out) if s.points]
    if not series:
        raise UsageError("the search measured no lever with a gain and a cost")
    what = "HTP cycles (emulated)" if basis == "cycles" else "model bytes"
    return line_chart(series, x_label=f"cost: relative {what} over the baseline, %",
                      y_label="gain, worst watched SQNR (dB)", hline=0.0, hline_label="baseline",
                      label="tune search frontier: gain vs cost")
