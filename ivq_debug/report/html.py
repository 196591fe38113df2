"""The self-contained HTML report of a comparison (``docs/report.md``).

One offline file: CSS and a small hand-written script inline, charts as inline SVG (the heatmap body as an
embedded PNG), no network access (a Content-Security-Policy allows only the page's own script, by hash).
Every name from a dump is escaped with :func:`html.escape`; names reach the script only as JSON in
``<script type="application/json">`` blocks (with ``<``, ``>`` and ``&`` written as ``\\u00XX``) or as
data attributes, and the script writes text with ``textContent`` only.

Sections: findings, summary (side by side when several comparisons are given), error vs depth, step × layer
heatmap, layer table, drill-downs of the worst layers, QNN profiling timeline, unmatched tensors,
provenance. Sizes stay bounded for large models: ``max_rows`` table rows, ``max_points`` points per chart
series and per scatter, ``drilldowns`` drill-downs, ``max_timeline_ops`` timeline bars, heatmaps of at most
``HEATMAP_MAX_COLS`` × ``HEATMAP_MAX_ROWS`` cells; the report states every cut it makes.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import __version__, defaults
from ivq_debug.diagnose.findings import SEVERITIES, severity_rank
from ivq_debug.dump.format import part_rank
from ivq_debug.dump.stats import sample_indices
from ivq_debug.errors import UsageError, one_line
from ivq_debug.jsonio import as_float, json_safe
from ivq_debug.report import threeway as threeway_report
from ivq_debug.report.charts import (
    NODATA_COLOR,
    Bar,
    Point,
    Series,
    Svg,
    color_scale_legend,
    esc,
    fmt,
    heatmap_chart,
    histogram_chart,
    line_chart,
    scatter_chart,
    sqnr_color,
    text_color_on,
    thin_points,
    timeline_chart,
)
from ivq_debug.report.exports import write_text
from ivq_debug.report.layers import Labeled, LayerView, build_layers
from ivq_debug.report.samples import HIST_SAMPLES, pair_samples
from ivq_debug.report.timeline import build_timelines

#: default cap of points per chart series and per drill-down scatter
MAX_POINTS = 400
#: default cap of layer-table rows
MAX_ROWS = 2000
#: default number of drill-downs (worst layers)
DRILLDOWNS = 6
#: pairs read per drill-down shown at most, when skipping byte copies
DRILL_CANDIDATES = 4
#: default cap of individual timeline bars (smaller ops are merged beyond it)
MAX_TIMELINE_OPS = 1500
HEATMAP_MAX_COLS = 240
HEATMAP_MAX_ROWS = 64
MAX_CHARTS = 12
MAX_NAMES = 300
#: name lists up to this long are shown open; longer ones are folded
NAMES_OPEN = 20
#: (colour, dash) of the chart series, in order: no two alike, and none the budget line's red dashes
SERIES_STYLES = (("#2457a6", ""), ("#e07b00", "7 3"), ("#2a9d8f", "2 2"), ("#9c3fb8", "9 3 2 3"),
                 ("#6b8e23", "4 4"), ("#8c564b", "1 3"), ("#4c6a92", "12 4"), ("#d45087", "3 2 1 2"),
                 ("#7f7f7f", "6 2 2 2"))
#: the replay's introduced-error series
INTRODUCED_STYLE = ("#111827", "1 2")
DASH = '<span class="muted">–</span>'


# ============================================================================ helpers
def _json_script(obj: Any) -> str:
    """JSON safe inside ``<script type="application/json">`` (no ``</``, no ``<!--``, no line separators)."""

    s = json.dumps(json_safe(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _data_v(v: Any) -> str:
    """Sort key for a numeric cell (``Infinity`` parses in JS; empty for missing)."""
    f = as_float(v)
    if f is None:
        return ""
    if math.isinf(f):
        return "Infinity" if f > 0 else "-Infinity"
    return repr(f)


def _rec_label(key: Sequence[Any], multi_sample: bool = False) -> str:
    sample, part, step = key
    s = f"{part}" if (part != "decode" and int(step) == 0) else f"{part} {int(step)}"
    return f"s{sample} · {s}" if multi_sample else s


def _rec_sort(key: Sequence[Any]) -> float:
    sample, part, step = key
    return int(sample) * 1e7 + part_rank(part) * 1e5 + int(step)


def _sqnr_cell(v: Any, status: str | None = None, extra_cls: str = "") -> str:
    f = as_float(v)
    if f is None:
        label = "–" if status in (None, "ok", "identical", "empty") else "undef"
        return f'<td class="num{extra_cls}" data-v="">{esc(label)}</td>'
    bg = sqnr_color(f)
    return (f'<td class="num cell-sqnr{extra_cls}" data-v="{_data_v(f)}" style="background:{bg};color:{text_color_on(bg)}">'
            f"{esc(fmt(f, 4))}</td>")


def _asset(name: str) -> str:
    return resources.files("ivq_debug.report").joinpath("assets", name).read_text(encoding="utf-8")


def _labeled(extra: Any) -> list[Labeled]:
    if extra is None:
        return []
    items: list[tuple[str | None, Any]]
    if isinstance(extra, Mapping):
        items = [(str(k), v) for k, v in extra.items()]
    else:
        items = [(x[0], x[1]) if isinstance(x, tuple) else (None, x) for x in extra]
    return [Labeled(lab or comparison_label(c), c) for lab, c in items]


def short_labels(labels: Sequence[str], limit: int = 34) -> dict[str, str]:
    """Comparison labels for column heads: the words before the parenthesis (``quantization (fp32 → CPU-QDQ
    a8w8)`` → ``quantization``), at most ``limit`` characters cut at a word; a label whose short form another
    label shares stays whole (the full label always goes in the title)."""
    short = {lab: one_line(lab.split(" (", 1)[0].strip() or lab, limit) for lab in labels}
    counts = Counter(short.values())
    return {lab: sh if counts[sh] == 1 else lab for lab, sh in short.items()}


def comparison_label(cmp: Any) -> str:
    """``ref-file → test-file`` (file stems), the default label of a comparison."""
    return f"{Path(str(cmp.ref.path)).stem} → {Path(str(cmp.test.path)).stem}"


def _emulation(info: dict[str, Any]) -> tuple[str, str]:
    """(badge class, text) for a dump's emulated/device status."""
    emu = info.get("emulated")
    if emu is True:
        return "emulated", info.get("label") or "emulated (not a device measurement)"
    if emu is False:
        return "device", info.get("label") or "device"
    return "na", "not applicable (no NPU backend)"


@dataclass
class _Ctx:
    cmp: Any
    label: str
    extras: list[Labeled]
    replay: Any
    view: LayerView
    timeline: Any
    max_points: int
    max_rows: int
    drilldowns: int
    max_timeline_ops: int
    shown: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    blocks: list[tuple[str, Any]] = field(default_factory=list)
    multi_sample: bool = False
    finding_groups: list[tuple[str, list[Any], bool]] = field(default_factory=list)

    def href(self, row: int | None) -> str | None:
        return f"#L{row}" if row is not None and row in self.shown else None

    def name_link(self, row: int | None, name: str) -> str:
        h = self.href(row)
        code = f"<code>{esc(name)}</code>"
        return f'<a href="{esc(h)}">{code}</a>' if h else code


# ============================================================================ sections
def _verdict(cmp: Any) -> str:
    v = getattr(cmp, "verdict", None)
    ok = v.passed if v is not None else cmp.passed
    tip = f' title="{esc(v.sentence)}"' if v is not None else ""
    return f'<span class="verdict pass"{tip}>PASS</span>' if ok else f'<span class="verdict fail"{tip}>FAIL</span>'


def _verdict_line(cmp: Any) -> str:
    """The one-glance verdict under the title: pass/fail and why (the same sentence as the terminal and JSON)."""
    v = getattr(cmp, "verdict", None)
    if v is None:
        return ""
    return (f'<div class="sub verdict-line"><b>{"PASS" if v.passed else "FAIL"}</b>: {esc(v.sentence)}</div>')


def _header(ctx: _Ctx, title: str) -> str:
    cmp = ctx.cmp
    s = cmp.summary
    budgets = ", ".join(s["budgets"]) if s["budgets"] else (
        f"no budgets given (divergence shown at SQNR < {defaults.DIVERGENCE_SQNR_DB:g} dB)")
    dumps = [cmp.ref, cmp.test] + [d for ex in ctx.extras for d in (ex.cmp.ref, ex.cmp.test)]
    emulated = [d for d in dumps if (d.backend_info or {}).get("emulated") is True]
    banner = ""
    if emulated:
        labels = sorted({(d.backend_info or {}).get("label") or "emulated" for d in emulated})
        files = ", ".join(sorted({Path(str(d.path)).name for d in emulated}))
        banner = (f'<div class="banner"><span class="badge emulated">EMULATED</span> {esc("; ".join(labels))} — '
                  f"{esc(files)}. Numbers from an x86_64 emulation of the HTP backend: accuracy results are "
                  "the emulator's, and timings measure the host, not a device.</div>")
    return (f'<header class="top"><div class="wrap"><h1>{esc(title)}{_verdict(cmp)}</h1>'
            f'<div class="sub">reference <code>{esc(cmp.ref.path)}</code> ({esc(cmp.ref.backend)}) → test '
            f'<code>{esc(cmp.test.path)}</code> ({esc(cmp.test.backend)}) · budgets: {esc(budgets)}</div>'
            f"{_verdict_line(cmp)}{banner}</div></header>")


