"""Suggest quantization overrides from a comparison (and, when given, an introduced-error replay).

Rules, each entry carrying its rationale and evidence numbers:

=======================  ================================================  =====================================
evidence                 meaning                                           override
=======================  ================================================  =====================================
resolution collapse      the encoding step is large against the spread    16-bit activation
                         of the informative reference values
saturation               reference values fall outside the encoding range  range widened to the *calibration*
                                                                           range (± margin)
projector drift          the projector output breaks the 5 % rule          16-bit + calibration range on every
                                                                           projector activation
introduced error,        a pattern group over the introduced-error budget  16-bit activation on every tensor of
activation-dominated     (local attribution), mostly from activations      the group (a group override)
introduced error,        the group's error is mostly its weight encodings  per-channel weights (spread ≥
weight-dominated                                                           ``WEIGHT_SPREAD_WARN``), else 16-bit
                                                                           weights
weight range spread      a per-tensor weight's channel ranges spread       per-channel weights
                         ≥ ``WEIGHT_SPREAD_ERROR``
still bad after 16-bit   (from :func:`ivq_debug.tune.verify.greedy`)       fp16: the node stays float on HTP
=======================  ================================================  =====================================

Ranges never come from the evaluation inputs: a 16-bit request keeps the range calibration gave (the test
encoding's grid range), and a widened range is the *calibration* range (``ranges``: min / max of the float model's
tensors over the calibration samples, :meth:`ivq_debug.tune.verify.Tuner.calibration_ranges`) united with the
test encoding's range and widened by ``margin``. Without ``ranges`` no range is widened (the reason says why).
Weight encodings come from the float weights (per-channel: symmetric, one scale per output channel).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.patterns import WEIGHT_DOMINATED, groups
from ivq_debug.diagnose.projector import PROJECTOR_TOKENS, _is, projector_findings
from ivq_debug.diagnose.weight_spread import weight_spreads
from ivq_debug.encoding_fit import encoding_range
from ivq_debug.errors import UsageError
from ivq_debug.jsonio import load_json
from ivq_debug.onnxgraph.intake import load_float_model
from ivq_debug.onnxgraph.sites import constant_arrays
from ivq_debug.outputs import atomic_write_text
from ivq_debug.qnn.encodings import Encoding, EncodingSet, read_encodings, write_encodings
from ivq_debug.qnn.quantize import EXCLUDE_SUFFIX, read_exclude_sidecar
from ivq_debug.tune.legal import WEIGHT_PAIR_OPS, forbidden

ACTIONS = ("a16", "widen", "a16+widen", "a8", "fp16", "w_per_channel", "w16")
_NUM_OR_NULL = {"type": ["number", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}
#: one :class:`Suggestion` as a checkpoint or a job shard holds it (``to_dict``): read back with ``Suggestion(**d)``
#: only after this schema (the files are untrusted)
SUGGESTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["tensor", "action", "reason"],
    "additionalProperties": False,
    "properties": {"tensor": {"type": "string"}, "action": {"enum": list(ACTIONS)}, "reason": {"type": "string"},
                   "rmin": _NUM_OR_NULL, "rmax": _NUM_OR_NULL, "node": _STR_OR_NULL, "priority": {"type": "number"},
                   "evidence": {"type": "object"}, "group": _STR_OR_NULL, "axis": {"type": ["integer", "null"]},
                   "encoding": {}},
}
#: actions on weights (initializers) rather than activations
WEIGHT_ACTIONS = ("w_per_channel", "w16")


@dataclass
class Suggestion:
    """One proposed override."""

    tensor: str
    action: str  # one of ACTIONS ("a8": 8-bit on the given range, a type the quantizer resolved)
    reason: str
    rmin: float | None = None
    rmax: float | None = None
    node: str | None = None  # producing node (needed for fp16: the node is left unquantized)
    priority: float = 0.0  # larger first
    evidence: dict[str, Any] = field(default_factory=dict)
    group: str | None = None  # the pattern group (replay finding) this entry belongs to
    axis: int | None = None  # per-channel axis of a weight
    encoding: Any = None  # a given weight encoding (from a file), instead of one computed from the weights

    @property
    def bitwidth(self) -> int | None:
        """Bitwidth the override asks for (None: keep)."""
        if self.action == "a8":
            return 8
        return 16 if ("a16" in self.action or self.action == "w16") else None

    @property
    def is_weight(self) -> bool:
        """The override is on a weight (initializer)."""
        return self.action in WEIGHT_ACTIONS

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


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


def _selected(name: str, tensors: Sequence[str] | None) -> bool:
    return not tensors or any(fnmatch.fnmatchcase(name, g) for g in tensors)


def suggest(
    cmp: Any,
    replay: Any = None,
    *,
    ranges: dict[str, tuple[float, float]] | None = None,
    float_model: str | os.PathLike | None = None,
    tensors: Sequence[str] | None = None,
    per_channel: bool = False,
    margin: float = 0.05,
    resolution_db: float = defaults.RESOLUTION_WARN_DB,
    saturation: float = defaults.SATURATION_WARN,
    projector: bool = True,
    preset: str = "a8w8",
    backend: str | None = "qnn",
) -> list[Suggestion]:
    """Override suggestions for the test side of a comparison, most important first.

    Args:
        cmp: reference (float) vs test (quantized) :class:`~ivq_debug.comparator.Comparison`.
        replay: optional :class:`~ivq_debug.diagnose.replay.ReplayResult` of the same QDQ model: its pattern
            groups over budget give group overrides (activations or weights, by which part dominates).
        ranges: calibration ranges ``{tensor: (min, max)}``; the only source of widened ranges.
        float_model: the float model: its weights' per-channel spreads (weight rules) and encodings.
        tensors: only tensors (or weights) matching these globs.
        per_channel: the quantization already has per-channel weights (``ivq tune --per-channel``): a
            weight-dominated group gets 16-bit weights, and no per-channel entry is suggested.
        margin: widen suggested ranges by this share of their span on each side.
        resolution_db: grid SNR below which a tensor gets 16-bit activations.
        saturation: clipped share above which a tensor's range is widened.
        projector: apply the projector-drift rule.
        preset: the quantization the suggestions are added to (its activation bits decide which weight
            precisions the backend runs).
        backend: the deployment backend whose precision table (:mod:`ivq_debug.tune.legal`) every entry must
            respect: a 16-bit weight under an 8-bit activation (illegal on HTP) is paired with a 16-bit activation
            on the op's input (a16w16) when that input's calibrated range is known, else it becomes per-channel
            (when the weights are not already) or is dropped. ``None``: no table.
    """

    t = cmp.table
    by_name: dict[str, Suggestion] = {}
    test_entries = {e.name: e for e in cmp.test.tensors()}
    cal = ranges or {}

    def enc_range(name: str) -> tuple[float, float] | None:
        enc = test_entries.get(name)
        er = encoding_range(enc.encoding) if enc is not None and enc.encoding else None
        return (er[0], er[1]) if er is not None else None

    def add(name: str, action: str, reason: str, priority: float, evidence: dict[str, Any], row: Any,
            group: str | None = None) -> None:
        if not _selected(name, tensors):
            return
        if row.get("op_type") in defaults.VIEW_OPS and "a16" in action:
            # a view op shares its producer's quantization type (ORT's quantizer refuses a different one):
            # the 16-bit request belongs to the producer, which has its own row; a range can still move
            action = "widen" if "widen" in action else ""
            if not action:
                return
        if "widen" in action and not cal:
            reason += " (no calibration ranges given: range kept)"
            action = action.replace("+widen", "").replace("widen", "")
            if not action:
                return
        rng = _range(row["ref_name"], row, cal, margin) if "widen" in action else enc_range(name)
        if rng is None and "widen" in action:
            rng = enc_range(name)
        rng = rng or (None, None)
        cur = by_name.get(name)
        if cur is not None:
            acts = set(cur.action.split("+")) | set(action.split("+"))
            cur.action = "a16+widen" if acts >= {"a16", "widen"} else cur.action
            cur.reason += "; " + reason
            cur.priority = max(cur.priority, priority)
            cur.evidence.update(evidence)
            if "widen" in action and rng[0] is not None:
                cur.rmin, cur.rmax = rng
            cur.group = cur.group or group
            return
        by_name[name] = Suggestion(name, action, reason, rng[0], rng[1], None, priority, dict(evidence), group)

    if not t.empty:
        # one row per tensor: its worst record
        rows = t[t["grid_snr_db"].notna() | t["clipped_fraction"].notna()]
        worst = rows.sort_values("sqnr_db", kind="stable").drop_duplicates("test_name")
        for _, r in worst.iterrows():
            row = r.to_dict()
            er = enc_range(row["test_name"])
            if er is not None:
                row["enc_min"], row["enc_max"] = er
            g, c = row["grid_snr_db"], row["clipped_fraction"]
            if g is not None and not math.isnan(g) and g < resolution_db:
                add(row["test_name"], "a16",
                    f"resolution collapse: the 8-bit step {row['enc_step']:.4g} leaves {g:.1f} dB on the informative "
                    "values", resolution_db - g, {"grid_snr_db": g, "enc_step": row["enc_step"]}, row)
            if c is not None and not math.isnan(c) and c > saturation:
                add(row["test_name"], "widen", f"saturation: {c:.2%} of the reference values fall outside the range",
                    10 * math.log10(1 + 1000 * c), {"clipped_fraction": c}, row)
        if projector and projector_findings(cmp):
            proj = t[t.apply(lambda r: _is(r, PROJECTOR_TOKENS), axis=1)]
            for _, r in proj.drop_duplicates("test_name").iterrows():
                row = r.to_dict()
                er = enc_range(row["test_name"])
                if er is None:
                    continue
                row["enc_min"], row["enc_max"] = er
                add(row["test_name"], "a16+widen",
                    "projector drift: 16-bit activations and the calibration range for every projector tensor",
                    50.0, {"projector": True}, row)
    spreads = _spreads(float_model)
    weights_done: set[str] = set()
    if replay is not None:
        rows_by_tensor = {r["test_name"]: r for r in t.to_dict("records")} if not t.empty else {}
        budget = replay.budget_sqnr_db
        for g in groups(replay.table):
            over = [r for r in g.rows if _finite(r.get("intro_sqnr_db")) < budget]
            if not over:
                continue
            share = (replay.lift or {}).get(g.key, {}).get("share")
            prio = 100.0 * share if share is not None else budget - _finite(g.worst().get("intro_sqnr_db"))
            ws = g.weight_share()
            ev = {"pattern": g.key, "weight_share": ws, "output_error_share": share,
                  "worst_intro_sqnr_db": _finite(g.worst().get("intro_sqnr_db"))}
            weights = sorted({w for r in g.rows for w in str(r.get("weights") or "").split(",") if w})
            if ws >= WEIGHT_DOMINATED and weights:
                for w in weights:
                    sp = spreads.get(w)
                    if sp is None or not _selected(w, tensors) or w in weights_done:
                        continue
                    weights_done.add(w)
                    act = ("w_per_channel" if sp["spread"] >= defaults.WEIGHT_SPREAD_WARN and not per_channel
                           else "w16")
                    by_name[w] = Suggestion(
                        w, act, f"introduced error of {g.label}: {ws:.0%} from the weight encoding; channel "
                        f"ranges spread {sp['spread']:.0f}×", priority=prio, evidence=ev | {"spread": sp["spread"]},
                        group=g.key, axis=sp["axis"], node=sp["node"])
                continue
            for r in g.rows:
                name = r["tensor"]
                rowd = rows_by_tensor.get(name, {"ref_name": name, "op_type": r["op_type"]})
                add(name, "a16", f"introduced error of {g.label} ({len(over)} of {len(g.rows)} over the "
                    f"{budget:g} dB budget): group override", prio, ev | {"intro_sqnr_db": r.get("intro_sqnr_db")},
                    rowd | {"op_type": r["op_type"]}, group=g.key)
                if name in by_name:
                    by_name[name].node = r["node"]
    for w, sp in spreads.items():  # a per-tensor weight whose channels spread this much needs per-channel
        if (not per_channel and sp["spread"] >= defaults.WEIGHT_SPREAD_ERROR and w not in by_name
                and _selected(w, tensors)):
            by_name[w] = Suggestion(w, "w_per_channel", f"weight range spread: output-channel ranges spread "
                                    f"{sp['spread']:.0f}× under one per-tensor scale (smallest channel keeps "
                                    f"{sp['min_bits']:.1f} bits)", priority=10 * math.log10(sp["spread"]),
                                    evidence={"spread": sp["spread"], "min_bits": sp["min_bits"]}, axis=sp["axis"],
                                    node=sp["node"])
    out = sorted(by_name.values(), key=lambda s: -s.priority)
    if backend is not None and float_model is not None:
        out = legalize(out, float_model, preset, backend, enc_range, per_channel)
    return out


def legalize(suggestions: list[Suggestion], float_model: Any, preset: str, backend: str,
             enc_range: Any, per_channel: bool) -> list[Suggestion]:
    """The suggestions made legal on ``backend`` (:func:`suggest`, argument ``backend``)."""
    sug = list(suggestions)
    m = load_float_model(float_model)
    if not forbidden(sug, m, preset, backend):
        return sug
    reader = {n.input[1]: n for n in m.graph.node if n.op_type in WEIGHT_PAIR_OPS and len(n.input) > 1}
    by = {s.tensor: s for s in sug}
    out: list[Suggestion] = []
    for s in sug:
        if not s.is_weight or not forbidden([*out, s], m, preset, backend):
            out.append(s)
            continue
        node = reader.get(s.tensor)
        act = node.input[0] if node is not None else None
        rng = enc_range(act) if act else None
        why = f"{backend.upper()} runs 16-bit weights only under 16-bit activations (a16w16)"
        if act and rng is not None:
            cur = by.get(act)
            if cur is not None and cur in out:
                cur.action = "a16+widen" if "widen" in cur.action else "a16"
                cur.reason += f"; {why}: the input of {node.name}"
            else:
                out.append(Suggestion(act, "a16", f"{why}: the input of {node.name} (16-bit weight {s.tensor})",
                                      rng[0], rng[1], node=None, priority=s.priority, group=s.group))
            out.append(s)
        elif s.action == "w16" and not per_channel:
            out.append(replace(s, action="w_per_channel", reason=s.reason + f"; {why} and the input's range is "
                               "unknown: per-channel instead"))
        if forbidden(out, m, preset, backend):  # still illegal (e.g. a bias): leave the entry out
            out = [x for x in out if x is not s and x.tensor != s.tensor]
    return out


def _finite(x: Any) -> float:
    return math.inf if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _spreads(float_model: Any) -> dict[str, dict[str, Any]]:
    """Per weight of a float model: spread, min bits, channel axis, node (:mod:`~ivq_debug.diagnose.weight_spread`)."""
    if float_model is None:
        return {}
    return {r["weight"]: r for r in weight_spreads(float_model).to_dict("records")}


def filter_suggestions(suggestions: Iterable[Suggestion], tensors: Sequence[str] | None) -> list[Suggestion]:
    """Only the suggestions whose tensor matches one of the globs (all without globs)."""
    return [s for s in suggestions if _selected(s.tensor, tensors)]


# ---------------------------------------------------------------------------------------------- files
def weight_encoding(w: np.ndarray, action: str, axis: int | None) -> Encoding:
    """The symmetric weight encoding of a weight suggestion: per channel (8-bit, one scale per channel of
    ``axis``) or per tensor at 16 bits; unsigned storage (QNN's view), zero point ``2^(bw-1)``. ORT gets it in signed
    storage, zero point 0 (:func:`~ivq_debug.qnn.encodings.to_ort_overrides`): at 16 bits the weight QNN HTP
    computes right (:data:`ivq_debug.qnn.quantize.WEIGHT16`)."""
    w = np.asarray(w, dtype=np.float64)
    if action == "w_per_channel":
        ax = axis if axis is not None else 0
        absmax = np.max(np.abs(np.moveaxis(w, ax, 0).reshape(w.shape[ax], -1)), axis=1)
        bw = 8
    else:
        ax = None
        absmax = np.array([np.max(np.abs(w))])
        bw = 16
    half = (1 << (bw - 1)) - 1
    scale = tuple(float(max(a, 1e-12) / half) for a in absmax)
    return Encoding(bitwidth=bw, dtype="int", symmetric=True, scale=scale, zero_point=(1 << (bw - 1),) * len(scale),
                    signed=False, axis=ax)


def to_encodings(suggestions: list[Suggestion], activation_bits: int = 8, float_model: Any = None) -> EncodingSet:
    """The suggestions as an :class:`~ivq_debug.qnn.encodings.EncodingSet`: activations (16-bit, widened ranges,
    fp16 requests) and weights (per-channel or 16-bit encodings computed from ``float_model``'s weights)."""
    es = EncodingSet(format="legacy")
    weights = [s for s in suggestions if s.is_weight and s.encoding is None]
    arrays: dict[str, np.ndarray] = {}
    if weights:
        if float_model is None:
            raise UsageError("weight overrides need the float model (its weights)")
        m = load_float_model(float_model)
        arrays = constant_arrays(m, {s.tensor for s in weights}, str(Path(float_model).parent))
    for s in suggestions:
        if s.is_weight and s.encoding is not None:
            es.params[s.tensor] = s.encoding
            continue
        if s.is_weight:
            w = arrays.get(s.tensor)
            if w is None:
                raise UsageError(f"weight {s.tensor!r} is not an initializer of the float model")
            es.params[s.tensor] = weight_encoding(w, s.action, s.axis)
            continue
        if s.action == "fp16":
            es.activations[s.tensor] = Encoding(bitwidth=16, dtype="float")
            continue
        if s.rmin is None or s.rmax is None:
            raise UsageError(f"{s.tensor!r}: a {s.action} override needs a range to be written (its calibrated "
                             "encoding is unknown)")
        bw = s.bitwidth or activation_bits
        es.activations[s.tensor] = Encoding(bitwidth=bw, dtype="int", symmetric=False, min=(float(s.rmin),),
                                            max=(float(s.rmax),))
    return es


def write_suggestions(suggestions: list[Suggestion], path: str | os.PathLike, *, fmt: str = "legacy",
                      activation_bits: int = 8, float_model: Any = None, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a ready overrides file (QNN ``legacy`` / ``1.0.0`` or ORT JSON) and ``<stem>.rationale.md``.

    ORT overrides cannot express fp16: with ``fmt="ort"`` the fp16 nodes go to ``<name>.nodes_to_exclude.json``
    (``nodes_to_exclude`` of ORT's quantizer). Returns the overrides and rationale paths.
    """
    if not suggestions:
        raise UsageError("no overrides to write: nothing breaks the thresholds")
    p = Path(path)
    encs = to_encodings([s for s in suggestions if not (fmt == "ort" and s.action == "fp16")], activation_bits,
                        float_model)
    write_encodings(encs, p, format=fmt, overwrite=overwrite)
    side = p.with_name(p.name + EXCLUDE_SUFFIX)
    fp16 = [s.node for s in suggestions if s.action == "fp16" and s.node]
    if fmt == "ort" and fp16:
        atomic_write_text(side, json.dumps({"nodes_to_exclude": fp16}, indent=1) + "\n", overwrite=overwrite)
    elif side.exists() and overwrite:
        side.unlink()
    lines = [f"# Suggested quantization overrides ({p.name})", "",
             "| # | tensor | action | range | group | why |", "|---|---|---|---|---|---|"]
    for i, s in enumerate(suggestions, 1):
        rng = f"[{s.rmin:.4g}, {s.rmax:.4g}]" if s.rmin is not None and s.rmax is not None else (
            "per channel" if s.action == "w_per_channel" else "calibrated")
        lines.append(f"| {i} | `{s.tensor}` | {s.action} | {rng} | {s.group or ''} | {s.reason} |")
    lines += ["", "Ranges come from the calibration data (never the evaluation inputs).", "",
              "Evidence per entry (JSON):", "", "```json",
              json.dumps([s.to_dict() for s in suggestions], indent=1, default=str), "```", ""]
    md = p.with_suffix(".rationale.md")
    atomic_write_text(md, "\n".join(lines), overwrite=overwrite)
    return p, md


def read_overrides(path: str | os.PathLike, model: Any) -> tuple[EncodingSet, list[str]]:
    """An overrides file written by :func:`write_suggestions` (any format) and the nodes it leaves float. An ORT
    file of fp16 entries alone is ``{}`` (the nodes are in its sidecar): an empty set, not "no encodings file"."""
    p = Path(path)
    empty = load_json(p, "overrides file") == {}
    encs = EncodingSet(format="ort", source=str(p)) if empty else read_encodings(p, model=model)
    inits = {i.name for i in model.graph.initializer}
    for name in [n for n in encs.activations if n in inits]:  # ORT files do not say which entries are weights
        encs.params[name] = encs.activations.pop(name)
    return encs, read_exclude_sidecar(p)


def from_encodings(encs: Any, nodes_to_exclude: Sequence[str] = ()) -> list[Suggestion]:
    """Suggestions from an overrides / encodings file (to verify a hand-written file)."""
    out = []
    for name, e in encs.activations.items():
        if e.is_float:
            out.append(Suggestion(name, "fp16", "from file"))
            continue
        lo, hi = (e.grid_range() if e.scale else (e.min, e.max))
        action = "a16" if e.bitwidth == 16 else "a8"
        out.append(Suggestion(name, action, "from file", lo[0] if lo else None, hi[0] if hi else None))
    for name, e in encs.params.items():
        out.append(Suggestion(name, "w_per_channel" if e.per_channel else "w16", "from file", axis=e.axis,
                              encoding=e))
    out += [Suggestion(n, "fp16", "from file (nodes_to_exclude)", node=n) for n in nodes_to_exclude]
    return out
