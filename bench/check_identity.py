"""Bit-identity check for changes that must not change any result: dumps, diff tables, ``ivq-diff/1`` JSON.

Three modes:

- ``table REF.h5 TEST.h5 -o OUT.json``: run ``compare()`` and write every column of every row of the table
  (floats as ``float.hex``, so equal means bit-equal) and the ``ivq-diff/1`` document. Run it once with each
  revision (``PYTHONPATH=<checkout>``), on the same or on re-captured dumps.
- ``compare A.json B.json [--rel]``: both outputs of ``table`` (or two ``ivq-diff --json`` files) must be equal:
  every metric of every pair, statuses, verdicts, findings, summary; the dumps' paths and creation times are
  ignored. Prints the number of pairs and values checked and the first differences; exit 1 on any. With
  ``--rel``, also per field how many values differ and by how much (for a deliberately re-pinned definition).
  With ``--pairs``, for revisions whose tables differ in shape (a column or pairs added in between): rows are
  matched by pair (record, both names) and every common column of every pair in both is compared.
- ``dumps A.h5 B.h5``: two dumps of the same capture must hold the same manifest rows, record attributes and
  the same bytes in every dataset (provenance attributes such as ``created`` and ``command``, and the QNN
  profiling timings, are ignored). A format-version-1 dump against a version-2 one (quantized tensors stored as
  their integers only, ``docs/dump-format.md``): a tensor's values (``t/<key>``) in one and its integers alone in
  the other must agree as the reader returns them (``Dump.read``: the values rebuilt from the integers, bit for
  bit), the integers' dataset carries the values' attributes (plus ``derived``), and the manifests agree on every
  column but ``derived``.

    python bench/check_identity.py table golden/a.h5 golden/b.h5 -o /tmp/after.json
    python bench/check_identity.py compare /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

#: root attributes that differ between two captures of the same thing (provenance)
PROVENANCE = {"created", "command", "host", "tool_version", "backend_info", "model"}
#: datasets that hold measured timings (QNN profiling), which differ from run to run
TIMINGS = {"tables/profiling"}
#: keys of an ivq-diff/1 document's ref/test blocks that name the file rather than describe results
DUMP_IDENTITY = {"path", "created", "backend_info", "model"}


def exact(v: Any) -> Any:
    """A JSON value in which floats are exact (``float.hex``) and numpy scalars / tuples are plain."""
    import numpy as np

    if isinstance(v, (float, np.floating)):
        return float(v).hex() if math.isfinite(v) else repr(float(v))
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, dict):
        return {str(k): exact(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [exact(x) for x in v]
    return v


def table_mode(ref: str, test: str, out: str) -> int:
    """Full comparison table + ivq-diff/1 document of one dump pair, exactly."""
    from ivq_debug.comparator import compare

    cmp = compare(ref, test, progress=False)
    rows = [exact(r) for r in cmp.table.to_dict(orient="records")]
    doc = {"columns": list(cmp.table.columns), "rows": rows, "ivq-diff": exact(cmp.to_json())}
    Path(out).write_text(json.dumps(doc))
    print(f"{out}: {len(rows)} rows × {len(doc['columns'])} columns")
    return 0


def _normalize(doc: dict[str, Any]) -> dict[str, Any]:
    d = doc.get("ivq-diff", doc)
    ident = d.get("contract", {}).get("identity", {}) if isinstance(d.get("contract"), dict) else {}
    for side in ("ref", "test"):
        if isinstance(d.get(side), dict):
            d[side] = {k: v for k, v in d[side].items() if k not in DUMP_IDENTITY}
        if isinstance(ident, dict) and isinstance(ident.get(side), dict):  # the contract names the files too
            ident[side] = {k: v for k, v in ident[side].items() if k != "path"}
    return doc


def _walk(a: Any, b: Any, where: str, diffs: list[str], counter: list[int],
          values: list[tuple[str, Any, Any]] | None = None) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                diffs.append(f"{where}.{k}: only in {'B' if k not in a else 'A'}")
                continue
            _walk(a[k], b[k], f"{where}.{k}", diffs, counter, values)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{where}: {len(a)} vs {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _walk(x, y, f"{where}[{i}]", diffs, counter, values)
        return
    counter[0] += 1
    if a != b and not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        diffs.append(f"{where}: {a!r} != {b!r}")
        if values is not None:
            values.append((where, a, b))


def _number(v: Any) -> float | None:
    """A value as a float when it is one (a number, or a ``float.hex`` string of ``table``), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float.fromhex(v) if v.startswith(("0x", "-0x")) else None
        except ValueError:
            return None
    return None


def _field(where: str) -> str:
    """The name of the value a difference is in (``$.rows[3].sqnr_db`` -> ``sqnr_db``)."""
    last = where.rsplit(".", 1)[-1]
    return last.split("[", 1)[0] or where


