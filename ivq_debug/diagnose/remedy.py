"""A fix by cause: one registered rule per cause, applied per unit (issue 28).

A unit over the introduced-error budget has a *weight* part and an *activation* part (``replay`` docstring). Each
part is tested against the rules of :data:`RULES` in order; the first rule whose cause the evidence shows gives
the part's :class:`Remedy`. Both parts may need one (a unit with bad weights and a clipped output gets two).

=====================  =====================================================  ==================================
cause (rule)           evidence (:class:`UnitEvidence`)                       remedy (lever)
=====================  =====================================================  ==================================
``weight_range``       the weight encoding's grid spans ≥ 2× the weight's     re-quantize that weight from its
                       largest value (a mis-fit scale: steps wasted)           values (``requantize_weight``)
``weight_spread``      per-tensor weight, live output channels spread          per-channel on *that* weight
                       ≥ ``defaults.WEIGHT_SPREAD_WARN`` (dead channels         (``w_per_channel``)
                       counted, left out)
``weight_resolution``  per-channel (or unspread) weight, < 16 bits            16-bit weight, with 16-bit
                                                                               activations around it when they
                                                                               are 8-bit (HTP runs w16 only
                                                                               under a16) (``w16``)
``weight_precision``   16-bit weights already                                 fp16: the node stays float
``clipping``           the output encoding clips > ``SATURATION_WARN`` of     widen / re-calibrate the range to
                       the reference values and the clipping is most of the   the range needed (``widen``), on
                       activation error                                       the tensor and every copy sharing
                                                                               its encoding
``resolution``         < 16-bit output encoding whose grid is most of the     16-bit activation (``a16``), on
                       activation error (always on CPU-QDQ, whose arithmetic   the tensor and its copies
                       is exact)
``precision``          16-bit output encoding already, still over budget      fp16: the node stays float
``arithmetic``         (a non-exact backend) the output encoding fits (grid   fp16: the node stays float
                       SNR well above the unit's activation SQNR): the         (``fp16``)
                       backend's arithmetic
=====================  =====================================================  ==================================

A weight rule never names a bias: the *weight* is the compute node's weight input (``Conv`` / ``Gemm`` /
``ConvTranspose`` input 1, the constant side of a ``MatMul``). A fix the model already has is never given
(16-bit on a 16-bit tensor, per-channel on a per-channel weight): the next rule takes over.

API (stable; the tuner builds its unit candidates from it)::

    ev = unit_evidence(model, table, read, budget)    # {node: UnitEvidence} of the units over budget
    remedies_for(ev[node]) -> list[Remedy]            # the unit's remedies, weight part first when it dominates
    ReplayResult.remedies(node)                       # the same, for the units a replay's findings fix
    group_remedy(remedies) -> (text, override)        # one group fix over its over-budget units' remedies

A :class:`Remedy` carries its ``cause``, ``lever``, ``text``, the ``tensors`` and ``weights`` it names, the
``override`` fragment that applies it (ORT ``TensorQuantOverrides`` form, what ``ivq quantize --overrides`` reads:
``{name: [{"quant_type": "QUInt16"}]}``, ``{weight: [{"axis": 0}]}``, ``{tensor: [{"rmin": .., "rmax": ..}]}``) or
``None`` when the fix is not an override (fp16: ``exclude_nodes`` lists the nodes to leave float), and its
``evidence`` numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.weight_spread import channel_axis, channel_ranges
from ivq_debug.encoding_fit import EncodingAccumulator
from ivq_debug.onnxgraph.sites import QDQ_DOMAINS, constant_arrays, float_name, quant_params
from ivq_debug.qnn.quantize import weight16_override

#: a weight encoding whose grid spans at least this many times the weight's largest magnitude is mis-fit
WEIGHT_RANGE_RATIO = 2.0
#: the output encoding's grid explains the activation part when its SNR is within this of the part's SQNR
GRID_EXPLAINS_DB = 6.0
#: ops whose weight input is input 1 (``MatMul``: the constant side)
WEIGHT_INPUT = {"Conv": 1, "ConvTranspose": 1, "Gemm": 1, "MatMul": 1, "MatMulInteger": 1, "ConvInteger": 1}
#: ORT quant types by (bits, signed)
_QTYPE = {(8, False): "QUInt8", (8, True): "QInt8", (16, False): "QUInt16", (16, True): "QInt16"}


@dataclass
class UnitEvidence:
    """What the rules read about one unit (JSON-able; :func:`unit_evidence` builds it)."""

    node: str
    op_type: str
    tensor: str
    budget_sqnr_db: float
    intro_sqnr_db: float | None
    weight_sqnr_db: float | None = None  # the weight part alone (float activations, quantized weights)
    act_sqnr_db: float | None = None  # the activation part alone (output encoding and arithmetic)
    weight_share: float | None = None
    weight: str | None = None  # the weight input's float name (never the bias)
    bias: str | None = None
    weight_enc: dict[str, Any] | None = None  # bits, signed, per_channel, axis, range_ratio, spread, ...
    out_enc: dict[str, Any] | None = None  # bits, signed, lo, hi, step
    fit: dict[str, Any] | None = None  # clipped_fraction, clip_snr_db, grid_snr_db, ref_min, ref_max
    copies: list[str] = field(default_factory=list)  # tensors sharing the output encoding (Reshape copies, ...)
    inputs: list[str] = field(default_factory=list)  # the unit's quantized activation inputs
    activation_bits: int = 8
    replayed_on: str = ""  # the replay's backend for this unit (CPU-QDQ: exact arithmetic)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @property
    def exact(self) -> bool:
        """Replayed on CPU-QDQ (exact float arithmetic): the activation part is the output encoding's alone (on
        the unit's own float output, whose values may differ from the reference's)."""
        return "cpu" in self.replayed_on

    @property
    def weight_over(self) -> bool:
        """The weight part needs a fix: it dominates, or alone breaks the budget."""
        if not self.weight:
            return False
        if _num(self.weight_sqnr_db) < self.budget_sqnr_db:
            return True
        return (self.weight_share or 0.0) >= 0.5

    @property
    def act_over(self) -> bool:
        """The activation part needs a fix: it dominates, or alone breaks the budget."""
        if _num(self.act_sqnr_db) < self.budget_sqnr_db:
            return True
        return not self.weight or (self.weight_share or 0.0) < 0.5


@dataclass(frozen=True)
class Remedy:
    """One fix for one unit, by cause (module docstring)."""

    cause: str
    lever: str  # requantize_weight, w_per_channel, w16, widen, a16, fp16
    unit: str  # the compute node
    text: str
    tensors: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    override: dict[str, list[dict[str, Any]]] | None = None
    exclude_nodes: tuple[str, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        d = asdict(self)
        d["tensors"], d["weights"], d["exclude_nodes"] = list(self.tensors), list(self.weights), list(self.exclude_nodes)
        return d


@dataclass(frozen=True)
class Rule:
    """One registered rule: a cause of one part (``weight`` / ``activation``) and its remedy."""

    cause: str
    part: str
    apply: Callable[[UnitEvidence], Remedy | None]
    doc: str = ""


RULES: list[Rule] = []


def rule(cause: str, part: str, doc: str = "") -> Callable[[Callable[[UnitEvidence], Remedy | None]], Any]:
    """Register a rule (order of registration = order of trial within its part)."""
    def deco(fn: Callable[[UnitEvidence], Remedy | None]) -> Callable[[UnitEvidence], Remedy | None]:
        RULES.append(Rule(cause, part, fn, doc or (fn.__doc__ or "").strip().splitlines()[0]))
        return fn
    return deco


def _num(x: Any) -> float:
    """A comparable number: None / NaN as +inf (no evidence of a problem)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return math.inf
    return float(x)


