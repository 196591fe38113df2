"""Where the error accumulates when no unit introduces more than the budget but the output breaks it.

The replay charges each QDQ unit the error it introduces on its own. A part can fail with every unit within the
budget: 160 units of the demo's a8w8 prefill each stay above 20 dB (worst 20.3 dB), yet its logits end at 7.2 dB
with 98.9 % of their error inherited. The headline then has no unit to name, and saying "no unit introduces more
error than the budget" would read as a pass. :func:`explain_accumulation` says instead where the error builds up,
from figures the replay and the cumulative comparison already hold:

- **the outputs** of the part that break the budget (cumulative SQNR, the inherited share);
- **where it crosses**: the first unit in execution order whose cumulative SQNR falls below the budget, and the
  units closest to the budget under the ranking attribution;
- **the inputs** that arrive with error (a decode step's past keys / values from the backend's earlier steps,
  the prefill's image features from the vision part), by their SQNR in the comparison (for a QDQ model the
  tensor of an input's name is its quantized value, so its own quantization counts; the sentence names the
  inputs below the budget);
- **the ``iso`` outliers**: units within the budget on their own quantized inputs (``local``) but far below it
  when their inputs are re-quantized (``iso``): an input encoding that is too coarse for this consumer (an
  attention Softmax reading 8-bit masked scores at 1.9 dB);
- **the related findings** of the comparison on those tensors (``resolution_collapse`` of the scores'
  encoding, ``saturation``), the encoding facts that explain the outliers.

The result is data (:class:`Accumulation`, one ``accumulated_error`` finding); ``ivq diagnose`` prints it and
exits 1. It suggests no remedy of its own (none was run); the related findings carry theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ivq_debug.diagnose.findings import Finding
from ivq_debug.jsonio import as_float

#: entries listed per category (outputs, inputs, iso outliers, units, related findings)
TOP = 5


_num = as_float


def _db(v: Any) -> str:
    f = _num(v)
    return "–" if f is None else ("+inf" if f == math.inf else f"{f:.1f}")


@dataclass
class Accumulation:
    """Where the error of a part accumulates (see the module docstring).

    Attributes:
        record: the replayed record (``sample``, ``part``, ``step``).
        budget_sqnr_db: the introduced-error budget (also what the outputs are held to here).
        attribution: the ranking attribution of the replay.
        outputs: the part's outputs below the budget, worst first: ``tensor``, ``cum_sqnr_db``,
            ``inherited_share``, ``intro_sqnr_db``.
        crossing: the first unit (execution order) whose cumulative SQNR is below the budget: ``tensor``,
            ``op_type``, ``cum_sqnr_db``, ``intro_sqnr_db``, ``order``, ``of`` (units replayed); ``None`` when the
            cumulative error is not known per unit.
        closest: the units closest to the budget by the ranking attribution.
        inputs: the part's inputs with their SQNR on arrival (worst first; identical inputs left out).
        iso_outliers: units below the budget under ``iso`` only: ``tensor``, ``op_type``, ``iso_sqnr_db``,
            ``local_sqnr_db``, ``inputs`` (the fed tensors), ``related`` (kinds of findings on those inputs).
        related: findings of the comparison on the outliers' inputs first, then the part's other encoding
            findings.
    """

    record: dict[str, Any]
    budget_sqnr_db: float
    attribution: str
    outputs: list[dict[str, Any]]
    crossing: dict[str, Any] | None = None
    closest: list[dict[str, Any]] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    iso_outliers: list[dict[str, Any]] = field(default_factory=list)
    related: list[Finding] = field(default_factory=list)

    @property
    def sentence(self) -> str:
        """Where the error accumulates, in one sentence."""
        part = self.record.get("part")
        o = self.outputs[0]
        inh = _num(o.get("inherited_share"))
        worst = self.closest[0] if self.closest else None
        s = (f"no unit introduces more error than the budget ({self.budget_sqnr_db:g} dB, {self.attribution}"
             + (f"; closest {worst['tensor']} at {_db(worst['intro_sqnr_db'])} dB" if worst else "")
             + f"), yet {part} output {o['tensor']} is at {_db(o['cum_sqnr_db'])} dB"
             + (f", {inh:.1%} of its error inherited" if inh is not None else "")
             + "".join(f", {x['tensor']} at {_db(x['cum_sqnr_db'])} dB" for x in self.outputs[1:3])
             + (f" and {len(self.outputs) - 3} more outputs" if len(self.outputs) > 3 else "")
             + ": the error accumulates")
        if self.crossing is not None:
            c = self.crossing
            s += (f", below the budget from {c['tensor']} on (unit {c['order']} of {c['of']}, cumulative "
                  f"{_db(c['cum_sqnr_db'])} dB)")
        bad_in = [i for i in self.inputs if _num(i["sqnr_db"]) is not None and i["sqnr_db"] < self.budget_sqnr_db]
        if bad_in:
            s += "; input " + ", ".join(f"{i['tensor']} arrives at {_db(i['sqnr_db'])} dB" for i in bad_in[:2])
        if self.iso_outliers:
            x = self.iso_outliers[0]
            s += (f"; re-quantizing its inputs costs most at {x['tensor']} (iso {_db(x['iso_sqnr_db'])} dB, local "
                  f"{_db(x['local_sqnr_db'])} dB)")
            if x.get("related"):
                r = x["related"][0]
                s += f", whose input {r['tensor']} has {r['kind']}"
        return s

    def finding(self) -> Finding:
        """The ``accumulated_error`` finding (an error: the part's output breaks the budget)."""
        o = self.outputs[0]
        return Finding(
            "accumulated_error", "error", self.sentence,
            where={"record": self.record, "tensor": o["tensor"]},
            evidence={"outputs": self.outputs, "crossing": self.crossing, "closest": self.closest,
                      "inputs": self.inputs, "iso_outliers": self.iso_outliers,
                      "related": [f"{f.kind} at {f.where.get('tensor')}" for f in self.related],
                      "budget_sqnr_db": self.budget_sqnr_db, "attribution": self.attribution},
            suggestion=("no single unit to fix: look at the inputs that arrive with error and at the iso outliers' "
                        "input encodings (the related findings carry their own fixes); no remedy was run"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the ``accumulation`` block of ``ivq-replay/2``)."""
        return {"sentence": self.sentence, "record": self.record, "budget_sqnr_db": self.budget_sqnr_db,
                "attribution": self.attribution, "outputs": self.outputs, "crossing": self.crossing,
                "closest": self.closest, "inputs": self.inputs, "iso_outliers": self.iso_outliers,
                "related": [f.to_dict() for f in self.related]}


def explain_accumulation(table: Any, budget_sqnr_db: float, record: dict[str, Any], *, attribution: str,
                         cumulative: dict[str, dict[str, Any]], model_inputs: list[str], model_outputs: list[str],
                         unit_inputs: dict[str, list[str]], findings: list[Finding]) -> Accumulation | None:
    """Where the error accumulates, or ``None`` when a unit breaks the budget (the introduced-error headline then
    names it) or when no output of the part breaks it.

    Args:
        table: the replay table (:attr:`~ivq_debug.diagnose.replay.ReplayResult.table`).
        budget_sqnr_db: the introduced-error budget.
        record: the replayed record.
        attribution: the ranking attribution (``intro_sqnr_db`` is under it).
        cumulative: comparison rows of the replayed record keyed by test tensor name (``sqnr_db``, ``status``).
        model_inputs / model_outputs: the part's graph inputs and outputs (float names, as keyed in dumps).
        unit_inputs: unit output tensor → the float tensors the unit is fed.
        findings: the comparison's encoding findings (``resolution_collapse``, ``saturation``).
    """
    if table is None or not len(table):
        return None
    rows = table.sort_values("order", kind="stable").to_dict("records")
    if any((_num(r["intro_sqnr_db"]) is not None and r["intro_sqnr_db"] < budget_sqnr_db)
           or r.get("intro_status") == "non_finite" for r in rows):
        return None
    by_tensor = {r["tensor"]: r for r in rows}
    outputs = []
    for name in model_outputs:
        c = cumulative.get(name)
        sq = _num(c.get("sqnr_db")) if c is not None else None
        if c is None or not ((sq is not None and sq < budget_sqnr_db) or c.get("status") == "non_finite"):
            continue
        u = by_tensor.get(name, {})
        outputs.append({"tensor": name, "cum_sqnr_db": sq, "inherited_share": _num(u.get("inherited_share")),
                        "intro_sqnr_db": _num(u.get("intro_sqnr_db"))})
    if not outputs:
        return None
    outputs.sort(key=lambda o: o["cum_sqnr_db"] if o["cum_sqnr_db"] is not None else -math.inf)
    crossing = None
    for k, r in enumerate(rows, 1):
        cum = _num(r.get("cum_sqnr_db"))
        if cum is not None and cum < budget_sqnr_db:
            crossing = {"tensor": r["tensor"], "op_type": r["op_type"], "cum_sqnr_db": cum,
                        "intro_sqnr_db": _num(r["intro_sqnr_db"]), "order": k, "of": len(rows)}
            break
    closest = [{"tensor": r["tensor"], "op_type": r["op_type"], "intro_sqnr_db": _num(r["intro_sqnr_db"]),
                "cum_sqnr_db": _num(r.get("cum_sqnr_db"))}
               for r in sorted(rows, key=lambda r: _num(r["intro_sqnr_db"]) if _num(r["intro_sqnr_db"]) is not None
                               else math.inf)[:TOP]]
    inputs = []
    for name in model_inputs:
        c = cumulative.get(name)
        sq = _num(c.get("sqnr_db")) if c is not None else None
        if c is not None and c.get("status") != "identical" and sq is not None and sq != math.inf:
            inputs.append({"tensor": name, "sqnr_db": sq})
    inputs = sorted(inputs, key=lambda i: i["sqnr_db"])[:TOP]
    part = record.get("part")
    mine = [f for f in findings if ((f.where or {}).get("record") or {}).get("part") in (None, part)]
    on_tensor: dict[str, list[Finding]] = {}
    for f in mine:
        for t in {str(x) for x in ((f.where or {}).get("tensor"), (f.where or {}).get("test_tensor")) if x}:
            on_tensor.setdefault(t, []).append(f)
    outliers, related = [], []
    iso_rows = [r for r in rows if _num(r.get("iso_sqnr_db")) is not None and r["iso_sqnr_db"] < budget_sqnr_db]
    for r in sorted(iso_rows, key=lambda r: r["iso_sqnr_db"])[:TOP]:
        fed = list(unit_inputs.get(r["tensor"], []))
        rel = [f for x in fed for f in on_tensor.get(x, [])]
        related += [f for f in rel if f not in related]
        outliers.append({"tensor": r["tensor"], "op_type": r["op_type"], "iso_sqnr_db": _num(r["iso_sqnr_db"]),
                         "local_sqnr_db": _num(r.get("local_sqnr_db")), "inputs": fed,
                         "related": [{"kind": f.kind, "tensor": f.where.get("tensor")} for f in rel]})
    related += [f for f in mine if f not in related]
    return Accumulation(dict(record), float(budget_sqnr_db), attribution, outputs, crossing, closest, inputs,
                        outliers, related[:TOP])
