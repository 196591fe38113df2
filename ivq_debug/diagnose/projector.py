"""Projector drift: the vision→LLM projector (InternVL ``mlp1`` = HF ``multi_modal_projector``, Qwen-VL
``merger``) amplifying the vision error, or mis-calibrated.

Per vision record of a comparison:

- ``mean_rel_err`` at the projector output, ``Σ|t − r| / Σ|r|`` (the seed's rule: above 5 % the projector
  drifts and colour / spatial words break);
- ``amplification``: ``rel_l2`` at the projector output over ``rel_l2`` at the vision tower output;
- calibration coverage: for every projector tensor with a test encoding, the share of reference values
  outside the encoding range (``clipped_fraction``, computed in the comparison pass);
- the worst output channels (last axis) by mean relative error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding

PROJECTOR_TOKENS = ("multi_modal_projector", "mlp1", "merger")
VISION_TOKENS = ("vision_tower", "vision_model", "visual")


def _has(text: Any, tokens: tuple[str, ...]) -> bool:
    if not isinstance(text, str):
        return False
    return any(t in text.replace("/", ".").split(".") or f".{t}." in f".{text}." for t in tokens)


def _is(row: Any, tokens: tuple[str, ...]) -> bool:
    return _has(row["scope"], tokens) or _has(row["ref_name"], tokens) or _has(row["test_name"], tokens)


def projector_stats(cmp: Any) -> list[dict[str, Any]]:
    """Projector drift statistics, one dict per record that holds a projector."""
    t = cmp.table
    if t.empty:
        return []
    out = []
    for (sample, part, step), g in t.groupby(["sample", "part", "step"], sort=False):
        g = g.sort_values("order", kind="stable")
        proj_mask = g.apply(lambda r: _is(r, PROJECTOR_TOKENS), axis=1)
        proj = g[proj_mask]
        if proj.empty:
            continue
        first_proj = proj["order"].min()
        vis = g[(g["order"] < first_proj) & g.apply(lambda r: _is(r, VISION_TOKENS), axis=1)]
        last = proj.iloc[-1]
        pair = next(p for p in cmp.alignment.pairs
                    if p.ref.name == last["ref_name"] and p.test.name == last["test_name"]
                    and p.ref.record == (sample, part, step))
        rv, rs = cmp.ref.read_any(pair.ref)
        tv, ts = cmp.test.read_any(pair.test)
        sampled = rs or ts
        if sampled:  # summary-only dumps: the same strided sample on both sides, no channel structure
            rv, tv = cmp.ref.read_sample(pair.ref), cmp.test.read_sample(pair.test)
        cols = 1 if sampled or not pair.ref.shape else pair.ref.shape[-1]
        r = rv.astype(np.float64).reshape(-1, cols)
        x = tv.astype(np.float64).reshape(r.shape)
        d = np.abs(x - r)
        denom = float(np.abs(r).sum())
        mean_rel = float(d.sum() / denom) if denom > 0 else None
        ch_err = d.sum(axis=0) / np.maximum(np.abs(r).sum(axis=0), 1e-30)
        worst = np.argsort(ch_err)[::-1][:5]
        cov = proj[proj["clipped_fraction"].notna()]
        vis_rel = float(vis.iloc[-1]["rel_l2"]) if not vis.empty else None
        out_rel = float(last["rel_l2"]) if last["rel_l2"] == last["rel_l2"] else None
        out.append({
            "record": {"sample": int(sample), "part": part, "step": int(step)},
            "projector_output": last["ref_name"],
            "test_tensor": last["test_name"],
            "vision_output": vis.iloc[-1]["ref_name"] if not vis.empty else None,
            "mean_rel_err": mean_rel,
            "rel_l2": out_rel,
            "vision_rel_l2": vis_rel,
            "amplification": (out_rel / vis_rel) if (out_rel is not None and vis_rel) else None,
            "sqnr_db": float(last["sqnr_db"]),
            "max_clipped_fraction": float(cov["clipped_fraction"].max()) if not cov.empty else None,
            "clipped": {row["ref_name"]: float(row["clipped_fraction"]) for _, row in cov.iterrows()},
            "worst_channels": [] if sampled else [{"channel": int(c), "mean_rel_err": float(ch_err[c])} for c in worst],
            "sampled": sampled,
        })
    return out


def projector_findings(cmp: Any, threshold: float = defaults.PROJECTOR_DRIFT_MEAN_REL) -> list[Finding]:
    """A ``projector_drift`` finding for each record whose projector output breaks the 5 % rule.

    It is an error when the projector itself is the cause: it amplifies the vision tower's relative error
    (``PROJECTOR_AMPLIFICATION``) or its encodings miss its reference activations (``PROJECTOR_COVERAGE_MISS``);
    otherwise a warning: the output breaks the rule with error inherited from the vision tower.
    """
    out = []
    for s in projector_stats(cmp):
        mr = s["mean_rel_err"]
        if mr is None or mr <= threshold:
            continue
        amp = s["amplification"]
        cov = s["max_clipped_fraction"]
        own = (amp is not None and amp >= defaults.PROJECTOR_AMPLIFICATION) or (cov or 0) > defaults.PROJECTOR_COVERAGE_MISS
        msg = f"projector output {s['projector_output']} drifts: mean relative error {mr:.1%} (> {threshold:.0%})"
        if amp is not None:
            msg += f", {amp:.1f}x the vision tower's relative error"
        if cov:
            msg += f"; {cov:.1%} of its reference activations fall outside the calibrated range"
        if not own:
            msg += " (inherited from the vision tower, not amplified by the projector)"
        out.append(Finding(
            "projector_drift", "error" if own else "warning", msg,
            where={"record": s["record"], "tensor": s["projector_output"], "test_tensor": s["test_tensor"]},
            evidence={k: s[k] for k in ("mean_rel_err", "rel_l2", "vision_rel_l2", "amplification", "sqnr_db",
                                        "max_clipped_fraction", "clipped", "worst_channels", "vision_output")},
            suggestion="calibrate the projector on images like the deployment's (its input range was missed), "
                       "or give the projector 16-bit activations / wider encodings (ivq tune)",
        ))
    return out