def _qtype(bits: int, signed: bool) -> str:
    return _QTYPE.get((bits, signed), "QUInt16" if bits >= 16 else "QUInt8")


def _fmt(x: float) -> str:
    return f"{x:.4g}"


# ------------------------------------------------------------------------------------------- weight rules
@rule("weight_range", "weight")
def _weight_range(ev: UnitEvidence) -> Remedy | None:
    """The weight encoding's grid is much wider than the weight's values: re-quantize the weight."""
    we = ev.weight_enc or {}
    ratio = we.get("range_ratio")
    if ratio is None or ratio < WEIGHT_RANGE_RATIO or we.get("per_channel"):
        return None
    w, bits, signed = str(ev.weight), int(we["bits"]), bool(we.get("signed"))
    amax = float(we["absmax"])
    half = (1 << (bits - 1)) - 1
    scale = amax / half if amax > 0 else 1.0
    zp = 0 if signed else (1 << (bits - 1))
    return Remedy("weight_range", "requantize_weight", ev.node,
                  f"re-quantize {w} from its values: its {bits}-bit encoding spans {ratio:.1f}× its largest value "
                  f"{_fmt(amax)} (scale {_fmt(we['scale'])} → {_fmt(scale)}), so it keeps "
                  f"{math.log2(max(ratio, 1.0)):.1f} bits fewer than it could",
                  weights=(w,), override={w: [{"quant_type": _qtype(bits, signed), "scale": scale,
                                               "zero_point": zp}]},
                  evidence={"range_ratio": ratio, "scale": we["scale"], "absmax": amax})


