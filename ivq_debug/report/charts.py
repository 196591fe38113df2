"""The package's one chart layer: inline SVG (hand-written, no plotting library): line, histogram, scatter,
heatmap, timeline. Every label that comes from data is escaped; links are fragment anchors (``#L12``) only.

Every chart is an :class:`Svg`: a ``str`` (the report inlines it as it is) with ``_repr_svg_``, so a notebook
displays it; :mod:`ivq_debug.plots` builds the notebook figures from a comparison with these same functions.

The heatmap body is a small PNG (written with :mod:`zlib`) embedded as a ``data:`` URI inside the SVG, so its
size does not grow with one element per cell.
"""

from __future__ import annotations

import base64
import html
import itertools
import math
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ivq_debug.errors import printable

FONT = "font-family:inherit"
AXIS = "#5f6b7a"
GRID = "#e6e9ee"
INK = "#1f2933"

#: colour of undefined metrics (non-finite values, mismatched shapes, zero-norm references)
UNDEFINED_COLOR = "#5b2a86"
#: colour of "no data" (no tensor joined, layer absent in a record)
NODATA_COLOR = "#d5d9df"
#: SQNR colour ramp (dB → colour): red is bad, blue is good (ColorBrewer RdBu, reversed)
SQNR_STOPS: tuple[tuple[float, str], ...] = (
    (0.0, "#b2182b"),
    (15.0, "#d6604d"),
    (25.0, "#f4a582"),
    (35.0, "#f7e3c4"),
    (45.0, "#d1e5f0"),
    (60.0, "#4393c3"),
    (80.0, "#2166ac"),
)


def esc(v: object) -> str:
    """HTML/SVG-escape any value (text and attribute values); control, surrogate and bidi characters
    (names come from files) are written as visible escapes first (:func:`~ivq_debug.errors.printable`)."""
    return html.escape(printable(v, multiline=True), quote=True)


def _hex(c: str) -> tuple[int, int, int]:
    c = c.lstrip("#")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)


def _lerp_stops(v: float, stops: Sequence[tuple[float, str]]) -> tuple[int, int, int]:
    if v <= stops[0][0]:
        return _hex(stops[0][1])
    for (a, ca), (b, cb) in itertools.pairwise(stops):
        if v <= b:
            t = (v - a) / (b - a) if b > a else 0.0
            x, y = _hex(ca), _hex(cb)
            return tuple(round(x[i] + (y[i] - x[i]) * t) for i in range(3))  # type: ignore[return-value]
    return _hex(stops[-1][1])


