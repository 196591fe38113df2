"""Layer alignment between two dumps.

Records pair by ``(sample, part, step)``. Inside a record pair, tensors are matched by the named strategies of
:data:`STRATEGIES`, in order, each taking what the previous ones left (the strategy's name is kept in the
``match`` column):

1. ``map``: a user mapping (``{ref_name: test_name}``), when given;
2. ``exact``: identical names;
3. ``input``: a tensor captured from a graph input (its quantization) ↔ the model input recorded on the
   other side;
4. ``qdq``: names equal after stripping QDQ suffixes (``_QuantizeLinear_Input``, ``_DequantizeLinear_Output``, …),
   when unique;
5. ``qnn``: names equal after QNN sanitizing (per character, then collapsed runs), when unique;
6. ``scope``: a PyTorch module path ↔ the last ONNX tensor in that module's scope subtree (legacy
   exporter scope names or dynamo ``name_scopes`` metadata, recorded at capture) whose shape matches
   (then whose element count matches); tuple outputs ``name[i]`` match per index;
7. ``reshape``: a test tensor the reference does not name, holding *the same values* as a matched test tensor
   in another shape (the quantizer's preprocessing puts ``MatMul + Add`` into a ``Gemm`` between
   2-D reshapes: ``gemm_input_reshape_arg*`` is the LayerNorm output reshaped, ``gemm_output_reshape_arg*``
   the ``Add`` output before its reshape back), takes that tensor's partner. Candidates are matched tensors of
   the same element count within ``RESHAPE_WINDOW`` positions in execution order; the match is verified by
   values on the first record holding both (``max |a − b| ≤ RESHAPE_RTOL · max |b|``: a reshape is exact, on
   the quantized side too, where both are the same integers) and reused for later records;
8. ``fused``: an unmatched test tensor produced by an op that fuses a subgraph (``Gemm``, ``Gelu``,
   ``LayerNormalization``, … of ``FUSED_OPS``) ↔ the unmatched reference tensor of the same element count
   between the partners of its nearest matched neighbours, the one whose values agree best, accepted when the
   cosine similarity on the first record is ≥ ``FUSED_MIN_COSINE`` (the test side may be quantized, even
   faulty: a loose tolerance, and only inside the neighbours' window).

Everything left is reported as unmatched (names and counts per side), never dropped silently.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.dump.format import part_rank
from ivq_debug.dump.reader import Dump, Entry
from ivq_debug.errors import AlignmentError, UsageError
from ivq_debug.qnn.names import qnn_sanitize

QDQ_SUFFIXES = (
    "_QuantizeLinear_Input",
    "_QuantizeLinear_Output",
    "_DequantizeLinear_Output",
    "_ReshapedSavedOutput",
    "_quantized",
    "_dequantized",
)

#: ``reshape`` strategy: how far (positions in execution order) a same-valued partner may be, and the tolerance
RESHAPE_WINDOW = 6
RESHAPE_RTOL = 1e-6
#: tensors the reshape strategy keeps between its value checks, the last read: each unnamed tensor is checked against
#: its nearest matched neighbours, which the next ones check too (on bench_loop's 12-block ViT 624 reads of 288
#: tensors became 288 reads)
RESHAPE_KEPT = 8
#: ``fused`` strategy: ops that replace a float subgraph, and the cosine similarity a pair must reach
FUSED_OPS = ("Gemm", "Gelu", "FastGelu", "LayerNormalization", "SimplifiedLayerNormalization",
             "SkipLayerNormalization", "FusedMatMul", "BiasGelu", "MultiHeadAttention", "Attention")
FUSED_MIN_COSINE = 0.8

_INDEX_RE = re.compile(r"^(?P<base>.*?)(?P<call>#\d+)?(?P<idx>(\[\d+\]|\.[A-Za-z_]\w*)*)$")


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

    def unmatched_limit(self, allowed: int | float | None = None) -> tuple[int, int, float]:
        """``(unmatched, size, limit)`` of the side with fewer tensors under the allowance ``allowed``.

        ``allowed``: a count (an int, or a float >= 1), a fraction of the smaller side (a float < 1), or
        ``None`` for ``defaults.MAX_UNMATCHED_FRACTION``.
        """
        n_ref = len(self.pairs) + len(self.unmatched_ref)
        n_test = len(self.pairs) + len(self.unmatched_test)
        small = min(n_ref, n_test)
        unmatched = len(self.unmatched_ref) if n_ref <= n_test else len(self.unmatched_test)
        if allowed is None:
            limit = defaults.MAX_UNMATCHED_FRACTION * small
        elif allowed < 0:
            raise UsageError("the unmatched allowance must be >= 0")
        else:
            limit = allowed * small if isinstance(allowed, float) and allowed < 1 else float(allowed)
        return unmatched, small, limit

    def check(self, allowed: int | float | None = None) -> None:
        """The unmatched-tensor policy of ``ivq-diff`` (exit 4): raise :class:`AlignmentError` when more tensors
        of the smaller side are unmatched than ``allowed`` (see :meth:`unmatched_limit`), or when nothing was
        paired although a side holds tensors."""
        unmatched, small, limit = self.unmatched_limit(allowed)
        n_max = max(len(self.pairs) + len(self.unmatched_ref), len(self.pairs) + len(self.unmatched_test))
        if unmatched > limit or (not self.pairs and n_max > 0):
            raise AlignmentError(
                f"{unmatched} of {small} tensors on the smaller side are unmatched "
                f"(allowed {limit:g}); see the unmatched lists in --json, or pass --map / --max-unmatched"
            )

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


# ------------------------------------------------------------------------------------------ strategies
@dataclass
class RecordPair:
    """One pair of records being aligned: the tensors still unmatched on each side, and the context strategies
    read (model inputs, every tensor of the record, which side is a torch capture, the user mapping)."""

    ref: dict[str, Entry]
    test: dict[str, Entry]
    ref_inputs: dict[str, Entry] = field(default_factory=dict)
    test_inputs: dict[str, Entry] = field(default_factory=dict)
    ref_all: list[Entry] = field(default_factory=list)
    test_all: list[Entry] = field(default_factory=list)
    ref_torch: bool = False
    test_torch: bool = False
    mapping: dict[str, str] | None = None
    ref_dump: Any = None
    test_dump: Any = None
    matched_ref: dict[str, Entry] = field(default_factory=dict)  # ref name -> its test partner so far
    matched_test: dict[str, Entry] = field(default_factory=dict)  # test name -> its ref partner so far
    memo: dict[Any, Any] = field(default_factory=dict)  # value checks of earlier records (shared by align)


#: a strategy yields ``(ref entry, test entry)`` pairs from a :class:`RecordPair`; each pair is taken out of the
#: unmatched tensors as soon as it is yielded
Finder = Callable[[RecordPair], Iterator[tuple[Entry, Entry]]]


@dataclass(frozen=True)
class Strategy:
    """A named matching rule (the name goes to the ``match`` column)."""

    name: str
    find: Finder
    doc: str = ""


def by_map(rp: RecordPair) -> Iterator[tuple[Entry, Entry]]:
    """The user's ``{ref_name: test_name}`` pairs."""
    for a, b in (rp.mapping or {}).items():
        if a in rp.ref and b in rp.test:
            yield rp.ref[a], rp.test[b]