@rule("weight_spread", "weight")
def _weight_spread(ev: UnitEvidence) -> Remedy | None:
    """A per-tensor weight whose live output channels spread widely: per-channel on that weight."""
    we = ev.weight_enc or {}
    sp = we.get("spread")
    if we.get("per_channel") or sp is None or sp < defaults.WEIGHT_SPREAD_WARN:
        return None
    w = str(ev.weight)
    dead = int(we.get("dead_channels") or 0)
    return Remedy("weight_spread", "w_per_channel", ev.node,
                  f"per-channel weights on {w} (its {we['channels'] - dead} live output channels' ranges spread "
                  f"{sp:.0f}× under one per-tensor scale; the smallest keeps {we['min_bits']:.1f} bits"
                  + (f"; {dead} dead channel(s) left out" if dead else "") + ")",
                  weights=(w,), override={w: [{"axis": int(we["axis"])}]},
                  evidence={"spread": sp, "min_bits": we["min_bits"], "dead_channels": dead, "axis": we["axis"]})


@rule("weight_resolution", "weight")
def _weight_resolution(ev: UnitEvidence) -> Remedy | None:
    """Weights already fitted (per-channel, or channels alike) but too coarse: 16-bit weights (with 16-bit
    activations around the unit when they are 8-bit: HTP runs 16-bit weights only under 16-bit activations)."""
    we = ev.weight_enc or {}
    if int(we.get("bits") or 8) >= 16:
        return None
    w = str(ev.weight)
    over: dict[str, list[dict[str, Any]]] = {w: [weight16_override()]}  # signed symmetric: what HTP computes
    acts: tuple[str, ...] = ()
    text = f"16-bit weights on {w}"
    if ev.activation_bits < 16:
        acts = tuple(dict.fromkeys([*ev.inputs, ev.tensor, *ev.copies]))
        over.update({t: [{"quant_type": "QUInt16"}] for t in acts})
        text += (f" with 16-bit activations on its input(s) and output ({', '.join(acts[:3])}"
                 f"{' …' if len(acts) > 3 else ''}): HTP runs 16-bit weights only under 16-bit activations")
    return Remedy("weight_resolution", "w16", ev.node, text, tensors=acts, weights=(w,), override=over,
                  evidence={"weight_sqnr_db": ev.weight_sqnr_db, "per_channel": bool(we.get("per_channel"))})


@rule("weight_precision", "weight")
def _weight_precision(ev: UnitEvidence) -> Remedy | None:
    """16-bit weights that still break the budget: leave the node float (fp16)."""
    return Remedy("weight_precision", "fp16", ev.node,
                  f"fp16 for {ev.node} (its weight {ev.weight} is 16-bit already and still introduces "
                  f"{_num(ev.weight_sqnr_db):.1f} dB): leave the node unquantized", weights=(str(ev.weight),),
                  exclude_nodes=(ev.node,), evidence={"weight_sqnr_db": ev.weight_sqnr_db})


