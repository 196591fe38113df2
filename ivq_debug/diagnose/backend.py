"""``backend_divergence``: layers where the backend departs from what quantization explains.

Reads the three-way measurement of a comparison (``cmp.three_way``, :mod:`ivq_debug.comparator.threeway`:
fp32 → backend, with the CPU-QDQ dump of the same QDQ model and inputs as the expected error), pooled per
layer over samples and steps. A layer *departs* when the backend's error against fp32 exceeds ``k`` times the
CPU-QDQ error (``defaults.BACKEND_DIVERGENCE_K``, 1.5) in relative L2 *and* relative L∞ (the bulk and the
worst element both), or in either one by the error ratio (``defaults.BACKEND_DIVERGENCE_ERROR_RATIO``, 4).
A ratio counts only when the backend's own error in that norm is at least
``defaults.BACKEND_DIVERGENCE_MIN_REL_L2`` (below, the difference is float rounding). A backend exactly as bad
as its quantization (the a8w8 mask collapse, which CPU-QDQ shows too) has ratios near 1 and gets no finding;
a backend kernel that rounds a little differently moves one norm, not both: measured on the demo's clean a16w8
HTP run (onnxruntime-qnn 2.7.0, soc 60), single-norm ratios reach 1.56 (rel-L2, the decode RMSNorm division)
and 1.89 (rel-L∞, a post-attention RMSNorm mean) while no layer exceeds 1.5 in both; an HTP-only corrupted
encoding departs by 94x / 111x.

One finding per part, at its first departing layer in execution order (where the backend's own error starts;
later layers inherit it), severity ``error`` from ``defaults.BACKEND_DIVERGENCE_ERROR_RATIO`` on, else
``warning``. A part whose inputs carry an earlier part's departure (a prefill after a departing vision part)
is reported as downstream of it, at most a warning.

Without an expected dump, when REF is itself the CPU-QDQ capture of the QDQ model TEST ran (``cmp.backend_check``,
set by :func:`ivq_debug.api.compare` when nothing is declared), the same finding comes from the default backend
check (:func:`backend_check_findings`): TEST should compute what REF holds up to a backend's rounding, so a tensor
departs when its rmse against REF exceeds ``defaults.BACKEND_CHECK_LSB_RMSE`` steps of an 8-bit grid and its SQNR
against REF is below ``defaults.BACKEND_CHECK_MAX_SQNR_DB`` (measurements beside the defaults).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding
from ivq_debug.dump.format import part_rank

#: pipeline order of the parts (a departure in an earlier part is carried into the later ones)


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def departure(row: dict[str, Any], k: float) -> float | None:
    """The ratio by which a pooled layer row departs at ``k``, or None when it does not (module docstring).

    With ``lo`` / ``hi`` the smaller / larger of its L2 and L∞ ratios (a norm whose backend error is below the
    floor does not count), the row departs by ``hi`` when ``hi`` exceeds the error ratio, else by ``lo``; it
    departs at ``k`` when that ratio exceeds ``k``. So ``departure(row, 0.0)`` is exactly the ``k`` at which the
    finding goes (``--max-ratio``)."""
    if row.get("status") not in ("ok", "expected_exact"):
        return None
    ratios = []
    for r_key, e_key in (("ratio_l2", "rel_l2_test"), ("ratio_linf", "rel_linf_test")):
        r, e = _num(row.get(r_key)), _num(row.get(e_key))
        ratios.append(r if r is not None and e is not None and e >= defaults.BACKEND_DIVERGENCE_MIN_REL_L2
                      else None)
    counted = [r for r in ratios if r is not None]
    if not counted:
        return None
    hi = max(counted)
    by = hi if hi > defaults.BACKEND_DIVERGENCE_ERROR_RATIO else (min(counted) if len(counted) == 2 else None)
    return by if by is not None and by > k else None


def _bits(cmp: Any) -> dict[tuple[tuple[int, str, int], str], int]:
    """The bitwidth of each pair's test encoding, keyed ``(record, ref_name)``."""
    out = {}
    for p in cmp.alignment.pairs:
        enc = p.test.encoding
        if isinstance(enc, dict) and isinstance(enc.get("bitwidth"), int | float):
            out[(tuple(p.ref.record), p.ref.name)] = int(enc["bitwidth"])
    return out


def lsb8(lsb_rmse: Any, bits: int | None) -> float | None:
    """``lsb_rmse`` in 8-bit steps (a ``bits``-bit step is 2^(8 - bits) of an 8-bit one); None when undefined."""
    v = _num(lsb_rmse)
    return None if v is None or bits is None else v * 2.0 ** (8 - bits)


#: what every backend_divergence finding suggests
SUGGESTION = ("the CPU-QDQ run of the same QDQ model does not show this error: compare this op's precision, encoding "
              "and partition on the backend (ivq diagnose --backend qnn replays it alone)")
Hit = tuple[dict[str, Any], float]


def _per_part(table: Any, sort: list[str], depart: Callable[[dict[str, Any]], float | None],
              make: Callable[[str, list[dict[str, Any]], list[Hit], str], Finding | None]) -> list[Finding]:
    """One finding per part (pipeline order) at its first departing row: ``depart(row)`` is the amount a row departs
    by (None: it does not), ``make(part, rows, hits, downstream)`` builds the finding; a part after a departing one
    gets ``downstream`` text and at most a warning (its inputs carry the earlier departure)."""
    out: list[Finding] = []
    upstream: tuple[str, str] | None = None
    for part in sorted(set(table["part"]), key=part_rank):
        rows = table[table["part"] == part].sort_values(sort, kind="stable").to_dict("records")
        hits = [(r, x) for r in rows for x in [depart(r)] if x is not None]
        if not hits:
            continue
        down = "" if upstream is None else (f"; downstream of the {upstream[0]} part's departure at {upstream[1]} "
                                            "(its inputs carry it)")
        f = make(part, rows, hits, down)
        if f is None:
            continue
        if down:
            f.severity = "warning"
        out.append(f)
        if upstream is None:
            upstream = (part, hits[0][0]["ref_name"])
    return out