def by_exact_name(rp: RecordPair) -> Iterator[tuple[Entry, Entry]]:
    """Identical names."""
    for name in list(rp.ref):
        if name in rp.test and name in rp.ref:
            yield rp.ref[name], rp.test[name]


def by_graph_input(rp: RecordPair) -> Iterator[tuple[Entry, Entry]]:
    """A tensor captured from a graph input on one side ↔ the model input recorded on the other."""
    for name in list(rp.test):
        if name in rp.ref_inputs and name in rp.test:
            yield rp.ref_inputs[name], rp.test[name]
    for name in list(rp.ref):
        if name in rp.test_inputs and name in rp.ref:
            yield rp.ref[name], rp.test_inputs[name]


def by_key(key: Callable[[str], str]) -> Finder:
    """Names equal under ``key``, when the key is unique on both sides."""
    def find(rp: RecordPair) -> Iterator[tuple[Entry, Entry]]:
        idx_t: dict[str, list[str]] = defaultdict(list)
        for n in rp.test:
            idx_t[key(n)].append(n)
        idx_r: dict[str, list[str]] = defaultdict(list)
        for n in rp.ref:
            idx_r[key(n)].append(n)
        for k, rn in idx_r.items():
            tn = idx_t.get(k, [])
            if len(rn) == 1 and len(tn) == 1:
                yield rp.ref[rn[0]], rp.test[tn[0]]
    return find


