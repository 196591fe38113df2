"""Suggest quantization overrides from a comparison (and, when given, an introduced-error replay).

Rules, each entry carrying its rationale and evidence numbers:

=====================  ==================================================  =====================================
evidence               meaning                                             override
=====================  ==================================================  =====================================
resolution collapse    the encoding step is large against the spread      16-bit activation
                       of the informative reference values
saturation             reference values fall outside the encoding range   range widened to the reference range
projector drift        the projector output breaks the 5 % rule           16-bit + reference range on every
                                                                           projector activation
introduced error       a unit breaks the introduced-error budget          16-bit activation on its output
still bad after 16-bit (from :func:`ivq_debug.tune.verify.greedy`)        fp16: the node stays float on HTP
=====================  ==================================================  =====================================

Ranges come from the reference dump's manifest statistics (min / max over every record, no tensor
reads), united with the test encoding's range and widened by ``margin``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ivq_debug import defaults
from ivq_debug.comparator.encoding_fit import encoding_range
from ivq_debug.diagnose.projector import PROJECTOR_TOKENS, _is, projector_findings
from ivq_debug.errors import UsageError
from ivq_debug.qnn.encodings import Encoding, EncodingSet, write_encodings
from ivq_debug.util import atomic_write_text

ACTIONS = ("a16", "widen", "a16+widen", "fp16")


@dataclass
class Suggestion:
    """One proposed override."""

    tensor: str
    action: str  # one of ACTIONS
    reason: str
    rmin: float | None = None
    rmax: float | None = None
    node: str | None = None  # producing node (needed for fp16: the node is left unquantized)
    priority: float = 0.0  # larger first
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def bitwidth(self) -> int | None:
        """Activation bitwidth the override asks for (None: keep)."""
        return 16 if "a16" in self.action else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def _ref_ranges(ref: Any) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for e in [*ref.tensors(), *ref.tensors(kind="input")]:
        lo, hi = e.stats.get("min"), e.stats.get("max")
        if lo is None or hi is None:
            continue
        cur = out.get(e.name)
        out[e.name] = (min(lo, cur[0]), max(hi, cur[1])) if cur else (lo, hi)
    return out


def _range(name: str, row: Any, ranges: dict[str, tuple[float, float]], margin: float) -> tuple[float, float] | None:
    r = ranges.get(name)
    if r is None:
        return None
    lo, hi = r
    enc_lo, enc_hi = row.get("enc_min"), row.get("enc_max")
    if enc_lo is not None and enc_hi is not None and not (math.isnan(enc_lo) or math.isnan(enc_hi)):
        lo, hi = min(lo, enc_lo), max(hi, enc_hi)
    span = hi - lo
    return lo - margin * span, hi + margin * span


def suggest(
    cmp: Any,
    replay: Any = None,
    *,
    margin: float = 0.05,
    resolution_db: float = defaults.RESOLUTION_WARN_DB,
    saturation: float = defaults.SATURATION_WARN,
    projector: bool = True,
) -> list[Suggestion]:
    """Override suggestions for the test side of a comparison, most important first.

    Args:
        cmp: reference (float) vs test (quantized) :class:`~ivq_debug.comparator.Comparison`.
        replay: optional :class:`~ivq_debug.diagnose.replay.ReplayResult` of the same QDQ model.
        margin: widen suggested ranges by this share of their span on each side.
        resolution_db: grid SNR below which a tensor gets 16-bit activations.
        saturation: clipped share above which a tensor's range is widened.
        projector: apply the projector-drift rule.
    """

    t = cmp.table
    if t.empty:
        return []
    ranges = _ref_ranges(cmp.ref)
    by_name: dict[str, Suggestion] = {}
    # one row per tensor: its worst record
    rows = t[t["grid_snr_db"].notna() | t["clipped_fraction"].notna()]
    worst = rows.sort_values("sqnr_db", kind="stable").drop_duplicates("test_name")
    test_entries = {e.name: e for e in cmp.test.tensors()}

    def add(name: str, action: str, reason: str, priority: float, evidence: dict[str, Any], row: Any) -> None:
        if row.get("op_type") in defaults.VIEW_OPS and "a16" in action:
            # a view op shares its producer's quantization type (ORT's quantizer refuses a different one):
            # the 16-bit request belongs to the producer, which has its own row; a range can still move
            action = "widen" if "widen" in action else ""
            if not action:
                return
        rng = _range(row["ref_name"], row, ranges, margin) if "widen" in action else (None, None)
        if rng is None:
            rng = (None, None)
        cur = by_name.get(name)
        if cur is not None:
            acts = set(cur.action.split("+")) | set(action.split("+"))
            cur.action = "a16+widen" if acts >= {"a16", "widen"} else cur.action
            cur.reason += "; " + reason
            cur.priority = max(cur.priority, priority)
            cur.evidence.update(evidence)
            if "widen" in action and rng[0] is not None:
                cur.rmin, cur.rmax = rng
            return
        e = test_entries.get(name)
        by_name[name] = Suggestion(name, action, reason, rng[0], rng[1], None, priority, dict(evidence))
        del e

    for _, r in worst.iterrows():
        row = r.to_dict()
        enc = test_entries.get(row["test_name"])
        if enc is not None and enc.encoding:

            er = encoding_range(enc.encoding)
            if er is not None:
                row["enc_min"], row["enc_max"] = er[0], er[1]
        g, c = row["grid_snr_db"], row["clipped_fraction"]
        if g is not None and not math.isnan(g) and g < resolution_db:
            add(row["test_name"], "a16",
                f"resolution collapse: the 8-bit step {row['enc_step']:.4g} leaves {g:.1f} dB on the informative values",
                resolution_db - g, {"grid_snr_db": g, "enc_step": row["enc_step"]}, row)
        if c is not None and not math.isnan(c) and c > saturation:
            add(row["test_name"], "widen", f"saturation: {c:.2%} of the reference values fall outside the range",
                10 * math.log10(1 + 1000 * c), {"clipped_fraction": c}, row)
    if projector and projector_findings(cmp):
        proj = t[t.apply(lambda r: _is(r, PROJECTOR_TOKENS), axis=1)]
        for _, r in proj.drop_duplicates("test_name").iterrows():
            row = r.to_dict()
            enc = test_entries.get(row["test_name"])
            if enc is None or not enc.encoding:
                continue

            er = encoding_range(enc.encoding)
            if er is not None:
                row["enc_min"], row["enc_max"] = er[0], er[1]
            add(row["test_name"], "a16+widen",
                "projector drift: 16-bit activations and the reference range for every projector tensor",
                50.0, {"projector": True}, row)
    if replay is not None:
        for _, r in replay.breaking.iterrows():
            name = r["tensor"]
            row = t[t["test_name"] == name]
            rowd = row.iloc[0].to_dict() if len(row) else {"ref_name": name}
            add(name, "a16", f"introduced error: {r['intro_sqnr_db']:.1f} dB on its own "
                f"(budget {replay.budget_sqnr_db:g} dB)", replay.budget_sqnr_db - float(r["intro_sqnr_db"]),
                {"intro_sqnr_db": float(r["intro_sqnr_db"])}, rowd)
            by_name[name].node = r["node"]
    return sorted(by_name.values(), key=lambda s: -s.priority)


def to_encodings(suggestions: list[Suggestion], activation_bits: int = 8) -> Any:
    """The suggestions as an :class:`~ivq_debug.qnn.encodings.EncodingSet` (activations)."""

    es = EncodingSet(format="legacy")
    for s in suggestions:
        if s.action == "fp16":
            es.activations[s.tensor] = Encoding(bitwidth=16, dtype="float")
            continue
        bw = s.bitwidth or activation_bits
        mn = (s.rmin,) if s.rmin is not None else ()
        mx = (s.rmax,) if s.rmax is not None else ()
        es.activations[s.tensor] = Encoding(bitwidth=bw, dtype="int", symmetric=False, min=mn, max=mx)
    return es


def ort_overrides(suggestions: list[Suggestion], activation_type: str = "QUInt8") -> tuple[dict[str, Any], list[str]]:
    """ORT ``init_overrides`` for the integer suggestions, and the node names to leave float (fp16).

    Every entry carries an explicit ``quant_type`` (ORT's mixed-precision fixer compares it at precision
    boundaries): ``QUInt16`` for 16-bit requests, else the preset's ``activation_type``; a widened range adds
    ``rmin`` / ``rmax``.
    """
    import numpy as np
    from onnxruntime.quantization import QuantType

    out: dict[str, Any] = {}
    for s in suggestions:
        if s.action == "fp16":
            continue
        d: dict[str, Any] = {"quant_type": QuantType.QUInt16 if s.bitwidth == 16 else getattr(QuantType, activation_type)}
        if s.rmin is not None and s.rmax is not None:
            d["rmin"] = np.array(min(s.rmin, 0.0), dtype=np.float32)
            d["rmax"] = np.array(max(s.rmax, 0.0), dtype=np.float32)
        out[s.tensor] = [d]
    nodes = [s.node for s in suggestions if s.action == "fp16" and s.node]
    return out, nodes


def write_suggestions(suggestions: list[Suggestion], path: str | os.PathLike, *, fmt: str = "legacy",
                      activation_bits: int = 8, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a ready overrides file (QNN ``legacy`` / ``1.0.0`` or ORT JSON) and ``<stem>.rationale.md``.

    Returns the two paths.
    """

    if not suggestions:
        raise UsageError("no overrides to write: nothing breaks the thresholds")
    p = Path(path)
    encs = to_encodings(suggestions if fmt != "ort" else [s for s in suggestions if s.action != "fp16"],
                        activation_bits)
    write_encodings(encs, p, format=fmt, overwrite=overwrite)
    lines = [f"# Suggested quantization overrides ({p.name})", "",
             "| # | tensor | action | range | why |", "|---|---|---|---|---|"]
    for i, s in enumerate(suggestions, 1):
        rng = f"[{s.rmin:.4g}, {s.rmax:.4g}]" if s.rmin is not None else "calibrated"
        lines.append(f"| {i} | `{s.tensor}` | {s.action} | {rng} | {s.reason} |")
    lines += ["", "Evidence per entry (JSON):", "", "```json",
              json.dumps([s.to_dict() for s in suggestions], indent=1, default=str), "```", ""]
    md = p.with_suffix(".rationale.md")
    atomic_write_text(md, "\n".join(lines), overwrite=overwrite)
    return p, md


def from_encodings(encs: Any) -> list[Suggestion]:
    """Suggestions from an overrides / encodings file (to verify a hand-written file)."""
    out = []
    for name, e in encs.activations.items():
        if e.is_float:
            out.append(Suggestion(name, "fp16", "from file"))
            continue
        lo, hi = (e.grid_range() if e.scale else (e.min, e.max))
        action = "a16" if e.bitwidth == 16 else "widen"
        if e.bitwidth == 16 and lo:
            action = "a16+widen"
        out.append(Suggestion(name, action, "from file", lo[0] if lo else None, hi[0] if hi else None))
    return out