# ------------------------------------------------------------------------------------------- activation rules
def _family(ev: UnitEvidence) -> tuple[str, ...]:
    return tuple(dict.fromkeys([ev.tensor, *ev.copies]))


@rule("clipping", "activation")
def _clipping(ev: UnitEvidence) -> Remedy | None:
    """The output encoding clips the reference values: widen / re-calibrate the range to the one needed."""
    fit, enc = ev.fit or {}, ev.out_enc or {}
    cf = fit.get("clipped_fraction")
    if cf is None or cf <= defaults.SATURATION_WARN or not enc:
        return None
    clip = _num(fit.get("clip_snr_db"))
    # the clipping is the activation part's cause when it throws away at least as much as the part loses
    if clip > _num(ev.act_sqnr_db) + GRID_EXPLAINS_DB and clip >= defaults.SATURATION_WARN_CLIP_SNR_DB:
        return None
    lo, hi = min(float(fit["ref_min"]), enc["lo"]), max(float(fit["ref_max"]), enc["hi"])
    fam = _family(ev)
    copies = f" and the {len(fam) - 1} tensor(s) sharing its encoding ({', '.join(fam[1:3])}" \
             f"{' …' if len(fam) > 3 else ''})" if len(fam) > 1 else ""
    return Remedy("clipping", "widen", ev.node,
                  f"widen / re-calibrate the range of {ev.tensor}{copies} to [{_fmt(lo)}, {_fmt(hi)}]: its encoding "
                  f"holds [{_fmt(enc['lo'])}, {_fmt(enc['hi'])}] and clips {cf:.1%} of the reference values "
                  f"(clipping SNR {clip:.1f} dB); the calibration data must reach that range",
                  tensors=fam, override={t: [{"rmin": lo, "rmax": hi}] for t in fam},
                  evidence={"clipped_fraction": cf, "clip_snr_db": fit.get("clip_snr_db"), "needed": [lo, hi],
                            "encoding": [enc["lo"], enc["hi"]]})


@rule("resolution", "activation")
def _resolution(ev: UnitEvidence) -> Remedy | None:
    """An output encoding too coarse for its values (< 16 bits): 16-bit activation."""
    fit, enc = ev.fit or {}, ev.out_enc or {}
    if not enc or int(enc.get("bits") or 8) >= 16:
        return None
    grid = _num(fit.get("grid_snr_db"))
    if not ev.exact and grid > _num(ev.act_sqnr_db) + GRID_EXPLAINS_DB and grid >= defaults.RESOLUTION_WARN_DB:
        return None  # the grid fits the reference values and the backend's arithmetic is not exact: not resolution
    fam = _family(ev)
    return Remedy("resolution", "a16", ev.node,
                  f"16-bit activations on {ev.tensor}" + (f" and its {len(fam) - 1} copies ({', '.join(fam[1:3])}"
                                                           f"{' …' if len(fam) > 3 else ''})" if len(fam) > 1 else "")
                  + f" (its {enc['bits']}-bit step {_fmt(enc['step'])} leaves "
                  + (f"{_num(ev.act_sqnr_db):.1f} dB on the unit's output)" if ev.exact else f"{grid:.1f} dB on its values)"),
                  tensors=fam, override={t: [{"quant_type": "QUInt16"}] for t in fam},
                  evidence={"grid_snr_db": fit.get("grid_snr_db"), "step": enc.get("step"), "bits": enc.get("bits")})