def by_scope(rp: RecordPair) -> Iterator[tuple[Entry, Entry]]:
    """A torch module's output ↔ the last ONNX tensor of its scope subtree with a compatible shape (only when
    exactly one side is a torch capture; every ONNX tensor of the record is a candidate, even a matched one)."""
    if not rp.ref or rp.ref_torch == rp.test_torch:
        return
    if rp.ref_torch:
        for te, oe in _match_scope(list(rp.ref.values()), rp.test_all):
            yield te, oe
    else:
        for te, oe in _match_scope(list(rp.test.values()), rp.ref_all):
            yield oe, te


def _flat(dump: Any, e: Entry) -> np.ndarray:
    return np.asarray(dump.read(e), dtype=np.float64).reshape(-1)


def _stored(dump: Any, e: Entry) -> np.ndarray:
    """The values of a full entry, flat, in the dtype they are stored in: one block of the reader's streaming
    read (an uncompressed tensor by ``os.pread``, without h5py's per-read cost)."""
    if e.size and hasattr(dump, "iter_flat"):
        return next(iter(dump.iter_flat(e, e.size)))
    return np.asarray(dump.read(e)).reshape(-1)


def _recent(n: int) -> Callable[[Any, Entry], np.ndarray]:
    """:func:`_stored` keeping the last ``n`` tensors it read (a fresh array each: nothing writes into them)."""
    kept: OrderedDict[tuple[Any, str], np.ndarray] = OrderedDict()

    def read(dump: Any, e: Entry) -> np.ndarray:
        k = (e.rid, e.name)
        if k in kept:
            kept.move_to_end(k)
            return kept[k]
        v = kept[k] = _stored(dump, e)
        if len(kept) > n:
            kept.popitem(last=False)
        return v

    return read


def _same_values(dump: Any, a: Entry, b: Entry, memo: dict[Any, Any], side: str,
                 read: Callable[[Any, Entry], np.ndarray] = _stored) -> bool:
    """``a`` and ``b`` of one dump hold the same values (``RESHAPE_RTOL``), checked on the first record.

    The test is ``max |a − b| ≤ RESHAPE_RTOL · max |b|`` (with ``b`` not all zero nor constant) in float64; two
    exact shortcuts spare the float64 copies: values equal in their stored dtype pass it whenever ``b`` has a
    non-zero spread, and two float tensors whose difference in their own dtype exceeds the bound by more than
    that dtype's rounding fail it."""
    key = ("reshape", side, a.name, b.name)
    if key not in memo:
        if dump is None or a.stored != "full" or b.stored != "full":
            memo[key] = False
            return False
        ra, rb = read(dump, a), read(dump, b)
        if ra.size != rb.size or not rb.size:
            memo[key] = False
            return False
        same_type = ra.dtype == rb.dtype
        if same_type and np.array_equal(ra, rb):  # |a − b| = 0: the spread of b decides
            vb = np.asarray(rb, dtype=np.float64)
            memo[key] = bool(float(np.max(np.abs(vb))) > 0 and float(np.std(vb)) > 0)
            return memo[key]
        if same_type and ra.dtype.kind == "f":
            scale = float(np.max(np.abs(rb)))  # exact in any float dtype
            with np.errstate(over="ignore", invalid="ignore"):  # inf past the dtype's range; NaN: no shortcut
                d = float(np.max(np.abs(ra - rb)))
            if d > RESHAPE_RTOL * scale * (1 + 4 * float(np.finfo(ra.dtype).eps)):
                memo[key] = False
                return False
        va, vb = np.asarray(ra, dtype=np.float64), np.asarray(rb, dtype=np.float64)
        scale = float(np.max(np.abs(vb)))
        memo[key] = bool(scale > 0 and float(np.std(vb)) > 0
                         and float(np.max(np.abs(va - vb))) <= RESHAPE_RTOL * scale)
    return memo[key]


