"""QNN HTP capture through ONNX Runtime's QNN execution provider.

:class:`QnnHtpRunner` is an :class:`~ivq_debug.capture.onnxrt.runner.OrtRunner` given the QNN session factory
:class:`~ivq_debug.capture.qnn_ep.factory.QnnSessions` (sessions on the QNN HTP backend: Qualcomm's x86 emulation
on Linux x86_64, the NPU on a Snapdragon machine), plus what only HTP needs: pruning tensors whose exposure makes QNN refuse the graph, and
storing the partition, op trace and profile with the capture. It exposes the same tensors as the CPU-QDQ
reference: the activation ``QuantizeLinear`` outputs as raw integers (this adds no op and keeps every QNN fusion
intact), dequantized with the model's scale / zero point and keyed by the ONNX float names, so an HTP dump
aligns by name with the CPU-QDQ dump of the same model.

What a capture records (``runner.info`` -> the dump's ``backend_info``; ``/meta/partition``):
soc_model, htp_arch, ``emulated``, QNN SDK / onnxruntime-qnn / onnxruntime versions, providers, the
CPU-fallback setting, the compilation target the EP reports, every session's partition (which node ran
on QNN, which on the CPU and why), session and run times, the with/without-exposure output check, and
the QNN profile joined to the ONNX tensors when profiling is on (``/tables/profiling``: the report needs no
model file). See ``docs/qnn-capture.md``.
"""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path
from typing import Any

from ivq_debug import defaults
from ivq_debug.capture.base import Closing
from ivq_debug.capture.onnxrt.runner import OrtRunner
from ivq_debug.capture.qnn_ep.cache import (
    ContextCache,
    ExposureMemory,
    exposure_material,
    recall_exposure,
    remember_exposure,
)
from ivq_debug.capture.qnn_ep.factory import QnnSessions, cache_of
from ivq_debug.capture.qnn_ep.plan import DEAD_REASON, channels_last, consumers_of, dead_sites, nhwc_exposure
from ivq_debug.capture.qnn_ep.session import (
    EP_NAME,
    Partition,
    QnnSessionConfig,
    QnnUnsupportedError,
    cache_material,
    source_ops,
)
from ivq_debug.console import note, warn
from ivq_debug.errors import CaptureError, one_line
from ivq_debug.onnxgraph.load import Model
from ivq_debug.onnxgraph.sites import TensorSite
from ivq_debug.qnn.profiling import TensorJoin, profiling_table, read_qnn_ep_csv

UPSTREAM_HOPS = 7


