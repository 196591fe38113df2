"""Cheap diagnostics that need only the comparison and the manifests (no replay, no tensor reads)."""

from __future__ import annotations

from typing import Any

from ivq_debug.diagnose.findings import Finding, severity_rank


def _where(d: dict[str, Any]) -> dict[str, Any]:
    return {
        "record": {"sample": int(d["sample"]), "part": d["part"], "step": int(d["step"])},
        "tensor": d["ref_name"],
        "test_tensor": d["test_name"],
        "order": int(d["order"]),
    }


def first_divergence(cmp: Any) -> list[Finding]:
    """The first tensor in execution order that breaks the budgets."""
    d = cmp.first_divergence
    if d is None:
        return []
    budgets = cmp.divergence_budgets.describe()
    sev = "error" if cmp.budgets else "warning"
    sq = d.get("sqnr_db")
    return [
        Finding(
            "first_divergence", sev,
            f"first divergence at {d['ref_name']} ({d['part']} step {d['step']})"
            + (f": SQNR {sq:.1f} dB" if isinstance(sq, float) else f": status {d['status']}"),
            where=_where(d),
            evidence={k: d.get(k) for k in ("sqnr_db", "max_abs", "cosine", "rel_l2", "status")} | {"budgets": budgets},
            suggestion="inspect this layer first: compare its introduced vs inherited error (ivq diagnose)",
        )
    ]


def non_finite(cmp: Any) -> list[Finding]:
    """The first tensor holding NaN/Inf in the test dump (and in the reference, if any)."""
    out = []
    for side, dump in (("test", cmp.test), ("ref", cmp.ref)):
        for e in sorted(dump.tensors(), key=lambda e: (e.sample, e.step, e.rid, e.order)):
            stats = e.stats
            if stats.get("nonfinite"):
                out.append(
                    Finding(
                        "non_finite", "error",
                        f"first non-finite tensor in the {side} dump: {e.name} ({stats['nonfinite']} values)",
                        where={"record": {"sample": e.sample, "part": e.part, "step": e.step}, "tensor": e.name,
                               "side": side},
                        evidence={"nonfinite": stats["nonfinite"], "numel": e.size},
                        suggestion="check the producing op's precision (fp16 overflow) and its input ranges",
                    )
                )
                break
    return out


def fp64(cmp: Any) -> list[Finding]:
    """Tensors held in float64 (QNN supports fp64 poorly; exports should stay fp32)."""
    out = []
    for side, dump in (("ref", cmp.ref), ("test", cmp.test)):
        names = [e.name for e in dump.tensors() if e.dtype == "float64"]
        if names:
            out.append(
                Finding(
                    "fp64_op", "warning",
                    f"{len(names)} float64 tensor(s) in the {side} dump, first {names[0]}",
                    where={"tensor": names[0], "side": side},
                    evidence={"count": len(names), "names": names[:20]},
                    suggestion="cast to float32 before export; QNN HTP has no fp64 path",
                )
            )
    return out


def token_divergence(cmp: Any) -> list[Finding]:
    """The first generation step whose chosen token differs between the dumps."""
    rmeta = {(r["sample"], r["part"], r["step"]): r["meta"] for r in cmp.ref._records}
    tmeta = {(r["sample"], r["part"], r["step"]): r["meta"] for r in cmp.test._records}
    out = []
    for key in sorted(set(rmeta) & set(tmeta), key=lambda k: (k[0], k[2], k[1])):
        a, b = rmeta[key].get("token"), tmeta[key].get("token")
        if a is None or b is None or a == b:
            continue
        out.append(
            Finding(
                "token_divergence", "error",
                f"generated tokens differ first at sample {key[0]} {key[1]} step {key[2]}: {a} vs {b}",
                where={"record": {"sample": key[0], "part": key[1], "step": key[2]}},
                evidence={"ref_token": a, "test_token": b,
                          "teacher_forced": "forced_token" in tmeta[key] or "forced_token" in rmeta[key]},
                suggestion="compare this step's inputs (position_ids, attention_mask, cache length) first",
            )
        )
        break
    return out


def cpu_fallback(cmp: Any) -> list[Finding]:
    """Nodes of a QNN capture that ran on the CPU (from the recorded ``/meta/partition``).

    Graph-input QuantizeLinear / graph-output DequantizeLinear nodes that the EP leaves to the CPU by
    design (``io_offload``) are reported as info; any other CPU node is an error: those are the CPU islands
    that cost transfers on a device and whose numerics are not the HTP's.
    """
    part = cmp.test.meta("partition")
    if not part:
        return []
    cpu = part.get("cpu_nodes", [])
    real = [n for n in cpu if not n.get("io_offload")]
    out = []
    if real:
        first = real[0]
        out.append(Finding(
            "cpu_fallback", "error",
            f"{len(real)} node(s) ran on the CPU instead of QNN, first {first.get('name')} ({first.get('op_type')})"
            + (f": {first['reason']}" if first.get("reason") else ""),
            where={"node": first.get("name"), "op_type": first.get("op_type")},
            evidence={"count": len(real), "nodes": real[:20], "counts": part.get("counts")},
            suggestion="replace the op with a QNN-supported form (e.g. the Gelu op instead of an Erf chain) or "
                       "quantize it differently; each CPU island costs NPU<->CPU transfers",
        ))
    io = [n for n in cpu if n.get("io_offload")]
    if io:
        out.append(Finding(
            "cpu_fallback", "info",
            f"{len(io)} graph-I/O quantize/dequantize node(s) run on the CPU by design (offload_graph_io_quantization)",
            where={"node": io[0].get("name")}, evidence={"count": len(io)},
            suggestion="nothing to do unless the graph I/O conversion shows up in the profile",
        ))
    return out


def merge_repeats(findings: list[Finding]) -> list[Finding]:
    """One finding per (kind, tensor): the first occurrence, with the records of the others in its evidence."""
    seen: dict[tuple[str, Any], Finding] = {}
    out: list[Finding] = []
    for f in findings:
        key = (f.kind, f.where.get("tensor"), f.where.get("node"))
        first = seen.get(key)
        if first is None:
            seen[key] = f
            out.append(f)
            continue
        if "record" in f.where:
            first.evidence.setdefault("also_in", []).append(f.where["record"])
        if severity_rank(f.severity) > severity_rank(first.severity):
            first.severity = f.severity
    return out