def _nav(sections: list[tuple[str, str]]) -> str:
    links = "".join(f'<a href="#{esc(i)}">{esc(t)}</a>' for i, t in sections)
    return f'<nav class="sections"><div class="wrap">{links}</div></nav>'


#: evidence values shown inline before a list folds into ``<details>``
EVIDENCE_INLINE = 6
#: rows of a list of records (dicts) shown in an evidence table
EVIDENCE_ROWS = 50


#: words of evidence keys written as a reader expects them
_WORDS = {"db": "dB", "sqnr": "SQNR", "snr": "SNR", "lsb": "LSB", "kl": "KL", "l2": "L2", "rel": "rel.", "enc": "encoding",
          "pct": "%", "ids": "ids", "id": "id"}


def _label(key: Any) -> str:
    """An evidence key as a label: ``mean_rel_err`` → ``mean rel. err``, ``grid_snr_db`` → ``grid SNR dB``."""
    return " ".join(_WORDS.get(w.lower(), w) for w in str(key).split("_") if w)


def _is_name(v: Any) -> bool:
    """A tensor / node name (it has a path separator) rather than a word."""
    return isinstance(v, str) and "/" in v and " " not in v


def _key_span(k: Any) -> str:
    return f'<span class="ev-k">{esc(_label(k))}</span>'


def _scalar(ctx: _Ctx, v: Any, rec: Any = None) -> str:
    """One evidence value: numbers with 4 significant digits, names as (linked) code, the rest as text."""
    if v is None:
        return DASH
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return esc(str(v))
    if isinstance(v, float):
        return esc(fmt(v, 4))
    if _is_name(v):
        return ctx.name_link(ctx.view.find(rec, v), v)
    return esc(v)


def _value(ctx: _Ctx, v: Any, rec: Any = None, depth: int = 0) -> str:
    """An evidence value as HTML: a mapping as labelled values, a list inline when short and folded into
    ``<details>`` when long, a list of records as a small table (issue 32: no raw JSON or Python reprs)."""
    if isinstance(v, Mapping):
        if set(v) == {"sample", "part", "step"}:  # a record
            try:
                return esc(_rec_label((int(v["sample"]), v["part"], int(v["step"])), True))
            except (TypeError, ValueError):
                pass
        if depth >= 2:
            return esc(json.dumps(json_safe(v), default=str)[:200])
        items = [f'<span class="ev-kv">{_scalar(ctx, k, rec) if _is_name(k) else _key_span(k)} '
                 f"{_value(ctx, x, rec, depth + 1)}</span>" for k, x in v.items()]
        if len(items) > EVIDENCE_INLINE:
            return (f"<details><summary>{len(items)} entries</summary><div class=\"ev-list\">"
                    + "".join(f"<div>{i}</div>" for i in items[:MAX_NAMES]) + "</div></details>")
        return " ".join(items) or DASH
    if isinstance(v, list | tuple):
        if not v:
            return '<span class="muted">none</span>'
        if all(isinstance(x, Mapping) for x in v) and depth < 2:
            cols = list(dict.fromkeys(k for x in v for k in x))
            head = "".join(f"<th>{esc(_label(c))}</th>" for c in cols)
            body = "".join("<tr>" + "".join(f"<td>{_value(ctx, x.get(c), rec, depth + 1)}</td>" for c in cols)
                           + "</tr>" for x in v[:EVIDENCE_ROWS])
            more = f'<p class="note">First {EVIDENCE_ROWS} of {len(v)}.</p>' if len(v) > EVIDENCE_ROWS else ""
            table = f'<table class="data ev-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}'
            return table if len(v) <= 8 else f"<details><summary>{len(v)} entries</summary>{table}</details>"
        cells = [_value(ctx, x, rec, depth + 1) for x in v[:MAX_NAMES]]
        if len(v) <= EVIDENCE_INLINE and not any(_is_name(x) for x in v[3:]):
            return ", ".join(cells)
        what = "tensors" if all(_is_name(x) for x in v) else "values"
        first = ", ".join(esc(str(x).rsplit("/", 1)[-1]) if _is_name(x) else esc(fmt(x, 4)) if isinstance(x, float)
                          else esc(str(x)) for x in v[:3])
        more = f'<li class="muted">… {len(v) - MAX_NAMES} more</li>' if len(v) > MAX_NAMES else ""
        return (f"<details><summary>{len(v)} {what} ({first}, …)</summary><ul class=\"names\">"
                + "".join(f"<li>{c}</li>" for c in cells) + f"{more}</ul></details>")
    return _scalar(ctx, v, rec)


def _evidence(ctx: _Ctx, ev: dict[str, Any], rec: Any = None) -> str:
    items = []
    for k, v in ev.items():
        if k in _OWN_SECTION:
            continue
        block = isinstance(v, list | tuple) and (len(v) > EVIDENCE_INLINE or any(isinstance(x, Mapping) for x in v))
        items.append(f'<div class="{"ev-block" if block else ""}"><dt>{esc(_label(k))}</dt>'
                     f"<dd>{_value(ctx, v, rec)}</dd></div>")
    return f'<dl class="evidence">{"".join(items)}</dl>' if items else ""


def _where_row(ctx: _Ctx, rec: Any, where: Mapping[str, Any]) -> int | None:
    """The layer row of a finding's tensor (by reference name, else by test name) in its record."""
    for key in ("tensor", "test_tensor"):
        row = ctx.view.find(rec, str(where.get(key) or ""))
        if row is not None:
            return row
    return None


def _finding_html(ctx: _Ctx, f: Any, source: str) -> str:

    d = f.to_dict() if hasattr(f, "to_dict") else dict(f)
    sev = d.get("severity") if d.get("severity") in SEVERITIES else "info"
    where = d.get("where") or {}
    parts = []
    rec = where.get("record")
    if isinstance(rec, dict):
        parts.append("record " + esc(_rec_label((rec.get("sample", 0), rec.get("part"), rec.get("step", 0)),
                                                ctx.multi_sample)))
    tensor = where.get("tensor")
    row = None
    if tensor:
        # the row of the tensor in this report's table: a finding of another comparison links to the same
        # tensor's row, which carries that comparison's SQNR column too
        row = _where_row(ctx, rec, where)
        parts.append("tensor " + ctx.name_link(row, str(tensor)))
    for k, v in where.items():
        if k not in ("record", "tensor", "test_tensor"):
            parts.append(f"{esc(_label(k))} {_value(ctx, v, rec)}")
    sugg = f'<p class="suggest">{esc(d.get("suggestion"))}</p>' if d.get("suggestion") else ""
    href = ctx.href(row)
    go = (f' <a class="goto" href="{esc(href)}" title="open its row in the layer table">row →</a>'
          if href else "")
    return (f'<article class="finding sev-{esc(sev)}"><div class="head"><span class="sev">{esc(sev)}</span>'
            f'<span class="kind">{esc(d.get("kind"))}</span><span class="src">{esc(source)}</span></div>'
            f'<p class="msg">{esc(d.get("message"))}</p>'
            + (f'<p class="where">{" · ".join(parts)}{go}</p>' if parts else "")
            + _evidence(ctx, d.get("evidence") or {}, rec) + sugg + "</article>")


#: findings shown open per group (the rest sit in a collapsed list)
FINDINGS_OPEN = 12


def _finding_groups(ctx: _Ctx) -> list[tuple[str, list[Any], bool]]:
    """(source label, findings, primary) of this comparison, the replay and the other comparisons."""
    groups: list[tuple[str, list[Any], bool]] = [(ctx.label, list(ctx.cmp.findings), True)]
    if ctx.replay is not None:
        try:
            rf = list(ctx.replay.findings())
        except Exception:  # a replay result without findings support
            rf = []
        groups.append((f"replay on {ctx.replay.backend or 'the test backend'}", rf, True))
    return groups + [(ex.label, list(ex.cmp.findings), False) for ex in ctx.extras]


def _finding_rows(ctx: _Ctx) -> list[int]:
    """Layer rows the findings point at (``where``: record and tensor), headline first."""
    out: list[int] = []
    for _, fs, _ in ctx.finding_groups:
        for f in sorted(fs, key=lambda f: -severity_rank(getattr(f, "severity", "info"))):
            where = (f.to_dict() if hasattr(f, "to_dict") else dict(f)).get("where") or {}
            rec = where.get("record") if isinstance(where.get("record"), dict) else None
            row = _where_row(ctx, rec, where)
            if row is not None and row not in out:
                out.append(row)
    return out


def _findings(ctx: _Ctx) -> str:

    groups = [g for g in ctx.finding_groups if g[2]]
    extra = [g for g in ctx.finding_groups if not g[2]]
    out = []

    def cards(source: str, fs: list[Any]) -> list[str]:
        fs = sorted(fs, key=lambda f: -severity_rank(getattr(f, "severity", "info")))
        return [_finding_html(ctx, f, source) for f in fs]

    main = sorted([(f, src, pr) for src, fs, pr in groups for f in fs],
                  key=lambda x: -severity_rank(getattr(x[0], "severity", "info")))
    html_main = [_finding_html(ctx, f, src) for f, src, _ in main]
    out += html_main[:FINDINGS_OPEN]
    if len(html_main) > FINDINGS_OPEN:
        out.append(f"<details><summary>{len(html_main) - FINDINGS_OPEN} more findings</summary>"
                   f'{"".join(html_main[FINDINGS_OPEN:])}</details>')
    if not main:
        out.append('<p class="muted">No findings for this comparison: no budget violation, divergence or '
                   "quantization hazard was detected.</p>")
    for source, fs, _ in extra:
        if fs:
            c = Counter(getattr(f, "severity", "info") for f in fs)
            head = ", ".join(f"{c[s]} {s}" for s in ("error", "warning", "info") if c[s])
            out.append(f"<details><summary>{len(fs)} findings of {esc(source)} ({esc(head)})</summary>"
                       f'{"".join(cards(source, fs))}</details>')
    counts = Counter(getattr(f, "severity", "info") for f, _, _ in main)
    head = " · ".join(f"{counts[s]} {s}" for s in ("error", "warning", "info") if counts[s])
    return (f'<section class="card" id="findings"><h2>Findings <span class="muted small">{esc(head)}</span></h2>'
            + "".join(out) + "</section>")


