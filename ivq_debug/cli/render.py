"""Rich terminal rendering of dumps, comparisons and findings.

Everything read from a file (names, parts, op types, paths, messages, backend info) is untrusted: cells
and markup strings go through :func:`~ivq_debug.cli.common.escape` (control characters shown as escapes,
rich markup escaped), plain ``Text`` through :func:`~ivq_debug.cli.common.safe`.
"""

from __future__ import annotations

from typing import Any

from ivq_debug.cli.common import escape, fmt_bytes, fmt_num, safe

SEV_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _rec(d: dict[str, Any] | Any) -> str:
    """``sample/part[/step]`` of a record (raw: escape it for the context)."""
    part, step = d["part"], d["step"]
    return f"{d['sample']}/{part}" + (f"/{step}" if part == "decode" or step else "")


def dump_header(dump: Any) -> str:
    """One-line description of a dump."""
    info = dump.backend_info
    extra = []
    for k in ("soc_model", "htp_arch"):
        if k in info:
            extra.append(f"{k}={info[k]}")
    if info.get("emulated"):
        extra.append("EMULATED")
    if not dump.complete:
        extra.append("INCOMPLETE")
    tail = f" [{' '.join(extra)}]" if extra else ""
    return f"{escape(dump.path)} ({escape(dump.backend)}){escape(tail)}"



def manifest_table(dump: Any, limit: int | None = None, kind: str | None = None):
    """The manifest of a dump as a rich Table."""
    from rich.table import Table

    t = Table(title=dump_header(dump), title_justify="left", header_style="bold")
    for col, just in (("record", "left"), ("#", "right"), ("name", "left"), ("op", "left"), ("shape", "left"),
                      ("dtype", "left"), ("min", "right"), ("max", "right"), ("mean", "right"), ("std", "right"),
                      ("nf", "right"), ("q", "left")):
        t.add_column(col, justify=just, no_wrap=col != "name", min_width=24 if col == "name" else None,
                     overflow="fold")
    ents = [e for e in dump.entries if kind is None or e.kind == kind]
    ents.sort(key=lambda e: (e.rid, e.kind != "input", e.order))
    for e in ents[:limit]:
        enc = e.encoding
        q = f"u{enc.get('bitwidth')}" if isinstance(enc, dict) else ""
        cells = (
            f"{e.sample}/{e.part}/{e.step}", "in" if e.kind == "input" else str(e.order), e.name,
            e.op_type or "", "x".join(map(str, e.shape)) or "scalar", e.dtype,
            fmt_num(e.stats.get("min")), fmt_num(e.stats.get("max")), fmt_num(e.stats.get("mean")),
            fmt_num(e.stats.get("std")), str(e.stats.get("nonfinite") or ""), q,
        )
        t.add_row(*(escape(c) for c in cells))
    return t


