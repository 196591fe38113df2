"""``mrope_layout``: which M-RoPE layout the test's prefill keys were rotated with.

M-RoPE (Qwen2-/Qwen3-VL) rotates frequency ``j`` of a key by ``p[axis_j] · θ_j``, where ``p`` is the token's
3-D position (t, h, w) and ``axis_j`` comes from ``mrope_section`` and the layout
(:func:`ivq_debug.vlm.inputs.mrope_frequency_axes`): ``sectioned`` (Qwen2-VL, ``t…t h…h w…w``) or
``interleaved`` (Qwen3-VL, ``t h w t h w …``). A rotary kernel written for the other layout is exact on text
tokens (t = h = w) and wrong on image tokens only.

The check recomputes the rotary embedding from the captured 3-D positions: the reference's post-RoPE keys
of the first layer both dumps hold (``present.{i}.key`` of the prefill; layer 0 by default, whose pre-RoPE
keys depend on the input embeddings alone) are rotated back with the model's own layout, giving the pre-RoPE
keys, then rotated forward under each layout and compared with the test's keys on the tokens where the
layouts differ. The evidence is the relative residual ``‖k_test − R_L k_pre‖ / ‖k_test‖`` of each layout and
the *shift*: the test's keys projected on the line from the model layout's rotation (0) to the other's (1),
``⟨k_test − R_own k_pre, R_other k_pre − R_own k_pre⟩ / ‖R_other k_pre − R_own k_pre‖²``, one direction, so
noise in the pre-RoPE keys (a quantized vision tower) averages out where the residuals do not. The other
layout is named when the shift is within ``MROPE_SHIFT_TOLERANCE`` of 1 and its residual is at most
``MROPE_MAX_RESIDUAL`` and below the model layout's. A record whose positions have t = h = w everywhere (a text-only prompt) cannot tell the
layouts apart and gives nothing, as does a test whose keys differ by more than a rotation (neither fits).

The model's layout and sections come from the HF config stored in a dump's model attributes
(:func:`ivq_debug.diagnose.positions.rope_of_dumps`) or from ``config=``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding
from ivq_debug.diagnose.positions import RopeSpec, layer_keys, record_input, rope_from_config, rope_of_dumps
from ivq_debug.errors import UsageError
from ivq_debug.vlm.build import MROPE_LAYOUTS
from ivq_debug.vlm.inputs import mrope_frequency_axes


def mrope_angles(positions: np.ndarray, rope: RopeSpec, key_dim: int, layout: str) -> np.ndarray:
    """Rotation angle ``[S, r/2]`` of each token and frequency: ``positions [3, S]`` under ``layout``."""
    theta = rope.frequencies(key_dim)
    if rope.mrope_section is None:
        raise ValueError("not an M-RoPE model (no mrope_section)")
    axes = mrope_frequency_axes(rope.mrope_section, layout)
    if axes.size != theta.size:
        raise ValueError(f"mrope_section {list(rope.mrope_section)} covers {axes.size} frequencies, "
                         f"the keys have {theta.size}")
    pos = np.asarray(positions, dtype=np.float64).reshape(3, -1)
    return pos[axes].T * theta  # [S, h]


def rotate(keys: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """HF ``rotate_half`` RoPE of ``keys [..., S, d]`` by ``angles [S, h]`` (dims ``j`` and ``j + h`` paired)."""
    k = np.asarray(keys, dtype=np.float64).copy()
    h = angles.shape[-1]
    z = (k[..., :h] + 1j * k[..., h:2 * h]) * np.exp(1j * angles)
    k[..., :h], k[..., h:2 * h] = z.real, z.imag
    return k


def _positions(dump: Any, rid: str) -> np.ndarray | None:
    e = record_input(dump, rid, "position_ids")
    if e is not None:
        pos = np.asarray(dump.read(e))
    elif "position_ids" in dump.record_meta(rid):
        pos = np.asarray(dump.record_meta(rid)["position_ids"])
    else:
        return None
    return pos.reshape(3, -1) if pos.size % 3 == 0 and (pos.ndim == 3 or pos.shape[0] == 3) else None


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


def layout_residuals(ref: Any, test: Any, rid_ref: str, rid_test: str, rope: RopeSpec,
                     layer: int = 0) -> dict[str, Any] | None:
    """Per layout, the relative residual of the test's prefill keys against the recomputed rotation.

    None when the records cannot tell the layouts apart (no 3-D positions, t = h = w at every token, no
    common key tensor, or shapes that do not fit).
    """
    pos = _positions(test, rid_test)
    if pos is None:
        pos = _positions(ref, rid_ref)
    if pos is None or rope.mrope_layout is None:
        return None
    names_r, names_t = layer_keys(ref, rid_ref), layer_keys(test, rid_test)
    common = sorted(set(names_r) & set(names_t))
    if not common:
        return None
    li = layer if layer in common else common[0]
    kr = np.asarray(ref.read(ref.entry(names_r[li], rid_ref)), dtype=np.float64)
    kt = np.asarray(test.read(test.entry(names_t[li], rid_test)), dtype=np.float64)
    if kr.shape != kt.shape or kr.shape[-2] != pos.shape[-1]:
        return None
    d = kr.shape[-1]
    try:
        angles = {lay: mrope_angles(pos, rope, d, lay) for lay in MROPE_LAYOUTS}
    except (ValueError, UsageError):  # sections that do not fit the keys: nothing to say
        return None
    own = rope.mrope_layout
    tokens = np.flatnonzero(np.abs(angles["sectioned"] - angles["interleaved"]).max(axis=-1) > 1e-9)
    if tokens.size == 0:
        return None  # t = h = w everywhere (text only): both layouts rotate alike
    pre = rotate(kr, -angles[own])
    same = np.setdiff1d(np.arange(pos.shape[-1]), tokens)
    out: dict[str, Any] = {"layer": li, "tensor": names_t[li], "tokens": tokens.tolist(), "residual": {},
                           "per_token": {}}
    preds = {lay: rotate(pre, ang)[..., tokens, :] for lay, ang in angles.items()}
    kt_tok = kt[..., tokens, :]
    for lay, pred in preds.items():
        out["residual"][lay] = _rel(kt_tok, pred)
        out["per_token"][lay] = [round(_rel(kt_tok[..., i, :], pred[..., i, :]), 6) for i in range(tokens.size)]
    # how far the test's keys moved from the model layout's rotation towards the other one (0 = none, 1 = all the
    # way): a projection on one direction, so noise in the pre-RoPE keys averages out
    other = next(lay for lay in preds if lay != own)
    step = preds[other] - preds[own]
    out["shift"] = float(np.sum((kt_tok - preds[own]) * step) / max(float(np.sum(step * step)), 1e-30))
    out["residual_other_tokens"] = (_rel(kt[..., same, :], rotate(pre, angles[own])[..., same, :])
                                    if same.size else None)
    return out


def mrope_layout_findings(ref: Any, test: Any, *, config: Mapping[str, Any] | str | os.PathLike | None = None,
                          max_residual: float = defaults.MROPE_MAX_RESIDUAL,
                          shift_tolerance: float = defaults.MROPE_SHIFT_TOLERANCE) -> list[Finding]:
    """``mrope_layout`` findings: prefill records whose keys fit another M-RoPE layout than the model's."""
    rope = rope_from_config(config) if config is not None else rope_of_dumps(ref, test)
    if rope is None or rope.mrope_layout is None:
        return []
    rk, tk = ref.record_keys(), test.record_keys()
    out: list[Finding] = []
    for key in sorted(set(rk) & set(tk)):
        if key[1] != "prefill":
            continue
        res = layout_residuals(ref, test, rk[key], tk[key], rope)
        if res is None:
            continue
        own = rope.mrope_layout
        r = res["residual"]
        best = next(lay for lay in r if lay != own)
        if abs(res["shift"] - 1.0) > shift_tolerance or r[best] > max_residual or r[best] >= r[own]:
            continue
        toks = res["tokens"]
        out.append(Finding(
            "mrope_layout", "error",
            f"prefill keys are rotated with the {best} M-RoPE layout, the model's is {own}: at the {len(toks)} "
            f"image tokens whose t/h/w positions differ they lie {res['shift']:.2f} of the way from the {own} "
            f"rotation to the {best} one, residual {r[best]:.1e} against {r[own]:.2f} (layer {res['layer']}, "
            f"first token {toks[0]})",
            where={"record": {"sample": key[0], "part": "prefill", "step": key[2]}, "tensor": res["tensor"],
                   "positions": toks},
            evidence={"layout": best, "model_layout": own, "shift": res["shift"], "residual": r, "layer": res["layer"],
                      "first_position": toks[0], "positions": toks, "per_token": res["per_token"],
                      "residual_other_tokens": res["residual_other_tokens"], "rope": rope.to_dict()},
            suggestion=f"the rotary kernel must map the t/h/w axes to frequencies in the {own} layout "
                       f"(mrope_section {list(rope.mrope_section or [])}); text tokens cannot show this",
        ))
    return out