class _Probes:
    """The throw-away compiles the unexposable search may still make (a count cap and a time budget)."""

    def __init__(self, cap: int, budget_s: float) -> None:
        self.cap, self.budget_s = cap, budget_s
        self.used, self.spent = 0, 0.0

    def allowed(self, est_s: float) -> int:
        """How many more probes fit, at ``est_s`` seconds each."""
        left = self.cap - self.used
        if est_s > 0:
            left = min(left, int((self.budget_s - self.spent) // est_s))
        return max(0, left)

    def take(self, est_s: float) -> bool:
        """Spend one probe if it fits."""
        if self.allowed(est_s) < 1:
            return False
        self.used += 1
        return True


def _names(items: list[dict[str, Any]], limit: int = 6) -> str:
    names = [str(u["name"]) for u in items]
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class QnnHtpRunner(Closing):
    """Run an ONNX model (normally a QDQ model) on QNN HTP and capture its intermediate tensors.

    Args:
        model_path: the ONNX model (QDQ for quantized HTP numerics; a float model runs in fp16 on HTP).
        selection: which tensors to capture (``None``: a plain run).
        exposure: ``"auto"`` / ``"qdq"`` / ``"float"`` (see :func:`ivq_debug.onnxgraph.sites.list_sites`).
        optimization: ORT graph optimization level before partitioning (``"disable"`` default: the QNN
            graph is exactly the QDQ model; ``"all"`` is ORT's own default and gave the same bits here).
        max_outputs_per_run: capture in several sessions of at most this many extra outputs.
        verify: on the first capture run, also run the unmodified model and check the model's outputs
            are bit-identical with and without the exposed tensors (``info["exposure_check"]``).
        require_bit_identical: raise :class:`CaptureError` when that check fails.
        drop_unexposable: when exposing a tensor makes QNN refuse the graph although the unmodified
            model runs (e.g. the output of a Transpose that QNN fuses into the following MatMul), leave
            that tensor out and list it in ``info["unexposable"]`` instead of failing the capture. The search
            first keeps a refused tensor in one session with its neighbour's tensor (a group boundary between a
            fused pair is what QNN refuses), then probes with throw-away compiles, at most ``max_probes`` of
            them and no more than fit in ``defaults.QNN_PROBE_BUDGET_S`` at the measured compile time; what it
            could not probe is left out too, listed with the reason and said on the console.
        max_probes: the probe cap above (default ``defaults.QNN_MAX_PROBES``).
        channels_last: expose channels-last tensors through an NHWC Transpose that ORT cancels against QNN's
            own, transposed back in numpy (default ``defaults.QNN_CHANNELS_LAST_EXPOSURE``; the same values,
            a fraction of the compile time on conv nets: ``docs/qnn-compile.md``).
        qnn_cache: the compiled-context cache: ``None`` (default) the folder of
            :func:`~ivq_debug.capture.qnn_ep.cache.default_root`, a path, a
            :class:`~ivq_debug.capture.qnn_ep.cache.ContextCache`, or ``False`` to compile every session.
        fast_compile: QNN's faster, less optimized finalization (``defaults.QNN_FAST_COMPILE_OPTIONS``): 10x
            faster compiles, but the model's output can differ by a quantization step; recorded in the dump.
        soc_model, htp_arch: the QNN target (defaults from :mod:`ivq_debug.defaults`); always set.
        allow_cpu_fallback: let unsupported nodes run on the CPU EP (they are recorded in the partition);
            default False: unsupported nodes raise :class:`CaptureError` naming them.
        profiling_level: ``"basic"`` / ``"detailed"`` / ``"optrace"``: QNN per-op profile CSV.
        profiling_path: the CSV of the first session; later sessions write ``<stem>.<label>.csv``.
        op_trace_dir: keep ``qnn_op_trace.json`` of each session in ``<dir>/<label>/`` (the trace is
            always recorded in memory; this keeps the files).
        json_graph_dir: write the QNN graph JSON of each session into ``<dir>/<label>/``.
        config: a full :class:`~ivq_debug.capture.qnn_ep.session.QnnSessionConfig` (overrides the target / fallback /
            profiling-level arguments above; its artifact paths are used when the arguments are not
            given, and turned into per-session paths here).
        overwrite: replace existing profiling CSVs.
        ort_options: what is the same on every ONNX Runtime EP, given to :class:`OrtRunner` as they are:
            ``selection``, ``exposure``, ``optimization`` (above), ``max_outputs_per_run``, ``threads`` (intra-op
            threads of the CPU side of the session), ``input_shapes`` (static shapes for dynamic inputs: QNN HTP
            takes only static shapes, "Having zero graph inputs is not supported on this backend" otherwise).

    Raises:
        ToolNotFoundError: onnxruntime-qnn is not installed (at construction).
    """

    backend = "qnn-htp"

    def __init__(
        self,
        model_path: str | os.PathLike | Model,
        *,
        verify: bool = True,
        require_bit_identical: bool = False,
        drop_unexposable: bool = True,
        soc_model: str | None = None,
        htp_arch: str | None = None,
        allow_cpu_fallback: bool = False,
        profiling_level: str | None = None,
        profiling_path: str | os.PathLike | None = None,
        op_trace_dir: str | os.PathLike | None = None,
        json_graph_dir: str | os.PathLike | None = None,
        config: QnnSessionConfig | None = None,
        overwrite: bool = False,
        max_probes: int | None = None,
        channels_last: bool | None = None,
        qnn_cache: str | os.PathLike | ContextCache | bool | None = None,
        fast_compile: bool = False,
        **ort_options: Any,
    ) -> None:
        if config is None:
            config = QnnSessionConfig(allow_cpu_fallback=allow_cpu_fallback, profiling_level=profiling_level)
            if soc_model is not None:
                config.soc_model = str(soc_model)
            if htp_arch is not None:
                config.htp_arch = str(htp_arch)
        if fast_compile:
            config = config.with_changes(provider_options={**config.provider_options,
                                                           **defaults.QNN_FAST_COMPILE_OPTIONS})
        artifacts = {
            "profiling_path": profiling_path if profiling_path is not None else config.profiling_file_path,
            "op_trace_dir": op_trace_dir if op_trace_dir is not None else config.op_trace_dir,
            "json_graph_dir": json_graph_dir if json_graph_dir is not None else config.json_graph_dir,
        }
        config = config.with_changes(profiling_file_path=None, op_trace_dir=None, json_graph_dir=None)
        self.qnn = QnnSessions(config, overwrite=overwrite, cache=cache_of(qnn_cache), **artifacts)
        self.ort = OrtRunner(model_path, verify=verify, sessions=self.qnn, **ort_options)
        self.require_bit_identical = require_bit_identical
        self.drop_unexposable = drop_unexposable
        self.max_probes = defaults.QNN_MAX_PROBES if max_probes is None else int(max_probes)
        self.unexposable: list[dict[str, Any]] = []
        self._bonds: list[set[str]] = []  # site outputs that must share a capture session
        self._probes = _Probes(self.max_probes, defaults.QNN_PROBE_BUDGET_S)
        self._prepared = False
        self._written: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
        self._plan_exposure(defaults.QNN_CHANNELS_LAST_EXPOSURE if channels_last is None else channels_last)
        self.qnn.main_profile = "capture" if self.ort.sites else "plain"
        self._cache_said = False
        self._parts: dict[str, None] = {}  # the parts of the records this runner captured (profiling table name)
        self._join: TensorJoin | None = None  # the profile's join to this model, built at the first capture run
        if fast_compile:
            self.ort.info["fast_compile"] = {**defaults.QNN_FAST_COMPILE_OPTIONS, "note": (
                "QNN's faster, less optimized finalization: the model's output can differ by a quantization "
                "step from a default compile")}
            self.ort.info["label"] += " [fast compile: less optimized graph]"

    def _plan_exposure(self, nhwc: bool) -> None:
        """Leave out dead tensors (listed as unexposable) and expose channels-last ones in their own layout."""
        ort = self.ort
        if not ort.sites:
            return
        dead = dead_sites(self.model, ort.sites)
        if dead:
            for s in dead:
                self.unexposable.append({"name": s.name, "output": s.output, "op_type": s.op_type,
                                         "reason": DEAD_REASON})
            gone = {s.output for s in dead}
            ort.sites = [s for s in ort.sites if s.output not in gone]
            ort.info["unexposable"] = list(self.unexposable)
            ort.info["exposed_tensors"] = len(ort.sites)
        if nhwc:
            plan = channels_last(self.model, ort.sites)
            ort.exposed_as = {o: nhwc_exposure(o) for o in sorted(plan)}
            ort.info["channels_last_exposure"] = len(plan)

    # ---------------------------------------------------------------- what the ORT runner knows
    @property
    def model_path(self) -> Path:
        """The ONNX model."""
        return self.ort.model_path

    @property
    def model(self) -> Any:
        """The loaded graph (``onnx.ModelProto``)."""
        return self.ort.model

    @property
    def sites(self) -> list[TensorSite]:
        """The tensors this runner exposes (after pruning the unexposable ones)."""
        return self.ort.sites

    @property
    def qnn_config(self) -> QnnSessionConfig:
        """The session settings (target, fallback, profiling level)."""
        return self.qnn.config

    @property
    def info(self) -> dict[str, Any]:
        """The ORT runner's info with the QNN sessions' state merged in (``backend_info`` of a capture)."""
        self.ort.info.update(self.qnn.state())
        return self.ort.info

    @property
    def exposure_check(self) -> dict[str, Any] | None:
        """Result of the with/without-exposure output check (after the first capture run)."""
        return self.ort.exposure_check

    @property
    def main_partition(self) -> Partition | None:
        """Partition of the capture session (or of the plain session when nothing was captured)."""
        label = self.qnn.main_label
        return self.qnn.sessions[label].partition if label else None

    @property
    def partitions(self) -> dict[str, Partition]:
        """Partition of every session created so far, by label (``capture``, ``capture-1``, ``plain``)."""
        return {k: v.partition for k, v in self.qnn.sessions.items()}

    def partition_record(self) -> dict[str, Any]:
        """What goes to the dump's ``/meta/partition``: the main session's nodes, every session's summary."""
        main = self.main_partition
        if main is None:
            return {}
        rec = {"session": self.qnn.main_label, **main.to_dict(with_nodes=True)}
        rec["all_sessions_on_qnn"] = all(p.all_on_qnn for p in self.partitions.values())
        rec["sessions"] = {k: p.to_dict(with_nodes=False) for k, p in self.partitions.items()}
        return rec

    def op_trace(self, label: str | None = None) -> dict[str, Any] | None:
        """The QNN framework op trace (ONNX -> QNN op mapping) of a session (default: the main one)."""
        label = label or self.qnn.main_label
        return self.qnn.sessions[label].op_trace if label else None

    # ---------------------------------------------------------------- exposure that breaks QNN
    def _what(self, gi: int, n_groups: int, n: int) -> str:
        total = n_groups + (1 if self.ort.verify else 0)  # + the exposure check's session
        return f"capture {gi + 1}/{total}, {n} tensors"

    def _prepare(self) -> None:
        """Create every capture session before anything is written; prune tensors QNN cannot expose."""
        ort = self.ort
        dead = [u for u in self.unexposable if u["reason"] == DEAD_REASON]
        if dead:
            note(f"not exposing {len(dead)} tensor(s) nothing reads on the way to a model output (the deployed "
                 f"graph does not compute them; exposing them changes what QNN compiles): {_names(dead)}")
        self._probes = _Probes(self.max_probes, defaults.QNN_PROBE_BUDGET_S)
        t0, plan0 = time.perf_counter(), set(ort.exposed_as)
        memory = self._recall_exposure()
        for _ in range(4 + 2 * len(ort.groups())):
            groups = ort.groups()
            failure = None
            for gi, group in enumerate(groups):
                self.qnn.what = self._what(gi, len(groups), len(group))
                try:
                    ort.session_for(gi, group)
                except QnnUnsupportedError as e:
                    failure = (gi, len(groups), group, e)
                    break
                finally:
                    self.qnn.what = None
            if failure is None:
                self._prepared = True
                self._remember_exposure(memory, plan0, time.perf_counter() - t0)
                return
            gi, n_groups, group, err = failure
            if not group or not self.drop_unexposable:
                raise err
            self.qnn.what = "model outputs only (the unmodified model must run on HTP)"
            try:
                ort.session_for(-1, [])  # if the unmodified model does not run, its error is the real one
            finally:
                self.qnn.what = None
            if not self._unplan(group, err) and not self._bond(group, err):
                found = self._culprits(f"capture {gi + 1}/{n_groups}", group, err)
                if not found:
                    raise err
                for site, reason in found:
                    self.unexposable.append({"name": site.name, "output": site.output, "op_type": site.op_type,
                                             "reason": one_line(reason, 600)})
                drop = {s.output for s, _ in found}
                ort.sites = [s for s in ort.sites if s.output not in drop]
                ort.info["unexposable"] = list(self.unexposable)
                ort.info["exposed_tensors"] = len(ort.sites)
                unprobed = [{"name": s.name} for s, r in found if "not probed" in r]
                if unprobed:  # left out without proof: a loss the user can act on (a smaller --include set)
                    warn(f"not exposing {len(unprobed)} tensor(s) on QNN HTP, not probed (the probe budget ran "
                         f"out): {_names(unprobed, 3)}; reasons in the dump's backend_info.unexposable")
                if len(unprobed) < len(found):
                    note(f"not exposing {len(found) - len(unprobed)} tensor(s) QNN HTP refuses to expose: "
                         f"{_names([{'name': s.name} for s, r in found if 'not probed' not in r], 3)} (reasons "
                         "in the dump's backend_info.unexposable)")
            ort.sites = self._ordered(ort.sites)
            for k in [k for k in ort.sessions if k != -1]:
                del ort.sessions[k]
            self.qnn.drop_capture_sessions()
        raise CaptureError("could not find a set of exposed tensors QNN accepts", self.model_path)

    def _exposure_key(self) -> dict[str, Any]:
        """The key material of this runner's exposure search (:func:`~ivq_debug.capture.qnn_ep.cache.
        exposure_material`): the unmodified model's context material and the tensors asked for."""
        ort = self.ort
        request = {"sites": [s.output for s in ort.sites], "max_outputs_per_run": ort.max_outputs_per_run,
                   "channels_last": sorted(ort.exposed_as), "fixed_dims": ort.info.get("fixed_dims")}
        cfg = self.qnn.config.with_changes(profiling_level=None)  # runtime-only (and its CSV is per session)
        src = ort.source  # the model file when the graph is the file's, else the graph's bytes (in memory, dims fixed)
        graph = (str(src.path) if src.path is not None and ort.model is src.proto
                 else ort.model.SerializeToString())
        return exposure_material(cache_material(graph, cfg, ort.session_options(), ort.model), request)

    def _recall_exposure(self) -> tuple[dict[str, Any], ExposureMemory | None] | None:
        """Apply the remembered search for this model and request, if any; returns (key material, memory), or
        None without a cache (nothing is remembered then)."""
        cache, ort = self.qnn.cache, self.ort
        if cache is None or not self.drop_unexposable or not ort.sites:
            return None
        material = self._exposure_key()
        mem = recall_exposure(cache, material)
        if mem is None or mem.empty():
            return material, mem
        gone = {u["output"] for u in mem.unexposable}
        self.unexposable += [dict(u) for u in mem.unexposable]
        ort.sites = [s for s in ort.sites if s.output not in gone]
        self._bonds = [set(b) for b in mem.bonds]
        for o in mem.nchw:
            ort.exposed_as.pop(o, None)
        ort.sites = self._ordered(ort.sites)
        ort.info.update(unexposable=list(self.unexposable), exposed_tensors=len(ort.sites),
                        exposure_memory={"unexposable": len(gone), "probes_saved": mem.probes,
                                         "seconds_saved": mem.seconds})
        if "channels_last_exposure" in ort.info:
            ort.info["channels_last_exposure"] = len(ort.exposed_as)
        return material, mem  # said with the cache line after the first capture run (:meth:`_say_cache`)

    def _remember_exposure(self, recalled: tuple[dict[str, Any], ExposureMemory | None] | None,
                           plan0: set[str], seconds: float) -> None:
        """Store what the search found, when it found something the memory did not hold."""
        if recalled is None:
            return
        material, old = recalled
        mem = ExposureMemory([{k: u.get(k) for k in ("name", "output", "op_type", "reason")}
                              for u in self.unexposable if u.get("reason") != DEAD_REASON],
                             [sorted(b) for b in self._bonds], sorted(plan0 - set(self.ort.exposed_as)),
                             self._probes.used, seconds)
        if mem.empty() or (old is not None and (old.unexposable, old.bonds, old.nchw)
                           == (mem.unexposable, mem.bonds, mem.nchw)):
            return
        if old is not None:  # the remembered outcome needed more: keep what both searches cost
            mem.probes, mem.seconds = mem.probes + old.probes, mem.seconds + old.seconds
        remember_exposure(self.qnn.cache, material, mem)  # type: ignore[arg-type]

    def _accepts(self, sites: list[TensorSite], what: str) -> bool:
        """Whether QNN takes the model with these tensors exposed (a throw-away session)."""
        t0 = time.perf_counter()
        with self.ort.augmented([s.output for s in sites]) as model:
            ok = self.qnn.accepts(model, self.ort.session_options, self.model, what)
        self._probes.spent += time.perf_counter() - t0
        return ok

    def _near(self, sites: list[TensorSite], refused: set[str]) -> list[TensorSite]:
        """The sites produced or read by the nodes QNN refused."""
        users = self._users()
        return [s for s in sites if s.node in refused or set(users.get(s.output, ())) & refused]

    def _users(self) -> dict[str, list[str]]:
        if not hasattr(self, "_users_map"):
            self._users_map = consumers_of(self.model)
        return self._users_map

    def _unplan(self, group: list[TensorSite], err: QnnUnsupportedError) -> bool:
        """Expose the channels-last tensors next to the refused nodes in their plain NCHW layout again (the extra
        Transpose can meet a layout transpose QNN cannot fold: a ViT's patch embedding exposed in a 17-tensor
        group). Looks from each refused site up through the view ops to the sites that feed it. Returns True when
        some exposure changed (the caller retries before dropping anything)."""
        plan = self.ort.exposed_as
        if not plan:
            return False
        near = self._near(group, {str(u.get("name")) for u in err.unsupported})
        if not near:
            return False
        producer = {o: n for n in self.model.graph.node for o in n.output if o}
        site_of = {s.output: s for s in self.ort.sites}
        found = {s.output for s in near}
        for s in near:  # up to two producing ops back (through their Q / DQ): ``UPSTREAM_HOPS`` tensors
            stack, seen = [(s.output, 0)], set()
            while stack:
                t, depth = stack.pop()
                if t in seen or depth > UPSTREAM_HOPS:
                    continue
                seen.add(t)
                if t in site_of:
                    found.add(t)
                n = producer.get(t)
                if n is not None:
                    stack.extend((i, depth + 1) for i in n.input if i in producer)
        back = sorted(o for o in found if o in plan)
        if not back:
            return False
        for o in back:
            del plan[o]
        self.ort.info["channels_last_exposure"] = len(plan)
        note(f"QNN HTP refused a capture group next to {len(back)} tensor(s) exposed channels-last; exposing "
             f"{_names([{'name': site_of[o].name} for o in back], 3)} in the NCHW layout instead")
        return True

    def _bond(self, group: list[TensorSite], err: QnnUnsupportedError) -> bool:
        """Keep the refused tensors in one session with their neighbours' tensors when a group boundary
        separates them (QNN refuses a fused pair such as ViT's Kᵀ Transpose exposed without the Mul after it).
        Returns True when the groups changed (the caller retries before dropping anything)."""
        n = self.ort.max_outputs_per_run
        refused = {str(u.get("name")) for u in err.unsupported}
        near = self._near(group, refused)
        if not n or not near:
            return False
        users = self._users()
        inside = {s.output for s in group}
        near_users = {u for s in near for u in users.get(s.output, ())}
        near_nodes = {s.node for s in near}
        partners = [t for t in self.ort.sites if t.output not in inside
                    and (t.node in refused or t.node in near_users
                         or set(users.get(t.output, ())) & (refused | near_nodes))]
        bond = {s.output for s in near} | {t.output for t in partners}
        if not partners or len(bond) > n or any(bond <= b for b in self._bonds):
            return False  # nothing outside the group, too many, or already together and still refused
        merged = [b for b in self._bonds if b & bond]
        self._bonds = [b for b in self._bonds if not b & bond] + [set().union(bond, *merged)]
        note(f"QNN HTP refused a capture group exposing {_names([{'name': s.name} for s in near], 3)} without "
             f"{_names([{'name': t.name} for t in partners], 3)}; keeping them in one session")
        return True

    def _ordered(self, sites: list[TensorSite]) -> list[TensorSite]:
        """``sites`` reordered so that every bond falls inside one capture group (groups are consecutive slices
        of ``max_outputs_per_run``); the dump keeps the topological order (each tensor carries its own)."""
        n = self.ort.max_outputs_per_run
        if not n or not self._bonds:
            return sites
        cluster = {o: i for i, b in enumerate(self._bonds) for o in b}
        units: list[list[TensorSite]] = []
        by_cluster: dict[int, list[TensorSite]] = {}
        for s in sites:
            c = cluster.get(s.output)
            if c is None:
                units.append([s])
            elif c in by_cluster:
                by_cluster[c].append(s)
            else:
                by_cluster[c] = [s]
                units.append(by_cluster[c])
        out: list[TensorSite] = []
        room = n
        while units:
            k = next((i for i, u in enumerate(units) if len(u) <= room), None)
            if k is None:  # only clusters larger than the room are left: they cannot all be kept whole
                return out + [s for u in units for s in u]
            u = units.pop(k)
            out.extend(u)
            room -= len(u)
            if room == 0:
                room = n
        return out

    def _culprits(self, where: str, group: list[TensorSite],
                  err: QnnUnsupportedError) -> list[tuple[TensorSite, str]]:
        """The exposed tensors that make QNN refuse the graph, with the reason for each: the ones next to the
        refused nodes, else found by bisection; each probe is a throw-away compile, within the probe budget.
        What the budget does not cover is returned with a "not probed" reason."""
        refused = {str(u.get("name")) for u in err.unsupported}
        why = "; ".join(sorted({f"{u['name']} ({u['op_type']}): {u['reason']}" for u in err.unsupported}))
        refused_reason = f"exposing it makes QNN refuse the graph: {why}"
        probes = self._probes
        est = max(self.qnn.compile_seconds or [0.0])
        left = probes.allowed(est)
        reasons = "; ".join(dict.fromkeys(one_line(u["reason"]).rstrip(".") for u in err.unsupported))
        note(f"QNN HTP refused {where} exposing {len(group)} tensors ({len(refused)} node(s): "
             f"{one_line(reasons, 80)}); looking for the tensors it will not expose with at most {left} probe "
             f"compile(s) of ~{est:.0f} s")
        unprobed = (f"not probed: QNN refused a graph exposing it ({why}) and the search for the culprits stops "
                    f"after {probes.cap} probe compiles or {probes.budget_s:.0f} s (one compile of this model takes "
                    f"~{est:.0f} s); capture it in a smaller --include set to try again")

        def probe(sites: list[TensorSite]) -> bool | None:
            if not probes.take(max(self.qnn.compile_seconds or [0.0])):
                return None
            return self._accepts(sites, f"probe {probes.used}/{probes.cap}, {len(sites)} tensors")

        near = self._near(group, refused)
        if near:
            ok = probe([s for s in group if s not in near])
            if ok is None:  # no budget: leave out the neighbours unverified; the next capture session checks
                return [(s, f"next to the nodes QNN refused; {unprobed}") for s in near]
            if ok:
                bad, found = list(near), []
                for s in near:  # keep the neighbours whose exposure is harmless on its own
                    keep = probe([x for x in group if x not in bad or x is s])
                    if keep is None:
                        found.append((s, f"next to the nodes QNN refused; {unprobed}"))
                    elif keep:
                        bad.remove(s)
                    else:
                        found.append((s, refused_reason))
                return found

        def bisect(sites: list[TensorSite]) -> list[tuple[TensorSite, str]]:
            if not sites:
                return []
            ok = probe(sites)
            if ok is None:
                return [(s, unprobed) for s in sites]
            if ok:
                return []
            if len(sites) == 1:
                return [(sites[0], refused_reason)]
            half = len(sites) // 2
            return bisect(sites[:half]) + bisect(sites[half:])

        return bisect(group)

    # ---------------------------------------------------------------- running
    def prepare(self) -> None:
        """Create the capture sessions now (compiled, or loaded from the context cache), as the first capture run
        does: a second runner of the same model made afterwards loads them from the cache (``ivq tune`` runs the
        evaluation samples of an HTP trial on two)."""
        if not self._prepared:
            self._prepare()

    def run(self, feeds: dict[str, Any], writer: Any = None) -> dict[str, Any]:
        """Run on HTP; with ``writer``, stream the selected tensors and record partition / profiling.

        On the first capture run into a writer, ``/meta/partition`` and the backend info (sessions,
        partition summary, exposure check, run times) are stored; the profiling CSV (when on), joined to the
        ONNX tensors, is attached as the ``profiling`` table after every capture run.
        """
        if writer is not None and not self._prepared:
            self._prepare()
        out = self.ort.run(feeds, writer)
        check = self.exposure_check
        if check is not None and not check.get("bit_identical", True) and self.require_bit_identical:
            raise CaptureError(f"final outputs differ with and without exposed tensors "
                               f"(max |Δ| {check.get('max_abs')}); intermediates perturb the HTP graph",
                               self.model_path)
        if writer is not None:
            self._write_meta(writer)
            self._say_cache()
        return out

    def _say_cache(self) -> None:
        """One console line after the first capture run: how many sessions the context cache gave back."""
        cc = self.info.get("context_cache")
        if self._cache_said or not cc:
            return
        self._cache_said = True
        hits, misses = cc["hits"], cc["misses"]
        mem = self.ort.info.get("exposure_memory")
        left = (f"; {mem['unexposable']} tensor(s) QNN refuses to expose left out as an earlier capture found "
                f"({mem['probes_saved']} probe compile(s) not repeated)") if mem else ""
        if hits:
            note(f"QNN context cache hit: {len(hits)} of {len(hits) + len(misses)} QNN HTP session(s) loaded instead "
                 f"of compiled ({cc['compile_seconds_saved']:.1f} s of compile saved; {cc['root']}){left}")
        elif misses:
            note(f"QNN context cache: compiled {len(misses)} session(s) and stored them in {cc['root']}; the next "
                 f"capture of this model loads them")

    def _write_meta(self, writer: Any) -> None:
        labels = tuple(sorted(self.qnn.sessions))
        if self._written.get(writer) != labels:
            writer.set_meta("partition", self.partition_record())
            trace = self.op_trace()
            if trace is not None:
                writer.set_meta("qnn_op_trace", trace)
            self._written[writer] = labels
        info = self.info
        keys = ("sessions", "partition", "providers", "unexposable", "exposed_tensors", "compiled_target",
                "target_verified", "run_seconds", "profiling", "exposure_check", "context_cache",
                "channels_last_exposure")
        writer.update_backend_info(**{k: info[k] for k in keys if k in info})
        self._attach_profiling(writer)

    def _attach_profiling(self, writer: Any) -> None:
        label = self.qnn.main_label
        csv = self.qnn.profiling_files.get(label) if label else None
        if not csv or not os.path.exists(csv):
            return
        part = self.main_partition
        # with CPU fallback a session holds several QNN partitions: each inference writes one block each
        n_qnn = sum(1 for ep, _ in part.subgraphs if ep == EP_NAME) if part is not None else 1
        table = read_qnn_ep_csv(csv, graphs_per_run=max(1, n_qnn))
        if table is None:
            return
        if (self.qnn.sessions[label].cache or {}).get("hit"):  # a loaded context: source ops from the trace
            src = source_ops(self.op_trace(label))
            table["onnx_source_ops"] = [ops if ops or not is_op else src.get(str(q), [])
                                        for ops, is_op, q in zip(table["onnx_source_ops"], table["is_op"],
                                                                 table["qnn_name"], strict=True)]
        # one table per part when this runner ran one part (a VLM's vision, prefill and decode runners each have
        # their own profile); a runner that ran records of several parts writes the plain ``profiling`` table
        key = getattr(writer, "current_key", None)
        if key is not None:
            self._parts.setdefault(key[1])
        part = next(iter(self._parts)) if len(self._parts) == 1 else None
        if self._join is None:
            self._join = TensorJoin(self.model)
        writer.add_table(profiling_table(part), self._join(table))

    def close(self) -> None:
        """Release the sessions."""
        self.ort.close()