def entry_panel(dump: Any, e: Any) -> Any:
    """Details of one tensor as a rich Table (two columns)."""
    from rich.table import Table

    t = Table(show_header=False, title=f"{escape(e.name)}", title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value")
    rows = [
        ("dump", str(dump.path)), ("record", f"sample {e.sample}, part {e.part}, step {e.step}"),
        ("kind", e.kind), ("order", str(e.order)), ("op / module type", e.op_type or "-"),
        ("scope", e.scope or "-"), ("shape", str(list(e.shape))), ("dtype", e.dtype), ("layout", e.layout or "-"),
        ("stored", e.stored), ("bytes", fmt_bytes(e.nbytes) if isinstance(e.nbytes, int) else str(e.nbytes)),
    ]
    rows += [(k, fmt_num(e.stats.get(k), 6)) for k in ("min", "max", "mean", "std")]
    rows.append(("non-finite", str(e.stats.get("nonfinite"))))
    if isinstance(e.encoding, dict) and e.encoding:
        enc = e.encoding
        rows.append(("encoding", ", ".join(f"{k}={v}" for k, v in enc.items() if k in
                                            ("bitwidth", "dtype", "scale", "zero_point", "axis"))))
        rows.append(("raw integers", "stored" if e.has_raw else "no"))
    for k, v in rows:
        t.add_row(k, escape(v))
    return t


def comparison_report(cmp: Any, top: int) -> list[Any]:
    """Renderables for ``ivq-diff``: header, worst layers, first divergence, findings, unmatched."""
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    s = cmp.summary
    out.append(Text.from_markup(f"[bold]ref [/bold] {dump_header(cmp.ref)}"))
    out.append(Text.from_markup(f"[bold]test[/bold] {dump_header(cmp.test)}"))
    um = cmp.unmatched
    out.append(
        Text(safe(
            f"{s['pairs']} aligned tensors in {s['records']} record(s) · unmatched ref {um['ref']['count']}, "
            f"test {um['test']['count']} · match: "
            + ", ".join(f"{k} {v}" for k, v in s["match_methods"].items())
            + (f" · budgets: {', '.join(s['budgets'])}" if s["budgets"] else " · no thresholds")
        ))
    )
    contract = getattr(cmp, "contract", None)
    broken = contract is not None and contract.status == "broken"
    if contract is not None:
        style = {"ok": "green", "unknown": "yellow"}.get(contract.status, "bold red")
        out.append(Text(contract.line() + (" — compared anyway (--allow-input-mismatch)" if broken else ""),
                        style=style))
    worst = cmp.worst(top)
    t = Table(title=f"worst {len(worst)} by {cmp.rank_by}", title_justify="left", header_style="bold")
    for col, just in (("rank", "right"), ("record", "left"), ("tensor", "left"), ("op", "left"),
                      ("sqnr_db", "right"), ("cosine", "right"), ("max_abs", "right"), ("rel_l2", "right"),
                      ("status", "left")):
        t.add_column(col, justify=just, no_wrap=col != "tensor", min_width=24 if col == "tensor" else None,
                     overflow="fold")
    for i, (_, r) in enumerate(worst.iterrows(), 1):
        name = escape(r["ref_name"]) + ("" if r["test_name"] == r["ref_name"] else f"\n→ {escape(r['test_name'])}")
        status = escape(r["status"]) if r["passed"] else f"[red]FAIL[/red] {escape(', '.join(r['violations']))}"
        if broken:
            status += " [red]· inputs differ[/red]"
        t.add_row(str(i), escape(_rec(r)), name, escape(r["op_type"] or ""), fmt_num(r["sqnr_db"]), fmt_num(r["cosine"], 6),
                  fmt_num(r["max_abs"]), fmt_num(r["rel_l2"]), status)
    out.append(t)
    tw = getattr(cmp, "three_way", None)
    if tw is not None:
        out.append(three_way_table(tw, top))
    fd = cmp.first_divergence
    if fd is None:
        out.append(Text("first divergence: none", style="green"))
    else:
        out.append(Text.from_markup(
            f"[bold]first divergence[/bold]: {escape(fd['ref_name'])} ({escape(_rec(fd))}, order {escape(fd['order'])}) "
            f"sqnr {fmt_num(fd['sqnr_db'])} dB, max_abs {fmt_num(fd['max_abs'])}, status {escape(fd['status'])}"
        ))
    for f in cmp.findings:
        style = SEV_STYLE.get(f.severity, "")
        out.append(Text.from_markup(f"[{style}]{f.severity:7s}[/{style}] [bold]{escape(f.kind)}[/bold]: "
                                    f"{escape(f.message)}"))
        if f.suggestion:
            out.append(Text(f"         → {safe(f.suggestion)}", style="dim"))
    if cmp.regressions is not None:
        if cmp.regressions:
            out.append(Text(f"{len(cmp.regressions)} regression(s) against the baseline:", style="bold red"))
            for r in cmp.regressions[:top]:
                out.append(Text(safe(f"  {r['ref_name']} ({_rec(r['record'])}): {'; '.join(map(str, r['reasons']))}")))
        else:
            out.append(Text("no regression against the baseline", style="green"))
    for side in ("ref", "test"):
        names = um[side]["names"]
        if names:
            shown = ", ".join(map(str, names[:5])) + (" …" if len(names) > 5 else "")
            out.append(Text(safe(f"unmatched in {side} ({len(names)}): {shown}"), style="dim"))
    return out


def three_way_table(tw: Any, top: int) -> Any:
    """The layers with the largest backend / CPU-QDQ error ratios (pooled over records) as a rich Table."""
    from rich.table import Table

    layers = tw.layers()
    keyed = layers.assign(_r=layers[["ratio_l2", "ratio_linf"]].max(axis=1).fillna(-1.0))
    rows = keyed.sort_values("_r", ascending=False, kind="stable").head(top)
    t = Table(title=f"backend vs quantization (expected {escape(tw.expected.path)}, k {tw.k:g}): largest error "
                    "ratios per layer", title_justify="left", header_style="bold")
    for col, just in (("part", "left"), ("tensor", "left"), ("rel-L2 test", "right"), ("rel-L2 CPU-QDQ", "right"),
                      ("ratio L2", "right"), ("ratio L∞", "right"), ("BC", "right"), ("records", "right")):
        t.add_column(col, justify=just, no_wrap=col != "tensor", overflow="fold",
                     min_width=24 if col == "tensor" else None)
    for _, r in rows.iterrows():
        hot = max(r["ratio_l2"] if r["ratio_l2"] == r["ratio_l2"] else 0, 0) > tw.k
        ratio = fmt_num(r["ratio_l2"], 3)
        t.add_row(escape(r["part"]), escape(r["ref_name"]), fmt_num(r["rel_l2_test"]), fmt_num(r["rel_l2_expected"]),
                  f"[red]{ratio}[/red]" if hot else ratio, fmt_num(r["ratio_linf"], 3), fmt_num(r["bc"], 3),
                  str(int(r["records"])))
    return t
