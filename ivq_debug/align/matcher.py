"""Layer alignment between two dumps.

Records pair by ``(sample, part, step)``. Inside a record pair, tensors are matched by the first
strategy that applies (the strategy is kept in the ``match`` column):

1. ``exact``: identical names;
2. ``qdq``: names equal after stripping QDQ suffixes (``_QuantizeLinear_Input``, ``_DequantizeLinear_Output``, …);
   ``input``: a tensor captured from a graph input (its quantization) ↔ the model input recorded on the
   other side;
3. ``qnn``: names equal after QNN sanitizing (per character or collapsed runs), when unique;
4. ``scope``: a PyTorch module path ↔ the last ONNX tensor in that module's scope subtree (legacy
   exporter scope names or dynamo ``name_scopes`` metadata, recorded at capture) whose shape matches
   (then whose element count matches); tuple outputs ``name[i]`` match per index;
5. ``map``: a user mapping (``{ref_name: test_name}``), tried first when given.

Everything left is reported as unmatched (names and counts per side), never dropped silently.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ivq_debug.dump.reader import Dump, Entry
from ivq_debug.qnn.names import qnn_sanitize

QDQ_SUFFIXES = (
    "_QuantizeLinear_Input",
    "_QuantizeLinear_Output",
    "_DequantizeLinear_Output",
    "_ReshapedSavedOutput",
    "_quantized",
    "_dequantized",
)

_INDEX_RE = re.compile(r"^(?P<base>.*?)(?P<call>#\d+)?(?P<idx>(\[\d+\]|\.[A-Za-z_]\w*)*)$")
PART_ORDER = {"vision": 0, "model": 1, "prefill": 2, "decode": 3}


def strip_qdq(name: str) -> str:
    """Remove one QDQ naming suffix, if any."""
    for s in QDQ_SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


@dataclass(frozen=True)
class Pair:
    """Two aligned tensors."""

    ref: Entry
    test: Entry
    match: str


@dataclass
class Alignment:
    """Result of aligning two dumps."""

    pairs: list[Pair]
    unmatched_ref: list[Entry] = field(default_factory=list)
    unmatched_test: list[Entry] = field(default_factory=list)
    unmatched_ref_records: list[tuple[int, str, int]] = field(default_factory=list)
    unmatched_test_records: list[tuple[int, str, int]] = field(default_factory=list)

    @property
    def unmatched_fraction(self) -> float:
        """Unmatched share of the side with fewer tensors (0 when both sides are empty)."""
        n_ref = len(self.pairs) + len(self.unmatched_ref)
        n_test = len(self.pairs) + len(self.unmatched_test)
        if min(n_ref, n_test) == 0:
            return 0.0 if max(n_ref, n_test) == 0 else 1.0
        if n_ref <= n_test:
            return len(self.unmatched_ref) / n_ref
        return len(self.unmatched_test) / n_test

    def counts(self) -> dict[str, int]:
        """Counts per category."""
        return {
            "pairs": len(self.pairs),
            "unmatched_ref": len(self.unmatched_ref),
            "unmatched_test": len(self.unmatched_test),
            "unmatched_ref_records": len(self.unmatched_ref_records),
            "unmatched_test_records": len(self.unmatched_test_records),
        }


def _scope_matches(module: str, scope: str) -> bool:
    return module == scope or module.endswith("." + scope) or scope.endswith("." + module)


def _split_torch_name(e: Entry) -> tuple[str, str]:
    """(module path, call suffix) of a torch capture entry (its ``scope`` is the module path)."""
    if e.scope and e.name.startswith(e.scope):
        rest = e.name[len(e.scope) :]
        return e.scope, rest.split("[")[0].split(".")[0] if rest.startswith("#") else ""
    m = _INDEX_RE.match(e.name)
    assert m is not None
    return m.group("base"), m.group("call") or ""


def _match_scope(torch_side: list[Entry], onnx_side: list[Entry]) -> list[tuple[Entry, Entry]]:
    """Match torch module outputs to ONNX tensors through recorded scopes, confirmed by shape.

    A module's output is the *latest* tensor of its scope subtree with a compatible shape. An ONNX
    tensor may serve several torch outputs (a container module returning its last child's output).
    """
    by_scope: dict[str, list[Entry]] = defaultdict(list)
    for e in onnx_side:
        if e.scope:
            by_scope[e.scope].append(e)
    scopes = list(by_scope)
    # expand each scope to its ancestors so a module matches its whole subtree
    subtree: dict[str, list[Entry]] = defaultdict(list)
    for sc, ents in by_scope.items():
        parts = sc.split(".")
        for k in range(1, len(parts) + 1):
            subtree[".".join(parts[:k])].extend(ents)
    del scopes
    out: list[tuple[Entry, Entry]] = []
    # group torch outputs of one module call (tuple indices)
    groups: dict[tuple[str, str], list[Entry]] = defaultdict(list)
    for e in torch_side:
        base, call = _split_torch_name(e)
        if call:  # repeated calls have no distinct ONNX scope
            continue
        groups[(base, call)].append(e)
    keys = list(subtree)
    for (base, _call), outs in groups.items():
        cand_scopes = [k for k in keys if _scope_matches(base, k)]
        if not cand_scopes:
            continue
        # most specific: the longest matching scope
        sc = max(cand_scopes, key=len)
        cands = sorted({id(c): c for c in subtree[sc]}.values(), key=lambda c: c.order)
        # walk torch outputs from the last index backwards, picking the latest compatible candidate
        limit = math.inf
        for te in sorted(outs, key=lambda e: e.order, reverse=True):
            pick = None
            for rule in ("shape", "numel"):
                for c in reversed(cands):
                    if c.order >= limit:
                        continue
                    ok = c.shape == te.shape if rule == "shape" else (c.size == te.size and c.size > 0)
                    if ok:
                        pick = c
                        break
                if pick:
                    break
            if pick is not None:
                limit = pick.order
                out.append((te, pick))
    return out


def align(ref: Dump, test: Dump, mapping: dict[str, str] | None = None) -> Alignment:
    """Align the tensors of two dumps (see module docstring)."""
    rk, tk = ref.record_keys(), test.record_keys()
    rec_pairs: list[tuple[str, str]] = []
    if len(rk) == 1 and len(tk) == 1 and set(rk) != set(tk):
        rec_pairs.append((next(iter(rk.values())), next(iter(tk.values()))))
        un_ref_recs: list[Any] = []
        un_test_recs: list[Any] = []
    else:
        for key in sorted(set(rk) & set(tk), key=lambda k: (k[0], PART_ORDER.get(k[1], 9), k[2])):
            rec_pairs.append((rk[key], tk[key]))
        un_ref_recs = sorted(set(rk) - set(tk))
        un_test_recs = sorted(set(tk) - set(rk))
    by_rid_ref: dict[str, list[Entry]] = defaultdict(list)
    by_rid_test: dict[str, list[Entry]] = defaultdict(list)
    for e in ref.tensors():
        by_rid_ref[e.rid].append(e)
    for e in test.tensors():
        by_rid_test[e.rid].append(e)
    inputs_ref: dict[str, dict[str, Entry]] = defaultdict(dict)
    inputs_test: dict[str, dict[str, Entry]] = defaultdict(dict)
    for e in ref.tensors(kind="input"):
        inputs_ref[e.rid][e.name] = e
    for e in test.tensors(kind="input"):
        inputs_test[e.rid][e.name] = e
    paired_rids_ref = {a for a, _ in rec_pairs}
    paired_rids_test = {b for _, b in rec_pairs}
    pairs: list[Pair] = []
    un_ref: list[Entry] = [e for rid, es in by_rid_ref.items() if rid not in paired_rids_ref for e in es]
    un_test: list[Entry] = [e for rid, es in by_rid_test.items() if rid not in paired_rids_test for e in es]
    torch_ref, torch_test = ref.backend == "torch", test.backend == "torch"
    for rr, tr in rec_pairs:
        rem_r = {e.name: e for e in by_rid_ref[rr]}
        rem_t = {e.name: e for e in by_rid_test[tr]}

        def take(a: Entry, b: Entry, how: str, rem_r: dict = rem_r, rem_t: dict = rem_t) -> None:
            pairs.append(Pair(a, b, how))
            rem_r.pop(a.name, None)
            rem_t.pop(b.name, None)

        if mapping:
            for a, b in mapping.items():
                if a in rem_r and b in rem_t:
                    take(rem_r[a], rem_t[b], "map")
        for name in list(rem_r):
            if name in rem_t:
                take(rem_r[name], rem_t[name], "exact")
        # a captured (e.g. quantized) graph input on one side ↔ the recorded model input on the other
        for name in list(rem_t):
            if name in inputs_ref[rr]:
                take(inputs_ref[rr][name], rem_t[name], "input")
        for name in list(rem_r):
            if name in inputs_test[tr]:
                take(rem_r[name], inputs_test[tr][name], "input")
        for how, fn in (("qdq", strip_qdq), ("qnn", qnn_sanitize), ("qnn", lambda n: qnn_sanitize(n, True))):
            if not rem_r or not rem_t:
                break
            idx_t: dict[str, list[str]] = defaultdict(list)
            for n in rem_t:
                idx_t[fn(n)].append(n)
            idx_r: dict[str, list[str]] = defaultdict(list)
            for n in rem_r:
                idx_r[fn(n)].append(n)
            for k, rn in idx_r.items():
                tn = idx_t.get(k, [])
                if len(rn) == 1 and len(tn) == 1:
                    take(rem_r[rn[0]], rem_t[tn[0]], how)
        if rem_r and torch_ref != torch_test:
            # every ONNX tensor of the record is a candidate, even one already matched by name
            tside, oside = (list(rem_r.values()), by_rid_test[tr])
            if torch_test:
                tside, oside = list(rem_t.values()), by_rid_ref[rr]
            for te, oe in _match_scope(tside, oside):
                if torch_ref:
                    take(te, oe, "scope")
                else:
                    take(oe, te, "scope")
        un_ref.extend(rem_r.values())
        un_test.extend(rem_t.values())
    pairs.sort(key=lambda p: (p.ref.sample, PART_ORDER.get(p.ref.part, 9), p.ref.step, p.ref.order))
    return Alignment(pairs, un_ref, un_test, un_ref_recs, un_test_recs)