def sqnr_rgb(v: float | None) -> tuple[int, int, int]:
    """RGB of an SQNR value on the report's ramp (``None``/NaN: undefined; ``+inf``: identical)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return _hex(UNDEFINED_COLOR)
    if math.isinf(v):
        return _hex(SQNR_STOPS[-1][1]) if v > 0 else _hex(SQNR_STOPS[0][1])
    return _lerp_stops(float(v), SQNR_STOPS)


def sqnr_color(v: float | None) -> str:
    """CSS hex colour of an SQNR value (see :func:`sqnr_rgb`)."""
    r, g, b = sqnr_rgb(v)
    return f"#{r:02x}{g:02x}{b:02x}"


def text_color_on(bg: str) -> str:
    """Black or white, whichever reads better on ``bg``."""
    r, g, b = _hex(bg)
    return "#111" if (0.299 * r + 0.587 * g + 0.114 * b) > 150 else "#fff"


# ------------------------------------------------------------------------------------------ numbers
def fmt(v: object, digits: int = 4) -> str:
    """Compact number formatting (``–`` for missing, ``inf`` for infinities)."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(f):
        return "–"
    if math.isinf(f):
        return "+inf" if f > 0 else "-inf"
    if f == int(f) and abs(f) < 1e9:
        return str(int(f))
    if 1e4 <= abs(f) < 1e9:
        return f"{f:.0f}"
    if f != 0 and (abs(f) < 1e-3 or abs(f) >= 1e9):
        return f"{f:.{max(digits - 2, 1)}e}"
    return f"{f:.{digits}g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    start = math.ceil(lo / step - 1e-9) * step
    out = []
    v = start
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def nice_range(lo: float, hi: float, n: int = 5, integer: bool = False) -> tuple[float, float, list[float]]:
    """Round ticks *enclosing* ``[lo, hi]``: ``(first tick ≤ lo, last tick ≥ hi, ticks)``.

    ``integer`` keeps the tick step a whole number (execution orders, counts)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return 0.0, 1.0, [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    if integer:
        step = max(1.0, float(math.ceil(step)))
    a = math.floor(lo / step + 1e-9) * step
    b = math.ceil(hi / step - 1e-9) * step
    k = round((b - a) / step)
    return a, b, [round(a + i * step, 12) for i in range(k + 1)]


def _tick_label(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if a >= scale:
            k = v / (1e3 if suffix == "k" else scale)
            return f"{k:.4g}{suffix}"
    if a < 1e-3:
        return f"{v:.1e}"
    return f"{v:.6g}"


# ------------------------------------------------------------------------------------------ frame
@dataclass
class Frame:
    """Plot area and linear scales of one chart."""

    width: int
    height: int
    x0: float
    x1: float
    y0: float
    y1: float
    left: int = 56
    right: int = 14
    top: int = 14
    bottom: int = 40

    @property
    def pw(self) -> float:
        return self.width - self.left - self.right

    @property
    def ph(self) -> float:
        return self.height - self.top - self.bottom

    def sx(self, x: float) -> float:
        span = (self.x1 - self.x0) or 1.0
        return self.left + (x - self.x0) / span * self.pw

    def sy(self, y: float) -> float:
        span = (self.y1 - self.y0) or 1.0
        return self.top + self.ph - (y - self.y0) / span * self.ph

    def axes(self, x_label: str = "", y_label: str = "", xticks: list[float] | None = None,
             yticks: list[float] | None = None, x_labels: dict[float, str] | None = None) -> str:
        """Grid, tick labels and axis titles."""
        parts = []
        for t in yticks if yticks is not None else nice_ticks(self.y0, self.y1, 5):
            if not self.y0 - 1e-9 <= t <= self.y1 + 1e-9:
                continue
            y = self.sy(t)
            parts.append(f'<line x1="{self.left}" x2="{self.left + self.pw:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                         f'stroke="{GRID}"/>')
            parts.append(f'<text x="{self.left - 6}" y="{y + 3.5:.1f}" text-anchor="end" font-size="10.5" '
                         f'fill="{AXIS}">{esc(_tick_label(t))}</text>')
        for t in xticks if xticks is not None else nice_ticks(self.x0, self.x1, 6):
            if not self.x0 - 1e-9 <= t <= self.x1 + 1e-9:
                continue
            x = self.sx(t)
            lab = (x_labels or {}).get(t, _tick_label(t))
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{self.top + self.ph:.1f}" '
                         f'y2="{self.top + self.ph + 4:.1f}" stroke="{AXIS}"/>')
            parts.append(f'<text x="{x:.1f}" y="{self.top + self.ph + 16:.1f}" text-anchor="middle" '
                         f'font-size="10.5" fill="{AXIS}">{esc(lab)}</text>')
        parts.append(f'<rect x="{self.left}" y="{self.top}" width="{self.pw:.1f}" height="{self.ph:.1f}" '
                     f'fill="none" stroke="#c9ced6"/>')
        if x_label:
            parts.append(f'<text x="{self.left + self.pw / 2:.1f}" y="{self.height - 6}" text-anchor="middle" '
                         f'font-size="11" fill="{INK}">{esc(x_label)}</text>')
        if y_label:
            cy = self.top + self.ph / 2
            parts.append(f'<text transform="translate(13,{cy:.1f}) rotate(-90)" text-anchor="middle" '
                         f'font-size="11" fill="{INK}">{esc(y_label)}</text>')
        return "".join(parts)


class Svg(str):
    """An SVG document as a string; Jupyter/IPython display it through :meth:`_repr_svg_`."""

    __slots__ = ()

    def _repr_svg_(self) -> str:
        return str(self)


def _size(svg: str) -> tuple[float, float]:
    m = re.search(r'viewBox="0 0 ([0-9.]+) ([0-9.]+)"', svg)
    return (float(m.group(1)), float(m.group(2))) if m else (0.0, 0.0)


def _stack(charts: Sequence[str], gap: int, label: str, across: bool) -> Svg:
    at, parts, extent = 0.0, [], 0.0
    for c in charts:
        w, h = _size(c)
        x, y = (at, 0.0) if across else (0.0, at)
        parts.append(c.replace("<svg ", f'<svg x="{x:g}" y="{y:g}" ', 1))
        at += (w if across else h) + gap
        extent = max(extent, h if across else w)
    length = max(int(at - gap), 1)
    return _svg(length, int(extent), "".join(parts), label) if across else _svg(int(extent), length, "".join(parts), label)


def hstack(charts: Sequence[str], gap: int = 12, label: str = "charts") -> Svg:
    """Charts side by side in one SVG (nested ``<svg>`` elements, tops aligned)."""
    return _stack(charts, gap, label, across=True)


def vstack(charts: Sequence[str], gap: int = 12, label: str = "charts") -> Svg:
    """Charts one below the other in one SVG (nested ``<svg>`` elements, left edges aligned)."""
    return _stack(charts, gap, label, across=False)


def _svg(width: int, height: int, body: str, label: str, cls: str = "chart",
         attrs: dict[str, object] | None = None) -> Svg:
    extra = "".join(f' {k}="{esc(v)}"' for k, v in (attrs or {}).items())
    return Svg(f'<svg class="{esc(cls)}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="{esc(label)}" style="{FONT}"{extra}>'
            f'<title>{esc(label)}</title>{body}</svg>')


def _legend_rows(items: Sequence[tuple[str, str, str]], x: float, max_x: float) -> list[list[tuple[float, int]]]:
    """Positions of legend entries, wrapped onto rows that end before ``max_x``: per row ``(x, item index)``."""
    rows: list[list[tuple[float, int]]] = [[]]
    cx = x
    for i, (label, _c, _d) in enumerate(items):
        w = 28 + 6.2 * len(label)
        if rows[-1] and cx + w > max_x:
            rows.append([])
            cx = x
        rows[-1].append((cx, i))
        cx += w
    return rows


def _legend(items: Sequence[tuple[str, str, str]], x: float, y: float, max_x: float = 1e9) -> str:
    """Legend entries ``(label, colour, dash)`` laid out left to right, wrapped at ``max_x`` (16 px rows)."""
    parts = []
    for k, row in enumerate(_legend_rows(items, x, max_x)):
        yy = y + 16 * k
        for cx, i in row:
            label, color, dash = items[i]
            d = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(f'<line x1="{cx:.1f}" x2="{cx + 16:.1f}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{color}" '
                         f'stroke-width="2.2"{d}/>')
            parts.append(f'<text x="{cx + 20:.1f}" y="{yy + 3.5:.1f}" font-size="10.5" fill="{INK}">{esc(label)}</text>')
    return "".join(parts)


# ------------------------------------------------------------------------------------------ line chart
@dataclass
class Point:
    """One point of a line series; ``y`` may be ``+inf`` (drawn at the top) or NaN (drawn at the bottom)."""

    x: float
    y: float
    href: str | None = None
    title: str = ""
    bad: bool = False


@dataclass
class Series:
    """A named line series."""

    name: str
    color: str
    points: list[Point] = field(default_factory=list)
    dash: str = ""
    #: join the points (False: markers only, a scatter of named points)
    line: bool = True


def _spread(idx: list[int], k: int) -> set[int]:
    """At most ``k`` of ``idx``, evenly spread, first and last included."""
    if len(idx) <= k:
        return set(idx)
    return {idx[int(j)] for j in np.linspace(0, len(idx) - 1, max(k, 2)).round().astype(int)}


def thin_points(points: list[Point], k: int) -> list[Point]:
    """At most about ``k`` points: the minimum, the first bad point, up to ``k/2`` bad or non-finite points and
    evenly spread others (all evenly chosen, in order)."""
    if len(points) <= k:
        return points
    keep: set[int] = set()
    finite = [(p.y, i) for i, p in enumerate(points) if math.isfinite(p.y)]
    if finite:
        keep.add(min(finite)[1])
    flagged = [i for i, p in enumerate(points) if p.bad or not math.isfinite(p.y)]
    if flagged:
        keep.add(flagged[0])
        keep |= _spread(flagged, max(k // 2, 1))
    keep |= _spread(list(range(len(points))), max(k - len(keep), 2))
    return [points[i] for i in sorted(keep)]


def line_chart(series: Sequence[Series], *, width: int = 560, height: int = 260, x_label: str = "",
               y_label: str = "", hline: float | None = None, hline_label: str = "", label: str = "chart",
               y_floor: float | None = None, max_markers: int = 10**9) -> Svg:
    """A line chart with markers; points with ``href`` are links, ``bad`` points are drawn red.

    Infinite values (identical tensors) sit on the top edge as hollow markers; undefined values (NaN) on the
    bottom edge as crosses. Each series draws its whole line but about ``max_markers`` markers at most
    (:func:`thin_points`), which bounds the size of the SVG.
    """
    xs = [p.x for s in series for p in s.points]
    ys = [p.y for s in series for p in s.points if math.isfinite(p.y)]
    if hline is not None:
        ys.append(hline)
    if not xs:
        return _svg(width, 60, f'<text x="10" y="30" font-size="12" fill="{AXIS}">no data</text>', label)
    ylo, yhi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if y_floor is not None:
        ylo = max(ylo, y_floor)
    pad = (yhi - ylo) * 0.04 or 1.0
    y0, y1, ticks = nice_range(ylo - pad, yhi + pad, 5)
    xlo, xhi = min(xs), max(xs)
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    integer_x = all(float(x).is_integer() for x in xs)
    xt = nice_ticks(xlo, xhi, 6)
    if integer_x:
        xt = [t for t in nice_range(xlo, xhi, 6, integer=True)[2] if xlo <= t <= xhi]
    items = [(s.name, s.color, s.dash) for s in series]
    if hline is not None:
        items.append((hline_label, "#c0392b", "5 4"))
    legend_rows = len(_legend_rows(items, 56, width - 8)) if len(items) > 1 else 0
    legend_h = 16 * legend_rows + 2 if legend_rows else 0
    height += max(legend_h - 18, 0)
    fr = Frame(width, height, xlo, xhi, y0, y1, top=14 + legend_h)
    body = [fr.axes(x_label, y_label, xticks=xt, yticks=ticks)]
    if hline is not None and y0 <= hline <= y1:
        y = fr.sy(hline)
        body.append(f'<line x1="{fr.left}" x2="{fr.left + fr.pw:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#c0392b" '
                    f'stroke-width="1.2" stroke-dasharray="5 4"><title>{esc(hline_label)}</title></line>')

    def ypos(v: float) -> float:
        if math.isnan(v):
            return fr.top + fr.ph
        if math.isinf(v):
            return fr.top if v > 0 else fr.top + fr.ph
        return fr.sy(min(max(v, y0), y1))

    for s in series:
        pts = sorted(s.points, key=lambda p: p.x)
        if len(pts) > 1 and s.line:
            d = " ".join(f"{fr.sx(p.x):.1f},{ypos(p.y):.1f}" for p in pts)
            dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
            body.append(f'<polyline points="{d}" fill="none" stroke="{s.color}" stroke-width="1.6" '
                        f'stroke-linejoin="round" opacity="0.9"{dash}/>')
        for p in thin_points(pts, max_markers):
            cx, cy = fr.sx(p.x), ypos(p.y)
            tip = f"<title>{esc(p.title)}</title>" if p.title else ""
            if math.isnan(p.y):
                mark = (f'<path d="M{cx - 3.5:.1f},{cy - 3.5:.1f}l7,7m0,-7l-7,7" stroke="{UNDEFINED_COLOR}" '
                        f'stroke-width="1.8">{tip}</path>')
            elif math.isinf(p.y):
                mark = (f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3.2" fill="#fff" stroke="{s.color}" '
                        f'stroke-width="1.5">{tip}</circle>')
            else:
                fill = "#d62728" if p.bad else s.color
                r = 3.4 if p.bad else 2.6
                mark = f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{r}" fill="{fill}" stroke="#fff" stroke-width="0.6">{tip}</circle>'
            body.append(f'<a href="{esc(p.href)}">{mark}</a>' if p.href else mark)
    if legend_h:
        body.append(_legend(items, fr.left, 12, width - 8))
    return _svg(width, height, "".join(body), label)


# ------------------------------------------------------------------------------------------ histogram
def histogram_chart(datasets: Sequence[tuple[str, np.ndarray, str]], *, bins: int = 48, width: int = 380,
                    height: int = 220, x_label: str = "value", label: str = "histogram",
                    log_y: bool = False) -> Svg:
    """Overlaid step histograms over shared bins (first dataset filled, the others outlined)."""
    vals = [np.asarray(v, dtype=np.float64) for _, v, _ in datasets]
    vals = [v[np.isfinite(v)] for v in vals]
    allv = np.concatenate(vals) if vals else np.zeros(0)
    if allv.size == 0:
        return _svg(width, 60, f'<text x="10" y="30" font-size="12" fill="{AXIS}">no finite values</text>', label)
    lo, hi = float(allv.min()), float(allv.max())
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    counts = [np.histogram(v, bins=edges)[0].astype(np.float64) for v in vals]
    tr = (lambda c: np.log10(c + 1.0)) if log_y else (lambda c: c)
    cmax = max(float(tr(c).max()) for c in counts) or 1.0
    _, ytop, yt = nice_range(0.0, cmax, 4, integer=not log_y)
    fr = Frame(width, height, lo, hi, 0.0, ytop, left=48, top=30)
    body = [fr.axes(x_label, "log₁₀(count+1)" if log_y else "count", yticks=yt)]
    for i, ((_name, _v, color), c) in enumerate(zip(datasets, counts, strict=True)):
        c = tr(c)
        d = [f"M{fr.sx(edges[0]):.1f},{fr.sy(0):.1f}"]
        for k in range(bins):
            d.append(f"L{fr.sx(edges[k]):.1f},{fr.sy(c[k]):.1f}L{fr.sx(edges[k + 1]):.1f},{fr.sy(c[k]):.1f}")
        d.append(f"L{fr.sx(edges[-1]):.1f},{fr.sy(0):.1f}")
        if i == 0:
            body.append(f'<path d="{"".join(d)}Z" fill="{color}" fill-opacity="0.28" stroke="{color}" stroke-width="1"/>')
        else:
            body.append(f'<path d="{"".join(d)}" fill="none" stroke="{color}" stroke-width="1.6"/>')
    body.append(_legend([(n, c, "") for n, _, c in datasets], fr.left, 12, width - 8))
    return _svg(width, height, "".join(body), label)


# ------------------------------------------------------------------------------------------ scatter
def scatter_chart(x: np.ndarray, y: np.ndarray, *, width: int = 300, height: int = 220, x_label: str = "reference",
                  y_label: str = "test", label: str = "scatter", color: str = "#1f77b4") -> Svg:
    """Test vs reference values with the ``y = x`` diagonal."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if x.size == 0:
        return _svg(width, 60, f'<text x="10" y="30" font-size="12" fill="{AXIS}">no finite values</text>', label)
    lo = float(min(x.min(), y.min()))
    hi = float(max(x.max(), y.max()))
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.02
    a, b, ticks = nice_range(lo - pad, hi + pad, 4)
    fr = Frame(width, height, a, b, a, b, left=48)
    body = [fr.axes(x_label, y_label, xticks=ticks, yticks=ticks)]
    body.append(f'<line x1="{fr.sx(a):.1f}" y1="{fr.sy(a):.1f}" x2="{fr.sx(b):.1f}" y2="{fr.sy(b):.1f}" '
                f'stroke="#9aa5b1" stroke-dasharray="4 3"/>')
    dots = "".join(f'<circle cx="{fr.sx(float(px)):.1f}" cy="{fr.sy(float(py)):.1f}" r="1.7"/>'
                   for px, py in zip(x, y, strict=True))
    body.append(f'<g fill="{color}" fill-opacity="0.55">{dots}</g>')
    return _svg(width, height, "".join(body), label)


