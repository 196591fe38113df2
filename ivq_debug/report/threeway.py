"""The report's three-way section: the backend's error and CPU-QDQ's against fp32 along depth, and the ratio table.

Drawn when the comparison carries a three-way measurement (``ivq-diff --expected``,
:mod:`ivq_debug.comparator.threeway`): one chart per part (sample 0, the first step of the part) with both
errors as SQNR against fp32 (``−20·log10(rel_l2)``) along execution order, markers red where the layer departs
(:func:`ivq_debug.diagnose.backend.departure`), then the pooled per-layer table with the largest ratios.
"""

from __future__ import annotations

import math
from typing import Any

from ivq_debug.diagnose.backend import departure
from ivq_debug.dump.format import part_rank
from ivq_debug.report.charts import Point, Series, esc, fmt, line_chart, thin_points

TABLE_ROWS = 30


def _db(rel: Any) -> float:
    try:
        v = float(rel)
    except (TypeError, ValueError):
        return math.nan
    if math.isnan(v):
        return math.nan
    return math.inf if v == 0 else -20.0 * math.log10(v)


def ratio_cells(tw: Any, row: dict[str, Any]) -> tuple[str, str]:
    """The layer table's two cells of a row: ratio (rel-L2, with rel-L∞ in the title) and BC."""
    r = tw.row_of(row["record"], row["ref_name"]) if tw is not None else None
    if r is None:
        return '<td class="num" data-v="">–</td>', '<td class="num" data-v="">–</td>'
    rl2, rli, bc = r.get("ratio_l2"), r.get("ratio_linf"), r.get("bc")
    hot = rl2 is not None and rl2 == rl2 and rl2 > tw.k
    dv = "" if rl2 is None or rl2 != rl2 else ("1e308" if math.isinf(rl2) else f"{rl2:.6g}")
    cls = ' class="num bad"' if hot else ' class="num"'
    title = f' title="rel-L∞ ratio {esc(fmt(rli, 3))}; status {esc(r.get("status"))}"'
    bdv = "" if bc is None or bc != bc else f"{bc:.6g}"
    return (f'<td{cls} data-v="{dv}"{title}>{esc(fmt(rl2, 3))}</td>',
            f'<td class="num" data-v="{bdv}">{esc(fmt(bc, 3))}</td>')


def section(cmp: Any, max_points: int = 400) -> str:
    """The ``Backend vs quantization`` card (empty string without a three-way measurement)."""
    tw = getattr(cmp, "three_way", None)
    if tw is None:
        return ""
    t = tw.table
    layers = tw.layers()
    hot = {(r["part"], r["ref_name"]) for r in layers.to_dict("records") if departure(r, tw.k) is not None}
    charts = []
    for part in sorted(set(t["part"]), key=part_rank):
        g = t[(t["part"] == part)]
        s0 = int(g["sample"].min())
        g = g[g["sample"] == s0]
        st = int(g["step"].min())
        g = g[g["step"] == st].sort_values("order")
        pts_t, pts_e = [], []
        for r in g.to_dict("records"):
            bad = (part, r["ref_name"]) in hot
            tip = (f"{r['ref_name']}: backend {fmt(r['rel_l2_test'])} vs CPU-QDQ {fmt(r['rel_l2_expected'])} rel-L2 "
                   f"(ratio {fmt(r['ratio_l2'], 3)})")
            pts_t.append(Point(float(r["order"]), _db(r["rel_l2_test"]), None, tip, bad))
            pts_e.append(Point(float(r["order"]), _db(r["rel_l2_expected"]), None, tip, False))
        series = [Series("backend vs fp32", "#c0392b", thin_points(pts_t, max_points)),
                  Series("CPU-QDQ vs fp32 (quantization alone)", "#2457a6", thin_points(pts_e, max_points), dash="6 3")]
        rec = f"{part}" + (f" step {st}" if part == "decode" else "") + f" · sample {s0}"
        svg = line_chart(series, width=570, height=280, x_label="execution order in the record",
                         y_label="SQNR vs fp32 (dB)", label=f"backend and CPU-QDQ error vs depth — {rec}",
                         max_markers=max(max_points // 4, 12))
        charts.append(f'<figure style="width:570px">{svg}<figcaption>{esc(rec)}: both errors against fp32 along '
                      "depth. Where the two lines run together the backend is as good as its quantization; red "
                      "markers are layers that depart (pooled over records).</figcaption></figure>")
    keyed = layers.assign(_r=layers[["ratio_l2", "ratio_linf"]].max(axis=1).fillna(-1.0))
    top = keyed.sort_values("_r", ascending=False, kind="stable").head(TABLE_ROWS)
    body = []
    for r in top.to_dict("records"):
        d = departure(r, tw.k)
        hot_cls = ' class="hot"' if d is not None else ""
        body.append(
            f'<tr{hot_cls}><td>{esc(r["part"])}</td>'
            f'<td class="name"><code>{esc(r["ref_name"])}</code></td>'
            f'<td class="num">{esc(fmt(r["rel_l2_test"]))}</td><td class="num">{esc(fmt(r["rel_l2_expected"]))}</td>'
            f'<td class="num{" bad" if d is not None else ""}">{esc(fmt(r["ratio_l2"], 3))}</td>'
            f'<td class="num">{esc(fmt(r["ratio_linf"], 3))}</td><td class="num">{esc(fmt(r["bc"], 3))}</td>'
            f'<td class="num">{int(r["records"])}</td><td>{esc(r["status"])}</td></tr>')
    s = tw.summary
    return (f'<section class="card" id="threeway"><h2>Backend vs quantization</h2><p class="muted small">Each '
            f"layer's error against fp32 on the backend, divided by the error of CPU-QDQ "
            f"(<code>{esc(tw.expected.path)}</code>, the exact fake-quant of the same QDQ model) on the same inputs; "
            f"a layer departs from what quantization explains above k = {esc(fmt(tw.k, 3))} (docs/metrics.md, "
            f"docs/findings.md <code>backend_divergence</code>). Largest pooled ratio: rel-L2 "
            f"{esc(fmt(s['max_ratio_l2'], 3))}, rel-L∞ {esc(fmt(s['max_ratio_linf'], 3))}; lowest error-shape "
            f"overlap (Bhattacharyya) {esc(fmt(s['min_bc'], 3))}.</p>"
            f'<div class="charts">{"".join(charts)}</div>'
            '<h3>Largest ratios per layer (pooled over samples and steps)</h3><div class="scroll"><table class="data '
            'sortable"><thead><tr><th data-sort="str">part</th><th data-sort="str">tensor</th>'
            '<th data-sort="num">rel-L2 backend</th><th data-sort="num">rel-L2 CPU-QDQ</th>'
            '<th data-sort="num">ratio L2</th><th data-sort="num">ratio L∞</th><th data-sort="num">BC</th>'
            '<th data-sort="num">records</th><th data-sort="str">status</th></tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div></section>')