def spread(values: list[tuple[str, Any, Any]]) -> list[str]:
    """Per field: how many values differ and by how much (relative), for a re-pinned definition. With a
    ``table`` output, only its rows (execution order) are summarized: the document's layers are sorted worst
    first, and values that moved in their last bits can swap two layers, which differs everywhere."""
    by: dict[str, list[float]] = {}
    other = 0
    rows = [v for v in values if v[0].startswith("$.rows[")]
    if rows:
        values = rows
    for where, x, y in values:
        fx, fy = _number(x), _number(y)
        if fx is None or fy is None or not (math.isfinite(fx) and math.isfinite(fy)):
            other += 1
            continue
        scale = max(abs(fx), abs(fy))
        by.setdefault(_field(where), []).append(abs(fx - fy) / scale if scale else 0.0)
    lines = [f"  {k}: {len(v)} values differ, relative difference max {max(v):.2e}, median "
             f"{sorted(v)[len(v) // 2]:.2e}" for k, v in sorted(by.items())]
    if other:
        lines.append(f"  {other} other differences (not two finite numbers)")
    return lines


def compare_mode(a: str, b: str, show: int = 20, rel: bool = False) -> int:
    """Every value of two ``table`` outputs (or two ivq-diff/1 files) must be equal; ``rel``: also say, per
    field, how many values differ and by how much."""
    da, db = _normalize(json.loads(Path(a).read_text())), _normalize(json.loads(Path(b).read_text()))
    diffs: list[str] = []
    values: list[tuple[str, Any, Any]] = []
    counter = [0]
    _walk(da, db, "$", diffs, counter, values)
    pairs = len(da["rows"]) if "rows" in da else len(da.get("layers", []))
    verdict = "IDENTICAL" if not diffs else f"{len(diffs)} DIFFERENCES"
    print(f"{a} vs {b}: {pairs} pairs, {counter[0]} values compared: {verdict}")
    for d in diffs[:show]:
        print("  " + d)
    if rel and diffs:
        print("by field" + (" (table rows)" if "rows" in da else "") + ":")
        for ln in spread(values):
            print(ln)
    return 0 if not diffs else 1