def _neighbours(e: Entry, pool: list[Entry], window: int) -> list[Entry]:
    """Entries of ``pool`` (sorted by order) nearest to ``e`` in execution order, nearest first."""
    pos = np.searchsorted([x.order for x in pool], e.order)
    near = pool[max(0, pos - window): pos + window]
    return sorted(near, key=lambda x: abs(x.order - e.order))


def by_reshape(rp: RecordPair) -> Iterator[tuple[Entry, Entry]]:
    """A test tensor the reference does not name, equal by values to a matched test tensor in another shape,
    takes that tensor's partner (reference-only tensors stay unmatched: the fused interior of a subgraph)."""
    pool = sorted((e for e in rp.test_all if e.name in rp.matched_test), key=lambda e: e.order)
    read = _recent(RESHAPE_KEPT)
    for name in list(rp.test):
        e = rp.test.get(name)
        if e is None or e.size == 0:
            continue
        for c in _neighbours(e, pool, RESHAPE_WINDOW):
            if c.size == e.size and c.shape != e.shape and _same_values(rp.test_dump, e, c, rp.memo, "test", read):
                yield rp.matched_test[c.name], e
                break


def by_fused(rp: RecordPair) -> Iterator[tuple[Entry, Entry]]:
    """A fused op's output ↔ the best-agreeing unmatched reference tensor between its matched neighbours."""
    if rp.ref_dump is None or rp.test_dump is None:
        return
    pool = sorted((e for e in rp.test_all if e.name in rp.matched_test), key=lambda e: e.order)
    orders = [e.order for e in pool]
    for name in list(rp.test):
        e = rp.test.get(name)
        if e is None or e.op_type not in FUSED_OPS or e.size == 0:
            continue
        pos = int(np.searchsorted(orders, e.order))
        lo = rp.matched_test[pool[pos - 1].name].order if pos > 0 else -math.inf
        hi = rp.matched_test[pool[pos].name].order if pos < len(pool) else math.inf
        cands = [r for r in rp.ref.values() if r.size == e.size and lo < r.order <= hi and r.stored == "full"]
        best, best_cos = None, FUSED_MIN_COSINE
        for r in cands:
            key = ("fused", r.name, e.name)
            if key not in rp.memo:
                a, b = _flat(rp.ref_dump, r), _flat(rp.test_dump, e)
                n = float(np.linalg.norm(a) * np.linalg.norm(b))
                rp.memo[key] = float(a @ b) / n if n > 0 else -1.0
            if rp.memo[key] >= best_cos:
                best, best_cos = r, rp.memo[key]
        if best is not None:
            yield best, e