@rule("precision", "activation")
def _precision(ev: UnitEvidence) -> Remedy | None:
    """A 16-bit output encoding still too coarse: fp16 (the node stays float)."""
    enc = ev.out_enc or {}
    if not enc or int(enc.get("bits") or 8) < 16:
        return None
    grid = _num((ev.fit or {}).get("grid_snr_db"))
    if not ev.exact and grid > _num(ev.act_sqnr_db) + GRID_EXPLAINS_DB:
        return None
    return Remedy("precision", "fp16", ev.node,
                  f"fp16 for {ev.node}: its output {ev.tensor} is 16-bit already ({grid:.1f} dB on its values); "
                  "leave the node unquantized", tensors=(ev.tensor,), exclude_nodes=(ev.node,),
                  evidence={"grid_snr_db": (ev.fit or {}).get("grid_snr_db"), "bits": enc.get("bits")})


@rule("arithmetic", "activation")
def _arithmetic(ev: UnitEvidence) -> Remedy | None:
    """The output encoding fits its values but the unit still loses: the backend's arithmetic; fp16."""
    return Remedy("arithmetic", "fp16", ev.node,
                  f"fp16 for {ev.node}: its output encoding fits its values "
                  f"({_num((ev.fit or {}).get('grid_snr_db')):.1f} dB) but the unit introduces "
                  f"{_num(ev.act_sqnr_db):.1f} dB in its arithmetic; leave the node unquantized",
                  tensors=(ev.tensor,), exclude_nodes=(ev.node,),
                  evidence={"grid_snr_db": (ev.fit or {}).get("grid_snr_db"), "act_sqnr_db": ev.act_sqnr_db})


def over_budget(ev: UnitEvidence) -> bool:
    """The unit's introduced SQNR is below its budget."""
    return _num(ev.intro_sqnr_db) < ev.budget_sqnr_db


def remedies_for(ev: UnitEvidence) -> list[Remedy]:
    """The unit's remedies: the first rule that applies per part that needs a fix (the dominant part first)."""
    parts = [p for p, need in (("weight", ev.weight_over), ("activation", ev.act_over)) if need]
    if (ev.weight_share or 0.0) < 0.5:
        parts.reverse()
    out = []
    for part in parts:
        for r in RULES:
            if r.part != part:
                continue
            got = r.apply(ev)
            if got is not None:
                out.append(got)
                break
    if not out and parts:  # no rule of the needed part applies (no weight encoding known): the other part
        other = "activation" if parts == ["weight"] else "weight"
        for r in RULES:
            if r.part == other and (got := r.apply(ev)) is not None:
                out.append(got)
                break
    return out


# ------------------------------------------------------------------------------------------- groups
#: the order levers are listed in a group fix
_LEVER_ORDER = ("requantize_weight", "w_per_channel", "widen", "a16", "w16", "fp16")
_LEVER_TEXT = {"requantize_weight": "re-quantize from their values", "w_per_channel": "per-channel weights on",
               "w16": "16-bit weights on", "widen": "widen / re-calibrate the range of", "a16": "16-bit activations on",
               "fp16": "fp16 (left float):"}


def group_remedy(remedies: Iterable[Remedy]) -> tuple[str, str, dict[str, list[dict[str, Any]]], list[str]]:
    """One fix for a group from its over-budget units' remedies (worst unit first): ``(lever of the first,
    text, merged override fragment, nodes to leave float)``. The text names each lever's weights / tensors in
    the order given (culprits first), up to four each."""
    rs = list(remedies)
    if not rs:
        return "", "", {}, []
    by: dict[str, list[str]] = {}
    causes: dict[str, set[str]] = {}
    override: dict[str, list[dict[str, Any]]] = {}
    exclude: list[str] = []
    for r in rs:
        names = list(r.weights) if r.lever in ("requantize_weight", "w_per_channel", "w16") else (
            list(r.exclude_nodes) if r.lever == "fp16" else list(r.tensors[:1]))
        lst = by.setdefault(r.lever, [])
        lst.extend(n for n in names if n not in lst)
        causes.setdefault(r.lever, set()).add(r.cause)
        for k, v in (r.override or {}).items():
            override.setdefault(k, v)
        exclude.extend(n for n in r.exclude_nodes if n not in exclude)
    parts = []
    for lever in sorted(by, key=lambda x: (_LEVER_ORDER.index(x) if x in _LEVER_ORDER else 99)):
        names = by[lever]
        parts.append(f"{_LEVER_TEXT.get(lever, lever)} {', '.join(names[:4])}{' …' if len(names) > 4 else ''} "
                     f"({'/'.join(sorted(causes[lever]))})")
    if len(rs) == 1:
        return rs[0].lever, rs[0].text, override, exclude
    return rs[0].lever, "; ".join(parts), override, exclude