def _stat(k: str, v: str, bad: bool = False) -> str:
    return f'<div class="stat"><div class="k">{esc(k)}</div><div class="v{" bad" if bad else ""}">{esc(v)}</div></div>'


def _summary(ctx: _Ctx) -> str:
    cmp = ctx.cmp
    s = cmp.summary
    um = cmp.unmatched
    fd = cmp.first_divergence
    stats = [
        _stat("aligned pairs", str(s["pairs"])), _stat("records", str(s["records"])),
        _stat("over budget", str(s["failed"]), bad=s["failed"] > 0),
        _stat("min SQNR (dB)", fmt(s["min_sqnr_db"], 4)), _stat("max |t − r|", fmt(s["max_max_abs"])),
        _stat("identical", str(s["identical"])), _stat("non-finite", str(s["non_finite"]), bad=s["non_finite"] > 0),
        _stat("unmatched ref / test", f"{um['ref']['count']} / {um['test']['count']}",
              bad=(um["ref"]["count"] + um["test"]["count"]) > 0),
    ]
    contract = getattr(cmp, "contract", None)
    if contract is not None:
        stats.append(_stat("input contract", contract.status, bad=contract.status != "ok"))
    html_ = [f'<section class="card" id="summary"><h2>Summary</h2><div class="grid">{"".join(stats)}</div>']
    if contract is not None:
        html_.append(f'<p class="{"note" if contract.status == "ok" else "banner"}">{esc(contract.line())}</p>')
    if fd is not None:
        row = ctx.view.find((fd["sample"], fd["part"], fd["step"]), fd["ref_name"])
        html_.append(f"<p><b>First divergence</b> (first tensor in execution order breaking "
                     f"{'the budgets' if cmp.budgets else f'SQNR ≥ {defaults.DIVERGENCE_SQNR_DB:g} dB'}): "
                     f"{ctx.name_link(row, fd['ref_name'])} in "
                     f"{esc(_rec_label((fd['sample'], fd['part'], fd['step']), ctx.multi_sample))}, "
                     f"SQNR {esc(fmt(fd.get('sqnr_db')))} dB, max |Δ| {esc(fmt(fd.get('max_abs')))}.</p>")
    else:
        html_.append("<p><b>First divergence:</b> none.</p>")
    # several comparisons side by side
    if ctx.extras:
        comps = [Labeled(ctx.label, cmp), *ctx.extras]
        short = short_labels([c.label for c in comps])
        head = "".join(f'<th title="{esc(c.label)}">{esc(short[c.label])}</th>' for c in comps)
        rows = []

        def line(name: str, cells: list[str]) -> None:
            rows.append(f"<tr><th>{esc(name)}</th>{''.join(cells)}</tr>")

        sums = [c.cmp.summary for c in comps]
        line("backends", [f"<td>{esc(c.cmp.ref.backend)} → {esc(c.cmp.test.backend)}</td>" for c in comps])
        line("verdict", [f"<td>{_verdict(c.cmp)}</td>" for c in comps])
        line("aligned pairs", [f'<td class="num">{x["pairs"]}</td>' for x in sums])
        line("over budget", [f'<td class="num">{x["failed"]}</td>' for x in sums])
        line("min SQNR (dB)", [_sqnr_cell(x["min_sqnr_db"]) for x in sums])
        line("max |t − r|", [f'<td class="num">{esc(fmt(x["max_max_abs"]))}</td>' for x in sums])
        fds = []
        for c in comps:
            f = c.cmp.first_divergence
            fds.append("<td>–</td>" if f is None else
                       f"<td class=\"fd\"><code>{esc(f['ref_name'])}</code> "
                       f"({esc(_rec_label((f['sample'], f['part'], f['step']), ctx.multi_sample))}, "
                       f"{esc(fmt(f.get('sqnr_db')))} dB)</td>")
        line("first divergence", fds)
        line("unmatched ref / test", [f'<td class="num">{c.cmp.unmatched["ref"]["count"]} / '
                                      f'{c.cmp.unmatched["test"]["count"]}</td>' for c in comps])
        html_.append("<h3>Comparisons side by side</h3><p class=\"muted small\">e.g. float vs CPU-QDQ is the "
                     "quantization error, CPU-QDQ vs HTP the backend error; the layer table has one SQNR column "
                     "per comparison.</p>")
        html_.append(f'<div class="scroll"><table class="data"><thead><tr><th></th>{head}</tr></thead>'
                     f'<tbody>{"".join(rows)}</tbody></table></div>')
    br = cmp.by_record()
    if len(br):
        fdr = cmp.first_divergences()
        first_by = {}
        if len(fdr):
            for r in fdr.to_dict("records"):
                first_by[(r["sample"], r["part"], r["step"])] = r
        recs = br.to_dict("records")[:200]
        body = []
        for r in recs:
            key = (r["sample"], r["part"], r["step"])
            f = first_by.get(key)
            frow = ctx.view.find(key, f["ref_name"]) if f else None
            body.append(
                f"<tr><td data-v=\"{_rec_sort(key)}\">{esc(_rec_label(key, ctx.multi_sample))}</td>"
                f'<td class="num">{int(r["tensors"])}</td>{_sqnr_cell(r.get("min_sqnr_db"))}'
                f'<td class="num" data-v="{_data_v(r.get("max_abs"))}">{esc(fmt(r.get("max_abs")))}</td>'
                f'<td class="num">{int(r["failed"])}</td>'
                f'<td class="num" data-v="{_data_v(r.get("top1"))}">{esc(fmt(r.get("top1")))}</td>'
                f'<td class="num" data-v="{_data_v(r.get("kl"))}">{esc(fmt(r.get("kl")))}</td>'
                f"<td>{ctx.name_link(frow, f['ref_name']) if f else '–'}</td></tr>")
        more = f'<p class="note">First 200 of {len(br)} records.</p>' if len(br) > 200 else ""
        html_.append('<h3>Per record (per step)</h3><div class="scroll"><table class="data sortable"><thead><tr>'
                     '<th data-sort="num">record</th><th data-sort="num">tensors</th><th data-sort="num">min SQNR</th>'
                     '<th data-sort="num">max |Δ|</th><th data-sort="num">over budget</th><th data-sort="num">top-1</th>'
                     '<th data-sort="num">KL</th><th data-sort="str">first divergence</th></tr></thead>'
                     f'<tbody>{"".join(body)}</tbody></table></div>{more}')
    html_.append("</section>")
    return "".join(html_)


def _budget_line(cmp: Any) -> tuple[float | None, str]:
    for b in cmp.budgets.items:
        if b.metric == "sqnr_db" and b.op == "min" and b.pattern == "*":
            return b.value, f"budget sqnr_db ≥ {b.value:g}"
    if not cmp.budgets:
        return defaults.DIVERGENCE_SQNR_DB, f"divergence threshold {defaults.DIVERGENCE_SQNR_DB:g} dB"
    return None, ""


def _point(ctx: _Ctx, r: dict[str, Any], y: Any, name: str, status: str | None = None,
           passed: bool | None = None) -> Point:
    """A chart point of a layer row; ``status`` / ``passed`` of the series when it is not the primary one."""
    f = as_float(y)
    val = math.nan if f is None else f
    status = status or r["status"]
    if passed is not None:
        bad = not passed
    elif ctx.cmp.budgets:
        bad = not r["passed"]
    else:
        bad = f is not None and f < defaults.DIVERGENCE_SQNR_DB
    title = f"{r['ref_name']} · {r.get('op_type') or '?'} · {name}: SQNR {fmt(f)} dB ({status})"
    return Point(float(r["order"]), val, ctx.href(r["row"]), title, bool(bad))


def _record_groups(ctx: _Ctx) -> dict[tuple[int, str], list[dict[str, Any]]]:
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in ctx.view.rows:
        groups.setdefault((r["record"][0], r["record"][1]), []).append(r)
    return groups