#: the strategies, in the order they run
STRATEGIES: tuple[Strategy, ...] = (
    Strategy("map", by_map, "the user's mapping"),
    Strategy("exact", by_exact_name, "identical names"),
    Strategy("input", by_graph_input, "a captured graph input ↔ the recorded model input"),
    Strategy("qdq", by_key(strip_qdq), "names equal without QDQ suffixes"),
    Strategy("qnn", by_key(qnn_sanitize), "names equal after QNN sanitizing"),
    Strategy("qnn", by_key(lambda n: qnn_sanitize(n, True)), "names equal after legacy QNN sanitizing"),
    Strategy("scope", by_scope, "torch module path ↔ ONNX scope, confirmed by shape"),
    Strategy("reshape", by_reshape, "a same-valued reshape of a matched tensor takes its partner (by values)"),
    Strategy("fused", by_fused, "a fused op's output ↔ the agreeing reference tensor between its neighbours"),
)


def match_record(rp: RecordPair, strategies: tuple[Strategy, ...] = STRATEGIES) -> list[Pair]:
    """Run the strategies on one record pair; matched tensors leave ``rp.ref`` / ``rp.test``."""
    pairs: list[Pair] = []
    for st in strategies:
        for a, b in st.find(rp):
            pairs.append(Pair(a, b, st.name))
            rp.ref.pop(a.name, None)
            rp.test.pop(b.name, None)
            rp.matched_ref.setdefault(a.name, b)
            rp.matched_test.setdefault(b.name, a)
    return pairs


def align(ref: Dump, test: Dump, mapping: dict[str, str] | None = None,
          memo: dict[Any, Any] | None = None,
          until: Callable[[tuple[int, str, int]], bool] | None = None) -> Alignment:
    """Align the tensors of two dumps (see module docstring).

    ``memo``: the value checks of the ``reshape`` and ``fused`` strategies, made on the first record holding a
    pair and reused for later ones; pass the same dict to align a capture record by record (a test dump of one
    record at a time, :class:`~ivq_debug.dump.memory.MemoryDump`) exactly as the whole capture at once.
    ``until``: align the common records in order up to the last one whose key ``(sample, part, step)`` it
    accepts, and no further (a caller that keeps only those records' pairs: each is aligned exactly as in the
    whole alignment, the earlier records' value checks included); the later records are neither paired nor
    listed as unmatched."""
    rk, tk = ref.record_keys(), test.record_keys()
    rec_pairs: list[tuple[str, str]] = []
    dropped: set[str] = set()  # records left out by ``until``
    if len(rk) == 1 and len(tk) == 1 and set(rk) != set(tk):
        rec_pairs.append((next(iter(rk.values())), next(iter(tk.values()))))
        un_ref_recs: list[Any] = []
        un_test_recs: list[Any] = []
    else:
        common = sorted(set(rk) & set(tk), key=lambda k: (k[0], part_rank(k[1]), k[2]))
        if until is not None:
            last = max((i for i, key in enumerate(common) if until(key)), default=-1)
            dropped = {rid for key in common[last + 1:] for rid in (rk[key], tk[key])}
            common = common[: last + 1]
        for key in common:
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
    memo = {} if memo is None else memo
    paired_rids_ref = {a for a, _ in rec_pairs}
    paired_rids_test = {b for _, b in rec_pairs}
    pairs: list[Pair] = []
    un_ref: list[Entry] = [e for rid, es in by_rid_ref.items() if rid not in paired_rids_ref | dropped for e in es]
    un_test: list[Entry] = [e for rid, es in by_rid_test.items() if rid not in paired_rids_test | dropped for e in es]
    for rr, tr in rec_pairs:
        rp = RecordPair({e.name: e for e in by_rid_ref[rr]}, {e.name: e for e in by_rid_test[tr]},
                        inputs_ref[rr], inputs_test[tr], by_rid_ref[rr], by_rid_test[tr],
                        ref.backend == "torch", test.backend == "torch", mapping, ref, test, memo=memo)
        pairs.extend(match_record(rp))
        un_ref.extend(rp.ref.values())
        un_test.extend(rp.test.values())
    pairs.sort(key=lambda p: (p.ref.sample, part_rank(p.ref.part), p.ref.step, p.ref.order))
    return Alignment(pairs, un_ref, un_test, un_ref_recs, un_test_recs)