# ------------------------------------------------------------------------------------------- evidence
def _weight_input(model_node: Any, weights_dq: dict[str, str]) -> tuple[str | None, str | None]:
    """(weight, bias) float names of a compute node: the weight input (never the bias), its bias when any."""
    ins = list(model_node.input)
    w = b = None
    idx = WEIGHT_INPUT.get(model_node.op_type)
    if idx is not None and len(ins) > idx and ins[idx] in weights_dq:
        w = weights_dq[ins[idx]]
    elif model_node.op_type == "MatMul" and ins and ins[0] in weights_dq:
        w = weights_dq[ins[0]]
    if model_node.op_type in ("Conv", "ConvTranspose", "Gemm") and len(ins) > 2 and ins[2] in weights_dq:
        b = weights_dq[ins[2]]
    if w is None:  # other ops with a quantized constant (Mul by a scale, LayerNorm gamma): the first one
        w = next((weights_dq[x] for x in ins if x in weights_dq), None)
    return w, b


def _weight_enc(node: Any, dq: Any, arrays: dict[str, np.ndarray], floats: dict[str, np.ndarray]) -> dict[str, Any]:
    q = arrays[dq.input[0]]
    qp = quant_params(dq, arrays)
    name = float_name(dq.input[0]).removesuffix("_quantized")
    zp = qp.zero_point.astype(np.float64) if qp.zero_point is not None else np.zeros(())
    sc = qp.scale.astype(np.float64)
    per = qp.axis is not None and sc.size > 1
    if per:
        shape = [1] * q.ndim
        shape[qp.axis] = sc.size
        wq = (q.astype(np.float64) - zp.reshape(shape)) * sc.reshape(shape)
    else:
        wq = (q.astype(np.float64) - zp) * sc
    wf = floats.get(name)
    w = wf.astype(np.float64) if wf is not None and wf.shape == q.shape else wq
    info = np.iinfo(q.dtype)
    out: dict[str, Any] = {"bits": qp.bitwidth, "signed": q.dtype.kind == "i", "per_channel": per,
                           "scale": float(np.max(sc)), "float_values": wf is not None}
    amax = float(np.max(np.abs(w))) if w.size else 0.0
    out["absmax"] = amax
    if not per and amax > 0:
        z = float(np.asarray(zp).reshape(-1)[0])
        grid = max(info.max - z, z - info.min) * float(sc.reshape(-1)[0])
        out["range_ratio"] = grid / amax
    if w.ndim >= 2 and node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
        axis = channel_axis(node, w.ndim)
        ranges, live = channel_ranges(w, axis)
        out.update(axis=axis, channels=int(ranges.size), dead_channels=int(ranges.size - live.sum()))
        if live.any():
            nz = ranges[live]
            step = float(np.max(sc))
            out["spread"] = float(nz.max() / nz.min())
            out["min_bits"] = max(math.log2(max(float(nz.min()) / step, 1e-30)) + 1.0, 0.0) if step > 0 else None
    return out


