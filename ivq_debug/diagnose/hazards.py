"""Quantization hazards from the comparison table: saturation and resolution collapse.

Both come from how the *test* tensor's encoding fits the *reference* values
(:mod:`ivq_debug.encoding_fit`), computed during the comparison's streaming pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding


def _where(r: Any) -> dict[str, Any]:
    return {"record": {"sample": int(r["sample"]), "part": r["part"], "step": int(r["step"])},
            "tensor": r["ref_name"], "test_tensor": r["test_name"], "op_type": r["op_type"]}


def _first_per_tensor(rows: Any) -> Any:
    """One row per tensor name (its worst record); tensors of view-only ops are left to their producer."""
    rows = rows[~rows["op_type"].isin(defaults.VIEW_OPS)]
    return rows.drop_duplicates("ref_name", keep="first")


def _per_tensor(hits: Any, worst_first: str, finding: Callable[[Any], Finding]) -> list[Finding]:
    """One finding per tensor (its worst record by ``worst_first``, ascending)."""
    rows = _first_per_tensor(hits.sort_values(worst_first, kind="stable"))
    return [finding(r) for _, r in rows.iterrows()]


def saturation(cmp: Any, warn: float = defaults.SATURATION_WARN,
               warn_clip_snr_db: float = defaults.SATURATION_WARN_CLIP_SNR_DB,
               error_clip_snr_db: float = defaults.SATURATION_ERROR_CLIP_SNR_DB) -> list[Finding]:
    """Tensors whose encoding clips more than ``warn`` of the reference values *and* throws away a
    noticeable part of the signal (clip SNR below ``warn_clip_snr_db``); an error below ``error_clip_snr_db``.
    """
    t = cmp.table
    if t.empty or "clipped_fraction" not in t:
        return []
    hits = t[(t["clipped_fraction"] > warn) & (t["clip_snr_db"] < warn_clip_snr_db)]

    def finding(r: Any) -> Finding:
        frac = float(r["clipped_fraction"])
        csnr = float(r["clip_snr_db"]) if r["clip_snr_db"] == r["clip_snr_db"] else float("inf")
        return Finding(
            "saturation", "error" if csnr < error_clip_snr_db else "warning",
            f"{r['ref_name']}: {frac:.2%} of the reference values fall outside the encoding range "
            f"(they saturate; clipping SNR {csnr:.1f} dB)",
            where=_where(r),
            evidence={"clipped_fraction": frac, "clip_snr_db": csnr, "enc_step": r["enc_step"], "sqnr_db": r["sqnr_db"]},
            suggestion="widen this tensor's encoding (calibrate on data that covers the real range, or set "
                       "min/max in quantization overrides)",
        )

    return _per_tensor(hits, "clip_snr_db", finding)


def resolution_collapse(cmp: Any, warn_db: float = defaults.RESOLUTION_WARN_DB,
                        error_db: float = defaults.RESOLUTION_ERROR_DB) -> list[Finding]:
    """Tensors whose encoding step is too coarse for the spread of the informative reference values."""
    t = cmp.table
    if t.empty or "grid_snr_db" not in t:
        return []

    def finding(r: Any) -> Finding:
        g = float(r["grid_snr_db"])
        return Finding(
            "resolution_collapse", "error" if g < error_db else "warning",
            f"{r['ref_name']}: the encoding step {r['enc_step']:.4g} leaves only {g:.1f} dB SNR on the "
            f"informative reference values (the step is large against their spread)",
            where=_where(r),
            evidence={"grid_snr_db": g, "enc_step": r["enc_step"], "sqnr_db": r["sqnr_db"],
                      "clipped_fraction": r["clipped_fraction"]},
            suggestion="give this tensor 16-bit activations, or split the large-range term out (e.g. keep an "
                       "additive attention mask out of the scores' 8-bit encoding)",
        )

    return _per_tensor(t[t["grid_snr_db"] < warn_db], "grid_snr_db", finding)