def _pair_rows(doc: dict[str, Any], columns: list[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """A ``table`` output's rows by pair (record and both names), restricted to ``columns``."""
    key = ("sample", "part", "step", "ref_name", "test_name")
    return {tuple(str(r.get(k)) for k in key): {c: r.get(c) for c in columns} for r in doc["rows"]}


def pairs_mode(a: str, b: str, show: int = 20, rel: bool = False) -> int:
    """Two ``table`` outputs of revisions whose tables differ in shape (a column or pairs added in between):
    every metric of every pair present in both must be equal, on the columns both have (``order``, a pair's
    place in the table, left out)."""
    da, db = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    cols = [c for c in da["columns"] if c in db["columns"] and c != "order"]
    ra, rb = _pair_rows(da, cols), _pair_rows(db, cols)
    both = sorted(set(ra) & set(rb))
    diffs: list[str] = []
    values: list[tuple[str, Any, Any]] = []
    counter = [0]
    for k in both:
        _walk(ra[k], rb[k], f"$.rows[{'/'.join(k)}]", diffs, counter, values)
    verdict = "IDENTICAL" if not diffs else f"{len(diffs)} DIFFERENCES"
    print(f"{a} vs {b}: {len(both)} pairs in both ({len(set(ra) - set(rb))} only in A, {len(set(rb) - set(ra))} "
          f"only in B), {len(cols)} common columns, {counter[0]} values compared: {verdict}")
    print(f"  columns only in A: {sorted(set(da['columns']) - set(db['columns']))}; "
          f"only in B: {sorted(set(db['columns']) - set(da['columns']))}")
    for d in diffs[:show]:
        print("  " + d)
    if rel and diffs:
        print("by field:")
        for ln in spread(values):
            print(ln)
    return 0 if not diffs else 1


def _attrs(obj: Any) -> dict[str, tuple[str, bytes]]:
    """An object's attributes as (value, serialized HDF5 datatype): equal means same value and same type."""
    return {k: (str(obj.attrs[k]), obj.attrs.get_id(k).get_type().encode()) for k in obj.attrs}


def _manifest_rows(f: Any) -> list[dict[str, Any]]:
    """The manifest's rows as dicts without the version-2 column ``derived`` (how a tensor is stored)."""
    doc = json.loads(f["manifest"][()])
    return [{c: v for c, v in zip(doc["columns"], r, strict=True) if c != "derived"} for r in doc["rows"]]


def _derived(f: Any) -> dict[str, str]:
    """A version-2 dump's tensors stored as integers only: ``records/<rid>/t/<key>`` -> ``records/<rid>/q/<key>``."""
    doc = json.loads(f["manifest"][()])
    if "derived" not in doc["columns"]:
        return {}
    c = {n: i for i, n in enumerate(doc["columns"])}
    return {f"records/{r[c['rid']]}/t/{r[c['key']]}": f"records/{r[c['rid']]}/q/{r[c['key']]}"
            for r in doc["rows"] if r[c["derived"]]}


def dumps_mode(a: str, b: str, show: int = 20) -> int:
    """Two dumps: manifest, record attributes and every dataset's bytes must be equal (a version-1 dump against
    a version-2 one: the values rebuilt from the integers, see the module docstring)."""
    import h5py
    import numpy as np

    from ivq_debug.dump import open_dump

    diffs: list[str] = []
    n = 0
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb, open_dump(a) as da, open_dump(b) as db:
        derived = {**_derived(fa), **_derived(fb)}  # t/<key> of the values -> q/<key> of the integers alone
        for k in sorted(set(fa.attrs) | set(fb.attrs)):
            if k in PROVENANCE or (k == "format_version" and derived):
                continue
            if k not in fa.attrs or k not in fb.attrs or _attrs(fa).get(k) != _attrs(fb).get(k):
                diffs.append(f"root attribute {k}")
        if fa["manifest"][()] != fb["manifest"][()] and (not derived or _manifest_rows(fa) != _manifest_rows(fb)):
            diffs.append("manifest differs")
        names_a: list[str] = []
        names_b: list[str] = []
        fa.visit(names_a.append)
        fb.visit(names_b.append)
        only = set(names_a) ^ set(names_b)
        by_path: dict[int, dict[str, Any]] = {}
        for name in sorted(only):  # a tensor's values in one dump, its integers alone in the other
            f, d, other = (fa, db, fb) if name in fa else (fb, da, fa)
            q = derived.get(name)
            if q is None or q not in other:
                if not (name.endswith("/t") and any(k.startswith(name + "/") for k in derived)):
                    diffs.append(f"{name}: only in {a if f is fa else b}")
                continue
            n += 1
            e = by_path.setdefault(id(d), {f"records/{x.rid}/t/{x.key}": x for x in d.entries if x.derived})[name]
            vals, rebuilt = np.asarray(f[name][()]), d.read(e)
            if vals.dtype != rebuilt.dtype or vals.shape != rebuilt.shape or vals.tobytes() != rebuilt.tobytes():
                diffs.append(f"{name}: the values rebuilt from {q} differ")
            qa = {k: v for k, v in _attrs(other[q]).items() if k != "derived"}
            if qa != _attrs(f[name]):
                diffs.append(f"{q}: attributes differ from the values' ({name})")
        for name in sorted(set(names_a) & set(names_b)):
            oa, ob = fa[name], fb[name]
            if name in derived.values() and set(derived) & only:
                pass  # the integers alone in one dump carry the values' attributes: compared with them above
            elif name != "manifest" and _attrs(oa) != _attrs(ob):
                diffs.append(f"{name}: attributes differ")
            if isinstance(oa, h5py.Dataset):
                n += 1
                if name == "manifest" or name in TIMINGS:
                    continue
                if oa.dtype != ob.dtype or oa.shape != ob.shape:
                    diffs.append(f"{name}: {oa.dtype}{oa.shape} vs {ob.dtype}{ob.shape}")
                elif oa.attrs.get("summary_only", False):
                    continue
                elif np.asarray(oa[()]).tobytes() != np.asarray(ob[()]).tobytes() and not (
                        name.startswith("meta/") and json.loads(oa[()]) == json.loads(ob[()])):
                    diffs.append(f"{name}: data differs")  # (a /meta JSON value: equal as JSON, key order aside)
    verdict = "IDENTICAL" if not diffs else f"{len(diffs)} DIFFERENCES"
    print(f"{a} vs {b}: {n} datasets compared: {verdict}")
    for d in diffs[:show]:
        print("  " + d)
    return 0 if not diffs else 1


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("table")
    t.add_argument("ref")
    t.add_argument("test")
    t.add_argument("-o", "--output", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--rel", action="store_true",
                   help="also print, per field, how many values differ and their largest relative difference")
    c.add_argument("--pairs", action="store_true",
                   help="table outputs of revisions with different tables: match rows by pair, common columns")
    d = sub.add_parser("dumps")
    d.add_argument("a")
    d.add_argument("b")
    o = ap.parse_args(argv)
    if o.mode == "table":
        return table_mode(o.ref, o.test, o.output)
    if o.mode == "compare":
        return (pairs_mode if o.pairs else compare_mode)(o.a, o.b, rel=o.rel)
    return dumps_mode(o.a, o.b)


if __name__ == "__main__":
    sys.exit(main())
