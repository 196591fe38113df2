"""Findings that summarize a replay: the pattern that matters, its effect on the output, the fix by cause.

A transformer repeats one block, so one bad encoding shows up once per block. Units are grouped by their *role*:
the compute node's name with block indices replaced (``/blocks.3/ln1/Pow`` → ``/blocks.*/ln1/Pow``) and its op
type; units without indexed names stay alone. A group's figures:

- ``units`` and ``over_budget``: members, and members whose introduced SQNR (ranking attribution) breaks the
  budget; ``blocks``: "11 of 12" when the indices are blocks;
- ``worst``: the member with the lowest introduced SQNR, with both attributions ("where it starts");
- ``weight_share``: the noise-weighted share of the over-budget members' error that comes from their weight
  encodings: the sum of those units' measured parts (``replay`` docstring), consistent with the unit rows;
- ``effect``: the counterfactual run of the whole model with the group's over-budget units put back to float
  (:mod:`ivq_debug.diagnose.effect`): ``output_error_share`` (never negative; ``why`` when ≈ 0) and
  ``effect_gain_db``, the final outputs' SQNR gained.

The headline is the group with the largest measured effect (groups not measured follow, by introduced error);
the next groups over budget follow as warnings; the first over-budget unit *of the group* is evidence. The fix is
by cause (:mod:`ivq_debug.diagnose.remedy`), per unit, over the group's over-budget units only, worst first.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding
from ivq_debug.diagnose.remedy import group_remedy, remedies_for

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

    def weight_share(self, rows: list[dict[str, Any]] | None = None) -> float:
        """Noise-weighted weight share of the introduced error of ``rows`` (default: every member; the findings
        use the members over budget, the units the fix changes): the sum of the units' measured parts."""
        rows = self.rows if rows is None else rows
        w = sum(float(r.get("weight_noise") or 0.0) for r in rows)
        a = sum(float(r.get("act_noise") or 0.0) for r in rows)
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


def fix_for(res: Any, over: list[dict[str, Any]]) -> tuple[str, str, dict[str, Any], list[str]]:
    """``(lever, text, override fragment, nodes left float)`` of a group's fix: the remedies by cause of its
    over-budget units (``over``, worst first; :func:`~ivq_debug.diagnose.remedy.group_remedy`)."""
    rs = [r for row in sorted(over, key=lambda r: sortable(r.get("intro_sqnr_db")))
          for r in (remedies_for(res.evidence[row["node"]]) if row["node"] in getattr(res, "evidence", {}) else [])]
    if not rs:
        return "", "no rule matched the evidence (no encoding or weight of these units is known)", {}, []
    lever, text, override, exclude = group_remedy(rs)
    return lever, text + " (not run here: `ivq tune` applies and verifies it)", override, exclude


def _effect_text(e: dict[str, Any] | None, n: int = 2) -> str:
    if not e:
        return ""
    where = f" (measured on {e['backend']}: the replay's backend refused the lifted model)" if e.get("refused") else ""
    if e.get("why"):
        return f"; effect on the output ≈ 0{where}: {e['why']}"
    return (f"; putting {'them' if n > 1 else 'it'} back to float gains {e['gain_db']:+.1f} dB at the output "
            f"(removes {e['share']:.0%} of its error){where}")


def replay_findings(res: Any) -> list[Finding]:
    """The findings of a :class:`~ivq_debug.diagnose.replay.ReplayResult` (module docstring)."""
    t = res.table
    out: list[Finding] = []
    if len(t):
        budget = res.budget_sqnr_db
        gs = groups(t)
        iso_order = [g.key for g in sorted(gs, key=lambda g: sortable(g.worst("iso_sqnr_db").get("iso_sqnr_db")))]
        lifted = res.lift or {}

        def over_of(g: Group) -> list[dict[str, Any]]:
            return [r for r in g.rows if sortable(r.get("intro_sqnr_db")) < budget or r.get("intro_status") == "non_finite"]

        fix_units = (getattr(res, "effects", None) or {}).get("groups") or {}
        evidence = getattr(res, "evidence", None) or {}

        def copies_only(g: Group) -> bool:  # data-movement units repeating their producer's encoding (iso)
            return all(r["op_type"] in defaults.VIEW_OPS and r["node"] in evidence and evidence[r["node"]].copies
                       for r in over_of(g))

        cands = [g for g in gs if (over_of(g) and not copies_only(g)) or g.key in fix_units]
        # the headline: the largest measured effect on the output; groups not measured follow by introduced error
        cands.sort(key=lambda g: (0, -lifted[g.key]["share"], -lifted[g.key]["gain_db"]) if g.key in lifted
                   else (1, 0.0, 0.0))
        for shown, g in enumerate(cands[:MORE_PATTERNS + 1]):
            over = over_of(g)
            within = not over
            if within:  # a unit within the budget whose effect on the output is large (effect_targets.replay_effects)
                over = [r for r in g.rows if r["node"] in set(fix_units[g.key])]
            w = min(over, key=lambda r: sortable(r.get("intro_sqnr_db")))
            kind, text, override, exclude = fix_for(res, over)
            if g.label.startswith("LayerNorm") and kind in ("a16", "fp16"):
                text += "; or export the LayerNorm fused (opset ≥ 17 LayerNormalization) so its statistics stay internal"
            eff = lifted.get(g.key)
            head = shown == 0
            if within:
                msg = (f"{g.label}: {w['tensor']} introduces {_fmt(w['intro_sqnr_db'])} dB, within the budget "
                       f"({budget:g} dB, {res.attribution}), yet costs the output" + _effect_text(eff, 1))
            else:
                msg = (f"{g.label}: {_blocks_text(g, over)} introduce more error than the budget ({budget:g} dB, "
                       f"{res.attribution}); worst {w['tensor']} at {_fmt(w['intro_sqnr_db'])} dB" + _effect_text(eff, len(over)))
            first = min(over, key=lambda r: r.get("order", 0))
            ev = {
                "pattern": g.key, "label": g.label, "units": len(g.rows), "over_budget": 0 if within else len(over),
                "tensors": g.tensors, "fix_tensors": [r["tensor"] for r in over],
                "worst": {k: w.get(k) for k in ("tensor", "node", "intro_sqnr_db", "local_sqnr_db", "iso_sqnr_db",
                                                "cum_sqnr_db", "inherited_share")},
                "weight_share": g.weight_share(over), "output_error_share": eff.get("share") if eff else None,
                "effect_gain_db": eff.get("gain_db") if eff else None, "effect_why": eff.get("why") if eff else None,
                "lift": eff, "fix": kind, "override": override, "exclude_nodes": exclude,
                "attribution": res.attribution, "budget_sqnr_db": budget,
                "iso_rank": iso_order.index(g.key) + 1, "backend": res.backend,
                "approximate": [r["tensor"] for r in g.rows if r.get("approximate")],
                # evidence of this group's own units only: its first unit over budget in execution order
                "first_over_budget": {k: first.get(k) for k in ("tensor", "op_type", "intro_sqnr_db")},
            }
            out.append(Finding(
                "introduced_error", "error" if head else "warning", msg,
                where={"record": res.record, "tensor": w["tensor"], "node": w["node"], "tensors": g.tensors},
                evidence=ev, suggestion=text))
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
