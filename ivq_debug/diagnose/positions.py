"""Position-id offsets in decode, found directly or inferred from the KV cache.

**Direct**: the prefill record's ``position_ids`` input fixes what every decode step must use: step ``k``
(k ≥ 1) feeds position ``max(prefill positions) + k`` (1-D RoPE without padding: ``S + k − 1``; M-RoPE:
``max(pos) + k`` on all three rows, which is ``S + rope_delta + k − 1``). The offset is *observed −
expected*: decode positions restarting at 0 give ``−(max(pos) + 1)`` (``−S`` for 1-D RoPE); an M-RoPE
scheduler that uses ``S + k − 1`` gives ``−rope_delta`` (HF's ``rope_deltas = max(pos) + 1 − S``).

**Inferred** (a device whose decode ``position_ids`` were not kept, or a decode graph without a position
input): the key a decode step *appends* to the cache is compared with the reference's. Which slot that is
comes from the shapes: a cache that holds one slot is the new slot (fixed-cache exports that return only
the new K/V); a cache one slot longer than the ``past`` input, or ``S + k`` slots long at step ``k``, grows
(HF / optimum dynamic caches, whose ``present`` holds the whole cache): the last slot; a cache as long as
its ``past`` input is a fixed buffer returned whole: the slot it changed (or ``cache_len``). Comparing whole
caches instead lets the identical prompt slots dominate (offset 0 at confidence ≈ 1: a confident false
negative). Only steps fed the same token as the reference are used (meta ``input_ids``, else the
``inputs_embeds`` inputs); layer 0 by default, where the pre-RoPE key depends on that token alone.

Both post-RoPE keys then differ only by a rotation. Pairing dimensions ``j`` and ``j + r/2`` of the rotary
part (HF ``rotate_half``, ``r`` = rotary dim) into ``z_j = k_j + i·k_{j+r/2}``, ``z_test · conj(z_ref) ≈
|z|² e^{iδθ_j}`` with ``θ_j = base^(−2j/r) / factor`` (``factor``: linear position scaling). The offset
``δ`` maximizes ``Re Σ_j c_j e^{−iδθ_j}`` (summed over heads); ``fit`` is that maximum over ``Σ|c_j|`` (1 =
a perfect rotation); the *runner-up* is the best offset more than one position away, or offset 0 (no fault)
when the best offset is not 0; ``margin`` is the fit gap to it and ``confidence = margin / (1 − runner-up
fit)``: how much of the distance to a perfect fit the best offset covers (1 = only the best offset is a
perfect rotation). Low RoPE frequencies make every offset's fit high, so the absolute margin is small with
few dimensions; the confidence is not. A step whose fit or confidence is low reports no offset. M-RoPE
decode slots (all three position rows equal) rotate like 1-D RoPE.

The RoPE parameters (``rope_theta``, ``head_dim``, ``partial_rotary_factor``, linear scaling) come from the
caller (``base=`` or an HF ``config.json`` as ``config=``) or, failing that, from the dumps' model
attributes (``rope_theta``, or an HF config dict under ``config``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding
from ivq_debug.errors import InputError, UsageError
from ivq_debug.jsonio import read_json
from ivq_debug.vlm.config import check_hf_config


def _pos_array(v: Any) -> np.ndarray:
    """Positions as int64, or float64 when any is fractional (InternVL3's V2PE visual positions)."""
    a = np.asarray(v)
    if a.dtype.kind == "f" and not np.all(a == np.round(a)):
        return a.astype(np.float64)
    return a.astype(np.int64)


def _num(x: Any) -> int | float:
    """A position as ``int`` when integral, else ``float`` (fractional positions flow through unrounded)."""
    f = float(x)
    return int(f) if f == round(f) else f


def prefill_and_decode_positions(dump: Any, sample: int = 0) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
    """The prefill ``position_ids`` and each decode step's ``position_ids`` recorded in a dump."""
    prefill = None
    steps: dict[int, np.ndarray] = {}
    for (s, part, step), rid in dump.record_keys().items():
        if s != sample or part not in ("prefill", "decode"):
            continue
        names = {e.name: e for e in dump.tensors(rid, kind="input")}
        if "position_ids" in names:
            pos = _pos_array(dump.read(names["position_ids"]))
        else:
            meta = dump.record_meta(rid)
            if "position_ids" not in meta:
                continue
            pos = _pos_array(meta["position_ids"])
        if part == "prefill":
            prefill = pos
        else:
            steps[step] = pos
    return prefill, steps


@dataclass
class PositionCheck:
    """Result of the direct check."""

    prefill_len: int
    max_prefill_pos: int | float  # float: fractional positions (V2PE)
    rope_delta: int | float
    offsets: dict[int, int | float]  # decode step -> observed - expected
    expected: dict[int, int | float]
    observed: dict[int, int | float]

    @property
    def first_wrong_step(self) -> int | None:
        """First decode step whose offset is not 0."""
        bad = [k for k, v in sorted(self.offsets.items()) if v != 0]
        return bad[0] if bad else None

    @property
    def offset(self) -> int | None:
        """The offset when it is the same at every wrong step (None when positions are right or vary)."""
        vals = {v for v in self.offsets.values() if v != 0}
        return vals.pop() if len(vals) == 1 else None


def check_positions(dump: Any, sample: int = 0) -> PositionCheck | None:
    """Compare recorded decode ``position_ids`` with what the prefill implies (None without them)."""
    prefill, steps = prefill_and_decode_positions(dump, sample)
    if prefill is None or not steps:
        return None
    s_len = int(prefill.shape[-1])
    mx = _num(prefill.max())
    offsets, expected, observed = {}, {}, {}
    for k, pos in sorted(steps.items()):
        rows = pos.reshape(-1)
        obs = _num(rows[0] if np.all(rows == rows[0]) else rows.max())
        exp = mx + k
        offsets[k], expected[k], observed[k] = _num(obs - exp), exp, obs
    return PositionCheck(s_len, mx, _num(mx + 1 - s_len), offsets, expected, observed)


# ================================================================================ RoPE parameters
#: ``rope_type`` values whose frequencies :class:`RopeSpec` reproduces (``mrope``: transformers 4.x Qwen2-VL)
ROPE_TYPES = ("default", "linear", "mrope")


@dataclass(frozen=True)
class RopeSpec:
    """The RoPE parameters the KV-cache inference needs.

    Attributes:
        theta: the base (``rope_theta``).
        head_dim: the key head dim, when known (checked against the keys).
        rotary_dim: rotated dims (``head_dim × partial_rotary_factor``); ``None`` = the whole head.
        factor: linear position scaling (``rope_type="linear"``); 1 otherwise.
        mrope_section: M-RoPE sections, when the model has them (decode slots rotate like 1-D RoPE).
        source: where the parameters came from.
        mrope_layout: how the M-RoPE axes map to frequencies (``sectioned`` / ``interleaved``, see
            :func:`ivq_debug.vlm.inputs.mrope_frequency_axes`); None without M-RoPE.
    """

    theta: float
    head_dim: int | None = None
    rotary_dim: int | None = None
    factor: float = 1.0
    mrope_section: tuple[int, ...] | None = None
    source: str = "argument"
    mrope_layout: str | None = None

    def frequencies(self, key_dim: int) -> np.ndarray:
        """``θ_j`` of the rotary part of a key with ``key_dim`` dims."""
        rd = self.rotary_dim or key_dim
        if rd > key_dim or rd % 2:
            raise UsageError(f"rotary dim {rd} does not fit keys of head dim {key_dim}")
        return rope_frequencies(rd, self.theta) / self.factor

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready evidence."""
        return {"rope_theta": self.theta, "head_dim": self.head_dim, "rotary_dim": self.rotary_dim,
                "factor": self.factor, "mrope_section": list(self.mrope_section) if self.mrope_section else None,
                "mrope_layout": self.mrope_layout, "source": self.source}


def rope_from_config(config: Mapping[str, Any] | str | os.PathLike) -> RopeSpec:
    """The :class:`RopeSpec` of an HF ``config.json`` (a path, a checkpoint folder holding it, or a dict).

    Reads the text config when there is one (``text_config`` / ``llm_config``): ``rope_parameters`` (or the
    older ``rope_scaling``) with ``rope_theta`` / ``rope_type`` / ``factor`` / ``mrope_section`` /
    ``partial_rotary_factor``, else the config's own ``rope_theta`` / ``partial_rotary_factor``, and
    ``head_dim`` (default ``hidden_size / num_attention_heads``). The M-RoPE layout is ``interleaved`` when
    the rope parameters say ``mrope_interleaved`` (released Qwen3-VL configs) or the ``model_type`` is a
    Qwen3-VL one (transformers always interleaves there), else ``sectioned`` (Qwen2-/Qwen2.5-VL).

    Raises:
        InputError: the file is missing or not JSON, or it has no ``rope_theta``.
        UsageError: a ``rope_type`` whose frequencies are not reproduced (see :data:`ROPE_TYPES`).
    """
    source = "config"
    if isinstance(config, Mapping):
        cfg: Any = config
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        source = str(path)
        cfg = read_json(path, "config.json")
    cfg = check_hf_config(cfg, source)  # a dump's stored config is as untrusted as a file
    tc = cfg.get("text_config") or cfg.get("llm_config") or cfg
    rp = tc.get("rope_parameters") or tc.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta") or tc.get("rope_theta") or cfg.get("rope_theta")
    if not theta:
        raise InputError("config has no rope_theta (in text_config.rope_parameters or text_config)", source)
    rope_type = rp.get("rope_type") or rp.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UsageError(f"rope_type {rope_type!r} is not supported by the KV-cache position check "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    head_dim = tc.get("head_dim")
    if not head_dim and tc.get("hidden_size") and tc.get("num_attention_heads"):
        head_dim = int(tc["hidden_size"]) // int(tc["num_attention_heads"])
    partial = float(rp.get("partial_rotary_factor") or tc.get("partial_rotary_factor") or 1.0)
    rotary = int(head_dim * partial) if head_dim and partial != 1.0 else None
    section = rp.get("mrope_section")
    layout = None
    if section:
        types = {str(c.get("model_type") or "") for c in (cfg, tc)}
        interleaved = bool(rp.get("mrope_interleaved")) or any(t.startswith("qwen3_vl") for t in types)
        layout = "interleaved" if interleaved else "sectioned"
    return RopeSpec(float(theta), int(head_dim) if head_dim else None, rotary,
                    float(rp.get("factor") or 1.0) if rope_type == "linear" else 1.0,
                    tuple(int(x) for x in section) if section else None, source, layout)


def rope_of_dumps(*dumps: Any) -> RopeSpec | None:
    """The RoPE parameters stored in dump model attributes (an HF config dict ``config``, or ``rope_theta``);
    None when there are none (or only configs the check cannot use)."""
    for d in dumps:
        model = getattr(d, "model", None) or {}
        if isinstance(model.get("config"), Mapping):
            try:
                spec = rope_from_config(model["config"])
            except (InputError, UsageError):  # a config the check cannot use: no inferred check from it
                continue
            return replace(spec, source=f"{Path(str(getattr(d, 'path', 'dump'))).name} model attributes")
    for d in dumps:
        theta = (getattr(d, "model", None) or {}).get("rope_theta")
        if theta:
            return RopeSpec(float(theta), source=f"{Path(str(getattr(d, 'path', 'dump'))).name} model attributes")
    return None


# ================================================================================ rotation estimate
def rope_frequencies(head_dim: int, base: float) -> np.ndarray:
    """``θ_j = base^(−2j/d)`` for ``j < d/2`` (HF default RoPE)."""
    return base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


@dataclass
class RotationEstimate:
    """Offset between two sets of post-RoPE keys."""

    offset: int
    fit: float
    margin: float
    confidence: float
    scores: np.ndarray  # fit for every candidate offset, index = offset + max_offset
    fit_at_zero: float = 0.0  # fit of offset 0 (no fault)


def estimate_rotation(k_ref: np.ndarray, k_test: np.ndarray, base: float | RopeSpec,
                      max_offset: int = defaults.POSITION_MAX_OFFSET) -> RotationEstimate:
    """Estimate the position offset δ with ``k_test ≈ RoPE(δ) k_ref`` (arrays ``[..., head_dim]``).

    ``base`` is ``rope_theta`` or a :class:`RopeSpec` (rotary dim, linear scaling).
    """
    rope = base if isinstance(base, RopeSpec) else RopeSpec(float(base))
    r = np.asarray(k_ref, dtype=np.float64)
    t = np.asarray(k_test, dtype=np.float64)
    d = r.shape[-1]
    theta = rope.frequencies(d)
    h = theta.size
    zr = (r[..., :h] + 1j * r[..., h : 2 * h]).reshape(-1, h)
    zt = (t[..., :h] + 1j * t[..., h : 2 * h]).reshape(-1, h)
    c = (zt * np.conj(zr)).sum(axis=0)  # per frequency
    deltas = np.arange(-max_offset, max_offset + 1, dtype=np.float64)
    total = float(np.abs(c).sum()) or 1.0
    # score(δ) = Re Σ_j c_j e^{-iδθ_j}
    fit = (np.exp(-1j * np.outer(deltas, theta)) @ c).real / total
    best = int(np.argmax(fit))
    rivals = np.abs(deltas - deltas[best]) > 1
    if deltas[best] != 0:
        rivals[max_offset] = True  # offset 0 (no fault) always competes
    runner_up = float(fit[rivals].max()) if rivals.any() else -1.0
    margin = float(fit[best] - runner_up)
    confidence = margin / max(1.0 - runner_up, 1e-12)
    return RotationEstimate(int(deltas[best]), float(fit[best]), margin, min(1.0, confidence), fit,
                            float(fit[max_offset]))


# ================================================================================ appended slots
_PRESENT_KEY = re.compile(r"^present[._](\d+)[._]key$")
_PAST_KEY = re.compile(r"^past(?:_key_values)?[._](\d+)[._]key$")


@dataclass
class AppendedSlot:
    """The key slot one call appended to the cache."""

    key: np.ndarray  # [..., 1, head_dim]
    cache: str  # "new_slot" | "growing" | "fixed_buffer"
    index: int  # slot index in the call's cache output


@dataclass
class StepRotation:
    """The KV-cache inference of one decode step.

    ``offset`` is the reported offset: ``None`` when the step was not compared (``reason`` says why) or its
    fit / confidence is below the thresholds.
    """

    step: int
    layer: int
    same_token: bool | None
    cache: str | None = None
    slot: int | None = None
    estimate: RotationEstimate | None = None
    offset: int | None = None
    reason: str = ""

    def to_evidence(self) -> dict[str, Any]:
        """JSON-ready evidence of the step."""
        e = self.estimate
        return {"offset": self.offset, "best_offset": e.offset if e else None,
                "fit": round(e.fit, 6) if e else None, "confidence": round(e.confidence, 6) if e else None,
                "fit_at_zero": round(e.fit_at_zero, 6) if e else None, "cache": self.cache, "slot": self.slot,
                "same_token": self.same_token, "reason": self.reason or None}


def layer_keys(dump: Any, rid: str) -> dict[int, str]:
    """Layer index -> name of the ``present.{i}.key`` tensors of a record."""
    return {int(m.group(1)): e.name for e in dump.tensors(rid) if (m := _PRESENT_KEY.match(e.name))}


def record_input(dump: Any, rid: str, name: str) -> Any:
    """The input entry ``name`` of a record (None when it was not stored)."""
    return next((e for e in dump.tensors(rid, kind="input") if e.name == name), None)


def _past_input(dump: Any, rid: str, layer: int) -> Any:
    for e in dump.tensors(rid, kind="input"):
        m = _PAST_KEY.match(e.name)
        if m and int(m.group(1)) == layer:
            return e
    return None


def prefill_length(dump: Any, sample: int = 0) -> int | None:
    """Prompt length ``S`` of a sample: the prefill's key cache length (or its ``position_ids`` length)."""
    for (s, part, _), rid in dump.record_keys().items():
        if s != sample or part != "prefill":
            continue
        keys = layer_keys(dump, rid)
        if keys:
            return int(dump.entry(keys[min(keys)], rid).shape[-2])
        pos = record_input(dump, rid, "position_ids")
        if pos is not None:
            return int(pos.shape[-1])
    return None


def appended_slot(dump: Any, rid: str, name: str, layer: int, step: int, prefill_len: int | None) -> AppendedSlot | None:
    """The key decode step ``step`` appended to layer ``layer``'s cache (``name``), found from the shapes.

    None when the shapes do not say which slot it is.
    """
    k = dump.read(dump.entry(name, rid))
    if k.ndim < 2:
        return None
    T = k.shape[-2]
    if T == 1:
        return AppendedSlot(k, "new_slot", 0)
    past = _past_input(dump, rid, layer)
    if past is not None and past.shape[-2] == T - 1:
        return AppendedSlot(k[..., -1:, :], "growing", T - 1)
    if past is not None and past.shape[-2] == T:  # a fixed buffer returned whole: the slot that changed
        changed = np.flatnonzero(np.any(k != dump.read(past), axis=tuple(i for i in range(k.ndim) if i != k.ndim - 2)))
        if changed.size == 1:
            return AppendedSlot(k[..., changed[0] : changed[0] + 1, :], "fixed_buffer", int(changed[0]))
    cache_len = dump.record_meta(rid).get("cache_len")
    idx = int(cache_len) if cache_len is not None else (prefill_len + step - 1 if prefill_len else None)
    if idx is None or idx >= T:
        return None
    kind = "growing" if T == idx + 1 else "fixed_buffer"
    return AppendedSlot(k[..., idx : idx + 1, :], kind, idx)


def _fed_token(dump: Any, rid: str) -> list[int] | None:
    ids = dump.record_meta(rid).get("input_ids")
    return [int(x) for x in np.asarray(ids).reshape(-1)] if ids is not None else None


def same_token(ref: Any, rr: str, test: Any, tr: str) -> bool | None:
    """Whether two decode calls were fed the same token: meta ``input_ids``, else ``inputs_embeds`` inputs."""
    a, b = _fed_token(ref, rr), _fed_token(test, tr)
    if a is not None and b is not None:
        return a == b
    fa, fb = record_input(ref, rr, "inputs_embeds"), record_input(test, tr, "inputs_embeds")
    if fa is None or fb is None:
        return None
    ea, eb = ref.read(fa), test.read(fb)
    if ea.shape != eb.shape:
        return False
    ea, eb = ea.astype(np.float64), eb.astype(np.float64)
    return bool(np.linalg.norm(ea - eb) <= 1e-3 * max(np.linalg.norm(ea), 1e-12))


def infer_offsets(ref: Any, test: Any, *, base: float | RopeSpec, layer: int = 0, sample: int = 0,
                  key_name: str | None = None, max_offset: int = defaults.POSITION_MAX_OFFSET,
                  min_fit: float = defaults.POSITION_MIN_FIT,
                  min_confidence: float = defaults.POSITION_MIN_CONFIDENCE) -> dict[int, StepRotation]:
    """Per decode step, the rotation offset between the keys the test and the reference appended.

    ``layer`` is preferred (the lowest layer both dumps hold otherwise); ``key_name`` names the key tensor
    explicitly. Steps fed another token than the reference are not compared.
    """
    rk, tk = ref.record_keys(), test.record_keys()
    s_ref, s_test = prefill_length(ref, sample), prefill_length(test, sample)
    out: dict[int, StepRotation] = {}
    for key in sorted(set(rk) & set(tk)):
        s, part, step = key
        if s != sample or part != "decode":
            continue
        if key_name is not None:
            names_r = names_t = {layer: key_name}
        else:
            names_r, names_t = layer_keys(ref, rk[key]), layer_keys(test, tk[key])
        common = sorted(set(names_r) & set(names_t))
        if not common:
            continue
        li = layer if layer in common else common[0]
        st = StepRotation(step, li, same_token(ref, rk[key], test, tk[key]))
        out[step] = st
        if st.same_token is False:
            st.reason = "fed another token than the reference"
            continue
        a = appended_slot(ref, rk[key], names_r[li], li, step, s_ref)
        b = appended_slot(test, tk[key], names_t[li], li, step, s_test)
        if a is None or b is None:
            st.reason = "the appended key slot cannot be told from the shapes"
            continue
        if a.key.shape != b.key.shape:
            st.reason = f"key slots differ in shape ({list(a.key.shape)} vs {list(b.key.shape)})"
            continue
        st.cache, st.slot = b.cache, b.index
        head_dim = base.head_dim if isinstance(base, RopeSpec) else None
        if head_dim and b.key.shape[-1] != head_dim:
            st.reason = f"keys have {b.key.shape[-1]} dims, the config's head_dim is {head_dim}"
            continue
        st.estimate = est = estimate_rotation(a.key, b.key, base, max_offset)
        if est.fit < min_fit:
            st.reason = f"low fit ({est.fit:.2f} < {min_fit})"
        elif est.confidence < min_confidence:
            st.reason = f"low confidence ({est.confidence:.2f} < {min_confidence})"
        else:
            st.offset = est.offset
    return out


# ================================================================================ findings
#: what a wrong decode position equals, most specific first: ``cause -> (message, suggestion)``. ``S`` is the
#: prompt length, ``max`` the prefill's largest position, ``delta = max + 1 − S`` (M-RoPE: < 0 with an image)
CAUSES: dict[str, tuple[str, str]] = {
    "restart": ("decode positions restart at 0, at k − 1",
                "decode step k must continue after the prompt: max(prefill positions) + k, not k − 1"),
    "pinned_zero": ("decode positions are pinned to 0",
                    "feed every decode step its own position (max(prefill positions) + k), not a constant 0"),
    "pinned": ("decode positions are pinned to one value", "advance the decode position by one per step"),
    "rope_delta_dropped": (
        "the M-RoPE rope delta is dropped: decode used the cache position S + k − 1 (the image tokens counted "
        "as text) instead of S + k − 1 + rope_delta = max(pos) + k",
        "add the rope delta max(prefill positions) + 1 − S (HF rope_deltas) to the cache position of every "
        "decode step, on all three M-RoPE rows"),
    "raw_token_count": (
        "decode used the raw token count S + k (image tokens counted as text, one past) without the M-RoPE "
        "rope delta",
        "use max(prefill positions) + k: the cache position S + k − 1 plus the rope delta"),
    "off_by_one": ("decode positions are one past the model's (the new token counted twice)",
                   "decode step k uses max(prefill positions) + k, the fed token is not counted again"),
}


def position_cause(observed: Mapping[int, int | float], prefill_len: int | None,
                   max_pos: int | float | None) -> str | None:
    """Which wrong rule decode positions ``observed`` (step -> position) follow (a key of :data:`CAUSES`).

    Only steps whose position is wrong (not ``max_pos + k``) are judged; the cause must hold at every one
    of them. None when the positions are right, the prefill is unknown or no rule fits.
    """
    if prefill_len is None or max_pos is None:
        return None
    S, mx = int(prefill_len), max_pos
    wrong = {k: v for k, v in observed.items() if abs(v - (mx + k)) > 1e-6}
    if not wrong:
        return None
    delta = mx + 1 - S

    def eq(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-6

    rules: dict[str, Any] = {
        "restart": lambda k, v: eq(v, k - 1) and len(observed) > 1,
        "pinned_zero": lambda k, v: eq(v, 0),
        "rope_delta_dropped": lambda k, v: not eq(delta, 0) and eq(v, S + k - 1),
        "raw_token_count": lambda k, v: not (eq(delta, 0) or eq(delta, 1)) and eq(v, S + k),
        "off_by_one": lambda k, v: eq(v, mx + k + 1),
        "pinned": lambda k, v: len(set(wrong.values())) == 1 and len(observed) > 1,
    }
    for cause, rule in rules.items():
        if all(rule(k, v) for k, v in wrong.items()):
            return cause
    return None


def _hint(cause: str | None) -> str:
    return f" ({CAUSES[cause][0]})" if cause else ""


def _suggestion(cause: str | None) -> str:
    return CAUSES[cause][1] if cause else "decode step k must use max(prefill positions) + k (1-D RoPE: S + k − 1)"


def device_folder(dump: Any, sample: int, step: int) -> dict[str, Any]:
    """Where a decode step came from on the device: ``result_dir`` (``Result_<i>``) and the run ``folder`` of its
    record (an ingested device session), else ``{}``."""
    rid = dump.record_keys().get((sample, "decode", step))
    meta = dump.record_meta(rid) if rid is not None else {}
    return {k: meta[k] for k in ("result_dir", "folder") if meta.get(k) is not None}


def position_findings(ref: Any, test: Any, *, base: float | None = None,
                      config: Mapping[str, Any] | str | os.PathLike | None = None, sample: int = 0,
                      min_fit: float = defaults.POSITION_MIN_FIT,
                      min_confidence: float = defaults.POSITION_MIN_CONFIDENCE) -> list[Finding]:
    """``position_id_offset`` findings: direct from the test dump's ``position_ids`` when it has them,
    otherwise inferred from its KV cache against the reference.

    The inference needs the RoPE parameters: ``base`` (``rope_theta``), or ``config`` (an HF
    ``config.json`` path, a checkpoint folder or a config dict; see :func:`rope_from_config`), or else the
    dumps' model attributes (:func:`rope_of_dumps`); without any, no inferred check runs.
    """
    chk = check_positions(test, sample)
    if chk is not None:
        ref_chk = check_positions(ref, sample)
        step = chk.first_wrong_step
        if step is None:
            return []
        off = chk.offsets[step]
        cause = position_cause(chk.observed, chk.prefill_len, chk.max_prefill_pos)
        return [Finding(
            "position_id_offset", "error",
            f"decode position_ids are off by {off:+g} from step {step}{_hint(cause)}",
            where={"record": {"sample": sample, "part": "decode", "step": step}, "tensor": "position_ids"},
            evidence={"offset": off, "constant_offset": chk.offset, "first_wrong_step": step,
                      "prefill_len": chk.prefill_len, "rope_delta": chk.rope_delta,
                      "expected": chk.expected, "observed": chk.observed, "method": "direct", "cause": cause,
                      "reference_ok": ref_chk is not None and ref_chk.first_wrong_step is None}
            | device_folder(test, sample, step),
            suggestion=_suggestion(cause),
        )]
    if config is not None:
        rope: RopeSpec | None = rope_from_config(config)
    elif base is not None:
        rope = RopeSpec(float(base))
    else:
        rope = rope_of_dumps(test, ref)
    if rope is None:
        return []
    est = infer_offsets(ref, test, base=rope, sample=sample, min_fit=min_fit, min_confidence=min_confidence)
    bad = {k: s for k, s in est.items() if s.offset not in (None, 0)}
    if not bad:
        return []
    step = min(bad)
    st = bad[step]
    e = st.estimate
    assert e is not None
    offs = sorted({s.offset for s in bad.values()})
    ref_pre, _ = prefill_and_decode_positions(ref, sample)
    pre = ref_pre if ref_pre is not None else prefill_and_decode_positions(test, sample)[0]
    S = int(pre.shape[-1]) if pre is not None else prefill_length(ref, sample)
    mx = _num(pre.max()) if pre is not None else None
    tensor = layer_keys(test, test.record_keys()[(sample, "decode", step)]).get(st.layer, f"present.{st.layer}.key")
    cause = None
    if mx is not None and S is not None:  # the positions the rotations imply, on the steps that tell one
        cause = position_cause({k: mx + k + s.offset for k, s in est.items() if s.offset is not None}, S, mx)
    return [Finding(
        "position_id_offset", "error",
        f"decode keys are rotated as if positions were off by {e.offset:+d} from step {step}{_hint(cause)} "
        f"(inferred from the appended KV-cache slot, layer {st.layer}, fit {e.fit:.2f}, confidence {e.confidence:.2f})",
        where={"record": {"sample": sample, "part": "decode", "step": step}, "tensor": tensor},
        evidence={"offset": e.offset, "offsets": offs, "constant_offset": offs[0] if len(offs) == 1 else None,
                  "first_wrong_step": step, "fit": e.fit, "margin": e.margin, "confidence": e.confidence,
                  "fit_at_zero": e.fit_at_zero, "method": "inferred", "layer": st.layer, "cache": st.cache,
                  "prefill_len": S, "rope_delta": (mx + 1 - S) if mx is not None and S is not None else None,
                  "rope": rope.to_dict(), "steps": {k: v.to_evidence() for k, v in est.items()}, "cause": cause}
        | device_folder(test, sample, step),
        suggestion=_suggestion(cause),
    )]
