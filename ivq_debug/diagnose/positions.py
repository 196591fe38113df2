"""Position-id offsets in decode, found directly or inferred from the KV cache.

**Direct**: the prefill record's ``position_ids`` input fixes what every decode step must use: step ``k``
(k ≥ 1) feeds position ``max(prefill positions) + k`` (1-D RoPE without padding: ``S + k − 1``; M-RoPE:
``max(pos) + k`` on all three rows, which is ``S + rope_delta + k − 1``). The offset is *observed −
expected*: decode positions restarting at 0 give ``−S``; an M-RoPE scheduler that uses ``S + k − 1`` gives
``−rope_delta`` (HF's ``rope_deltas = max(pos) + 1 − S``).

**Inferred** (a device scheduler whose ``position_ids`` were not captured): post-RoPE keys of one layer
in the test and reference caches for the same decode step differ only by a rotation. Pairing dimensions
``j`` and ``j + d/2`` (HF ``rotate_half``) into ``z_j = k_j + i·k_{j+d/2}``, ``z_test · conj(z_ref) ≈ |z|²
e^{iδθ_j}`` with ``θ_j = base^(−2j/d)``. The offset ``δ`` maximizes ``Re Σ_j c_j e^{−iδθ_j}`` (summed over
heads); ``fit`` is that maximum over ``Σ|c_j|`` (1 = a perfect rotation), ``margin`` the fit gap to the best
offset more than one position away, and ``confidence = margin / (1 − runner-up fit)``: how much of the
distance to a perfect fit the best offset covers (1 = only the best offset is a perfect rotation). Low RoPE
frequencies make every offset's fit high, so the absolute margin is small with few dimensions; the
confidence is not. Layer 0 keys are used by default: under teacher forcing (and at
the first decode step always) their pre-RoPE values are identical on both sides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivq_debug.diagnose.findings import Finding


def _pos_array(v: Any) -> np.ndarray:
    return np.asarray(v).astype(np.int64)


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
    max_prefill_pos: int
    rope_delta: int
    offsets: dict[int, int]  # decode step -> observed - expected
    expected: dict[int, int]
    observed: dict[int, int]

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
    mx = int(prefill.max())
    offsets, expected, observed = {}, {}, {}
    for k, pos in sorted(steps.items()):
        rows = pos.reshape(-1)
        obs = int(rows[0]) if np.all(rows == rows[0]) else int(rows.max())
        exp = mx + k
        offsets[k], expected[k], observed[k] = obs - exp, exp, obs
    return PositionCheck(s_len, mx, mx + 1 - s_len, offsets, expected, observed)


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


def estimate_rotation(k_ref: np.ndarray, k_test: np.ndarray, base: float, max_offset: int = 4096) -> RotationEstimate:
    """Estimate the position offset δ with ``k_test ≈ RoPE(δ) k_ref`` (arrays ``[..., head_dim]``)."""
    r = np.asarray(k_ref, dtype=np.float64)
    t = np.asarray(k_test, dtype=np.float64)
    d = r.shape[-1]
    h = d // 2
    zr = (r[..., :h] + 1j * r[..., h:]).reshape(-1, h)
    zt = (t[..., :h] + 1j * t[..., h:]).reshape(-1, h)
    c = (zt * np.conj(zr)).sum(axis=0)  # per frequency
    theta = rope_frequencies(d, base)
    deltas = np.arange(-max_offset, max_offset + 1, dtype=np.float64)
    total = float(np.abs(c).sum()) or 1.0
    # score(δ) = Re Σ_j c_j e^{-iδθ_j}
    fit = (np.exp(-1j * np.outer(deltas, theta)) @ c).real / total
    best = int(np.argmax(fit))
    far = np.abs(deltas - deltas[best]) > 1
    runner_up = float(fit[far].max()) if far.any() else -1.0
    margin = float(fit[best] - runner_up)
    confidence = margin / max(1.0 - runner_up, 1e-12)
    return RotationEstimate(int(deltas[best]), float(fit[best]), margin, min(1.0, confidence), fit)


_KEY = re.compile(r"^present\.(\d+)\.key$")


def infer_offsets(ref: Any, test: Any, *, base: float, layer: int = 0, sample: int = 0,
                  key_name: str | None = None, max_offset: int = 4096) -> dict[int, RotationEstimate]:
    """Per decode step, the rotation offset between the test and reference keys of one layer."""
    name = key_name or f"present.{layer}.key"
    rk, tk = ref.record_keys(), test.record_keys()
    out: dict[int, RotationEstimate] = {}
    for key in sorted(set(rk) & set(tk)):
        s, part, step = key
        if s != sample or part != "decode":
            continue
        try:
            a = ref.read(ref.entry(name, rk[key]))
            b = test.read(test.entry(name, tk[key]))
        except Exception:
            continue
        out[step] = estimate_rotation(a, b, base, max_offset)
    return out


def position_findings(ref: Any, test: Any, *, base: float | None = None, sample: int = 0,
                      min_fit: float = 0.9, min_confidence: float = 0.5) -> list[Finding]:
    """``position_id_offset`` findings: direct from the test dump's ``position_ids`` when it has them,
    otherwise inferred from its KV cache against the reference (needs the RoPE ``base``)."""
    chk = check_positions(test, sample)
    if chk is not None:
        ref_chk = check_positions(ref, sample)
        step = chk.first_wrong_step
        if step is None:
            return []
        off = chk.offsets[step]
        hint = ""
        if chk.rope_delta != 0 and off == -chk.rope_delta:
            hint = " (decode ignores the M-RoPE delta: S+k−1 was used instead of max(pos)+k)"
        elif off == -chk.prefill_len:
            hint = " (decode positions restart at 0)"
        return [Finding(
            "position_id_offset", "error",
            f"decode position_ids are off by {off:+d} from step {step}{hint}",
            where={"record": {"sample": sample, "part": "decode", "step": step}, "tensor": "position_ids"},
            evidence={"offset": off, "constant_offset": chk.offset, "first_wrong_step": step,
                      "prefill_len": chk.prefill_len, "rope_delta": chk.rope_delta,
                      "expected": chk.expected, "observed": chk.observed, "method": "direct",
                      "reference_ok": ref_chk is not None and ref_chk.first_wrong_step is None},
            suggestion="decode step k must use position max(prefill position_ids) + k (1-D RoPE: prefill_len + k − 1)",
        )]
    if base is None:
        base = float(test.model.get("rope_theta") or ref.model.get("rope_theta") or 0) or None
    if base is None:
        return []
    est = infer_offsets(ref, test, base=base, sample=sample)
    bad = {k: e for k, e in est.items() if e.offset != 0 and e.fit >= min_fit and e.confidence >= min_confidence}
    if not bad:
        return []
    step = min(bad)
    e = bad[step]
    offs = sorted({b.offset for b in bad.values()})
    return [Finding(
        "position_id_offset", "error",
        f"decode keys are rotated as if positions were off by {e.offset:+d} from step {step} "
        f"(inferred from the KV cache, fit {e.fit:.2f}, confidence {e.confidence:.2f})",
        where={"record": {"sample": sample, "part": "decode", "step": step}, "tensor": "present.0.key"},
        evidence={"offset": e.offset, "offsets": offs, "first_wrong_step": step, "fit": e.fit, "margin": e.margin,
                  "confidence": e.confidence,
                  "method": "inferred", "steps": {k: v.offset for k, v in est.items()}},
        suggestion="check the scheduler's decode position_ids: step k must use max(prefill positions) + k",
    )]
