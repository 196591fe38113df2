"""Findings that summarize a replay: the worst introducer's *pattern*, its share of the output error, the fix.

A transformer repeats one block, so one bad encoding shows up once per block. Units are grouped by their *role*:
the compute node's name with block indices replaced (``/blocks.3/ln1/Pow`` → ``/blocks.*/ln1/Pow``) and its op
type; units without indexed names stay alone. A group's figures:

- ``units`` and ``over_budget``: members, and members whose introduced SQNR (ranking attribution) breaks the
  budget; ``blocks``: "11 of 12" when the indices are blocks;
- ``worst``: the member with the lowest introduced SQNR, with both attributions;
- ``weight_share``: the noise-weighted share of the members' error that comes from their weight encodings
  (``replay`` docstring);
- ``output_error_share``: the share of the model's final-output error noise power that disappears when the
  group's encodings (outputs, and weights when the float weights are known) are lifted to float, measured on
  CPU fake-quant with the first record's inputs (:func:`measure_lift`; ``None`` when not measured).

The headline finding names the group of the worst introducer (by the ranking attribution, ``local`` by
default); the next groups over budget follow as warnings; "the first unit over budget" is evidence. The fix
follows the evidence: weight-dominated → per-channel weights (when the weight's per-channel range spread is
large, :mod:`ivq_debug.diagnose.weight_spread`) or 16-bit weights; activation-dominated → 16-bit activations
on the group's tensors (fp16 when 16-bit is not enough), and for the LayerNorm statistics a fused
``LayerNormalization`` (opset 17).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.capture.base import make_runner
from ivq_debug.diagnose.findings import Finding
from ivq_debug.diagnose.graphs import typed_inputs, unit_value
from ivq_debug.onnxgraph.intake import load_float_model
from ivq_debug.onnxgraph.load import load
from ivq_debug.onnxgraph.sites import QDQ_DOMAINS, float_name, floors_at_zero

#: the number of groups whose output share :func:`measure_lift` measures (one CPU run of a merged model holding
#: the QDQ model once per group, plus once as it is)
LIFT_GROUPS = 2
#: a group is weight-dominated above this weight share
WEIGHT_DOMINATED = 0.5
#: extra pattern findings after the headline
MORE_PATTERNS = 4

#: a block index: a whole path component (``layers.3/``, ``/h/3/``)
_INDEX = re.compile(r"(?<=[./])(\d+)(?=[./]|$)")
_NORM = re.compile(r"(^|[/._])(ln\w*|\w*norm\w*|layer_?norm\w*)([/._]|$)", re.I)
_LN_ROLES = {"Pow": "x²", "Sub": "x − mean", "Sqrt": "std", "Div": "normalize", "Mul": "scale"}


def role(name: str) -> tuple[str, tuple[str, ...]]:
    """A node name with its block indices replaced by ``*``, and the indices (``("3",)``)."""
    idx: list[str] = []

    def sub(m: re.Match[str]) -> str:
        idx.append(m.group(1))
        return "*"

    return _INDEX.sub(sub, name), tuple(idx)


@dataclass
class Group:
    """Units that repeat one pattern."""

    key: str
    op_type: str
    label: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    indices: list[tuple[str, ...]] = field(default_factory=list)
    total_blocks: int = 0  # distinct block indices in the model

    @property
    def tensors(self) -> list[str]:
        """Member output tensors, in execution order."""
        return [r["tensor"] for r in self.rows]

    def worst(self, col: str = "intro_sqnr_db") -> dict[str, Any]:
        """The member with the lowest SQNR in ``col``."""
        return min(self.rows, key=lambda r: sortable(r.get(col)))

    def weight_share(self) -> float:
        """Noise-weighted weight share of the members' introduced error."""
        w = sum(float(r.get("weight_noise") or 0.0) for r in self.rows)
        a = sum(float(r.get("act_noise") or 0.0) for r in self.rows)
        return w / (w + a) if (w + a) > 0 else 0.0


