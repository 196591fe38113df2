"""``weight_range_spread``: weights whose output channels span very different ranges.

A per-tensor weight encoding has one scale for every output channel, set by the largest channel. A channel
``s`` times smaller than the largest is left ``log2(s)`` bits fewer: at 8 bits, a channel 100× smaller keeps
about one bit. Per-channel weights (one scale per output channel) remove that loss; 16-bit weights reduce it.

For every weight of a Conv / ConvTranspose / Gemm / MatMul (an initializer, through its DequantizeLinear in a
QDQ model), the per-output-channel range ``max |w_c|`` gives:

- ``spread``: the largest channel range over the smallest *live* one;
- ``min_bits``: the bits the smallest live channel keeps under the tensor's encoding (``log2`` of its range over
  the step, 0 when it is below one step; the step is the model's scale in a QDQ model, else ``max |w| / 127``);
- ``zero_channels``: dead channels, counted and left out of the figures above: all zero, or at most
  :data:`DEAD_CHANNEL` of the largest channel's range (float32 noise under it; in a QDQ model: rounded away by
  the per-tensor scale). A dead channel would otherwise read as a spread of 1e39× and −98 bits;
- ``per_channel``: the weight is already quantized per channel (no finding then).

A weight with ``spread ≥ defaults.WEIGHT_SPREAD_WARN`` is a warning, ``≥ defaults.WEIGHT_SPREAD_ERROR`` an error.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding
from ivq_debug.onnxgraph.intake import load_float_model
from ivq_debug.onnxgraph.load import Model
from ivq_debug.onnxgraph.sites import QDQ_DOMAINS, constant_arrays, quant_params

#: a channel whose range is at most this share of the largest channel's is dead (all zero, or float32 noise: below
#: the largest channel's float32 resolution)
DEAD_CHANNEL = 2.0 ** -24
#: compute ops whose weight input (index 1) has output channels, and how to find the channel axis
WEIGHT_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def channel_axis(node: Any, ndim: int) -> int:
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return ndim - 1  # MatMul: [.., K, N]


def channel_ranges(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel ``max |w_c|`` along ``axis`` and the mask of the live (not dead) channels."""
    a = np.asarray(w, np.float64)
    ranges = np.max(np.abs(np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1)), axis=1)
    top = float(ranges.max()) if ranges.size else 0.0
    return ranges, ranges > top * DEAD_CHANNEL


def weight_spreads(model: Any, base_dir: str = "") -> Any:
    """One row per weight (module docstring): ``weight, node, op_type, axis, channels, spread, min_bits,
    zero_channels, per_channel, worst_channels``, largest spread first (a pandas DataFrame)."""
    import pandas as pd

    m = load_float_model(model) if not hasattr(model, "graph") else model
    if not base_dir and isinstance(model, Model):
        base_dir = model.base_dir
    elif not base_dir and not hasattr(model, "graph"):
        base_dir = str(Path(model).parent)
    producer = {o: n for n in m.graph.node for o in n.output if o}
    inits = {i.name for i in m.graph.initializer}
    wanted: dict[str, tuple[Any, Any]] = {}  # weight value name -> (compute node, DQ node or None)
    for n in m.graph.node:
        if n.op_type not in WEIGHT_OPS or len(n.input) < 2:
            continue
        w = n.input[1]
        p = producer.get(w)
        if p is not None and p.op_type == "DequantizeLinear" and p.domain in QDQ_DOMAINS and p.input[0] in inits:
            wanted[p.input[0]] = (n, p)
        elif w in inits:
            wanted[w] = (n, None)
    needed = set(wanted) | {x for _, dq in wanted.values() if dq is not None for x in dq.input[1:] if x}
    arrays = constant_arrays(m, needed, base_dir)
    rows = []
    for name, (node, dq) in wanted.items():
        w = arrays.get(name)
        if w is None or w.ndim < 2:
            continue
        axis = channel_axis(node, w.ndim)
        qp = quant_params(dq, arrays) if dq is not None else None
        wf = w.astype(np.float64)
        if qp is not None:
            zp = qp.zero_point.astype(np.float64) if qp.zero_point is not None else 0.0
            sc = qp.scale.astype(np.float64)
            if qp.axis is not None and sc.size > 1:
                shape = [1] * w.ndim
                shape[qp.axis] = sc.size
                sc, zp = sc.reshape(shape), np.asarray(zp).reshape(shape)
            wf = (wf - zp) * sc
        ranges, live = channel_ranges(wf, axis)
        nz = ranges[live]
        if nz.size == 0:
            continue
        spread = float(nz.max() / nz.min())
        step = float(np.max(qp.scale)) if qp is not None else float(nz.max()) / 127.0
        min_bits = max(math.log2(max(float(nz.min()) / step, 1e-30)) + 1.0, 0.0) if step > 0 else None
        order = np.argsort(np.where(live, ranges, np.inf))  # the smallest live channels
        rows.append({
            "weight": name.removesuffix("_quantized"), "node": node.name, "op_type": node.op_type, "axis": axis,
            "channels": int(ranges.size), "spread": spread, "min_bits": min_bits,
            "zero_channels": int(ranges.size - nz.size), "per_channel": bool(qp is not None and qp.axis is not None),
            "worst_channels": [int(i) for i in order[:5]],
        })
    cols = ["weight", "node", "op_type", "axis", "channels", "spread", "min_bits", "zero_channels", "per_channel",
            "worst_channels"]
    return pd.DataFrame(rows, columns=cols).sort_values("spread", ascending=False, kind="stable").reset_index(
        drop=True)


def spread_by_weight(model: Any, base_dir: str = "") -> dict[str, float]:
    """``{weight float name: spread}`` of the per-tensor weights of a model (a path, a
    :class:`~ivq_debug.onnxgraph.load.Model`, or a proto whose external data lives in ``base_dir``)."""
    t = weight_spreads(model, base_dir)
    return {r["weight"]: float(r["spread"]) for r in t.to_dict("records") if not r["per_channel"]}


def weight_range_spread(model: Any, warn: float = defaults.WEIGHT_SPREAD_WARN,
                        error: float = defaults.WEIGHT_SPREAD_ERROR) -> list[Finding]:
    """A finding per per-tensor weight whose channel ranges spread ``≥ warn`` (an error ``≥ error``)."""
    t = weight_spreads(model)
    out = []
    for r in t.to_dict("records"):
        if r["per_channel"] or (r["spread"] < warn and not r["zero_channels"]):
            continue
        bits = f"; its smallest channel keeps {r['min_bits']:.1f} bits" if r["min_bits"] is not None else ""
        if r["zero_channels"]:
            bits += f"; {r['zero_channels']} channel(s) are all zero (rounded away, or dead)"
        out.append(Finding(
            "weight_range_spread", "error" if (r["spread"] >= error or r["zero_channels"]) else "warning",
            f"{r['weight']} ({r['op_type']} {r['node']}): output-channel ranges spread {r['spread']:.0f}× under one "
            f"per-tensor scale{bits}",
            where={"tensor": r["weight"], "node": r["node"]},
            evidence={k: r[k] for k in ("channels", "spread", "min_bits", "zero_channels", "worst_channels")},
            suggestion="per-channel weights (`ivq quantize --per-channel`, or `ivq tune`, which verifies it)",
        ))
    return out
