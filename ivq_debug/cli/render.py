"""Terminal rendering of dumps, comparisons and findings: tables that keep the tensor name, output that pipes.

A command builds :class:`TableData` (columns + raw rows) and plain lines and hands them to :func:`emit`, which
renders them for where stdout goes (``--format``, :data:`FORMATS`):

- ``table`` (the default on a terminal): a rich table that fits the terminal. The tensor-name column never
  shrinks below the name: numeric and other droppable columns go first (:attr:`Col.drop`, highest first; a
  caption says which), and only when the names alone still do not fit is each name shortened in the middle
  (``/vision/blocks.0/…/MaskAdd_output_0``), never wrapped.
- ``tsv`` (the default when stdout is not a terminal): one line per row, tab-separated, a ``#`` title line and a
  header line, every name whole, so ``ivq ls d.h5 | grep NAME`` finds each tensor and lines never wrap.
- ``json``: the rows as one JSON document, values raw.

Everything read from a file (names, parts, op types, paths, messages, backend info) is untrusted: table cells
and plain lines go through :func:`~ivq_debug.errors.printable` (control characters shown as escapes; a tab or a
newline inside a name cannot break a TSV row), rich markup strings through :func:`~ivq_debug.cli.common.escape`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ivq_debug.cli.common import escape, fmt_bytes, fmt_num, safe
from ivq_debug.errors import UsageError, printable
from ivq_debug.jsonio import json_safe

SEV_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
#: ``--format`` values (``None``: ``table`` on a terminal, else ``tsv``)
FORMATS = ("table", "tsv", "json")
#: a name column is never narrower than this on a terminal (below, the name no longer identifies the tensor)
NAME_MIN_WIDTH = 24
#: other columns are dropped until each name column gets this many cells (or its whole names), the rest of the
#: line then goes to the names: a name shortened to 40 cells keeps its scope's head and its op and output
NAME_KEEP_WIDTH = 40
ELLIPSIS = "…"


@dataclass(frozen=True)
class Col:
    """One column of a :class:`TableData`.

    Attributes:
        header: the column title.
        key: the row key of its raw value.
        kind: ``name`` (identifies a tensor: never dropped, shortened in the middle only as a last resort),
            ``num`` (right-aligned) or ``text``.
        drop: on a narrow terminal, columns with the highest ``drop`` go first; 0: always kept.
        fmt: raw value → cell text (default: ``fmt_num`` for ``num``, ``str`` otherwise; None → ``""``).
        style: row → rich style of the cell (terminal only), or None.
    """

    header: str
    key: str
    kind: str = "text"
    drop: int = 0
    fmt: Callable[[Any], str] | None = None
    style: Callable[[dict[str, Any]], str | None] | None = None

    def text(self, row: dict[str, Any]) -> str:
        """The cell text of ``row`` (unescaped)."""
        v = row.get(self.key)
        if self.fmt is not None:
            return self.fmt(v)
        if self.kind == "num":
            return fmt_num(v)
        return "" if v is None else str(v)


@dataclass
class TableData:
    """A table as data: a title, :class:`Col` s and one dict of raw values per row (rendered by :func:`emit`)."""

    title: str
    columns: list[Col]
    rows: list[dict[str, Any]] = field(default_factory=list)
    caption: str = ""
    #: facts about the whole table, raw (JSON: keys beside ``rows``; the caption says them in words)
    facts: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """``{"title", "columns", "rows"}`` (and the :attr:`facts`): each row keyed by column header, values raw
        (JSON-safe)."""
        return {"title": self.title, "columns": [c.header for c in self.columns],
                "rows": [{c.header: json_safe(r.get(c.key)) for c in self.columns} for r in self.rows],
                **json_safe(self.facts)}


def is_terminal(con: Any) -> bool:
    """True when ``con`` (a rich console) writes to a terminal (its stream's ``isatty``; ``FORCE_COLOR`` aside)."""
    isatty = getattr(getattr(con, "file", None), "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:
        return False


def resolve_format(fmt: str | None, con: Any) -> str:
    """The ``--format`` to render with: as given, else ``table`` on a terminal and ``tsv`` elsewhere."""
    if fmt is None:
        return "table" if is_terminal(con) else "tsv"
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def ellipsize_middle(text: str, width: int, among: Iterable[str] = ()) -> str:
    """``text`` cut to ``width`` terminal cells by replacing its middle with ``…``. The tail, where a tensor name
    says its layer, op and output, keeps at least half; when the cut would read the same as another name of
    ``among`` (``…/blocks.0/ln/…`` vs ``…/blocks.1/ln/…``), the cut moves towards the head until it does not."""
    from rich.cells import cell_len

    if cell_len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:max(width, 0)]
    keep = width - 1
    others = [o for o in among if o != text]

    def cut(n_head: int) -> str:
        head, tail = text[:n_head], text[len(text) - (keep - n_head):]
        while cell_len(head) + cell_len(tail) > keep:  # wide characters
            if len(head) >= len(tail):
                head = head[:-1]
            else:
                tail = tail[1:]
        return f"{head}{ELLIPSIS}{tail}"

    first = cut(keep // 2)
    for n_head in range(keep // 2, -1, -1):
        short = cut(n_head)
        head, _, tail = short.partition(ELLIPSIS)
        if not any(o.startswith(head) and o.endswith(tail) for o in others):
            return short
    return first


def _lines(text: str) -> list[str]:
    return [printable(s) for s in text.split("\n")]


def _layout(td: TableData, width: int) -> tuple[list[Col], dict[str, int], list[Col]]:
    """The columns kept, the name columns' widths and the columns dropped for a terminal ``width`` wide: columns
    are dropped (empty ones first, then by :attr:`Col.drop`) until every name column gets its whole names or
    :data:`NAME_KEEP_WIDTH` cells; the names then take the rest of the line."""
    from rich.cells import cell_len

    cells = {c.key: [ln for r in td.rows for ln in _lines(c.text(r))] for c in td.columns}
    natural = {c.key: max([cell_len(c.header), *(cell_len(s) for s in cells[c.key])]) for c in td.columns}
    empty = {c.key for c in td.columns if c.drop and all(s in ("", "-") for s in cells[c.key])}

    def total(cs: list[Col]) -> int:  # rich's default box: "│ cell │", padding 1 on each side
        return sum(natural[c.key] for c in cs) + 3 * len(cs) + 1

    names = [c for c in td.columns if c.kind == "name"]
    want = {c.key: min(natural[c.key], NAME_KEEP_WIDTH) for c in names}

    def fits(cs: list[Col]) -> bool:  # with each name at the width it must keep
        return total(cs) - sum(natural[c.key] - want[c.key] for c in names) <= width

    kept = list(td.columns)
    order = sorted((c for c in td.columns if c.drop), key=lambda c: (c.key not in empty, -c.drop))
    dropped = []
    for c in order:
        if fits(kept):
            break
        kept.remove(c)
        dropped.append(c)
    widths = {c.key: natural[c.key] for c in names}
    over = total(kept) - width
    if over > 0 and names:
        each = max(NAME_MIN_WIDTH, (sum(widths.values()) - over) // len(names))
        for c in names:
            widths[c.key] = min(natural[c.key], each)
    return kept, widths, [c for c in dropped if c.key not in empty]


def rich_table(td: TableData, width: int) -> Any:
    """``td`` as a rich Table that fits ``width`` columns (see the module docstring)."""
    from rich.table import Table
    from rich.text import Text

    kept, widths, dropped = _layout(td, width)
    caption = td.caption
    if dropped:
        caption = (caption + " · " if caption else "") + (
            f"not shown at {width} columns: {', '.join(c.header for c in dropped)} (--format tsv shows every column)")
    t = Table(title=safe(td.title), title_justify="left", header_style="bold", caption=caption or None,
              caption_justify="left")
    for c in kept:
        w = widths.get(c.key)
        t.add_column(c.header, justify="right" if c.kind == "num" else "left", no_wrap=True, overflow="ellipsis",
                     min_width=w, max_width=w)
    among = {key: sorted({ln for r in td.rows for ln in _lines(next(c for c in kept if c.key == key).text(r))})
             for key in widths}
    for r in td.rows:
        row = []
        for c in kept:
            lines = _lines(c.text(r))
            if c.key in widths:
                lines = [ellipsize_middle(s, widths[c.key], among[c.key]) for s in lines]
            row.append(Text("\n".join(lines), style=(c.style(r) if c.style else None) or ""))
        t.add_row(*row)
    return t


def tsv_lines(td: TableData) -> list[str]:
    """``td`` as TSV lines: ``# title``, the header, one line per row (cells escaped, multi-line cells joined)."""
    out = [f"# {printable(td.title)}"] if td.title else []
    out.append("\t".join(printable(c.header) for c in td.columns))
    for r in td.rows:
        out.append("\t".join(" ".join(_lines(c.text(r))) for c in td.columns))
    if td.caption:
        out.append(f"# {printable(td.caption)}")
    return out


def emit(con: Any, items: Iterable[Any], fmt: str) -> None:
    """Print tables and lines to ``con`` in format ``fmt`` (``table``, ``tsv``; ``json``: the tables only, one
    document: the table's own when there is one, else ``{"tables": [...]}``). A line is a rich ``Text`` (or a
    markup string); off ``table`` it is printed unwrapped."""
    items = list(items)
    if fmt == "json":
        tables = [i.to_json() for i in items if isinstance(i, TableData)]
        doc = tables[0] if len(tables) == 1 else {"tables": tables}
        con.file.write(json.dumps(doc, indent=1, allow_nan=False) + "\n")
        con.file.flush()
        return
    for item in items:
        if isinstance(item, TableData):
            if fmt == "table":
                con.print(rich_table(item, con.width))
            else:
                con.file.write("".join(f"{line}\n" for line in tsv_lines(item)))  # raw: rich would expand tabs
                con.file.flush()
        elif fmt == "table":
            con.print(item)
        else:
            con.print(item, soft_wrap=True)


def print_line(con: Any, markup: str) -> None:
    """Print one markup line unwrapped (a verdict: ``… | tail -1`` is the whole line)."""
    con.print(markup, soft_wrap=True)


def _rec(d: dict[str, Any] | Any) -> str:
    """``sample/part[/step]`` of a record (raw: escape it for the context)."""
    part, step = d["part"], d["step"]
    return f"{d['sample']}/{part}" + (f"/{step}" if part == "decode" or step else "")


def dump_header(dump: Any) -> str:
    """One-line description of a dump (raw text)."""
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
    return f"{dump.path} ({dump.backend}){tail}"


def _dash(v: Any) -> str:
    return "" if v in (None, 0) else str(v)


def manifest_table(dump: Any, limit: int | None = None, kind: str | None = None) -> TableData:
    """The manifest of a dump (``ivq ls``): one row per tensor or input."""
    cols = [Col("record", "record"), Col("#", "order", drop=9), Col("name", "name", "name"), Col("op", "op", drop=6),
            Col("shape", "shape", drop=5), Col("dtype", "dtype", drop=7), Col("min", "min", "num", drop=4),
            Col("max", "max", "num", drop=3), Col("mean", "mean", "num", drop=10), Col("std", "std", "num", drop=11),
            Col("nf", "nonfinite", "num", drop=2, fmt=_dash), Col("q", "q", drop=8)]
    ents = [e for e in dump.entries if kind is None or e.kind == kind]
    ents.sort(key=lambda e: (e.rid, e.kind != "input", e.order))
    rows = []
    for e in ents[:limit]:
        enc = e.encoding
        rows.append({"record": f"{e.sample}/{e.part}/{e.step}", "order": "in" if e.kind == "input" else str(e.order),
                     "name": e.name, "op": e.op_type or "", "shape": "x".join(map(str, e.shape)) or "scalar",
                     "dtype": e.dtype, **{k: e.stats.get(k) for k in ("min", "max", "mean", "std")},
                     "nonfinite": e.stats.get("nonfinite") or 0,
                     "q": f"u{enc.get('bitwidth')}" if isinstance(enc, dict) else ""})
    return TableData(dump_header(dump), cols, rows, *_size_facts(dump))


def records_table(dump: Any) -> TableData:
    """The records of a dump (``ivq ls --records``)."""
    cols = [Col("rid", "rid"), Col("sample", "sample"), Col("part", "part"), Col("step", "step"),
            Col("meta", "meta", drop=1, fmt=lambda v: json.dumps(json_safe(v), sort_keys=True))]
    rows = [{"rid": rid, "sample": sample, "part": part, "step": step, "meta": dump.record_meta(rid)}
            for (sample, part, step), rid in sorted(dump.record_keys().items(), key=lambda kv: kv[1])]
    return TableData(str(dump.path), cols, rows, *_size_facts(dump))


def _size_facts(dump: Any) -> tuple[str, dict[str, Any]]:
    """The caption and JSON facts of a dump's size (``ivq ls``): the file against the values it holds."""
    sz = dump.size()
    held = [f"tensors {fmt_bytes(sz.tensors)}"] + [f"{label} {fmt_bytes(v)}" for label, v in
                                                   (("raw integers", sz.raw), ("inputs", sz.inputs)) if v]
    text = f"on disk {fmt_bytes(sz.file)}: {sz.file / sz.data:.2f}× the {fmt_bytes(sz.data)} of values it holds " \
           f"({', '.join(held)})" if sz.data else f"on disk {fmt_bytes(sz.file)}"
    if sz.derived:
        text += f"; {fmt_bytes(sz.derived)} of quantized tensors' values rebuilt from their integers"
    if sz.summarized:
        text += f"; {fmt_bytes(sz.summarized)} of tensors kept as statistics and samples"
    return text, {"size": sz.to_json()}


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
        rows.append(("raw integers", "stored (the values are rebuilt from them)" if e.derived
                     else "stored" if e.has_raw else "no"))
    for k, v in rows:
        t.add_row(k, escape(v))
    return t


def _status_style(row: dict[str, Any]) -> str | None:
    return None if row["passed"] else "red"


def worst_table(cmp: Any, top: int) -> TableData:
    """The ``top`` worst tensor pairs by the comparison's rank metric (``ivq-diff``)."""
    broken = getattr(cmp, "contract", None) is not None and cmp.contract.status == "broken"
    metrics = [("sqnr_db", 4, 1), ("cosine", 6, 3), ("max_abs", 4, 4), ("rel_l2", 4, 2)]
    if cmp.rank_by not in {m for m, _, _ in metrics}:
        metrics.insert(0, (cmp.rank_by, 4, 1))
    cols = [Col("rank", "rank", "num", drop=8, fmt=str), Col("record", "record"), Col("tensor", "tensor", "name"),
            Col("op", "op", drop=7)]
    for m, digits, drop in metrics:
        cols.append(Col(m, m, "num", drop=0 if m == cmp.rank_by else drop + 2,
                        fmt=lambda v, d=digits: fmt_num(v, d)))
    cols.append(Col("status", "status", style=_status_style))
    rows = []
    for i, (_, r) in enumerate(cmp.worst(top).iterrows(), 1):
        name = r["ref_name"] + ("" if r["test_name"] == r["ref_name"] else f"\n→ {r['test_name']}")
        status = r["status"] if r["passed"] else "FAIL " + ", ".join(r["violations"])
        if broken:
            status += " · inputs differ"
        rows.append({"rank": i, "record": _rec(r), "tensor": name, "op": r["op_type"] or "", "status": status,
                     "passed": bool(r["passed"]), **{m: r.get(m) for m, _, _ in metrics}})
    return TableData(f"worst {len(rows)} by {cmp.rank_by}", cols, rows)


def comparison_report(cmp: Any, top: int) -> list[Any]:
    """What ``ivq-diff`` prints before its verdict: header lines, the worst layers, the three-way table, the first
    divergence, findings, regressions and unmatched names (tables as :class:`TableData`, lines as rich Text)."""
    from rich.text import Text

    out: list[Any] = []
    s = cmp.summary
    out.append(Text.assemble(("ref  ", "bold"), safe(dump_header(cmp.ref))))
    out.append(Text.assemble(("test ", "bold"), safe(dump_header(cmp.test))))
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
        out.append(Text(safe(contract.line() + (" — compared anyway (--allow-input-mismatch)" if broken else "")),
                        style=style))
        for w in getattr(contract, "warnings", []):
            out.append(Text(safe(f"warning: {w}"), style="yellow"))
    out.append(worst_table(cmp, top))
    tw = getattr(cmp, "three_way", None)
    if tw is not None:
        out.append(three_way_table(tw, top))
    fd = cmp.first_divergence
    if fd is None:
        out.append(Text("first divergence: none", style="green"))
    else:
        out.append(Text.assemble(("first divergence", "bold"), safe(
            f": {fd['ref_name']} ({_rec(fd)}, order {fd['order']}) sqnr {fmt_num(fd['sqnr_db'])} dB, "
            f"max_abs {fmt_num(fd['max_abs'])}, status {fd['status']}")))
    for f in cmp.findings:
        style = SEV_STYLE.get(f.severity, "")
        out.append(Text.assemble((f"{f.severity:7s}", style), " ", (safe(f.kind), "bold"), safe(f": {f.message}")))
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


def three_way_table(tw: Any, top: int) -> TableData:
    """The layers with the largest backend / CPU-QDQ error ratios (pooled over records)."""
    layers = tw.layers()
    keyed = layers.assign(_r=layers[["ratio_l2", "ratio_linf"]].max(axis=1).fillna(-1.0))
    rows = keyed.sort_values("_r", ascending=False, kind="stable").head(top)

    def hot(r: dict[str, Any]) -> str | None:
        v = r["ratio_l2"]
        return "red" if v == v and v is not None and v > tw.k else None

    cols = [Col("part", "part", drop=6), Col("tensor", "ref_name", "name"),
            Col("rel-L2 test", "rel_l2_test", "num", drop=4), Col("rel-L2 CPU-QDQ", "rel_l2_expected", "num", drop=3),
            Col("ratio L2", "ratio_l2", "num", fmt=lambda v: fmt_num(v, 3), style=hot),
            Col("ratio L∞", "ratio_linf", "num", drop=2, fmt=lambda v: fmt_num(v, 3)),
            Col("BC", "bc", "num", drop=5, fmt=lambda v: fmt_num(v, 3)),
            Col("records", "records", "num", drop=7, fmt=lambda v: str(int(v)))]
    return TableData(f"backend vs quantization (expected {tw.expected.path}, k {tw.k:g}): largest error ratios per "
                     "layer", cols, [r for r in rows.to_dict("records")])