def backend_check_findings(cmp: Any) -> list[Finding]:
    """The default backend check (``cmp.backend_check``: REF is the CPU-QDQ capture of the QDQ model TEST ran):
    per part, the first tensor in execution order whose rmse against CPU-QDQ exceeds ``lsb_rmse`` 8-bit steps and
    whose SQNR against it is below ``max_sqnr_db`` (``defaults.BACKEND_CHECK_*``); later parts downstream of a
    departure are warnings."""
    chk = cmp.backend_check
    t = cmp.table
    if t is None or not len(t):
        return []
    bits = _bits(cmp)
    budget, floor = float(chk["lsb_rmse"]), float(chk["max_sqnr_db"])

    def depart(r: dict[str, Any]) -> float | None:
        steps = lsb8(r.get("lsb_rmse"), bits.get(((int(r["sample"]), r["part"], int(r["step"])), r["ref_name"])))
        sq = _num(r.get("sqnr_db"))
        return steps if steps is not None and steps > budget and sq is not None and sq < floor else None

    def make(part: str, rows: list[dict[str, Any]], hits: list[Hit], down: str) -> Finding:
        (first, steps), worst = hits[0], max(hits, key=lambda h: h[1])
        return Finding(
            "backend_divergence", "error",
            f"the backend departs from the CPU-QDQ run of the same QDQ model at {first['ref_name']} ({part}): "
            f"{steps:.3g} 8-bit steps rms (limit {budget:g}), SQNR {_num(first['sqnr_db']):.3g} dB against CPU-QDQ"
            + down,
            where={"record": {"sample": int(first["sample"]), "part": part, "step": int(first["step"])},
                   "tensor": first["ref_name"], "part": part, "order": int(first["order"])},
            evidence={"lsb_rmse_8bit": steps, "lsb_rmse": _num(first.get("lsb_rmse")),
                      "sqnr_db": _num(first.get("sqnr_db")), "limit_lsb_rmse_8bit": budget, "max_sqnr_db": floor,
                      "departing_tensors": len(hits), "tensors": len(rows),
                      "worst": {"tensor": worst[0]["ref_name"], "lsb_rmse_8bit": worst[1]},
                      "reference": str(cmp.ref.path)},
            suggestion=SUGGESTION)

    return _per_part(t, ["sample", "step", "order"], depart, make)


def backend_divergence(cmp: Any, k: float | None = None) -> list[Finding]:
    """Findings for the layers where the backend departs from CPU-QDQ (module docstring): from the three-way
    ratios with an expected dump, else from the default backend check when REF is itself the CPU-QDQ run
    (:func:`backend_check_findings`); none otherwise."""
    tw = getattr(cmp, "three_way", None)
    if tw is None:
        return backend_check_findings(cmp) if getattr(cmp, "backend_check", None) else []
    k = float(k if k is not None else getattr(tw, "k", None) or defaults.BACKEND_DIVERGENCE_K)
    layers = tw.layers()
    if layers.empty:
        return []

    def make(part: str, rows: list[dict[str, Any]], hits: list[Hit], down: str) -> Finding:
        (first, x), worst = hits[0], max(hits, key=lambda h: h[1])
        s, p, st = (first["worst"] or "0/?/0").split("/")
        bc = _num(first.get("bc"))
        return Finding(
            "backend_divergence", "error" if x >= defaults.BACKEND_DIVERGENCE_ERROR_RATIO else "warning",
            f"the backend departs from what quantization explains at {first['ref_name']} ({part}): error vs fp32 "
            f"{_ratio_text(first)} CPU-QDQ's"
            + (f", error-shape overlap (Bhattacharyya) {bc:.2f}" if bc is not None else "") + down,
            where={"record": {"sample": int(s), "part": p, "step": int(st)}, "tensor": first["ref_name"],
                   "part": part, "order": int(first["order"])},
            evidence={"ratio_l2": _num(first["ratio_l2"]), "ratio_linf": _num(first["ratio_linf"]), "bc": bc,
                      "rel_l2_test": _num(first["rel_l2_test"]), "rel_l2_expected": _num(first["rel_l2_expected"]),
                      "rel_linf_test": _num(first["rel_linf_test"]),
                      "rel_linf_expected": _num(first["rel_linf_expected"]), "records": int(first["records"]),
                      "k": k, "error_ratio": defaults.BACKEND_DIVERGENCE_ERROR_RATIO,
                      "departing_layers": len(hits), "layers": len(rows),
                      "worst": {"tensor": worst[0]["ref_name"], "ratio": worst[1]},
                      "expected": str(tw.expected.path)},
            suggestion=SUGGESTION)

    return _per_part(layers, ["order"], lambda r: departure(r, k), make)


def _ratio_text(r: dict[str, Any]) -> str:
    l2, li = _num(r.get("ratio_l2")), _num(r.get("ratio_linf"))

    def fmt(v: float | None) -> str:
        return "inf" if v is not None and math.isinf(v) else f"{v:.3g}" if v is not None else "?"

    return f"{fmt(l2)}x (rel-L2) / {fmt(li)}x (rel-L∞)"
