"""ONNX Runtime capture: intermediate tensors exposed as extra graph outputs.

Float models expose node outputs. QDQ models expose the outputs of their activation ``QuantizeLinear``
nodes (raw integers, which adds no ops and keeps QNN fusions intact), dequantized with the model's own
scale / zero point and keyed by the *float* tensor name, so float, CPU-QDQ and QNN HTP dumps of one
model align by name (:mod:`ivq_debug.onnxgraph.sites`). The CPU EP reference runs with graph optimizations
disabled (exact fake-quant). Above that (a deployment's ``ORT_ENABLE_ALL``) only the tensors of the graph ONNX
Runtime actually runs are exposed, so the capture does not stop the fusions it observes
(:mod:`ivq_debug.capture.onnxrt.optimized`), and the model outputs are checked bit-identical with and without
the exposure. Every dump records the platform (:mod:`ivq_debug.capture.onnxrt.platform`) and the kernel behind
each tensor (``/meta/kernels``).

A runner composes a *session factory* (Polygraphy's loader + runner): :class:`CpuSessions` by default, the QNN
HTP one of :mod:`ivq_debug.capture.qnn_ep.runner` for HTP numerics. The runner owns what is the same on every
EP (which tensors to expose, the derived graphs, output groups, partitioned runs, the exposure check); the
factory owns how one session is made and what it records.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ivq_debug import defaults
from ivq_debug.capture.base import Closing, Selection
from ivq_debug.capture.onnxrt.optimized import graph_kernels, optimized_model
from ivq_debug.capture.onnxrt.partition import piece_model, plan_partitions
from ivq_debug.capture.onnxrt.platform import platform_info
from ivq_debug.dump.quant import dequantize
from ivq_debug.errors import CaptureError, InputError, UsageError, one_line
from ivq_debug.onnxgraph import intake
from ivq_debug.onnxgraph.fold import static_shapes
from ivq_debug.onnxgraph.load import Model, has_external_data, load
from ivq_debug.onnxgraph.sites import TensorSite, is_qdq_model, list_sites, scope_of

OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}


def _opt_level(level: str):
    import onnxruntime as ort

    if level not in OPT_LEVELS:
        raise UsageError(f"unknown graph optimization level {level!r} ({', '.join(OPT_LEVELS)})")
    return getattr(ort.GraphOptimizationLevel, OPT_LEVELS[level])


class SessionFactory(Protocol):
    """How a runner makes its ONNX Runtime sessions (one per derived graph).

    ``create`` gets the model (bytes or a path), a callable returning fresh ``SessionOptions`` (optimization
    level, threads), whether the model is the runner's unmodified model (``plain``) and its loaded graph.
    """

    #: partitioned capture gives bit-identical tensors with this factory's sessions
    can_partition: bool

    def backend(self, qdq: bool) -> str:
        """The backend name of a runner using this factory (``qdq``: the model holds Q/DQ nodes)."""
        ...

    def info(self) -> dict[str, Any]:
        """What the factory adds to the runner's ``info`` before any session exists (providers, target)."""
        ...

    def create(self, model: bytes | str, options: Callable[[], Any], *, plain: bool, proto: Any) -> Any:
        """One session."""
        ...


class CpuSessions:
    """Sessions on ONNX Runtime's CPU EP: the default factory of :class:`OrtRunner`."""

    can_partition = True
    #: the graph these sessions run can be saved (``optimized_model_filepath``), so only its tensors are exposed
    knows_optimized_graph = True

    def backend(self, qdq: bool) -> str:
        """``onnxruntime-cpu``, or ``onnxruntime-cpu-qdq`` for a QDQ model (exact fake-quant)."""
        return "onnxruntime-cpu-qdq" if qdq else "onnxruntime-cpu"

    def info(self) -> dict[str, Any]:
        """The providers."""
        return {"providers": ["CPUExecutionProvider"]}

    def create(self, model: bytes | str, options: Callable[[], Any], *, plain: bool, proto: Any) -> Any:
        """An ``InferenceSession`` on the CPU EP."""
        import onnxruntime as ort

        return ort.InferenceSession(model, sess_options=options(), providers=["CPUExecutionProvider"])