def unit_evidence(model: Any, table: Any, read: Callable[[str], np.ndarray | None], budget_sqnr_db: float, *,
                  nodes: Iterable[str] | None = None, base_dir: str = "",
                  float_weights: dict[str, np.ndarray] | None = None, copies: dict[str, list[str]] | None = None,
                  activation_bits: int = 8) -> dict[str, UnitEvidence]:
    """The :class:`UnitEvidence` of the units of a replay table (``nodes``, default those over the budget).

    ``read(tensor)`` gives a unit output's reference values (``None``: unknown, no encoding fit); ``float_weights``
    the float model's weights by name (default: the QDQ model's own dequantized weights); ``copies`` the tensors
    sharing each tensor's encoding (:func:`~ivq_debug.diagnose.effect.shared_encodings`).
    """
    rows = table.to_dict("records") if len(table) else []
    want = set(nodes) if nodes is not None else {
        r["node"] for r in rows if _num(r.get("intro_sqnr_db")) < budget_sqnr_db or r.get("intro_status") == "non_finite"}
    rows = [r for r in rows if r["node"] in want]
    if not rows:
        return {}
    by_name = {n.name: n for n in model.graph.node}
    producer = {o: n for n in model.graph.node for o in n.output if o}
    consumers: dict[str, list[Any]] = {}
    for n in model.graph.node:
        for x in n.input:
            consumers.setdefault(x, []).append(n)
    inits = {i.name for i in model.graph.initializer}
    need: set[str] = set()
    for r in rows:
        n = by_name.get(r["node"])
        for x in (n.input if n is not None else []):
            p = producer.get(x)
            if p is not None and p.op_type == "DequantizeLinear" and p.domain in QDQ_DOMAINS:
                need.update(y for y in p.input if y)
                q = producer.get(p.input[0])
                if q is not None and q.op_type == "QuantizeLinear":
                    need.update(y for y in q.input[1:] if y)
        for o in (n.output[:1] if n is not None else []):
            for q in consumers.get(o, []):
                if q.op_type == "QuantizeLinear":
                    need.update(y for y in q.input[1:] if y)
    arrays = constant_arrays(model, need, base_dir)
    out: dict[str, UnitEvidence] = {}
    for r in rows:
        n = by_name.get(r["node"])
        if n is None:
            continue
        signal = float(r.get("signal") or 0.0)
        act = float(r.get("act_noise") or 0.0)
        ev = UnitEvidence(r["node"], r["op_type"], r["tensor"], float(budget_sqnr_db), r.get("intro_sqnr_db"),
                          weight_sqnr_db=r.get("weight_sqnr_db"), weight_share=r.get("weight_share"),
                          act_sqnr_db=(10 * math.log10(signal / act) if act > 0 and signal > 0 else
                                       (math.inf if signal > 0 else None)),
                          copies=[c for c in (copies or {}).get(r["tensor"], []) if c != r["tensor"]],
                          activation_bits=activation_bits, replayed_on=str(r.get("replayed_on") or ""))
        weights_dq: dict[str, str] = {}
        for x in n.input:
            p = producer.get(x)
            if p is None or p.op_type != "DequantizeLinear" or p.domain not in QDQ_DOMAINS:
                continue
            if p.input[0] in inits:
                weights_dq[x] = float_name(p.input[0]).removesuffix("_quantized")
                continue
            q = producer.get(p.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                ev.inputs.append(float_name(q.input[0]))
        ev.weight, ev.bias = _weight_input(n, weights_dq)
        if ev.weight is not None:
            dq = next(producer[x] for x, w in weights_dq.items() if w == ev.weight)
            if dq.input[0] in arrays and quant_params(dq, arrays) is not None:
                ev.weight_enc = _weight_enc(n, dq, arrays, float_weights or {})
        outq = next((q for q in consumers.get(n.output[0], []) if q.op_type == "QuantizeLinear"), None)
        qp = quant_params(outq, arrays) if outq is not None else None
        if qp is not None and qp.is_integer and qp.axis is None:
            enc = qp.encoding()
            acc = EncodingAccumulator.for_encoding(enc)
            if acc is not None:
                ev.out_enc = {"bits": qp.bitwidth, "signed": enc["qmin"] < 0, "lo": acc.lo, "hi": acc.hi,
                              "step": acc.step}
                v = read(r["tensor"])
                if v is not None and v.size:
                    vf = np.asarray(v, np.float64).reshape(-1)
                    acc.update(vf)
                    fit = acc.result()
                    fin = vf[np.isfinite(vf)]
                    fit["ref_min"] = float(fin.min()) if fin.size else None
                    fit["ref_max"] = float(fin.max()) if fin.size else None
                    ev.fit = fit
        out[r["node"]] = ev
    return out
