"""The replay of one batch of units: its shadow and backend models, their sessions, and the per-unit sums.

A batch's units are laid side by side in one CPU *shadow* model (each unit, its ``Fw`` and ``Fq`` copies) and, for
a non-CPU backend, one backend model (:func:`~ivq_debug.diagnose.units.build_replay_model`); each goes to its
runner in memory (a :class:`~ivq_debug.onnxgraph.load.Model`, no file) and is one session per feed signature,
reused across records (:class:`SessionPool`). :func:`replay_batch` runs every record through them and adds each
unit's errors into its :class:`Acc` (the definitions: :mod:`ivq_debug.diagnose.replay`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.capture.base import make_runner
from ivq_debug.diagnose.graphs import typed_inputs, unit_value
from ivq_debug.diagnose.refs import RefIndex
from ivq_debug.diagnose.units import Unit, build_replay_model
from ivq_debug.errors import InputError
from ivq_debug.metrics import MetricAccumulator, dot, one_blas_thread
from ivq_debug.onnxgraph.load import Model
from ivq_debug.onnxgraph.sites import quant_params

#: ``f(model) -> runner`` on the replay's backend (a :class:`Model` in memory, or a path)
RunnerFactory = Callable[[Any], Any]


def cpu_runner(model: Any) -> Any:
    """The exact fake-quant runner: ORT CPU EP, graph optimizations disabled, threads that do not spin
    (``defaults.REPLAY_SESSION_CONFIG``): the shadow models, the CPU replay, the CPU effect runs."""
    return make_runner("onnx", model, optimization="disable", session_config=defaults.REPLAY_SESSION_CONFIG)


class SessionPool:
    """Replay sessions of one batch, one per (model kind, feed signature), reused across records. Each model goes
    to its runner in memory; the runner writes a file only when the model's weights are external data (next to
    the QDQ model: ONNX Runtime reads those only from inside the model's folder)."""

    def __init__(self) -> None:
        self.runners: dict[tuple[Any, ...], Any] = {}
        self._typed: set[int] = set()

    def get(self, kind: str, m: Model, feeds: dict[str, np.ndarray], factory: RunnerFactory) -> Any:
        """The runner of model ``m`` (``kind``) for feeds of these shapes and dtypes."""
        sig = (kind, tuple((k, v.shape, v.dtype.str) for k, v in sorted(feeds.items())))
        r = self.runners.get(sig)
        if r is None:
            if id(m.proto) in self._typed:  # another signature of the same model: typed on a copy
                proto = type(m.proto)()
                proto.CopyFrom(m.proto)
                m = m.derive(proto)
            self._typed.add(id(m.proto))
            typed_inputs(m.proto, feeds)
            try:
                r = self.runners[sig] = factory(m)
            except InputError as e:  # ONNX Runtime refused the model's own graph or weights: name the user's file
                raise InputError(e.message, m.origin) from None
        return r

    def close(self) -> None:
        """Close the runners."""
        for r in self.runners.values():
            close = getattr(r, "close", None)
            if close is not None:
                close()


class Acc:
    """Per-unit accumulators over records (:meth:`state` / :meth:`from_state`: a shard's JSON, exact)."""

    SUMS = ("iso", "local", "weight", "act_iso", "act_local")

    def __init__(self) -> None:
        self.iso, self.local, self.weight = MetricAccumulator(), MetricAccumulator(), MetricAccumulator()
        self.act_iso, self.act_local = MetricAccumulator(), MetricAccumulator()
        self.selfcheck: float | None = None
        self.selfcheck_share: float | None = None
        self.replayed_on = ""
        self.ref_match = ""

    def state(self) -> dict[str, Any]:
        """The accumulators as plain JSON values."""
        out: dict[str, Any] = {k: getattr(self, k).state() for k in self.SUMS}
        out.update(selfcheck=self.selfcheck, selfcheck_share=self.selfcheck_share, replayed_on=self.replayed_on,
                   ref_match=self.ref_match)
        return out

    @classmethod
    def from_state(cls, doc: dict[str, Any]) -> Acc:
        """The accumulators of :meth:`state`."""
        a = cls()
        for k in cls.SUMS:
            setattr(a, k, MetricAccumulator.from_state(doc[k]))
        a.selfcheck, a.selfcheck_share = doc["selfcheck"], doc["selfcheck_share"]
        a.replayed_on, a.ref_match = str(doc["replayed_on"]), str(doc["ref_match"])
        return a