# ------------------------------------------------------------------------------------------ heatmap
def png_rgb(pixels: np.ndarray) -> bytes:
    """Encode an ``H × W × 3`` uint8 array as a PNG (stdlib only)."""
    h, w, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[r].astype(np.uint8).tobytes() for r in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def heatmap_chart(grid: np.ndarray, row_labels: Sequence[str], *, width: int = 1080, x_label: str = "",
                  label: str = "heatmap", data_id: str = "", missing: np.ndarray | None = None,
                  x_extent: int | None = None) -> Svg:
    """A rows × columns SQNR heatmap: the cells are one PNG (crisp, ``image-rendering: pixelated``).

    ``grid`` holds SQNR values (NaN = undefined, +inf = identical); ``missing`` marks cells without data.
    ``data_id`` names the JSON block the page script reads for the hover readout. ``x_extent`` is the number
    of x units the columns span (layers, when columns are bins of several layers; default: the columns).
    """
    nr, nc = grid.shape
    px = np.zeros((nr, nc, 3), dtype=np.uint8)
    for i in range(nr):
        for j in range(nc):
            if missing is not None and missing[i, j]:
                px[i, j] = _hex(NODATA_COLOR)
            else:
                v = float(grid[i, j])
                px[i, j] = sqnr_rgb(None if math.isnan(v) else v)
    uri = "data:image/png;base64," + base64.b64encode(png_rgb(px)).decode("ascii")
    row_h = max(8, min(22, 320 // max(nr, 1)))
    left = 8 + 7 * max((len(r) for r in row_labels), default=4)
    left = min(max(left, 60), 160)
    top, bottom, right = 8, 34, 12
    pw = width - left - right
    ph = row_h * nr
    height = top + ph + bottom
    body = [f'<image x="{left}" y="{top}" width="{pw}" height="{ph}" preserveAspectRatio="none" '
            f'style="image-rendering:pixelated;image-rendering:crisp-edges" href="{uri}"/>']
    body.append(f'<rect class="hm-area" x="{left}" y="{top}" width="{pw}" height="{ph}" fill="transparent" '
                f'stroke="#c9ced6" data-rows="{nr}" data-cols="{nc}"/>')
    for i, lab in enumerate(row_labels):
        y = top + row_h * (i + 0.5) + 3.5
        if row_h >= 10 or i % max(1, 10 // row_h) == 0:
            body.append(f'<text x="{left - 6}" y="{y:.1f}" text-anchor="end" font-size="10.5" fill="{AXIS}">'
                        f'{esc(lab)}</text>')
    ext = x_extent or nc
    for t in nice_ticks(0, ext, 8):
        if t > ext:
            continue
        x = left + t / ext * pw
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="{AXIS}"/>'
                    f'<text x="{x:.1f}" y="{top + ph + 15}" text-anchor="middle" font-size="10.5" fill="{AXIS}">'
                    f'{esc(_tick_label(t))}</text>')
    body.append(f'<text x="{left + pw / 2:.1f}" y="{height - 4}" text-anchor="middle" font-size="11" '
                f'fill="{INK}">{esc(x_label)}</text>')
    attrs: dict[str, object] = {"data-heat": data_id} if data_id else {}
    return _svg(width, height, "".join(body), label, cls="chart heatmap", attrs=attrs)


def color_scale_legend(width: int = 420) -> Svg:
    """The SQNR colour ramp as a small horizontal legend."""
    lo, hi = SQNR_STOPS[0][0], SQNR_STOPS[-1][0]
    n = 60
    cells = []
    w = (width - 150) / n
    for k in range(n):
        v = lo + (hi - lo) * k / (n - 1)
        cells.append(f'<rect x="{10 + k * w:.2f}" y="6" width="{w + 0.3:.2f}" height="10" fill="{sqnr_color(v)}"/>')
    ticks = []
    for t in (0, 20, 40, 60, 80):
        x = 10 + (t - lo) / (hi - lo) * (n * w)
        ticks.append(f'<text x="{x:.1f}" y="28" text-anchor="middle" font-size="10" fill="{AXIS}">{t}</text>')
    x2 = 10 + n * w + 10
    extra = (f'<rect x="{x2:.1f}" y="6" width="10" height="10" fill="{UNDEFINED_COLOR}"/>'
             f'<text x="{x2 + 14:.1f}" y="15" font-size="10" fill="{AXIS}">undefined</text>'
             f'<rect x="{x2 + 72:.1f}" y="6" width="10" height="10" fill="{NODATA_COLOR}"/>'
             f'<text x="{x2 + 86:.1f}" y="15" font-size="10" fill="{AXIS}">no data</text>')
    body = "".join(cells) + "".join(ticks) + extra
    return _svg(width, 34, body, "SQNR colour scale (dB)", cls="chart legend")


# ------------------------------------------------------------------------------------------ timeline
@dataclass
class Bar:
    """One bar of a timeline lane (times in µs)."""

    start: float
    dur: float
    color: str
    title: str
    href: str | None = None
    label: str = ""


def timeline_chart(lanes: Sequence[tuple[str, list[Bar]]], *, width: int = 1080, lane_h: int = 34,
                   x_label: str = "time (µs)", label: str = "timeline") -> Svg:
    """Lanes of bars on a shared time axis; bars wide enough carry their label."""
    ends = [b.start + b.dur for _, bars in lanes for b in bars]
    starts = [b.start for _, bars in lanes for b in bars]
    if not ends:
        return _svg(width, 60, f'<text x="10" y="30" font-size="12" fill="{AXIS}">no timed ops</text>', label)
    t0, t1 = min(starts), max(ends)
    if t1 <= t0:
        t1 = t0 + 1
    left, right, top, bottom = 64, 12, 8, 38
    pw = width - left - right
    height = top + lane_h * len(lanes) + bottom

    def sx(t: float) -> float:
        return left + (t - t0) / (t1 - t0) * pw

    body = []
    for t in nice_ticks(t0, t1, 8):
        x = sx(t)
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + lane_h * len(lanes)}" stroke="{GRID}"/>'
                    f'<text x="{x:.1f}" y="{top + lane_h * len(lanes) + 15}" text-anchor="middle" font-size="10.5" '
                    f'fill="{AXIS}">{esc(_tick_label(t))}</text>')
    for i, (lane, bars) in enumerate(lanes):
        y = top + i * lane_h
        body.append(f'<rect x="{left}" y="{y}" width="{pw}" height="{lane_h}" fill="{"#fafbfc" if i % 2 else "#fff"}" '
                    f'stroke="{GRID}"/>')
        body.append(f'<text x="{left - 8}" y="{y + lane_h / 2 + 4:.1f}" text-anchor="end" font-size="11" '
                    f'font-weight="600" fill="{INK}">{esc(lane)}</text>')
        for b in bars:
            x = sx(b.start)
            w = max(sx(b.start + b.dur) - x, 0.8)
            rect = (f'<rect x="{x:.2f}" y="{y + 5}" width="{w:.2f}" height="{lane_h - 10}" fill="{b.color}" '
                    f'stroke="#ffffff" stroke-width="0.5"><title>{esc(b.title)}</title></rect>')
            if b.label and w > 7.2 * len(b.label) + 6:
                rect += (f'<text x="{x + 3:.1f}" y="{y + lane_h / 2 + 3.5:.1f}" font-size="10" '
                         f'fill="{text_color_on(b.color)}" pointer-events="none">{esc(b.label)}</text>')
            body.append(f'<a href="{esc(b.href)}">{rect}</a>' if b.href else rect)
    body.append(f'<text x="{left + pw / 2:.1f}" y="{height - 4}" text-anchor="middle" font-size="11" '
                f'fill="{INK}">{esc(x_label)}</text>')
    return _svg(width, height, "".join(body), label)
