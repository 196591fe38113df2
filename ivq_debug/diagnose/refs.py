"""The replay's reference values: for each record, where a unit tensor's reference comes from (by name, through
the comparison's alignment, or through the QDQ model's own lineage), and which records hold the model's inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivq_debug.errors import UsageError
from ivq_debug.onnxgraph.load import Model


@dataclass
class Source:
    """Where a unit tensor's reference value comes from: a ref entry, reshaped to ``shape`` when needed."""

    entry: Any
    how: str



def read_whole(dump: Any, e: Any) -> np.ndarray:
    """A full tensor of ``dump``, as ``dump.read`` gives it (its stored dtype, bfloat16 as float32, its shape), read
    by the reader's streaming read in one block: an uncompressed tensor by ``os.pread`` from its offset, without
    opening an h5py dataset per read and with the GIL released during the I/O (``docs/scale.md``, seventh pass). A
    tensor stored as its integers only, or a reference that is not a dump, is read by ``read``."""
    if e.size and e.stored == "full" and not e.derived and hasattr(dump, "iter_flat"):
        return next(iter(dump.iter_flat(e, e.size))).reshape(e.shape)
    return dump.read(e)


class RefIndex:
    """Reference values of one record by QDQ float name (name, alignment pair, or lineage): :meth:`source` says
    where one comes from (None: none, the reason in ``rejected``), :meth:`read` reads it in the model's shape.

    ``link`` (instead of ``pairs``, ``test`` and ``test_rid``): a call that returns them, made the first time one
    of them is needed (a tensor the reference does not name, a shape, the test dump). ``ivq diagnose`` passes the
    comparison it computes in a thread: a replay whose tensors the reference all names starts before the
    alignment ends (``docs/scale.md``, fifth pass)."""

    def __init__(self, ref: Any, rid: str, pairs: dict[str, Any], aliases: dict[str, list[str]],
                 test: Any = None, test_rid: str | None = None, shapes: dict[str, tuple[int, ...]] | None = None,
                 *, link: Callable[[], tuple[dict[str, Any], Any, str | None]] | None = None) -> None:
        self.ref = ref
        self.by_name = {e.name: e for e in ref.tensors(rid)} | {e.name: e for e in ref.tensors(rid, kind="input")}
        self.aliases = aliases
        self._model_shapes = dict(shapes or {})
        self._link = link if link is not None else (lambda: (pairs, test, test_rid))
        self._linked: tuple[dict[str, Any], Any, dict[str, Any], dict[str, tuple[int, ...]]] | None = None
        self.cache: dict[str, Source | None] = {}
        self.rejected: dict[str, str] = {}
        self.values: dict[str, np.ndarray] = {}

    def _resolved(self) -> tuple[dict[str, Any], Any, dict[str, Any], dict[str, tuple[int, ...]]]:
        """``(pairs, test, test_by_name, shapes)``, linked once."""
        if self._linked is None:
            pairs, test, test_rid = self._link()
            by_name = {e.name: e for e in test.tensors(test_rid)} if test is not None and test_rid else {}
            self._linked = (pairs, test, by_name, self._model_shapes | {n: e.shape for n, e in by_name.items()})
        return self._linked

    @property
    def pairs(self) -> dict[str, Any]:
        """Test name -> (ref entry, strategy) of the alignment, for the names the reference does not hold."""
        return self._resolved()[0]

    @property
    def test(self) -> Any:
        """The free-running test dump (None without a comparison)."""
        return self._resolved()[1]

    @property
    def test_by_name(self) -> dict[str, Any]:
        """The test dump's entries of the matching record, by name."""
        return self._resolved()[2]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor shapes in the model (the model's value shapes, the test dump's where it holds the tensor)."""
        return self._resolved()[3]

    def source(self, name: str) -> Source | None:
        """Where the reference value of ``name`` comes from (cached), or None."""
        if name in self.cache:
            return self.cache[name]
        src: Source | None = None
        if name in self.by_name:
            src = Source(self.by_name[name], "name")
        elif name in self.pairs:
            e, how = self.pairs[name]
            src = Source(e, f"alignment:{how}")
        else:
            for other in self.aliases.get(name, []):
                e = self.by_name.get(other)
                if e is not None and self._confirm(name, other):
                    src = Source(e, f"lineage:reshape of {other}")
                    break
        if src is not None and src.how != "name":
            shape = self.shapes.get(name)
            if shape is None or math.prod(shape) != src.entry.size:
                self.rejected[name] = (f"matched to {src.entry.name!r} ({src.how}) but its shape in this model is "
                                       "unknown" if shape is None else f"matched to {src.entry.name!r} with "
                                       f"{src.entry.size} elements, not {math.prod(shape)}")
                src = None
        self.cache[name] = src
        return src

    def _confirm(self, name: str, other: str) -> bool:
        """A lineage alias holds the same values: checked on the test dump (same elements, within one step of
        the tensor's encoding, or 1e-6 relative without one) when it holds both; assumed otherwise."""
        a, b = self.test_by_name.get(name), self.test_by_name.get(other)
        if a is None or b is None:
            return True
        if a.size != b.size:
            self.rejected[name] = f"lineage alias {other!r} has {b.size} elements, not {a.size}"
            return False
        va, vb = self.test.read(a).astype(np.float64).reshape(-1), self.test.read(b).astype(np.float64).reshape(-1)
        scale = np.max(np.asarray((a.encoding or {}).get("scale", [0.0]), dtype=np.float64)) if a.encoding else 0.0
        tol = scale * 1.0001 if scale > 0 else 1e-6 * max(float(np.max(np.abs(vb))), 1e-30)
        if float(np.max(np.abs(va - vb))) > tol:
            self.rejected[name] = f"lineage alias {other!r} differs by values on the test dump (> {tol:.3g})"
            return False
        return True

    def read(self, name: str) -> np.ndarray:
        """The reference value of ``name`` (a :meth:`source` it has), in the model's shape (cached)."""
        v = self.values.get(name)
        if v is None:
            src = self.cache.get(name) or self.source(name)
            assert src is not None
            v = read_whole(self.ref, src.entry)
            if src.how != "name":
                v = v.reshape(self.shapes[name])
            self.values[name] = v
        return v


def pairs_for(cumulative: Any, ref_rid: str) -> tuple[dict[str, Any], Any, str | None]:
    """From a comparison: test name -> (ref entry, strategy) for one ref record, the test dump and its rid."""
    if cumulative is None:
        return {}, None, None
    out: dict[str, Any] = {}
    test_rid = None
    for p in cumulative.alignment.pairs:
        if p.ref.rid == ref_rid:
            test_rid = p.test.rid
            if p.test.name != p.ref.name:
                out.setdefault(p.test.name, (p.ref, p.match))
    if test_rid is None:  # no pair: the record with the same key
        keys = cumulative.test.record_keys()
        ref_key = next((k for k, v in cumulative.ref.record_keys().items() if v == ref_rid), None)
        test_rid = keys.get(ref_key) if ref_key is not None else None
        if test_rid is None and len(keys) == 1:
            test_rid = next(iter(keys.values()))
    return out, cumulative.test, test_rid


# ------------------------------------------------------------------------------------------ records
def record_ids(ref: Any, record: Any) -> list[str]:
    """The record ids of ``record`` (a key / rid, a list of them, ``"all"`` or None: every record, in order)."""
    keys = ref.record_keys()
    if record is None or record == "all":
        if not keys:
            raise UsageError("the reference dump holds no records", getattr(ref, "path", None))
        return [keys[k] for k in sorted(keys, key=lambda k: (k[0], k[2], k[1]))]
    if isinstance(record, list):
        return [ref._rid(r) for r in record]
    return [ref._rid(record)]


def model_records(ref: Any, record: Any, rids: list[str], model: Model, index: Callable[[str], RefIndex]
                  ) -> list[str]:
    """The records of ``rids`` that hold the model's graph inputs (a session dump has vision, prefill and decode
    records; a part's model replays on its own): the first of them by default, every one with ``"all"``. A
    record named explicitly must hold them (``UsageError`` naming the first missing input)."""
    inits = {i.name for i in model.proto.graph.initializer}
    dims = {i.name: [d.dim_value if d.HasField("dim_value") else 0 for d in i.type.tensor_type.shape.dim]
            for i in model.proto.graph.input if i.name not in inits}
    inputs = list(dims)

    def fits(shape: tuple[int, ...], want: list[int]) -> bool:  # static dims agree (0: dynamic)
        if len(shape) != len(want):
            return all(want) and math.prod(shape) == math.prod(want)
        return all(w in (0, d) for d, w in zip(shape, want, strict=True))

    def missing(rid: str) -> str | None:
        idx = index(rid)
        for x in inputs:
            src = idx.source(x)
            if src is None:
                return x
            if not fits(tuple(src.entry.shape), dims[x]):
                return f"{x} of shape {list(dims[x])} (it holds {list(src.entry.shape)})"
        return None

    if record is None or record == "all":
        fit = [r for r in rids if missing(r) is None]
        if not fit:
            where = {v: k for k, v in ref.record_keys().items()}
            raise UsageError(f"no record holds the model's inputs ({', '.join(inputs[:4])}): checked "
                             f"{len(rids)} record(s), e.g. {where.get(rids[0], rids[0])} lacks "
                             f"{missing(rids[0])}", getattr(ref, "path", None))
        return fit if record == "all" else fit[:1]
    for r in rids:
        if (m := missing(r)) is not None:
            raise UsageError(f"record {r!r} does not hold the model's input {m} (is it a record of another "
                             "part?)", getattr(ref, "path", None))
    return rids