@dataclass
class BatchContext:
    """What the replay of one batch reads: the QDQ model, the records and their reference indexes, the backend."""

    model: Model
    rids: list[str]
    indexes: dict[str, RefIndex]
    runner_factory: RunnerFactory | None
    do_check: bool
    #: the ranking attribution (``local`` / ``iso``): whose sums :func:`replay_batch` adds first when it defers
    ranking: str = "local"


@dataclass
class BatchResult:
    """The accumulators of one batch's units, the backend that ran them (None: none ran on it) and its sessions;
    ``rest``: when :func:`replay_batch` deferred them, the call that adds the last record's other sums."""

    accs: dict[str, Acc]
    backend: str | None
    info: dict[str, Any]
    sessions: int
    rest: Callable[[], None] | None = None


@dataclass
class _BackendRun:
    """One record on the backend model: fed X (``iso``), fed Xq (``loc``), and for the self-check fed the test
    dump's upstream values (``chk``, for the units in ``chk_ok``)."""

    iso: dict[str, np.ndarray] = field(default_factory=dict)
    loc: dict[str, np.ndarray] = field(default_factory=dict)
    chk: dict[str, np.ndarray] = field(default_factory=dict)
    chk_ok: set[int] = field(default_factory=set)


def _sq(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> float:
    """``Σ (a − b)²`` of flat float64 arrays (the difference in ``out``), without BLAS threads (``metrics.dot``)."""
    np.subtract(a, b, out=out)
    return dot(out, out)


def _steps(got: np.ndarray, want: np.ndarray, scale: float | None) -> float | None:
    if scale is None or scale <= 0 or got.size != want.size:
        return None
    return float(np.max(np.abs(got.astype(np.float64).reshape(-1) - want.astype(np.float64).reshape(-1)))) / scale


@one_blas_thread
def replay_batch(ctx: BatchContext, batch: list[Unit], defer: bool = False) -> BatchResult:
    """Replay one batch of units over every record (the shadow model and the backend model: one session each per
    feed signature, reused across records). ``defer``: of the last record, add only the ranking attribution's sums
    (``ctx.ranking``: what the effect targets read) and leave the other sums to ``BatchResult.rest``, which the
    caller runs while the effect runs are under way (each accumulator sums the same values in the same order)."""
    model = ctx.model
    on_cpu = ctx.runner_factory is None
    factory = ctx.runner_factory or cpu_runner
    arrays = model.arrays({x for u in batch for q in [u.out_q, *u.in_q] if q is not None for x in q.input[1:]})
    out_scale: dict[str, float | None] = {}
    for u in batch:
        qp = quant_params(u.out_q, arrays) if u.out_q is not None else None
        out_scale[u.node] = float(np.max(qp.scale)) if qp is not None and qp.is_integer else None
    accs = {u.node: Acc() for u in batch}
    backend = None
    info: dict[str, Any] = {}
    sessions = 0
    keys = list(range(len(batch)))
    on_backend = [] if on_cpu else [k for k, u in zip(keys, batch, strict=True) if not u.moves_integers(arrays)]
    shadow, s_map, s_names = build_replay_model(model, batch, shadow=True, xq=not on_cpu)
    bmodel, b_map, _ = (build_replay_model(model, [batch[k] for k in on_backend], keys=on_backend)
                        if on_backend else (None, {}, {}))
    pool = SessionPool()
    work = _Work()
    rest = None
    try:
        for i, rid in enumerate(ctx.rids):
            idx = ctx.indexes[rid]
            feeds = {gi: idx.read(x) for gi, (_, x) in s_map.items()}
            s_runner = pool.get("shadow", shadow, feeds, cpu_runner)
            got = s_runner.run(feeds)
            s_out = {name: got[v] for name, v in s_names.items()}
            del got
            if on_cpu:
                backend, info = s_runner.backend, s_runner.info
            b = _BackendRun()
            if bmodel is not None:
                br = pool.get("backend", bmodel, {gi: feeds[gi] for gi in b_map}, factory)
                backend, info = br.backend, br.info
                b = _run_backend(br, ctx.do_check, b_map, feeds, s_out, batch, on_backend, idx)
            shadow_on = s_runner.backend + (" (data movement: exact on every backend)" if not on_cpu else "")
            sums = functools.partial(_sums, accs, batch, idx, s_out, b, backend or "", shadow_on, out_scale, work,
                                     ranking=ctx.ranking)
            if defer and i == len(ctx.rids) - 1:
                sums(_RANKING)
                rest = functools.partial(one_blas_thread(sums), _REST)
            else:
                sums(_ALL)
            del feeds, s_out, b, sums
    finally:
        sessions += len(pool.runners)
        pool.close()
    return BatchResult(accs, backend, info, sessions, rest)


#: which of a unit's sums :func:`_accumulate` adds: all, the ranking attribution's only, all but those
_ALL, _RANKING, _REST = "all", "ranking", "rest"


def _sums(accs: dict[str, Acc], batch: list[Unit], idx: RefIndex, s_out: dict[str, np.ndarray], b: _BackendRun,
          backend: str, shadow_on: str, out_scale: dict[str, float | None], work: _Work, part: str,
          ranking: str = "local") -> None:
    """Add one record's sums (``part``) of every unit of the batch."""
    for k, u in enumerate(batch):
        _accumulate(accs[u.node], k, u, idx, s_out, b, backend, shadow_on, out_scale[u.node], work, part, ranking)


def _run_backend(br: Any, do_check: bool, b_map: dict[str, tuple[int, str]], feeds: dict[str, np.ndarray],
                 s_out: dict[str, np.ndarray], batch: list[Unit], on_backend: list[int], idx: RefIndex) -> _BackendRun:
    """One record on the backend model: fed X, fed Xq (the shadow's ``::xq{j}``) and, for the self-check, fed the
    test dump's own upstream values of the units whose inputs and output it holds."""
    bf = {gi: feeds[gi] for gi in b_map}
    out = _BackendRun(iso=br.run(bf))
    lf = dict(bf)
    for gi, (k, x) in b_map.items():
        u = batch[k]
        if x in u.qin:
            lf[gi] = s_out[f"u{k}::xq{list(u.qin).index(x)}"].astype(bf[gi].dtype, copy=False)
    out.loc = br.run(lf)
    if do_check and idx.test is not None:
        cf = dict(bf)
        for k in on_backend:
            u = batch[k]
            ents = [idx.test_by_name.get(x) for x in [*u.inputs, u.output]]
            if all(e is not None and e.size == idx.read(x).size
                   for e, x in zip(ents, [*u.inputs, u.output], strict=True)):
                out.chk_ok.add(k)
                for x in u.inputs:
                    gi = unit_value(f"u{k}::", x)
                    cf[gi] = idx.test.read(idx.test_by_name[x]).reshape(bf[gi].shape).astype(bf[gi].dtype,
                                                                                             copy=False)
        if out.chk_ok:
            out.chk = br.run(cf)
    return out


class _Work:
    """float64 work arrays of one batch, reused from unit to unit: a unit's values are cast into them, not into
    new arrays (on bench_loop's 12-block ViT, 447 units: about seven arrays of a unit's size each, 408 MB of
    float32 results cast to float64, no longer allocated and faulted in anew per unit)."""

    def __init__(self) -> None:
        self.bufs: list[np.ndarray] = []

    def get(self, i: int, n: int) -> np.ndarray:
        """Work array ``i``, ``n`` elements (its values undefined)."""
        while len(self.bufs) <= i:
            self.bufs.append(np.empty(0))
        if self.bufs[i].size < n:
            self.bufs[i] = np.empty(n)
        return self.bufs[i][:n]

    def cast(self, i: int, x: np.ndarray) -> np.ndarray:
        """``x`` flat as float64, in work array ``i``."""
        out = self.get(i, x.size)
        np.copyto(out, x.reshape(-1), casting="unsafe")
        return out


def _accumulate(a: Acc, k: int, u: Unit, idx: RefIndex, s_out: dict[str, np.ndarray], b: _BackendRun,
                backend: str, shadow_on: str, out_scale: float | None, work: _Work, part: str = _ALL,
                ranking: str = "local") -> None:
    """Add one record's errors of unit ``k`` into its accumulators (the definitions: the replay module): every sum
    (``part`` :data:`_ALL`), the ``ranking`` attribution's only (:data:`_RANKING`) or the others (:data:`_REST`);
    each casts the values it reads."""
    ref = idx.read(u.output)
    fq_v = s_out[f"u{k}::fq"] if u.compute is not None else None
    fw_v = s_out[f"u{k}::fw"] if u.weights else None
    if f"u{k}::out" in b.iso:
        t_iso_v, t_loc_v = b.iso[f"u{k}::out"], b.loc[f"u{k}::out"]
        a.replayed_on = backend
    else:
        t_iso_v = t_loc_v = s_out[f"u{k}::out"]
        a.replayed_on = shadow_on
    a.ref_match = idx.source(u.output).how
    if len({x.size for x in (ref, fq_v, fw_v, t_iso_v, t_loc_v) if x is not None}) != 1:
        return  # element counts differ: the unit's metrics stay empty
    both = {"iso", "local"}  # the attributions whose sums this part adds: the ranking one first, the other after
    adds = both if part == _ALL else {ranking} if part == _RANKING else both - {ranking}
    do_iso, do_loc = "iso" in adds, "local" in adds
    loc = do_loc or part != _RANKING  # the values the local sums or the weight / activation parts read
    iso = do_iso or part != _RANKING
    r = work.cast(0, ref)
    fq = work.cast(1, fq_v) if fq_v is not None and loc else r
    fw = work.cast(2, fw_v) if fw_v is not None and loc else r
    t_iso = work.cast(3, t_iso_v) if iso else r
    t_loc = (t_iso if t_loc_v is t_iso_v and iso else work.cast(4, t_loc_v)) if loc else r
    if do_iso:
        a.iso.update(r, t_iso)
    if do_loc:
        r_loc = fq
        if u.weights:  # r + fq − fw
            r_loc = np.add(r, fq, out=work.get(5, r.size))
            np.subtract(r_loc, fw, out=r_loc)
        a.local.update(r_loc, t_loc)
    if part == _RANKING:
        return
    d = work.get(6, r.size)
    if u.weights:
        a.weight.sum_sq_err += _sq(fw, r, d)
        a.weight.sum_r2 += dot(r, r)
        a.weight.n += r.size
    a.act_iso.sum_sq_err += _sq(t_iso, fw, d)
    a.act_local.sum_sq_err += _sq(t_loc, fq, d)
    if k in b.chk_ok:
        want = idx.test.read(idx.test_by_name[u.output])
        st = _steps(b.chk[f"u{k}::out"], want, out_scale)
        if st is not None:
            a.selfcheck = st if a.selfcheck is None else max(a.selfcheck, st)
            d = np.abs(b.chk[f"u{k}::out"].astype(np.float64).reshape(-1) - want.astype(np.float64).reshape(-1))
            share = float(np.mean(d > 0.5 * out_scale))
            a.selfcheck_share = share if a.selfcheck_share is None else max(a.selfcheck_share, share)
