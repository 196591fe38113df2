"""The replay's counterfactual step (issue 28): which targets a replay table chooses (:func:`effect_plan`: the
worst groups over budget and the worst units, from the ranking columns only), the remedies' evidence, and the
measured effects written back into the table (:func:`replay_effects`). The runs themselves:
:mod:`~ivq_debug.diagnose.effect`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.effect import (
    EFFECT_GROUPS,
    EFFECT_MATTERS,
    EFFECT_UNITS,
    Target,
    float_weights,
    measure_effects,
    shared_encodings,
    why_small,
)
from ivq_debug.diagnose.patterns import groups, sortable
from ivq_debug.diagnose.remedy import unit_evidence
from ivq_debug.diagnose.units import activation_bits
from ivq_debug.executor import Executor
from ivq_debug.onnxgraph.load import Model


def _over(rows: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    return [r for r in rows if sortable(r.get("intro_sqnr_db")) < budget or r.get("intro_status") == "non_finite"]


def is_copy(row: dict[str, Any], copies: dict[str, list[str]]) -> bool:
    """A data-movement unit whose output shares its encoding with another tensor (its producer's): its error is
    that encoding's, charged to the producer (``iso`` repeats it); never a target nor a candidate of its own."""
    return row.get("op_type") in defaults.VIEW_OPS and len(copies.get(str(row["tensor"]), [])) > 1


def unit_target(row: dict[str, Any], copies: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """What putting one unit back to float lifts: its output and every tensor sharing that encoding, and its
    weights (bias included)."""
    t = str(row["tensor"])
    return list(dict.fromkeys([t, *copies.get(t, [])])), [w for w in str(row.get("weights") or "").split(",") if w]


@dataclass
class EffectPlan:
    """What :func:`replay_effects` measures, chosen from the replay table's ranking columns only (``intro_*``) and
    the units' names, op types, input ops and weights (:func:`effect_plan`)."""

    rows: list[dict[str, Any]]  # the table's rows
    copies: dict[str, list[str]]  # shared_encodings of the model
    nodes: list[str]  # the units whose remedies' evidence is read: over budget, then the worst
    top: list[dict[str, Any]]  # the worst units, measured alone
    groups: list[Any]  # every group of units (patterns.groups), worst first
    measured: list[Any]  # the worst groups over budget, measured (their units over budget lifted)
    targets: list[Target]


def effect_plan(model: Model, table: Any, budget: float, measure: bool = True,
                copies: dict[str, list[str]] | None = None) -> EffectPlan | None:
    """The effect targets of a replay table (``replay_effects``), None when no unit breaks the budget. Reads only
    the ranking attribution's columns and the units' names, op types, input ops and weights: a table whose other
    sums are not all added yet (``replay``: they are added while the effect runs) gives the same targets.
    ``copies``: :func:`shared_encodings` of ``model`` when the caller has them."""
    if not len(table):
        return None
    rows = table.to_dict("records")
    over = _over(rows, budget)
    if not over:
        return None
    copies = shared_encodings(model) if copies is None else copies
    finite = [r for r in rows if sortable(r.get("intro_sqnr_db")) < float("inf") and not is_copy(r, copies)]
    top = sorted(finite, key=lambda r: sortable(r.get("intro_sqnr_db")))[:EFFECT_UNITS] if measure else []
    nodes = list(dict.fromkeys([r["node"] for r in over] + [r["node"] for r in top]))
    all_groups = groups(table) if measure else []
    gs = [g for g in all_groups if [r for r in _over(g.rows, budget) if not is_copy(r, copies)]][:EFFECT_GROUPS]
    targets: list[Target] = []
    for g in gs:
        ts: list[str] = []
        ws: list[str] = []
        for r in _over(g.rows, budget):
            a, b = unit_target(r, copies)
            ts += a
            ws += b
        targets.append(Target(g.key, ts, ws))
    for r in top:
        a, b = unit_target(r, copies)
        targets.append(Target(f"unit:{r['node']}", a, b))
    return EffectPlan(rows, copies, nodes, top, all_groups, gs, targets)


def replay_effects(model: Model, ref: Any, rids: list[str], table: Any, budget: float, *,
                   read: Callable[[str], np.ndarray | None], float_model: Model | None = None,
                   runner_factory: Callable[[str], Any] | None = None, executor: Executor | None = None,
                   shards: str | os.PathLike | None = None, measure: bool = True, progress: bool = False,
                   plan: EffectPlan | None = None,
                   started: tuple[list[Target], Callable[[], dict[str, Any]]] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A replay's remedies evidence and effects: ``(evidence by node, effects document, effect by group key)``.

    Measured only when a unit breaks the budget. The targets (:func:`effect_plan`): the :data:`EFFECT_GROUPS` worst
    groups over budget (their units over budget: what the group fix changes) and the :data:`EFFECT_UNITS` worst
    units by introduced error, within the budget or not (a unit just inside it can still cost the output most). A
    group with no unit over budget whose measured unit removes at least :data:`EFFECT_MATTERS` of the output error
    joins the candidates with that unit (``effects["groups"]`` lists each group's fix units). Adds
    ``effect_share`` / ``effect_gain_db`` columns to ``table`` (NaN for units not measured alone).

    ``plan``: an earlier plan's copies are reused (:func:`shared_encodings`). ``started``: runs already under way
    (``replay``: started before the table's other sums were added), as ``(their targets, the call that waits for
    their measure_effects document)``; used when their targets are this table's, else waited for and measured anew.
    """

    table["effect_share"] = np.nan
    table["effect_gain_db"] = np.nan
    plan = effect_plan(model, table, budget, measure, plan.copies if plan is not None else None)
    if plan is None:
        return {}, {}, {}
    chosen = [r for r in plan.rows if r["node"] in set(plan.nodes)]
    weights = {w for r in chosen for w in str(r.get("weights") or "").split(",") if w}
    fw = float_weights(model, float_model, weights) if float_model is not None else {}
    evidence = unit_evidence(model.proto, table, read, budget, nodes=plan.nodes, base_dir=model.base_dir,
                             float_weights=fw, copies=plan.copies, activation_bits=activation_bits(model))
    if not measure:
        return evidence, {}, {}
    if started is not None and started[0] == plan.targets:
        effects = started[1]()
    else:
        if started is not None:
            started[1]()  # not these targets: waited for (measure_effects keeps module state while it runs)
        effects = measure_effects(model, ref, rids, plan.targets, float_model=float_model,
                                  runner_factory=runner_factory, executor=executor, shards=shards, progress=progress)
    if not effects:
        return evidence, {}, {}
    return evidence, effects, _effect_columns(table, plan, effects, budget)


def _effect_columns(table: Any, plan: EffectPlan, effects: dict[str, Any], budget: float) -> dict[str, Any]:
    """Write the measured units' effects into ``table``, each target's ``why``, ``effects["groups"]`` (each group's
    fix units); the effect by group key."""
    by_node = {r["node"]: r for r in plan.rows}
    fix_units = {g.key: [r["node"] for r in _over(g.rows, budget)] for g in plan.measured}
    for key, e in effects["targets"].items():
        if key.startswith("unit:"):
            node = key[len("unit:"):]
            sel = table["node"] == node
            table.loc[sel, "effect_share"] = e["share"]
            table.loc[sel, "effect_gain_db"] = e["gain_db"]
            e["why"] = why_small(e, by_node[node].get("weight_share"))
        else:
            g = next(g for g in plan.measured if g.key == key)
            e["why"] = why_small(e, g.weight_share(_over(g.rows, budget)))
    lifted = {g.key: effects["targets"][g.key] for g in plan.measured}
    for g in plan.groups:  # within the budget, but one of its units costs the output this much
        if g.key in lifted:
            continue
        hits = [r for r in g.rows if effects["targets"].get(f"unit:{r['node']}", {}).get("share", 0.0) >= EFFECT_MATTERS]
        if hits:
            best = max(hits, key=lambda r: effects["targets"][f"unit:{r['node']}"]["share"])
            lifted[g.key] = effects["targets"][f"unit:{best['node']}"]
            fix_units[g.key] = [best["node"]]
    effects["groups"] = fix_units
    return lifted
