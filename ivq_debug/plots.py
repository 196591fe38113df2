"""Matplotlib plots for notebooks: error vs depth, a layer's drill-down, the decode step x layer heatmap.

Each function draws into a given ``ax`` (or a new figure) and returns the axes; nothing is shown or saved.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _axes(ax: Any = None, figsize: tuple[float, float] = (9, 3.5)) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize)
    return ax


def error_vs_depth(cmp: Any, metric: str = "sqnr_db", part: str | None = None, ax: Any = None) -> Any:
    """``metric`` against execution order, one line per record (step) of ``part`` (default: every part)."""
    ax = _axes(ax)
    t = cmp.table
    if part is not None:
        t = t[t["part"] == part]
    for (sample, p, step), g in t.groupby(["sample", "part", "step"], sort=False):
        g = g.sort_values("order")
        y = g[metric].replace([np.inf, -np.inf], np.nan)
        ax.plot(np.arange(len(g)), y, marker=".", ms=3, lw=1, label=f"s{sample} {p} {step}")
    ax.set_xlabel("layer (execution order)")
    ax.set_ylabel(metric)
    if cmp.budgets:
        for b in cmp.budgets.items:
            if b.metric == metric and b.pattern == "*":
                ax.axhline(b.value, color="crimson", ls="--", lw=1)
    ax.legend(fontsize=7, ncol=4, loc="best")
    ax.grid(alpha=0.3)
    return ax


def drilldown(cmp: Any, name: str, record: tuple[int, str, int] | None = None, max_points: int = 20000,
              axes: Any = None) -> Any:
    """Reference vs test values of one tensor: overlaid histograms and a scatter (sampled when large)."""
    import matplotlib.pyplot as plt

    pair = next(p for p in cmp.alignment.pairs
                if name in (p.ref.name, p.test.name) and (record is None or p.ref.record == tuple(record)))
    r, t = cmp.ref.read_any(pair.ref)[0], cmp.test.read_any(pair.test)[0]
    if r.size != t.size:  # one side summary-only: compare the same strided sample
        r, t = cmp.ref.read_sample(pair.ref), cmp.test.read_sample(pair.test)
    r, t = r.astype(np.float64).reshape(-1), t.astype(np.float64).reshape(-1)
    if r.size > max_points:
        idx = np.linspace(0, r.size - 1, max_points).astype(np.int64)
        r, t = r[idx], t[idx]
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    a, b = axes
    bins = np.linspace(min(r.min(), t.min()), max(r.max(), t.max()), 60)
    a.hist(r, bins=bins, alpha=0.6, label="reference")
    a.hist(t, bins=bins, alpha=0.6, label="test")
    a.set_title(f"{pair.ref.name}\n{pair.ref.record}", fontsize=8)
    a.legend(fontsize=8)
    b.scatter(r, t, s=2, alpha=0.4)
    lo, hi = bins[0], bins[-1]
    b.plot([lo, hi], [lo, hi], color="gray", lw=1)
    b.set_xlabel("reference")
    b.set_ylabel("test")
    return axes


def step_heatmap(cmp: Any, metric: str = "sqnr_db", sample: int = 0, ax: Any = None) -> Any:
    """Decode step x layer map of ``metric`` for one sample (layers in execution order)."""
    ax = _axes(ax, (10, 3))
    t = cmp.table
    t = t[(t["part"] == "decode") & (t["sample"] == sample)]
    if t.empty:
        ax.set_title("no decode records")
        return ax
    piv = t.pivot_table(index="step", columns="order", values=metric, aggfunc="min")
    data = np.array(piv.to_numpy(dtype=float), copy=True)
    data[~np.isfinite(data)] = np.nan
    im = ax.imshow(data, aspect="auto", cmap="RdYlGn", interpolation="nearest")
    ax.set_yticks(range(len(piv.index)), [str(s) for s in piv.index])
    ax.set_ylabel("decode step")
    ax.set_xlabel("layer (execution order)")
    ax.figure.colorbar(im, ax=ax, label=metric)
    return ax
