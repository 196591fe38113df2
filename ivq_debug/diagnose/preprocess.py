"""``preprocess_mismatch``: the vision tower's inputs (``pixel_values``, ``image_grid_thw``) differ between the dumps.

Preprocessing runs before any graph (resize kernel, rounding, value range, normalization statistics), so a
difference in the vision record's *inputs* is upstream of every tensor a capture holds. The statistic that
tells the causes apart is an affine fit of the test's values on the reference's, per colour channel
(``t ≈ a_c·r + b_c``; channels: axis 1 of ``[B, 3, H, W]``, or the three contiguous thirds of a Qwen-VL patch
vector ``[N, 3·T·P·P]``):

* ``range``: an exact affine map (R² ≥ ``PREPROCESS_AFFINE_R2``) with the same ``a, b`` in every channel: a
  0–1 vs 0–255 range (a = 255 or 1/255) or a ``2x − 1`` / mean-0.5 convention;
* ``normalization``: exact per channel but ``a_c, b_c`` differ between channels: other mean / std statistics
  (ImageNet's against the model's own, the second seed's Qwen-VL warning);
* ``resize``: no affine map, the value statistics alike (mean and std within 10 %): the same picture
  resampled differently (kernel, antialiasing, rounding of the target size); different ``image_grid_thw``
  or shapes: another target resolution;
* ``other``: none of these.

A relative L2 difference at most ``PREPROCESS_MAX_REL`` is not reported (float rounding of the same pipeline).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding
from ivq_debug.diagnose.positions import record_input

PIXELS = "pixel_values"
GRID = "image_grid_thw"
SUGGESTIONS = {
    "range": "feed pixel values in the range the model was trained on (the reference's: compare min / max)",
    "normalization": "normalize with the model's own mean / std per channel (the processor's image_mean / "
                     "image_std), not another model's statistics",
    "resize": "resize with the processor's kernel and target size (resample filter, antialiasing, rounding "
              "of the size to the patch grid)",
    "other": "run the deployment's preprocessing and the reference's on the same image and compare step by step",
}


def _channels(x: np.ndarray) -> list[np.ndarray]:
    """The colour channels of a pixel tensor (one channel: the whole tensor, when the layout does not say)."""
    if x.ndim == 4 and x.shape[1] == 3:
        return [x[:, c] for c in range(3)]
    if x.ndim == 2 and x.shape[-1] % 3 == 0:
        k = x.shape[-1] // 3
        return [x[:, c * k:(c + 1) * k] for c in range(3)]
    return [x]


def affine_fit(r: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """Least-squares ``t ≈ a·r + b`` → ``(a, b, R²)`` (R² = 1 − SS_res / SS_tot of the test values)."""
    r, t = r.astype(np.float64).ravel(), t.astype(np.float64).ravel()
    vr = float(np.var(r))
    a = float(np.mean((r - r.mean()) * (t - t.mean())) / vr) if vr > 0 else 0.0
    b = float(t.mean() - a * r.mean())
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    ss_res = float(np.sum((t - (a * r + b)) ** 2))
    return a, b, (1.0 - ss_res / ss_tot) if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def _stats(x: np.ndarray) -> dict[str, float]:
    x = x.astype(np.float64)
    return {"min": float(x.min()), "max": float(x.max()), "mean": float(x.mean()), "std": float(x.std())}


def classify(r: np.ndarray, t: np.ndarray, r2_min: float = defaults.PREPROCESS_AFFINE_R2) -> dict[str, Any]:
    """The verdict and statistics of two same-shaped pixel tensors (see the module docstring)."""
    fits = [affine_fit(a, b) for a, b in zip(_channels(r), _channels(t), strict=True)]
    sr, st = _stats(r), _stats(t)
    ev: dict[str, Any] = {"affine": [{"scale": a, "offset": b, "r2": q} for a, b, q in fits], "ref": sr, "test": st}
    if all(q >= r2_min for _, _, q in fits):
        scales, offsets = [a for a, _, _ in fits], [b for _, b, _ in fits]
        span = max(sr["max"] - sr["min"], 1e-12)
        same = (max(scales) - min(scales) <= 1e-3 * max(abs(s) for s in scales)
                and (max(offsets) - min(offsets)) <= 1e-3 * span * max(abs(s) for s in scales))
        ev["verdict"] = "range" if same else "normalization"
    elif (abs(st["mean"] - sr["mean"]) <= 0.1 * max(sr["std"], 1e-12)
          and abs(st["std"] - sr["std"]) <= 0.1 * max(sr["std"], 1e-12)):
        ev["verdict"] = "resize"
    else:
        ev["verdict"] = "other"
    return ev


def preprocess_findings(ref: Any, test: Any, max_rel: float = defaults.PREPROCESS_MAX_REL) -> list[Finding]:
    """``preprocess_mismatch`` findings of every common record that feeds ``pixel_values``."""
    rk, tk = ref.record_keys(), test.record_keys()
    out: list[Finding] = []
    for key in sorted(set(rk) & set(tk)):
        pr, pt = record_input(ref, rk[key], PIXELS), record_input(test, tk[key], PIXELS)
        if pr is None or pt is None:
            continue
        record = {"sample": key[0], "part": key[1], "step": key[2]}
        gr, gt = record_input(ref, rk[key], GRID), record_input(test, tk[key], GRID)
        grids = ([int(v) for v in np.asarray(ref.read(gr)).ravel()], [int(v) for v in np.asarray(test.read(gt)).ravel()]) \
            if gr is not None and gt is not None else None
        if (grids is not None and grids[0] != grids[1]) or tuple(pr.shape) != tuple(pt.shape):
            ev = {"verdict": "resize", "ref_shape": list(pr.shape), "test_shape": list(pt.shape),
                  "ref_grid_thw": grids[0] if grids else None, "test_grid_thw": grids[1] if grids else None}
            out.append(Finding("preprocess_mismatch", "error",
                               f"the vision inputs have another resolution: {PIXELS} {list(pt.shape)} vs "
                               f"{list(pr.shape)}" + (f", {GRID} {grids[1]} vs {grids[0]}" if grids else ""),
                               where={"record": record, "tensor": PIXELS}, evidence=ev,
                               suggestion=SUGGESTIONS["resize"]))
            continue
        r = np.asarray(ref.read(pr), dtype=np.float64)
        t = np.asarray(test.read(pt), dtype=np.float64)
        rel = float(np.linalg.norm(t - r) / max(np.linalg.norm(r), 1e-30))
        if rel <= max_rel:
            continue
        ev = classify(r, t) | {"rel_l2": rel}
        a = ev["affine"]
        detail = {"range": f"test ≈ {a[0]['scale']:.4g}·ref + {a[0]['offset']:.4g} in every channel",
                  "normalization": "an exact affine map per channel with other statistics: scales "
                                   + ", ".join(f"{x['scale']:.3g}" for x in a) + "; offsets "
                                   + ", ".join(f"{x['offset']:.3g}" for x in a),
                  "resize": f"no affine map (R² {min(x['r2'] for x in a):.3f}) but alike statistics (mean "
                            f"{ev['test']['mean']:.3g} vs {ev['ref']['mean']:.3g}, std {ev['test']['std']:.3g} "
                            f"vs {ev['ref']['std']:.3g}): the same picture resampled differently",
                  "other": f"relative difference {rel:.3g}"}[ev["verdict"]]
        out.append(Finding("preprocess_mismatch", "error",
                           f"{PIXELS} differ before the vision tower ({ev['verdict']}): {detail}",
                           where={"record": record, "tensor": PIXELS}, evidence=ev,
                           suggestion=SUGGESTIONS[ev["verdict"]]))
    return out