@dataclass(frozen=True)
class ExposedAs:
    """How a composing runner exposes one tensor instead of adding it as a graph output directly.

    ``nodes`` (``onnx.NodeProto``) are appended to the derived graph and compute ``fetch`` from the tensor; the
    runner fetches ``fetch`` and stores ``restore(value)`` as the tensor. ``restore`` must be pure data movement
    (e.g. a transpose back), so the stored values are exactly the tensor's. Example: the QNN HTP runner exposes a
    channels-last tensor through ``Transpose(perm=[0, 2, 3, 1])`` (which ORT cancels against the layout transpose
    QNN would otherwise add per exposed output) and transposes it back in numpy (``docs/qnn-compile.md``).
    """

    fetch: str
    nodes: tuple[Any, ...]
    restore: Callable[[np.ndarray], np.ndarray]


class OrtRunner(Closing):
    """Run an ONNX model with ONNX Runtime and capture intermediate tensors.

    Args:
        model_path: the ONNX model: a path, or a :class:`~ivq_debug.onnxgraph.load.Model` (in memory: a derived
            model never goes through a file unless its weights are external data; external data > 2 GB
            supported, weights are never copied).
        selection: which tensors to capture (``None`` captures nothing: a plain run).
        exposure: ``"auto"`` / ``"float"`` / ``"qdq"`` (see :func:`list_sites`).
        optimization: ``"disable"`` (default, exact reference), ``"basic"``, ``"extended"``, ``"all"``.
        max_outputs_per_run: capture in several runs of at most this many extra outputs (bounds memory).
        partition: with ``max_outputs_per_run``, run consecutive subgraphs that each expose one group, so
            the capture costs one forward (:mod:`ivq_debug.capture.onnxrt.partition`) instead of one per group.
            Default: when the session factory supports it (``can_partition``: the CPU EP at
            ``optimization="disable"``, where the result is bit-identical) and the graph can be cut.
        verify: on the first capture run, also run the unmodified model and check the model's own
            outputs are bit-identical with and without exposure (recorded in ``info``). Default: only when
            graph optimizations are on (with ``optimization="disable"`` extra outputs cannot change which
            kernels run, so the check would cost a session and a forward for nothing).
        threads: intra-op threads (``None``: ORT default).
        session_config: ONNX Runtime session config entries (``{"session.x64quantprecision": "1"}``), as a
            deployment sets them with ``SessionOptions.add_session_config_entry``; applied to every session.
        sessions: the session factory (default :class:`CpuSessions`).
        input_shapes: static shapes for dynamic inputs (``{name: shape}``, e.g.
            :func:`ivq_debug.onnxgraph.intake.input_shapes` of the samples): the graph run is the model with
            those dims fixed (``info["fixed_dims"]``); QNN HTP takes only static shapes.

    Above ``optimization="disable"``, with a factory whose graph can be saved (``knows_optimized_graph``),
    only the selected tensors that survive in the optimized graph are exposed (``info["optimized_graph"]``
    counts the dropped ones).
    """

    def __init__(
        self,
        model_path: str | os.PathLike | Model,
        *,
        selection: Selection | None = None,
        exposure: str = "auto",
        optimization: str = "disable",
        max_outputs_per_run: int | None = None,
        verify: bool | None = None,
        threads: int | None = None,
        partition: bool | None = None,
        session_config: Mapping[str, str] | None = None,
        sessions: SessionFactory | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self.factory: SessionFactory = sessions if sessions is not None else CpuSessions()
        self.session_config = {str(k): str(v) for k, v in (session_config or {}).items()}
        #: the model as loaded (:class:`~ivq_debug.onnxgraph.load.Model`: a path is parsed here, once)
        self.source = load(model_path)
        #: the file named in messages and ``info`` (a derived model's source file)
        self.model_path = Path(self.source.origin or "<in-memory model>")
        self.folder = self.source.folder if self.source.folder is not None else Path.cwd()
        self.model = self.source.proto
        if input_shapes:  # fixed on a copy: the loaded model may serve other stages
            self.model = type(self.model)()
            self.model.CopyFrom(self.source.proto)
        try:
            fixed = intake.fix_input_dims(self.model, input_shapes) if input_shapes else []
        except UsageError as e:
            raise UsageError(e.message, self.model_path) from None
        #: what a plain run loads: the model's own file when its weights are external data there (ONNX Runtime
        #: reads those only through a file), else the proto serialized on first use (the file is not read again)
        self._plain_model: bytes | str | None = (
            str(self.source.path) if not fixed and self.source.path is not None and has_external_data(self.model)
            else None)
        self.selection = selection
        self.optimization = optimization
        self.max_outputs_per_run = max_outputs_per_run
        self.verify = (optimization != "disable") if verify is None else verify
        if threads is not None and threads < 1:
            raise UsageError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        _opt_level(optimization)  # an unknown level is a usage error before any session
        self.qdq = is_qdq_model(self.model)
        self.backend = self.factory.backend(self.qdq)
        self.output_names = [o.name for o in self.model.graph.output]
        self.input_names = [i.name for i in self.model.graph.input]
        all_sites = list_sites(self.model, exposure, str(self.folder)) if selection is not None else []
        outputs = set(self.output_names)
        self.sites = [
            s for s in all_sites if s.output not in outputs and selection is not None
            and selection.accepts(s.name, s.op_type)
        ]
        # graph outputs are captured too (under their own names) so the logits align
        self._producers = {o: (i, n) for i, n in enumerate(self.model.graph.node) for o in n.output if o}
        self.sessions: dict[int, Any] = {}
        #: site output -> how it is exposed, set by a composing runner (whole-model runs only: the partitioned
        #: CPU capture exposes every tensor directly)
        self.exposed_as: dict[str, ExposedAs] = {}
        self._plain: Any = None
        self._verified: dict[str, Any] | None = None
        self._kernels_for: Any = None  # weak reference to the writer that has /meta/kernels
        self.kernels: dict[str, Any] | None = None
        optimized = None
        if (selection is not None and self.optimization != "disable"
                and getattr(self.factory, "knows_optimized_graph", False)):  # (a plain run exposes nothing)
            optimized = self._optimized_graph()
        auto = None
        if max_outputs_per_run is None and partition is not False:
            auto = self._auto_group_size()
            self.max_outputs_per_run = auto["per_run"] if auto else None
        self.plan = self._partition_plan(partition)
        if auto and self.plan is None:  # a graph that cannot be cut runs whole: never N whole-model runs unasked
            self.max_outputs_per_run, auto = None, None
        self.info: dict[str, Any] = self.base_info()
        if fixed:
            self.info["fixed_dims"] = fixed
        if optimized is not None:
            self.info["optimized_graph"] = optimized
        if len(self.groups()) > 1:
            self.info["capture_runs"] = {"mode": "partitioned" if self.plan else "whole-model",
                                         "runs": len(self.plan) if self.plan else len(self.groups())}
            if auto:
                self.info["capture_runs"]["auto"] = auto

    def _auto_group_size(self) -> dict[str, Any] | None:
        """The memory bound the caller did not set: tensors per run so that one run's exposed outputs stay near
        ``defaults.CAPTURE_RUN_BYTES`` (shape inference, 4 bytes per element; tensors of unknown shape count at
        the mean), or None when they fit, the shapes are unknown or the backend cannot run subgraphs."""
        if not (self.sites and self.factory.can_partition and self.optimization == "disable"):
            return None
        shapes = static_shapes(self.model)
        sizes = [4 * math.prod(shapes[s.output]) for s in self.sites if s.output in shapes]
        if not sizes:
            return None
        total = sum(sizes) * len(self.sites) / len(sizes)
        if total <= defaults.CAPTURE_RUN_BYTES:
            return None
        per = max(1, int(len(self.sites) * defaults.CAPTURE_RUN_BYTES / total))
        return {"per_run": per, "estimated_bytes": int(total), "limit_bytes": defaults.CAPTURE_RUN_BYTES}

    def _optimized_graph(self) -> dict[str, Any]:
        """Keep only the sites whose tensor the optimized graph still computes; the kernels as run."""
        try:
            with self.augmented([]) as plain:  # (the file, or the model with its dims fixed)
                graph = optimized_model(
                    lambda options: self.factory.create(plain, options, plain=True, proto=self.model),
                    self.session_options)
        except Exception as e:
            raise CaptureError(f"cannot save the optimized graph: {one_line(e, 300)}", self.model_path) from None
        self.kernels = graph_kernels(graph, OPT_LEVELS[self.optimization])
        computed = set(self.kernels["tensors"])
        before = len(self.sites)
        self.sites = [s for s in self.sites if s.output in computed]
        return {"nodes": len(graph.graph.node), "model_nodes": len(self.model.graph.node),
                "exposed": len(self.sites), "dropped": before - len(self.sites)}

    def _partition_plan(self, partition: bool | None) -> Any:
        if partition is False or not self.max_outputs_per_run or len(self.groups()) < 2:
            return None
        if not (self.factory.can_partition and self.optimization == "disable"):
            if partition:
                raise UsageError(f"partitioned capture needs the CPU EP with optimization='disable' "
                                 f"({self.backend}, optimization={self.optimization!r})")
            return None
        plan = plan_partitions(self.model, self.sites, self.max_outputs_per_run)
        if plan is None and partition:
            raise UsageError("this graph cannot be cut into consecutive subgraphs (control flow, sparse "
                             "initializers, nodes out of topological order, model outputs no node produces, or "
                             "shape inference fails)", self.model_path)
        return plan

    # ---------------------------------------------------------------- sessions
    def base_info(self) -> dict[str, Any]:
        """``info`` before any run: versions, optimization level, exposure, and the factory's own info."""
        import onnx
        import onnxruntime as ort

        level = OPT_LEVELS.get(self.optimization, self.optimization)
        return {
            "onnxruntime": ort.__version__,
            "onnx": onnx.__version__,
            "graph_optimization_level": level,
            "exposure": "qdq" if self.qdq else "float",
            "exposed_tensors": len(self.sites),
            "opset": {o.domain or "ai.onnx": o.version for o in self.model.opset_import},
            "model_path": str(self.model_path),
            "platform": platform_info(threads=self.threads, optimization=level, session_config=self.session_config),
            **self.factory.info(),
        }

    def session_options(self):
        """Session options shared by every session of this runner (the factory adds its EP)."""
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = _opt_level(self.optimization)
        so.log_severity_level = 3
        if self.threads:
            so.intra_op_num_threads = self.threads
        for k, v in self.session_config.items():
            try:
                so.add_session_config_entry(k, v)
            except Exception as e:
                raise UsageError(f"session option {k}={v}: {one_line(e, 200)}") from None
        return so

    def create_session(self, model_bytes_or_path: bytes | str):
        """Create one session through the factory."""
        plain = model_bytes_or_path is self._plain_model or (
            isinstance(model_bytes_or_path, str) and model_bytes_or_path == self._plain_model)
        return self.factory.create(model_bytes_or_path, self.session_options, plain=plain, proto=self.model)

    def model_with_outputs(self, outputs: list[str]) -> bytes | str:
        """The model with ``outputs`` added as graph outputs: bytes, or the path of a temporary file in the
        model's folder when it has external data (removed by :meth:`session_for` after loading)."""
        import onnx

        if not outputs:
            if self._plain_model is not None:
                return self._plain_model
            plain = self.serialized(self.model)
            if isinstance(plain, bytes):  # (a temporary file is removed once loaded: not kept)
                self._plain_model = plain
            return plain
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        existing = {o.name for o in m.graph.output}
        for name in outputs:
            how = self.exposed_as.get(name)
            if how is not None:
                m.graph.node.extend(how.nodes)
                name = how.fetch
            if name not in existing:
                m.graph.output.append(onnx.ValueInfoProto(name=name))
        return self.serialized(m)

    def fetch_name(self, output: str) -> str:
        """The graph output fetched for exposed value ``output`` (see :class:`ExposedAs`)."""
        how = self.exposed_as.get(output)
        return how.fetch if how is not None else output

    def serialized(self, m: Any) -> bytes | str:
        """A derived model (same folder, same weights) as bytes, or as a temporary file in the model's folder
        when its weights are external data (see :meth:`model_with_outputs`)."""
        import onnx

        if not has_external_data(m):  # (weights referenced in place count as external data)
            return m.SerializeToString()
        # external data (> 2 GB models): ORT only reads data files inside the model's folder, so the
        # augmented graph is written there under a hidden temporary name and removed once the session
        # has loaded it (see _session); the weights themselves are never copied.
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".ivq-{os.getpid()}-", suffix=".onnx", dir=self.folder)
            os.close(fd)
            onnx.save(m, tmp, save_as_external_data=False)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise CaptureError(f"cannot write the derived graph next to the model (external data must stay in "
                               f"its folder): {one_line(e, 200)}", self.folder) from None
        return tmp

    def groups(self) -> list[list[TensorSite]]:
        """The capture sites split into runs of at most ``max_outputs_per_run``."""
        if not self.sites:
            return [[]]
        n = self.max_outputs_per_run or len(self.sites)
        return [self.sites[i : i + n] for i in range(0, len(self.sites), n)]

    def session_for(self, gi: int, group: list[TensorSite]):
        """The (cached) session of capture group ``gi`` exposing ``group``; ``gi = -1`` is the plain model.

        Sessions live in :attr:`sessions` (a dict keyed by ``gi``); a composing runner may drop entries to
        force re-creation (e.g. after pruning sites).
        """
        if gi not in self.sessions:
            if self.max_outputs_per_run and len(self.groups()) > 1:
                # capture in output subsets bounds memory: keep one session (one copy of the weights) alive
                for k in [k for k in self.sessions if k != gi]:
                    del self.sessions[k]
            with self.augmented([s.output for s in group]) as model:
                self.sessions[gi] = self._checked_session(model)
        return self.sessions[gi]

    def _checked_session(self, model: bytes | str) -> Any:
        try:
            return self.create_session(model)
        except CaptureError:
            raise
        except Exception as e:
            msg = one_line(e, 400)
        if model is self._plain_model or not self._plain_loads():
            # the user's own model does not load (invalid graph, opset, external data outside its folder or
            # missing, initializer sizes): a bad input, exit 3
            raise InputError(f"ONNX Runtime cannot load the model: {msg}", self.model_path)
        raise CaptureError(f"session creation failed: {msg}", self.model_path)

    def _plain_loads(self) -> bool:
        """Whether the unmodified model gets a session (tells a bad model from a bad derived graph)."""
        try:
            with self.augmented([]) as plain:
                self.create_session(plain)
        except Exception:
            return False
        return True

    @contextmanager
    def augmented(self, outputs: list[str]) -> Iterator[bytes | str]:
        """:meth:`model_with_outputs` for the duration of a ``with`` block (its temporary file is removed)."""
        with self._temporary(self.model_with_outputs(outputs)) as model:
            yield model

    @contextmanager
    def _temporary(self, model: bytes | str) -> Iterator[bytes | str]:
        try:
            yield model
        finally:
            if isinstance(model, str) and model != self._plain_model:
                os.unlink(model)

    # ---------------------------------------------------------------- running
    def run(self, feeds: dict[str, np.ndarray], writer: Any = None) -> dict[str, np.ndarray]:
        """Run the model; with ``writer``, stream the selected tensors into its current record.

        Returns the model's own outputs. With a writer, the feeds are stored as the record's inputs (unless
        already there) and the graph outputs as tensors under their names.
        """
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise UsageError(f"missing inputs {missing} for {self.model_path.name}")
        feeds = {k: v for k, v in feeds.items() if k in self.input_names}
        if writer is not None:  # the record's model inputs, unless the caller stored them already
            for k, v in feeds.items():
                if not writer.has(k, "input"):
                    writer.add_input(k, v)
        if writer is not None and self.plan is not None:
            result = self._run_partitioned(feeds, writer)
            self._finish(feeds, result, writer)
            return result
        result: dict[str, np.ndarray] | None = None
        groups = self.groups() if writer is not None else [[]]
        for gi, group in enumerate(groups):
            sess = self.session_for(gi if writer is not None else -1, group if writer is not None else [])
            names = self.output_names + [self.fetch_name(s.output) for s in group]
            try:
                values = sess.run(names, feeds)
            except Exception as e:
                raise CaptureError(f"run failed: {one_line(e, 400)}", self.model_path) from None
            out = dict(zip(self.output_names, values[: len(self.output_names)], strict=True))
            if result is None:
                result = out
            if writer is not None:
                for site, val in zip(group, values[len(self.output_names) :], strict=True):
                    how = self.exposed_as.get(site.output)
                    self._write_site(writer, site, how.restore(val) if how is not None else val)
                    del val
        assert result is not None
        if writer is not None:
            self._finish(feeds, result, writer)
        return result

    def _run_partitioned(self, feeds: dict[str, np.ndarray], writer: Any) -> dict[str, np.ndarray]:
        """One forward through the plan's pieces; each piece's exposed tensors are written as it finishes."""
        assert self.plan is not None
        self.sessions.clear()  # a whole-model session would hold a second copy of the weights
        store: dict[str, np.ndarray] = {}  # boundary values still read by a later piece
        result: dict[str, np.ndarray] = {}
        outputs = set(self.output_names)
        for k, piece in enumerate(self.plan.pieces):
            pfeeds = {x: feeds[x] if x in feeds else store[x] for x in piece.inputs}
            odd = [x for x, v in pfeeds.items() if not isinstance(v, np.ndarray) or v.dtype == object]
            if odd:
                raise CaptureError(f"cannot cut the graph before piece {k + 1}: {odd[0]!r} is a sequence, map or "
                                   f"string value; capture with --whole-model-runs (partition=False)",
                                   self.model_path)
            model = piece_model(self.model, piece, pfeeds, self.plan.elem_types,
                                name=f"{self.model.graph.name}_part{k}")
            with self._temporary(self.serialized(model)) as m:
                sess = self._checked_session(m)
            del model, m  # (serialized bytes hold a copy of the piece's embedded weights)
            try:
                values = dict(zip(piece.outputs, sess.run(piece.outputs, pfeeds), strict=True))
            except Exception as e:
                raise CaptureError(f"run failed in piece {k + 1}/{len(self.plan)}: "
                                   f"{one_line(e, 400)}", self.model_path) from None
            del sess, pfeeds
            for site in piece.sites:
                self._write_site(writer, site, values[site.output])
            for name in values:
                if name in outputs:
                    result[name] = values[name]
                if self.plan.last_use.get(name, -1) > k:
                    store[name] = values[name]
            for name in [x for x in store if self.plan.last_use[x] <= k]:
                del store[name]
            del values
        return {name: result[name] for name in self.output_names}

    def _finish(self, feeds: dict[str, np.ndarray], result: dict[str, np.ndarray], writer: Any) -> None:
        """Write the model's own outputs into the record; run the exposure check once if asked."""
        site_names = {s.name for s in self.sites}
        # the kernels as run: the file's graph at disable, the optimized one above (QNN compiles a graph of its own)
        known = getattr(self.factory, "knows_optimized_graph", False) and (
            self.kernels is not None or self.optimization == "disable")
        if known and (self._kernels_for is None or self._kernels_for() is not writer):  # once per dump
            if self.kernels is None:
                self.kernels = graph_kernels(self.model, OPT_LEVELS[self.optimization])
            writer.set_meta("kernels", self.kernels)
            self._kernels_for = weakref.ref(writer)
        for name in self.output_names:
            if name not in site_names:  # a QDQ graph output is already captured from its Q node
                i, node = self._producers.get(name, (len(self.model.graph.node), None))
                writer.add_tensor(name, result[name], op_type=node.op_type if node else "GraphOutput",
                                  order=i, scope=scope_of(node) if node else None)
        if self.verify and self._verified is None and self.sites:
            self._verify(feeds, result)
            writer.update_backend_info(exposure_check=self._verified)

    def _write_site(self, writer: Any, site: TensorSite, val: np.ndarray) -> None:
        """One exposed tensor into the record, handed over (``owned``: the session's fresh output, which nothing
        changes after, so the writer may make its statistics in its own thread; a graph output also goes back to
        the caller of :meth:`run`, so it is not handed over)."""
        if site.encoding is not None:  # (the values: a new array, whatever ``val`` is)
            writer.add_tensor(site.name, dequantize(val, site.encoding), op_type=site.op_type,
                              order=site.order, scope=site.scope, encoding=site.encoding, raw=val, owned=True)
        else:
            writer.add_tensor(site.name, val, op_type=site.op_type, order=site.order, scope=site.scope,
                              owned=site.output not in self.output_names)

    def _verify(self, feeds: dict[str, np.ndarray], captured: dict[str, np.ndarray]) -> None:
        plain = self.session_for(-1, [])
        ref = dict(zip(self.output_names, plain.run(self.output_names, feeds), strict=True))
        worst = 0.0
        identical = True
        for k in self.output_names:
            a, b = np.asarray(ref[k]), np.asarray(captured[k])
            if a.shape != b.shape or a.tobytes() != b.tobytes():
                identical = False
                if a.shape == b.shape and a.dtype.kind == "f":
                    worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
                else:
                    worst = float("inf")
        self._verified = {"bit_identical": identical, "max_abs": worst}
        self.info["exposure_check"] = self._verified

    @property
    def exposure_check(self) -> dict[str, Any] | None:
        """Result of the with/without-exposure output check (after the first capture run)."""
        return self._verified

    def close(self) -> None:
        """Release the sessions."""
        self.sessions.clear()