def depth_charts(ctx: _Ctx, parts: Sequence[str] | None = None, *, with_others: bool = False
                 ) -> tuple[list[tuple[str, int, Svg]], list[str]]:
    """The error-vs-depth charts: ``(title, number of steps, chart)`` per (sample, part) (the first
    ``MAX_CHARTS``; only ``parts`` when given), and the notes on steps left out. A chart shows the comparison
    the report is about (one line per decode step, or its line and the replay's introduced error);
    ``with_others``: the charts with the other comparisons' lines too (``None`` where there are none)."""
    groups = _record_groups(ctx)
    hline, hlabel = _budget_line(ctx.cmp)
    charts = []
    cut_steps = []
    keys = sorted((k for k in groups if parts is None or k[1] in parts), key=lambda k: (k[0], part_rank(k[1])))
    for sample, part in keys[:MAX_CHARTS]:
        rows = groups[(sample, part)]
        steps = sorted({r["record"][2] for r in rows})
        series: list[Series] = []
        shown_steps = steps
        if len(steps) > 8:
            idx = np.linspace(0, len(steps) - 1, 8).round().astype(int)
            shown_steps = [steps[i] for i in sorted(set(idx.tolist()))]
            cut_steps.append(f"{part}: {len(shown_steps)} of {len(steps)} steps drawn")
        for k, st in enumerate(shown_steps):
            rr = [r for r in rows if r["record"][2] == st]
            name = ctx.label if len(steps) == 1 else f"step {st}"
            pts = thin_points([_point(ctx, r, r["sqnr_db"], name) for r in rr], ctx.max_points)
            color, dash = SERIES_STYLES[k % len(SERIES_STYLES)]
            series.append(Series(name, color, pts, dash=dash))
        others: list[Series] = []
        if len(steps) == 1:
            for k, ex in enumerate(ctx.extras, start=1):
                pts = []
                for r in rows:
                    e = r["extras"].get(ex.label)
                    if e is not None:
                        ok = e["passed"] if ex.cmp.budgets else not (
                            e["sqnr_db"] is not None and e["sqnr_db"] < defaults.DIVERGENCE_SQNR_DB)
                        pts.append(_point(ctx, r, e["sqnr_db"], ex.label, e["status"], ok))
                if pts:
                    color, dash = SERIES_STYLES[k % len(SERIES_STYLES)]
                    others.append(Series(ex.label, color, thin_points(pts, ctx.max_points), dash=dash))
            if ctx.view.has_replay:
                limit = getattr(ctx.replay, "budget_sqnr_db", defaults.DIVERGENCE_SQNR_DB)
                pts = [_point(ctx, r, r["intro_sqnr_db"], "introduced", r["intro_status"],
                              r["intro_sqnr_db"] is None or r["intro_sqnr_db"] >= limit)
                       for r in rows if r["intro_status"] is not None]
                if pts:
                    series.append(Series(f"introduced (replay on {ctx.replay.backend or '?'})", INTRODUCED_STYLE[0],
                                         thin_points(pts, ctx.max_points), dash=INTRODUCED_STYLE[1]))
        title = f"{part}" + (f" · sample {sample}" if ctx.multi_sample else "")

        def chart(ss: list[Series], title: str = title) -> Svg:
            return line_chart(ss, width=570, height=280, x_label="execution order in the record",
                              y_label="SQNR (dB)", hline=hline, hline_label=hlabel,
                              label=f"SQNR vs execution order — {title}",
                              max_markers=max(ctx.max_points // (2 * max(len(ss), 1)), 12))

        if not with_others:
            charts.append((title, len(steps), chart(series)))
        else:
            charts.append((title, len(steps), chart(series[:1] + others + series[1:]) if others else None))
    return charts, cut_steps


def _depth(ctx: _Ctx) -> str:
    groups = _record_groups(ctx)
    figures, cut_steps = depth_charts(ctx)
    alls, _ = depth_charts(ctx, with_others=True)
    hlabel = _budget_line(ctx.cmp)[1]
    charts = []
    for (title, nsteps, svg), (_, _, svg_all) in zip(figures, alls, strict=True):
        what = (f"{min(nsteps, 8)} decode steps" if nsteps > 1 else f"<b>{esc(ctx.label)}</b>"
                + (" and the error each unit introduces" if ctx.view.has_replay else ""))
        toggle = (f"<details><summary>with the {len(ctx.extras)} other comparison(s)</summary>{svg_all}</details>"
                  if svg_all is not None else "")
        charts.append(f'<figure style="width:570px">{svg}<figcaption>{esc(title)}: SQNR of each aligned tensor vs '
                      f"its execution order, {what}; the dashed red line is {esc(hlabel or 'no budget')}. Red "
                      "markers break the budget; hollow markers on the top edge are identical tensors, crosses on "
                      f"the bottom edge undefined metrics.</figcaption>{toggle}</figure>")
    note = ""
    if len(groups) > MAX_CHARTS:
        note += f'<p class="note">First {MAX_CHARTS} of {len(groups)} (sample, part) charts.</p>'
    if cut_steps:
        note += f'<p class="note">{esc("; ".join(cut_steps))} (evenly chosen, first and last included).</p>'
    note += (f'<p class="note">Lines use at most about {ctx.max_points} points per series and each chart about '
             f"{ctx.max_points // 2} markers, chosen evenly while always keeping the minimum and the first point over "
             "budget (up to half of them are points over budget). Markers link to their layer-table row.</p>")
    return (f'<section class="card" id="depth"><h2>Error vs depth</h2><div class="charts">{"".join(charts)}</div>'
            f"{note}</section>")


def heatmap_charts(ctx: _Ctx, samples: Sequence[int] | None = None,
                   parts: Sequence[str] | None = None) -> list[tuple[str, str, Svg, list[str]]]:
    """The step × layer SQNR heatmaps of the (sample, part) groups with several steps (the first 4; only
    ``samples`` / ``parts`` when given): ``(title, data id, chart, notes)``; their hover data go to
    ``ctx.blocks``."""
    multi = [(k, v) for k, v in _record_groups(ctx).items() if len({r["record"][2] for r in v}) > 1
             and (samples is None or k[0] in samples) and (parts is None or k[1] in parts)]
    out = []
    for hi, ((sample, part), rows) in enumerate(sorted(multi, key=lambda kv: kv[0])[:4]):
        steps = sorted({r["record"][2] for r in rows})
        notes = []
        if len(steps) > HEATMAP_MAX_ROWS:
            idx = np.linspace(0, len(steps) - 1, HEATMAP_MAX_ROWS).round().astype(int)
            steps = [steps[i] for i in sorted(set(idx.tolist()))]
            notes.append(f"{len(steps)} evenly chosen steps")
        cols = sorted({(r["order"], r["ref_name"]) for r in rows})
        col_of = {c: i for i, c in enumerate(cols)}
        nc = len(cols)
        nb = min(nc, HEATMAP_MAX_COLS)
        width = math.ceil(nc / nb)
        nb = math.ceil(nc / width)
        if width > 1:
            notes.append(f"{nc} layers binned {width} per column, each cell the worst (lowest SQNR) of its bin")
        grid = np.full((len(steps), nb), np.inf)
        missing = np.ones((len(steps), nb), dtype=bool)
        links: list[list[int | None]] = [[None] * nb for _ in steps]
        values: list[list[str | None]] = [[None] * nb for _ in steps]
        step_of = {s: i for i, s in enumerate(steps)}
        worst: dict[tuple[int, int], float] = {}
        for r in rows:
            i = step_of.get(r["record"][2])
            if i is None:
                continue
            j = col_of[(r["order"], r["ref_name"])] // width
            v = as_float(r["sqnr_db"])
            key_v = -math.inf if v is None and r["status"] not in ("identical", "empty") else (math.inf if v is None else v)
            if (i, j) not in worst or key_v < worst[(i, j)]:
                worst[(i, j)] = key_v
                grid[i, j] = math.nan if key_v == -math.inf else key_v
                missing[i, j] = False
                links[i][j] = r["row"] if r["row"] in ctx.shown else None
                values[i][j] = ("undefined (" + str(r["status"]) + ")") if key_v == -math.inf else fmt(key_v, 4)
        col_labels = []
        for j in range(nb):
            a, b = j * width, min((j + 1) * width, nc) - 1
            col_labels.append(cols[a][1] if a == b else f"layers {a}–{b} ({cols[a][1]} … {cols[b][1]})")
        did = f"heat-{hi}"
        row_labels = [f"step {s}" for s in steps]
        ctx.blocks.append((did, {"rows": len(steps), "cols": nb, "row_labels": row_labels,
                                 "col_labels": col_labels, "values": values, "links": links}))
        svg = heatmap_chart(grid, row_labels, x_label="layer (position in execution order)", data_id=did,
                            missing=missing, label=f"step × layer SQNR heatmap — {part}", x_extent=nb * width)
        out.append((part + (f" · sample {sample}" if ctx.multi_sample else ""), did, svg, notes))
    return out


def _heatmaps(ctx: _Ctx) -> str:
    out = [f"<h3>{esc(title)}</h3><figure>{svg}<div class=\"readout\" id=\"{esc(did)}-readout\">"
           f"hover a cell to read it; click to jump to its row</div></figure>"
           + (f'<p class="note">{esc("; ".join(notes))}.</p>' if notes else "")
           for title, did, svg, notes in heatmap_charts(ctx)]
    if not out:
        return ""
    return (f'<section class="card" id="heatmap"><h2>Step × layer heatmap</h2>'
            f'<p class="muted small">SQNR of every layer (columns, execution order) at every step (rows): a '
            "divergence that grows with the step shows as a colour change down a column.</p>"
            f'{color_scale_legend()}{"".join(out)}</section>')


#: evidence keys rendered by a section of their own (not in the finding's evidence list)
_OWN_SECTION = ("table",)


def _ds_cell(v: float, vmax: float, rgb: tuple[int, int, int], text: str) -> str:
    a = 0.0 if vmax <= 0 else min(1.0, max(0.0, v / vmax))
    return (f'<td title="{esc(text)}" style="background:rgba({rgb[0]},{rgb[1]},{rgb[2]},{a:.2f});'
            f'min-width:1.6em;height:1.2em;padding:0"></td>')


def _deepstack(ctx: _Ctx) -> str:
    """Per image token and layer boundary: the reference's DeepStack jump, the test's and their difference
    (the ``table`` of the DeepStack findings, one per comparison and record)."""
    groups = [(ctx.label, list(ctx.cmp.findings))] + [(ex.label, list(ex.cmp.findings)) for ex in ctx.extras]
    out = []
    for label, fs in groups:
        seen = set()
        for f in fs:
            d = f.to_dict() if hasattr(f, "to_dict") else dict(f)
            tab = (d.get("evidence") or {}).get("table")
            rec = json.dumps((d.get("where") or {}).get("record"), default=str)
            if not d.get("kind", "").startswith("deepstack") or not isinstance(tab, dict) or rec in seen:
                continue
            seen.add(rec)
            rows = [int(r) for r in tab.get("rows", [])]
            vmax = max([float(x) for series in ("ref", "test", "difference") for v in tab.get(series, {}).values()
                        for x in v] or [1.0])
            head = "".join(f"<th>{r}</th>" for r in rows)
            body = []
            for b in tab.get("boundaries", []):
                where = "before layer 0" if int(b) == 0 else f"after layer {int(b) - 1}"
                for series, rgb, name in (("ref", (37, 99, 235), "reference jump"), ("test", (37, 99, 235), "test jump"),
                                          ("difference", (220, 38, 38), "difference")):
                    vals = (tab.get(series) or {}).get(b) or (tab.get(series) or {}).get(str(b)) or []
                    cells = "".join(_ds_cell(float(v), vmax, rgb, f"{where}, row {r}: {name} {fmt(float(v), 3)}")
                                    for r, v in zip(rows, vals, strict=False))
                    body.append(f"<tr><th class=\"small\">{esc(where)} · {esc(name)}</th>{cells}</tr>")
            out.append(f"<h3>{esc(label)} <span class=\"muted small\">record {esc(rec)}</span></h3>"
                       f'<table class="small"><thead><tr><th>image row →</th>{head}</tr></thead>'
                       f"<tbody>{''.join(body)}</tbody></table>")
    if not out:
        return ""
    return ('<section class="card" id="deepstack"><h2>DeepStack per image token and layer</h2>'
            '<p class="muted small">The residual-stream jump between two LLM layers at each image row, relative to '
            "the stream (blue: the reference's and the test's; red: their difference). A fault shows as a red row: where "
            "the reference is blue and the test is not (missing), or at another layer (misrouted); "
            "docs/findings.md, DeepStack.</p>" + "".join(out) + "</section>")


def _select_rows(ctx: _Ctx) -> list[dict[str, Any]]:
    """Every row when they fit ``max_rows``; else, in this order until the cap: the rows the findings point at
    (always kept, even past the cap), each record's first divergence, the rows over budget and then the other
    rows, worst first by the ranking metric."""
    rows = ctx.view.rows
    if len(rows) <= ctx.max_rows:
        return rows
    keep = dict.fromkeys(_finding_rows(ctx))
    fds = ctx.cmp.first_divergences()
    for r in fds.to_dict("records") if len(fds) else []:
        i = ctx.view.find((r["sample"], r["part"], r["step"]), r["ref_name"])
        if i is not None and len(keep) < ctx.max_rows:
            keep[i] = None
    worst = [int(i) for i in ctx.cmp.worst(len(rows)).index]
    failing = [i for i in worst if not rows[i]["passed"]]
    for i in failing + worst:
        if len(keep) >= ctx.max_rows:
            break
        keep[i] = None
    return [r for r in rows if r["row"] in keep]


def _layer_table(ctx: _Ctx, rows: list[dict[str, Any]]) -> str:
    v = ctx.view
    heads = ['<th data-sort="num" title="execution order in the record (sorts by global order)">#</th>',
             '<th data-sort="num">record</th>', '<th data-sort="str">tensor</th>', '<th data-sort="str">op</th>',
             '<th data-sort="str" title="test precision (u8 = 8-bit encoding, /ch = per-channel) / reference">'
             "precision</th>",
             '<th data-sort="num" title="SQNR of this comparison; the status shows when a metric is undefined">'
             "SQNR dB</th>"]
    short = short_labels([ctx.label, *v.extra_labels])
    heads += [f'<th class="wrap x" data-sort="num" title="SQNR of the same tensor in {esc(lab)}">SQNR {esc(short[lab])}'
              "</th>" for lab in v.extra_labels]
    tw = getattr(ctx.cmp, "three_way", None)
    if tw is not None:
        heads += ['<th class="wrap" data-sort="num" title="rel-L2 error vs the reference of this comparison divided '
                  'by that of the expected (CPU-QDQ) dump, this record">ratio vs CPU-QDQ</th>',
                  '<th data-sort="num" title="Bhattacharyya coefficient of the two |error| histograms">BC</th>']
    if v.has_replay:
        heads += ['<th class="wrap" data-sort="num" title="SQNR of the error this QDQ unit introduces when fed the '
                  'reference inputs (replay)">introduced SQNR</th>',
                  '<th data-sort="num" title="share of the error power inherited from upstream">inherited</th>']
    heads += ['<th data-sort="str">budget</th>', '<th data-sort="num">cosine</th>', '<th data-sort="num">max |Δ|</th>',
              '<th class="wrap" data-sort="num" title="rmse in quantization steps of the test encoding">LSB rmse</th>',
              '<th data-sort="num" title="fraction of reference values outside the test encoding range">clipped</th>']
    if v.has_latency:
        heads.append(f'<th class="wrap" data-sort="num" title="{esc(v.latency_note)}">latency {esc(v.latency_unit)}</th>')
    body = []
    for r in rows:
        key = r["record"]
        status = str(r["status"])
        shape = "×".join(str(d) for d in (r.get("shape") or ())) or "scalar"
        names = f"<code>{esc(r['ref_name'])}</code>"
        if r["test_name"] != r["ref_name"]:
            names += f'<div class="alt">test: <code>{esc(r["test_name"])}</code></div>'
        names += f'<div class="alt">{esc(shape)}' + (f" · {esc(r['scope'])}" if r.get("scope") else "") + "</div>"
        op = str(r.get("op_type") or "")
        if r.get("test_op_type") and r["test_op_type"] != op:
            op += f" / {r['test_op_type']}"
        prec = r["precision"] if r["precision"] == r["ref_precision"] else f"{r['precision']} / {r['ref_precision']}"
        enc = r.get("encoding") or {}
        prec_title = ""
        if enc:
            sc = enc.get("scale")
            sc_txt = fmt(sc) if not isinstance(sc, list) else f"{len(sc)} scales"
            prec_title = f' title="scale {esc(sc_txt)}, zero point {esc(enc.get("zero_point"))}"'
        viol = r.get("violations") or []
        budget = (f'<span class="viol">{esc(", ".join(viol))}</span>' if viol else
                  ('<span class="pill pass">ok</span>' if ctx.cmp.budgets else '<span class="muted">–</span>'))
        tok = f"{status} {'pass' if r['passed'] else 'fail'}"
        sq = as_float(r["sqnr_db"])
        if not ctx.cmp.budgets and ((sq is None and status not in ("identical", "empty"))
                                    or (sq is not None and sq < defaults.DIVERGENCE_SQNR_DB)):
            tok += " diverged"
        sq_cell = _sqnr_cell(r["sqnr_db"], status)
        if status not in ("ok",):
            sq_cell = sq_cell.replace("</td>", f' <span class="pill {esc(status)}">{esc(status)}</span></td>', 1)
        if getattr(ctx.cmp, "contract", None) is not None and ctx.cmp.contract.status == "broken":
            sq_cell = sq_cell.replace("</td>", ' <span class="pill fail">inputs differ</span></td>', 1)
        cells = [
            f'<td class="num" data-v="{r["row"]}">{int(r["order"])}</td>',
            f'<td data-v="{_rec_sort(key)}">{esc(_rec_label(key, ctx.multi_sample))}</td>',
            f'<td class="name">{names}</td>',
            f"<td>{esc(op)}</td>",
            f"<td{prec_title}>{esc(prec)}</td>",
            sq_cell,
        ]
        for lab in v.extra_labels:
            e = r["extras"].get(lab)
            cells.append(_sqnr_cell(e["sqnr_db"], e["status"], " x") if e else '<td class="num x" data-v="">–</td>')
        if tw is not None:
            cells += list(threeway_report.ratio_cells(tw, r))
        if v.has_replay:
            cells.append(_sqnr_cell(r["intro_sqnr_db"], r["intro_status"]))
            sh = as_float(r["inherited_share"])
            cells.append(f'<td class="num" data-v="{_data_v(sh)}">'
                         f'{esc(fmt(100 * sh, 3) + " %" if sh is not None else "–")}</td>')
        clip = as_float(r.get("clipped_fraction"))
        cells += [
            f"<td>{budget}</td>",
            f'<td class="num" data-v="{_data_v(r["cosine"])}">{esc(fmt(r["cosine"], 5))}</td>',
            f'<td class="num" data-v="{_data_v(r["max_abs"])}">{esc(fmt(r["max_abs"]))}</td>',
            f'<td class="num" data-v="{_data_v(r.get("lsb_rmse"))}">{esc(fmt(r.get("lsb_rmse"), 3))}</td>',
            f'<td class="num" data-v="{_data_v(clip)}">{esc(fmt(100 * clip, 3) + " %" if clip is not None else "–")}</td>',
        ]
        if v.has_latency:
            lat = as_float(r["latency"])
            ops = ", ".join(r.get("ops") or [])
            cells.append(f'<td class="num" data-v="{_data_v(lat)}" title="{esc(ops)}">{esc(fmt(lat, 4))}</td>')
        body.append(f'<tr id="L{r["row"]}" data-status="{esc(tok)}" data-part="{esc(key[1])}">'
                    f'{"".join(cells)}</tr>')
    parts = sorted({r["record"][1] for r in v.rows}, key=part_rank)
    part_opts = "".join(f'<option value="{esc(p)}">{esc(p)}</option>' for p in parts)
    statuses = ["fail", "pass"] if ctx.cmp.budgets else ["diverged"]
    statuses += sorted({str(r["status"]) for r in v.rows})
    names_ = {"fail": "over budget", "pass": "within budget",
              "diverged": f"SQNR < {defaults.DIVERGENCE_SQNR_DB:g} dB"}
    st_opts = "".join(f'<option value="{esc(s)}">{esc(names_.get(s, "status " + s))}</option>' for s in statuses)
    note = ""
    if len(rows) < len(v.rows):
        note = (f'<p class="note">Showing {len(rows)} of {len(v.rows)} rows: every row a finding points at, each '
                f"record's first divergence, then the rows over budget and the others, worst first by "
                f"{esc(ctx.cmp.rank_by)}. The full table is in "
                "<code>ivq-diff --json</code> or <code>ivq.compare(...).table</code>.</p>")
    controls = (
        '<div class="controls"><input type="search" id="layer-filter" placeholder="filter by name, op, scope, '
        'precision" aria-label="filter rows">'
        f'<select id="layer-status" aria-label="status"><option value="">all rows</option>{st_opts}</select>'
        f'<select id="layer-part" aria-label="part"><option value="">any part</option>{part_opts}</select>'
        + (f'<label class="small"><input type="checkbox" id="layer-extra"> SQNR of the {len(v.extra_labels)} other '
           "comparison(s)</label>" if v.extra_labels else "")
        + f'<span class="count" id="layer-count">{len(rows)} rows</span></div>')
    return (f'<section class="card" id="layers"><h2>Layers</h2><p class="muted small">One row per aligned tensor '
            "pair in execution order; click a header to sort (again to reverse). SQNR cells use the heatmap "
            "colours; hover a header for its definition.</p>"
            f'{controls}{note}<div class="scroll tall"><table class="data sortable hide-x" id="layer-table"><thead><tr>'
            f'{"".join(heads)}</tr></thead><tbody>{"".join(body)}</tbody></table></div></section>')


def drilldown_charts(a: np.ndarray, b: np.ndarray, max_points: int) -> tuple[Svg, Svg, Svg]:
    """A pair's drill-down: value histograms (reference vs test), the error histogram (log count) and a
    scatter of ``max_points`` evenly strided values, from same-position samples ``a`` (reference), ``b``."""
    sub = sample_indices(a.size, max_points)
    h1 = histogram_chart([("reference", a, "#2457a6"), ("test", b, "#e07b00")], width=380, height=220,
                         label="value histograms, reference vs test")
    h2 = histogram_chart([("test − reference", b - a, "#c0392b")], width=340, height=220, x_label="error",
                         label="error histogram", log_y=True)
    sc = scatter_chart(a[sub], b[sub], width=260, height=220, label="test vs reference values")
    return h1, h2, sc


def _drilldowns(ctx: _Ctx) -> str:

    if ctx.drilldowns <= 0 or not len(ctx.cmp.table):
        return ""
    rows = ctx.view.rows
    picked: list[tuple[dict[str, Any], Any]] = []
    seen: dict[bytes, dict[str, Any]] = {}
    copies: list[tuple[dict[str, Any], dict[str, Any]]] = []
    tried = 0
    for i in ctx.cmp.worst(len(ctx.cmp.table)).index:
        r = rows[int(i)]
        if r["status"] in ("identical", "empty", "shape_mismatch"):
            continue
        if tried >= DRILL_CANDIDATES * ctx.drilldowns:
            break
        tried += 1
        s = pair_samples(ctx.cmp, r["row"], HIST_SAMPLES)
        if s is not None:  # a byte copy of a pair already drilled into (a Reshape, a view) says nothing new
            digest = hashlib.sha256(s[0].tobytes() + s[1].tobytes()).digest() + repr(r["record"]).encode()
            if digest in seen:
                copies.append((r, seen[digest]))
                continue
            seen[digest] = r
        picked.append((r, s))
        if len(picked) >= ctx.drilldowns:
            break
    if not picked:
        return ""

    out = []
    for r, s in picked:
        head = (f'<h3>{ctx.name_link(r["row"], r["ref_name"])} <span class="muted small">'
                f'{esc(r.get("op_type") or "")} · {esc(_rec_label(r["record"], ctx.multi_sample))} · '
                f'{esc(r["precision"])}</span></h3>')
        metrics = (f"<p class=\"small\">SQNR <b>{esc(fmt(r['sqnr_db']))}</b> dB · cosine {esc(fmt(r['cosine'], 6))} · "
                   f"max |Δ| {esc(fmt(r['max_abs']))} · rel L2 {esc(fmt(r['rel_l2']))} · LSB rmse "
                   f"{esc(fmt(r.get('lsb_rmse'), 3))} · status {esc(r['status'])}"
                   + (f" · clipped {esc(fmt(100 * r['clipped_fraction'], 3))} %" if as_float(r.get('clipped_fraction')) is not None else "")
                   + "</p>")
        if s is None:
            out.append(f'<div class="drill">{head}{metrics}<p class="muted">values not available (shapes differ or '
                       "the pair could not be read).</p></div>")
            continue
        a, b = s
        n = int(r.get("numel") or a.size)
        nonfin = int((~np.isfinite(a)).sum() + (~np.isfinite(b)).sum())
        sub = sample_indices(a.size, ctx.max_points)
        h1, h2, sc = drilldown_charts(a, b, ctx.max_points)
        how = (f"{a.size:,} of {n:,} values" if a.size < n else f"all {n:,} values") + " (evenly strided)"
        out.append(f'<div class="drill">{head}{metrics}<div class="charts"><figure style="width:380px">{h1}'
                   f"<figcaption>value histograms: {esc(how)}</figcaption></figure><figure style='width:340px'>{h2}"
                   "<figcaption>error t − r, log count</figcaption></figure>"
                   f'<figure style="width:260px">{sc}<figcaption>test vs reference: {len(sub):,} points'
                   "</figcaption></figure></div>"
                   + (f'<p class="note">{nonfin} non-finite values left out of the plots.</p>' if nonfin else "")
                   + "</div>")
    skipped = ""
    if copies:
        items = "".join(f"<li>{ctx.name_link(c['row'], c['ref_name'])} = {ctx.name_link(o['row'], o['ref_name'])}</li>"
                        for c, o in copies)
        skipped = (f"<details><summary>{len(copies)} byte copies of a pair above skipped</summary>"
                   f'<ul class="names">{items}</ul></details>')
    return (f'<section class="card" id="drilldown"><h2>Worst layers</h2><p class="muted small">The '
            f"{len(picked)} worst pairs by {esc(ctx.cmp.rank_by)} (identical and mismatched pairs skipped, and "
            "pairs whose values are a byte copy of a pair shown, such as a Reshape's output). Values "
            f"are evenly strided samples at the same positions on both sides: up to {HIST_SAMPLES:,} per histogram "
            f"and {ctx.max_points} per scatter, read block by block.</p>{skipped}{''.join(out)}</section>")


def _timeline(ctx: _Ctx) -> str:
    """The profiling timeline, one block per profile the test dump carries (per part: vision, prefill, decode)."""
    tls = ctx.timeline or []
    if not tls:
        return ""
    info = ctx.cmp.test.backend_info or {}
    emu = any(t.emulated is True for t in tls) or info.get("emulated") is True
    warn = ('<p class="banner"><span class="badge emulated">EMULATED</span> Host-side measurements of the x86_64 '
            "HTP emulation: use them to map ops and find relative hot spots, not as device latency.</p>") if emu else ""
    names = [f"{t.part or 'the model'} ({len(t.runs)} run{'s' if len(t.runs) != 1 else ''})" for t in tls]
    blocks = [_timeline_part(ctx, t, len(tls) > 1) for t in tls]
    return (f'<section class="card" id="timeline"><h2>QNN profiling timeline</h2>{warn}'
            f'<p class="small">Profiles in the test dump: {esc(", ".join(names))}.</p>'
            '<p class="muted small">One bar per profiled op, coloured by the SQNR of the tensor it produces (grey: '
            f"no tensor); click a bar to open its layer row.</p>{color_scale_legend()}{''.join(blocks)}</section>")


def _timeline_part(ctx: _Ctx, tl: Any, several: bool) -> str:
    """The timeline of one profile (one part): bars of one run, the longest ops, every run."""
    # the run shown: the one of the first divergence's record when runs map to records, else the first
    run = tl.runs[0]
    fd = ctx.cmp.first_divergence
    if tl.run_records and fd is not None:
        rec = (fd["sample"], fd["part"], fd["step"])
        run = next((k for k, v in tl.run_records.items() if v == rec), run)
    record = tl.run_records.get(run)
    ops = tl.run_ops(run)
    unit = tl.unit_label
    rows_by_name: dict[str, list[dict[str, Any]]] = {}
    for r in ctx.view.rows:
        if record is None or r["record"] == record:
            rows_by_name.setdefault(r["test_name"], []).append(r)

    def layer_of(op: Any) -> dict[str, Any] | None:
        cands = [r for t in op.tensors for r in rows_by_name.get(t, [])]
        if not cands:
            return None
        return min(cands, key=lambda r: (as_float(r["sqnr_db"]) if as_float(r["sqnr_db"]) is not None else -math.inf))

    total = sum(o.dur for o in ops) or 1.0
    keep = set(range(len(ops)))
    merged_note = ""
    if len(ops) > ctx.max_timeline_ops:
        order = sorted(range(len(ops)), key=lambda i: -ops[i].dur)
        keep = set(order[: ctx.max_timeline_ops])
        merged_note = (f"{len(ops) - len(keep)} shorter ops are merged into grey bars; the {len(keep)} longest are "
                       "drawn one by one.")
    lanes: dict[str, list[Bar]] = {}
    pending: list[Any] = []

    def lane_of(o: Any) -> str:
        return "HTP" if o.backend == "QNN" else str(o.backend)

    def flush() -> None:
        if not pending:
            return
        a, b = pending[0].start, pending[-1].start + pending[-1].dur
        lanes.setdefault(lane_of(pending[0]), []).append(
            Bar(a, b - a, NODATA_COLOR, f"{len(pending)} short ops, {fmt(b - a)} {unit}"))
        pending.clear()

    for i, o in enumerate(ops):
        lane = lane_of(o)
        if pending and lane_of(pending[0]) != lane:
            flush()
        if i not in keep:
            pending.append(o)
            continue
        flush()
        lr = layer_of(o)
        sq = as_float(lr["sqnr_db"]) if lr else None
        color = "#9aa5b1"
        if lr is not None:
            color = sqnr_color(math.inf if sq is None and lr["status"] == "identical" else sq)
        tip = (f"{o.name}" + (f" (op {o.op_id})" if o.op_id is not None else "")
               + f" · {fmt(o.dur, 4)} {unit} ({fmt(100 * o.dur / total, 3)} % of the run)"
               + (f" · tensor {lr['test_name']} · SQNR {fmt(sq)} dB · {lr['precision']}" if lr else " · no tensor"))
        short = o.name.rsplit("/", 1)[-1] if "/" in o.name else o.name
        lanes.setdefault(lane, []).append(Bar(o.start, o.dur, color, tip, ctx.href(lr["row"]) if lr else None, short))
    flush()
    lane_order = sorted(lanes, key=lambda k: (k != "HTP", k))
    svg = timeline_chart([(k, lanes[k]) for k in lane_order], x_label=f"{unit} (ops end to end, profile order)"
                         if tl.unit == "cycles" else "time (µs)",
                         label=f"profiling timeline of {tl.part or 'the model'}, run {run}")
    top = sorted(ops, key=lambda o: -o.dur)[:12]
    trs = []
    for o in top:
        lr = layer_of(o)
        trs.append(f"<tr><td><code>{esc(o.name)}</code></td><td>{esc(o.backend)}</td>"
                   f'<td class="num" data-v="{_data_v(o.dur)}">{esc(fmt(o.dur, 4))}</td>'
                   f'<td class="num" data-v="{_data_v(o.dur / total)}">{esc(fmt(100 * o.dur / total, 3))} %</td>'
                   f"<td>{ctx.name_link(lr['row'], lr['test_name']) if lr else DASH}</td>"
                   + (_sqnr_cell(lr["sqnr_db"], lr["status"]) if lr else '<td class="num" data-v="">–</td>')
                   + f"<td>{esc(lr['precision']) if lr else '–'}</td></tr>")
    joined = sum(1 for o in ops if o.tensors)
    rec_txt = (f"record {_rec_label(record, ctx.multi_sample)}" if record is not None else
               "runs do not map one to one to the dump's records: errors are the worst over all records")
    info = ctx.cmp.test.backend_info or {}
    if several and tl.part and isinstance(info.get(tl.part), dict):
        info = {**info, **info[tl.part]}  # a session dump keeps each part's partition under the part's name
    part_ = info.get("partition")
    cpu_nodes = (part_.get("cpu_nodes") or []) if isinstance(part_, dict) else []
    cpu_html = ""
    if cpu_nodes:
        items = "".join(f"<li>{esc(n.get('name'))} ({esc(n.get('op_type'))}): {esc(n.get('reason') or '')}</li>"
                        for n in cpu_nodes[:50] if isinstance(n, dict))
        cpu_html = ('<p class="small"><b>Ran on the CPU</b> (from the partition; the QNN profile does not time '
                    f'them):</p><ul class="names">{items}</ul>')
    runs_html = ""
    if len(tl.runs) > 1:
        cells = "".join(
            f"<tr><td>{r}</td><td>{esc(_rec_label(tl.run_records[r], ctx.multi_sample)) if r in tl.run_records else '–'}"
            f'</td><td class="num">{esc(fmt(tl.totals.get(r), 4))}</td>'
            f'<td class="num">{esc(fmt(tl.us_per_cycle.get(r), 4))}</td></tr>' for r in tl.runs[:64])
        runs_html = (f"<details><summary>all profiled runs of {esc(tl.part or 'the model')}</summary>"
                     '<div class="scroll"><table class="data"><thead><tr>'
                     f"<th>run</th><th>record</th><th>ops total ({esc(unit)})</th><th>profile µs/cycle</th></tr>"
                     f"</thead><tbody>{cells}</tbody></table></div></details>")
    basis = (f"per-op cycles from the profile, ops laid end to end in profile order; this run's own accelerator "
             f"time ratio is {fmt(tl.us_per_cycle[run], 4)} µs/cycle" if tl.unit == "cycles" and run in tl.us_per_cycle
             else "per-op cycles from the profile, ops laid end to end in profile order" if tl.unit == "cycles"
             else "µs from the profile")
    part_txt = (f"part {tl.part}" + (" (told from the tensors its ops produce)" if tl.part_inferred else "")
                if tl.part else "the model")
    notes = [f"Profile of {part_txt} (table {tl.table}): run {run} of {len(tl.runs)} ({rec_txt}); {len(ops)} ops, "
             f"{joined} joined to tensors (join: {tl.join}); {basis}."]
    if merged_note:
        notes.append(merged_note)
    title = f"{tl.part or 'model'}: run {run}" + (f", {_rec_label(record, ctx.multi_sample)}" if record else "")
    return (f'<div class="tl-part" id="timeline-{esc(tl.part or "model")}"><h3>{esc(title)}</h3><figure>{svg}</figure>'
            + "".join(f'<p class="note">{esc(n)}</p>' for n in notes)
            + "<details" + ("" if several else " open") + f"><summary>longest ops of {esc(tl.part or 'the model')}"
              '</summary><div class="scroll"><table class="data sortable"><thead><tr>'
              '<th data-sort="str">op</th><th data-sort="str">backend</th>'
              f'<th data-sort="num">{esc(unit)}</th><th data-sort="num">share</th><th data-sort="str">tensor</th>'
              f'<th data-sort="num">SQNR</th><th>precision</th></tr></thead><tbody>{"".join(trs)}</tbody></table>'
              f"</div></details>{runs_html}{cpu_html}</div>")


def _names_list(names: list[str]) -> str:
    c = Counter(names)
    items = [f"<li>{esc(n)}" + (f' <span class="muted">×{k}</span>' if k > 1 else "") + "</li>"
             for n, k in list(c.items())[:MAX_NAMES]]
    more = f'<p class="note">First {MAX_NAMES} of {len(c)} distinct names.</p>' if len(c) > MAX_NAMES else ""
    return f'<ul class="names">{"".join(items)}</ul>{more}' if items else '<p class="muted">none</p>'


def _unmatched(ctx: _Ctx) -> str:
    out = ['<section class="card" id="unmatched"><h2>Unmatched tensors</h2>'
           '<p class="muted small">Tensors present on one side only (counted per record); they are never dropped '
           "silently. Typical causes: graph inputs, tensors QNN cannot expose, fused ops.</p>"]
    for lab, c in [(ctx.label, ctx.cmp), *[(e.label, e.cmp) for e in ctx.extras]]:
        um = c.unmatched
        if len(ctx.extras):
            out.append(f"<h3>{esc(lab)}</h3>")
        out.append(f"<p>reference only: <b>{um['ref']['count']}</b> · test only: <b>{um['test']['count']}</b> · "
                   f"unmatched fraction {esc(fmt(um.get('fraction'), 3))}</p>")
        for side, what in (("ref", "reference only"), ("test", "test only")):
            n = um[side]["count"]
            out.append(f"<details{' open' if 0 < n <= NAMES_OPEN else ''}><summary>{what} ({n})</summary>"
                       f"{_names_list(um[side]['names'])}</details>")
        recs = um.get("ref_records", []) + um.get("test_records", [])
        if recs:
            out.append(f"<p>unmatched records: reference {esc(um.get('ref_records'))}, test "
                       f"{esc(um.get('test_records'))}</p>")
        unexp = (c.test.backend_info or {}).get("unexposable")
        if unexp:
            out.append("<p class=\"small\"><b>Not exposable on the test backend</b> (left out by the capture):</p>"
                       + _names_list([str(u.get("name", u)) if isinstance(u, dict) else str(u) for u in unexp]))
    out.append("</section>")
    return "".join(out)


_VERSION_KEYS = ("onnxruntime", "onnxruntime_qnn", "qnn_sdk_version", "onnx", "torch", "transformers", "onnxscript")


def _provenance_card(d: Any, roles: list[str]) -> str:
    info = d.backend_info or {}
    cls, text = _emulation(info)
    attrs = d.attrs
    rows: list[tuple[str, str]] = []

    def add(k: str, v: Any, raw: bool = False) -> None:
        if v is None or v == "" or v == [] or v == {}:
            return
        if raw:
            rows.append((k, v))
        elif isinstance(v, dict):
            rows.append((k, "<br>".join(f"{esc(a)}: {esc(b if not isinstance(b, dict | list) else json.dumps(b))}"
                                        for a, b in v.items())))
        elif isinstance(v, list):
            rows.append((k, esc(json.dumps(v, default=str))))
        else:
            rows.append((k, esc(v)))

    add("file", f"<code>{esc(d.path)}</code>", raw=True)
    add("role", ", ".join(roles))
    add("backend", d.backend)
    add("emulated / device", f'<span class="badge {cls}">{esc("EMULATED" if cls == "emulated" else cls)}</span> '
        f"{esc(text)}", raw=True)
    add("device", info.get("device"))
    add("soc_model", info.get("soc_model"))
    add("htp_arch", info.get("htp_arch"))
    add("compiled target", info.get("compiled_target"))
    if "target_verified" in info:
        add("target verified", "yes" if info.get("target_verified") else "NO")
    vers = {k: info[k] for k in _VERSION_KEYS if info.get(k)}
    add("versions", ", ".join(f"{k} {v}" for k, v in vers.items()))
    add("providers", ", ".join(map(str, info.get("providers") or [])))
    add("graph optimization", info.get("graph_optimization_level"))
    add("exposure", info.get("exposure"))
    add("CPU fallback", info.get("cpu_fallback"))
    if isinstance(info.get("exposure_check"), dict):
        ec = info["exposure_check"]
        add("exposure check", f"bit-identical: {ec.get('bit_identical')}, max |Δ| {fmt(ec.get('max_abs'))}")
    add("model", d.model)
    add("model path", info.get("model_path"))
    add("created", d.created)
    add("tool version", d.tool_version)
    add("command", f"<code>{esc(d.command)}</code>" if d.command else None, raw=True)
    add("host", attrs.get("host") if not isinstance(info.get("host"), dict) else
        f"{attrs.get('host') or ''} {json.dumps(info.get('host'))}")
    add("records / tensors", f"{attrs.get('n_records', '?')} / {attrs.get('n_tensors', '?')}")
    if d.summary_only:
        add("summary only", f"yes ({attrs.get('summary_samples')} samples per tensor)")
    add("complete", "yes" if d.complete else "NO — " + "; ".join(map(str, d.incomplete_reasons)))
    body = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    full = json.dumps(info, indent=1, default=str, sort_keys=True)
    cut = ""
    if len(full) > 30000:
        full, cut = full[:30000], f" (first 30 000 of {len(full):,} characters)"
    return (f'<div><h3>{esc(Path(str(d.path)).name)}</h3><table class="kv">{body}</table>'
            f"<details><summary>backend_info JSON{esc(cut)}</summary><pre class=\"json\">{esc(full)}</pre></details></div>")


def _provenance(ctx: _Ctx) -> str:
    seen: dict[str, tuple[Any, list[str]]] = {}
    for lab, c in [(ctx.label, ctx.cmp), *[(e.label, e.cmp) for e in ctx.extras]]:
        for d, role in ((c.ref, "reference"), (c.test, "test")):
            key = os.path.abspath(str(d.path))
            seen.setdefault(key, (d, []))[1].append(f"{role} of {lab}")
    cards = "".join(_provenance_card(d, roles) for d, roles in seen.values())
    return (f'<section class="card" id="provenance"><h2>Provenance</h2><div class="prov">{cards}</div>'
            "</section>")


# ============================================================================ page
def chart_context(cmp: Any, *, replay: Any = None, extra_comparisons: Any = None, timeline: Any = None,
                  max_points: int = MAX_POINTS, max_rows: int = MAX_ROWS, drilldowns: int = DRILLDOWNS,
                  max_timeline_ops: int = MAX_TIMELINE_OPS) -> _Ctx:
    """What the report's sections (and :mod:`ivq_debug.plots`) draw from: the joined layer view and caps."""
    extras = _labeled(extra_comparisons)
    view = build_layers(cmp, extras=extras, replay=replay, timeline=timeline)
    ctx = _Ctx(cmp, comparison_label(cmp), extras, replay, view, timeline, max(int(max_points), 10),
               max(int(max_rows), 1), max(int(drilldowns), 0), max(int(max_timeline_ops), 10))
    ctx.multi_sample = len({r["record"][0] for r in view.rows}) > 1
    return ctx


def render_report(
    cmp: Any,
    *,
    replay: Any = None,
    extra_comparisons: Any = None,
    title: str | None = None,
    max_points: int = MAX_POINTS,
    max_rows: int = MAX_ROWS,
    drilldowns: int = DRILLDOWNS,
    max_timeline_ops: int = MAX_TIMELINE_OPS,
    model: Any = None,
) -> str:
    """Render the report of a comparison as one self-contained HTML string.

    Args:
        cmp: the primary :class:`~ivq_debug.comparator.Comparison` (its test dump's profiling table feeds the
            timeline).
        replay: a :class:`~ivq_debug.diagnose.replay.ReplayResult`: introduced vs inherited error columns,
            an "introduced" series in the depth chart, its findings.
        extra_comparisons: other comparisons shown side by side: ``{label: Comparison}``, or a list of
            ``Comparison`` / ``(label, Comparison)``; joined to the primary rows by record and tensor name.
        title: page title (default ``ivq-debug report: <ref> → <test>``).
        max_points: points per chart series and per drill-down scatter.
        max_rows: layer-table rows (beyond it: failing rows, first divergences, then the worst).
        drilldowns: worst layers with histograms and a scatter.
        max_timeline_ops: timeline bars drawn one by one (shorter ops beyond it are merged).
        model: the profiled ONNX model (path or ``ModelProto``) for the op → tensor join of the timeline
            (default: the test dump's recorded model path, else its stored QNN op trace).
    """

    try:
        timeline = build_timelines(cmp.test, model)
    except Exception as e:  # a damaged profiling table must not cost the whole report
        timeline = []
        timeline_error = f"profiling table not shown ({type(e).__name__}: {e})"
    else:
        timeline_error = ""
    ctx = chart_context(cmp, replay=replay, extra_comparisons=extra_comparisons, timeline=timeline,
                        max_points=max_points, max_rows=max_rows, drilldowns=drilldowns,
                        max_timeline_ops=max_timeline_ops)
    ctx.finding_groups = _finding_groups(ctx)
    label = ctx.label
    rows = _select_rows(ctx)
    ctx.shown = {r["row"] for r in rows}
    title = title or f"ivq-debug report: {label}"
    # (anchor, navigation label, section html); a section whose html is empty is left out
    parts: list[tuple[str, str, str]] = [
        ("findings", "Findings", _findings(ctx)), ("summary", "Summary", _summary(ctx)),
        ("depth", "Error vs depth", _depth(ctx)),
        ("threeway", "Backend vs quantization", threeway_report.section(cmp, ctx.max_points)),
        ("heatmap", "Heatmap", _heatmaps(ctx)), ("deepstack", "DeepStack", _deepstack(ctx)),
        ("layers", "Layers", _layer_table(ctx, rows)), ("drilldown", "Worst layers", _drilldowns(ctx)),
        ("timeline", "Timeline", _timeline(ctx)),
    ]
    sections = [(a, n) for a, n, h in parts if h]
    body = [h for _, _, h in parts if h]
    if not parts[-1][2] and timeline_error:  # no timeline: say why when it failed
        body.append(f'<section class="card" id="timeline"><h2>QNN profiling timeline</h2><p class="note">'
                    f"{esc(timeline_error)}</p></section>")
    sections += [("unmatched", "Unmatched"), ("provenance", "Provenance")]
    body += [_unmatched(ctx), _provenance(ctx)]
    js = _asset("report.js")
    css = _asset("report.css")
    digest = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    csp = (f"default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'sha256-{digest}'; "
           "base-uri 'none'; form-action 'none'")
    blocks = "".join(f'<script type="application/json" id="{esc(i)}">{_json_script(o)}</script>' for i, o in ctx.blocks)
    now = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    footer = (f'<footer><div class="wrap">Generated by ivq-debug {esc(__version__)} at {esc(now)}. Metrics are '
              "float64 with the reference as signal (SQNR = 10·log10(Σr² / Σ(t−r)²)); see docs/metrics.md. "
              "This file is self-contained and works offline.</div></footer>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="generator" content="ivq-debug {esc(__version__)}">'
            f"<title>{esc(title)}</title><style>{css}</style></head><body>"
            + _header(ctx, title) + _nav(sections) + '<main><div class="wrap">' + "".join(body) + "</div></main>"
            + footer + blocks + f"<script>{js}</script></body></html>\n")


def write_report(cmp: Any, path: str | os.PathLike, *, replay: Any = None, extra_comparisons: Any = None,
                 title: str | None = None, overwrite: bool = False, max_points: int = MAX_POINTS,
                 **options: Any) -> Path:
    """Render the report (:func:`render_report`) and write it atomically (temp file + rename).

    Raises :class:`~ivq_debug.errors.UsageError` when ``path`` exists and ``overwrite`` is False.
    Extra keyword options (``max_rows``, ``drilldowns``, ``max_timeline_ops``, ``model``) go to
    :func:`render_report`. Returns the written path.
    """

    p = Path(path)
    if p.exists() and not overwrite:  # fail before rendering
        raise UsageError("output exists; pass --force to replace it", p)
    text = render_report(cmp, replay=replay, extra_comparisons=extra_comparisons, title=title,
                         max_points=max_points, **options)
    return write_text(p, text, overwrite)