def sortable(x: Any) -> float:
    """A sortable SQNR: None and NaN last (+inf)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return math.inf
    return float(x)


def _label(key: str, op_type: str, input_ops: str = "") -> str:
    ins = set(input_ops.split(",")) if input_ops else set()
    if _NORM.search(key):
        what = _LN_ROLES.get(op_type)
        if op_type == "ReduceMean":
            what = "variance" if "Pow" in ins or "Mul" in ins else "mean"
        elif op_type == "Add":
            what = "variance + ε" if "ReduceMean" in ins else "bias"
        if what:
            return f"LayerNorm {what} ({op_type})"
    return f"{op_type} at {key}"


def groups(table: Any) -> list[Group]:
    """The replay table's units grouped by role (:func:`role`; the LayerNorm statistics of every norm of the
    model form one group per step), in order of their worst member (ranking attribution)."""
    out: dict[str, Group] = {}
    rows = table.to_dict("records") if len(table) else []
    blocks: set[str] = set()
    for r in rows:
        key, idx = role(str(r["node"]) or str(r["tensor"]))
        label = _label(key, r["op_type"], str(r.get("input_ops") or ""))
        k = label if label.startswith("LayerNorm") else f"{r['op_type']}|{key}"
        g = out.get(k)
        if g is None:
            g = out[k] = Group(k, r["op_type"], label)
        g.rows.append(r)
        g.indices.append(idx)
        if idx:
            blocks.add(idx[0])
    for g in out.values():
        g.total_blocks = len(blocks)
    return sorted(out.values(), key=lambda g: sortable(g.worst().get("intro_sqnr_db")))


def _blocks_text(g: Group, over: list[dict[str, Any]]) -> str:
    ids = {id(r) for r in over}
    idx = {i[0] for r, i in zip(g.rows, g.indices, strict=True) if i and id(r) in ids}
    units = f"{len(over)} of {len(g.rows)} unit{'s' if len(g.rows) != 1 else ''}"
    if g.total_blocks > 1 and idx:
        return f"{units} in {len(idx)} of {g.total_blocks} blocks"
    return units


def fix_for(g: Group, spread: dict[str, float] | None = None) -> tuple[str, str]:
    """``(kind, text)`` of the fix the evidence points to (kinds: ``w_per_channel``, ``w16``, ``a16``)."""
    ws = g.weight_share()
    weights = sorted({w for r in g.rows for w in str(r.get("weights") or "").split(",") if w})
    if ws >= WEIGHT_DOMINATED and weights:
        sp = max((spread or {}).get(w, 0.0) for w in weights)
        if sp >= defaults.WEIGHT_SPREAD_WARN:
            return "w_per_channel", (f"per-channel weights for {', '.join(weights[:4])}"
                                     f"{' …' if len(weights) > 4 else ''} (their channel ranges spread {sp:.0f}×; "
                                     "`ivq quantize --per-channel`, or `ivq tune`)")
        return "w16", (f"16-bit weights for {', '.join(weights[:4])}{' …' if len(weights) > 4 else ''} "
                       "(or per-channel; `ivq tune` verifies both)")
    text = (f"16-bit activations on these {len(g.rows)} tensor(s) (fp16 if 16-bit is not enough); "
            "`ivq tune` writes and verifies the group's overrides")
    if g.label.startswith("LayerNorm"):
        text += "; or export the LayerNorm fused (opset ≥ 17 LayerNormalization) so its statistics stay internal"
    return "a16", text


def replay_findings(res: Any, spread: dict[str, float] | None = None) -> list[Finding]:
    """The findings of a :class:`~ivq_debug.diagnose.replay.ReplayResult` (module docstring)."""
    t = res.table
    out: list[Finding] = []
    if len(t):
        budget = res.budget_sqnr_db
        gs = groups(t)
        iso_order = [g.key for g in sorted(gs, key=lambda g: sortable(g.worst("iso_sqnr_db").get("iso_sqnr_db")))]
        fb = res.first_breaking
        shown = 0
        for g in gs:
            over = [r for r in g.rows if sortable(r.get("intro_sqnr_db")) < budget or r.get("intro_status") == "non_finite"]
            if not over:
                continue
            w = g.worst()
            kind, text = fix_for(g, spread)
            share = (res.lift or {}).get(g.key)
            head = shown == 0
            msg = (f"{g.label}: {_blocks_text(g, over)} introduce more error than the budget ({budget:g} dB, "
                   f"{res.attribution}); worst {w['tensor']} at {_fmt(w['intro_sqnr_db'])} dB")
            if share is not None and share.get("share") is not None:
                msg += f"; lifting them removes {share['share']:.0%} of the output error"
            ev = {
                "pattern": g.key, "label": g.label, "units": len(g.rows), "over_budget": len(over),
                "tensors": g.tensors, "worst": {k: w.get(k) for k in ("tensor", "node", "intro_sqnr_db",
                                                                        "local_sqnr_db", "iso_sqnr_db",
                                                                        "cum_sqnr_db", "inherited_share")},
                "weight_share": g.weight_share(), "output_error_share": share.get("share") if share else None,
                "lift": share, "fix": kind, "attribution": res.attribution, "budget_sqnr_db": budget,
                "iso_rank": iso_order.index(g.key) + 1, "backend": res.backend,
                "approximate": [r["tensor"] for r in g.rows if r.get("approximate")],
            }
            if head and fb is not None:
                ev["first_over_budget"] = {k: fb.get(k) for k in ("tensor", "op_type", "intro_sqnr_db")}
            out.append(Finding(
                "introduced_error", "error" if head else "warning", msg,
                where={"record": res.record, "tensor": w["tensor"], "node": w["node"], "tensors": g.tensors},
                evidence=ev, suggestion=text))
            shown += 1
            if shown > MORE_PATTERNS:
                break
    approx = [r for r in (t.to_dict("records") if len(t) else []) if r.get("approximate")]
    if approx:
        out.append(Finding(
            "replay_approximate", "info",
            f"{len(approx)} unit(s) are fused in the full graph: isolated attribution approximate "
            f"({', '.join(r['tensor'] for r in approx[:5])}{' …' if len(approx) > 5 else ''})",
            where={"record": res.record, "tensor": approx[0]["tensor"], "tensors": [r["tensor"] for r in approx]},
            evidence={"units": [{k: r.get(k) for k in ("tensor", "op_type", "selfcheck_steps", "selfcheck_share")}
                                for r in approx],
                      "tolerance_steps": defaults.REPLAY_SELFCHECK_STEPS, "backend": res.backend},
            suggestion="the backend computes these units differently inside the full graph than alone (fusion); "
                       "their introduced error is an estimate"))
    return out


def _fmt(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{float(x):.1f}"


# ------------------------------------------------------------------------------------------ output share
def _lifted_nodes(model: Any, const: set[str], tensors: set[str], floats: dict[str, np.ndarray], prefix: str,
                  shared: bool, base_dir: str = "") -> tuple[list[Any], list[Any]]:
    """The model's nodes renamed with ``prefix``, with the activation encodings of ``tensors`` and the weight
    DequantizeLinear of the weights in ``floats`` bypassed; constant nodes only when ``shared`` (they are
    shared by every variant). Returns (nodes, extra initializers)."""
    import onnx
    from onnx import numpy_helper

    inputs = {i.name for i in model.graph.input}
    producer = {o: n for n in model.graph.node for o in n.output if o}
    lifted_w = {n.output[0]: n.input[0].removesuffix("_quantized") for n in model.graph.node
                if n.op_type == "DequantizeLinear" and n.domain in QDQ_DOMAINS and n.input and n.input[0] in const
                and n.input[0].removesuffix("_quantized") in floats}

    def ren(x: str) -> str:
        if x in lifted_w:
            return unit_value(prefix, x)
        return x if (not x or x in const or x in inputs) else unit_value(prefix, x)

    extra: list[Any] = []
    nodes = []
    for n in model.graph.node:
        if n.output and n.output[0] in lifted_w:
            init = numpy_helper.from_array(np.asarray(floats[lifted_w[n.output[0]]], np.float32),
                                           f"{prefix}float:{lifted_w[n.output[0]]}")
            extra.append(init)
            nodes.append(onnx.NodeProto(op_type="Identity", name=unit_value(prefix, n.name), input=[init.name],
                                        output=[ren(n.output[0])]))
            continue
        if all((not o) or o in const for o in n.output):
            if shared:
                nodes.append(n)
            continue
        if n.op_type == "DequantizeLinear" and n.domain in QDQ_DOMAINS and n.input:
            q = producer.get(n.input[0])
            src = q.input[0] if q is not None and q.op_type == "QuantizeLinear" else None
            if src is not None and float_name(src) in tensors:  # lifted: float, with the ReLU a Q may hold
                nodes.append(onnx.NodeProto(op_type="Relu" if floors_at_zero(q, model, base_dir) else "Identity",
                                            name=unit_value(prefix, n.name), input=[ren(src)],
                                            output=[ren(n.output[0])]))
                continue
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = unit_value(prefix, n.name)
        del c.input[:]
        del c.output[:]
        c.input.extend(ren(x) for x in n.input)
        c.output.extend(ren(o) for o in n.output)
        nodes.append(c)
    return nodes, extra


def measure_lift(qdq_model: Any, ref: Any, rid: str, gs: list[Group], *, float_model: Any = None
                 ) -> dict[str, dict[str, Any]]:
    """Output-error share of each group: ``1 − P(lifted) / P(all)`` of the final outputs (module docstring).

    All variants run side by side in one CPU model (one session, one run; the model goes to the runner in memory).
    ``qdq_model`` and ``float_model``: paths or loaded :class:`~ivq_debug.onnxgraph.load.Model` objects. Returns
    ``{group key: {"share", "weights_lifted", "outputs"}}``; empty when the reference record lacks the model
    inputs or outputs.
    """
    import onnx
    from onnx import numpy_helper

    qdq = load(qdq_model)
    model = qdq.proto
    g_in = [i.name for i in model.graph.input if i.name not in {x.name for x in model.graph.initializer}]
    g_out = [o.name for o in model.graph.output]
    ins = {e.name: e for e in ref.tensors(rid, kind="input")}
    outs = {e.name: e for e in ref.tensors(rid)} | ins
    if not gs or any(n not in ins for n in g_in) or not any(n in outs for n in g_out):
        return {}
    g_out = [n for n in g_out if n in outs]
    floats: dict[str, np.ndarray] = {}
    if float_model is not None:
        fmodel = load(float_model)
        fm = load_float_model(fmodel)
        floats = {i.name: numpy_helper.to_array(i, fmodel.base_dir) for i in fm.graph.initializer}
    const, _ = qdq.constants
    variants: list[tuple[str, set[str], dict[str, np.ndarray]]] = [("base", set(), {})]
    for g in gs[:LIFT_GROUPS]:
        ws = {w for r in g.rows for w in str(r.get("weights") or "").split(",") if w}
        variants.append((g.key, set(g.tensors), {w: floats[w] for w in ws if w in floats}))
    m = onnx.ModelProto()
    m.CopyFrom(model)
    gr = m.graph
    del gr.node[:]
    del gr.output[:]
    del gr.value_info[:]
    for v, (_, tensors, fl) in enumerate(variants):
        nodes, extra = _lifted_nodes(model, const, tensors, fl, f"v{v}::", shared=v == 0, base_dir=qdq.base_dir)
        gr.node.extend(nodes)
        gr.initializer.extend(extra)
        for o in g_out:
            name = o if o in const else unit_value(f"v{v}::", o)
            gr.node.append(onnx.NodeProto(op_type="Identity", name=f"v{v}::out::{o}", input=[name],
                                          output=[f"v{v}::out::{o}"]))
            gr.output.append(onnx.ValueInfoProto(name=f"v{v}::out::{o}"))
    feeds = {n: ref.read(ins[n]) for n in g_in}
    typed_inputs(m, feeds)
    with make_runner("onnx", qdq.derive(m), optimization="disable") as runner:
        res = runner.run(feeds)
    want = {o: ref.read(outs[o]).astype(np.float64).reshape(-1) for o in g_out}

    def power(v: int) -> float:
        return float(sum(np.sum((res[f"v{v}::out::{o}"].astype(np.float64).reshape(-1) - want[o]) ** 2)
                         for o in g_out))

    p_all = power(0)
    out: dict[str, dict[str, Any]] = {}
    for v, (key, _tensors, fl) in enumerate(variants[1:], 1):
        p = power(v)
        out[key] = {"share": (1.0 - p / p_all) if p_all > 0 else None, "weights_lifted": sorted(fl),
                    "outputs": g_out, "noise_all": p_all, "noise_lifted": p}
    return out
