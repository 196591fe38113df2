"""ONNX Runtime capture: intermediate tensors exposed as extra graph outputs.

Float models expose node outputs. QDQ models expose the outputs of their activation ``QuantizeLinear``
nodes (raw integers, which adds no ops and keeps QNN fusions intact), dequantized with the model's own
scale / zero point and keyed by the *float* tensor name, so float, CPU-QDQ and QNN HTP dumps of one
model align by name. The CPU EP reference runs with graph optimizations disabled (exact fake-quant).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.capture.base import Selection
from ivq_debug.errors import CaptureError, InputError, UsageError, one_line
from ivq_debug.graph import constant_nodes

QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
#: suffix the ORT quantizer gives a graph output's float tensor when it inserts Q/DQ after it
Q_INPUT_SUFFIX = "_QuantizeLinear_Input"

OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}


@dataclass(frozen=True)
class TensorSite:
    """One capturable tensor of an ONNX graph."""

    name: str  # key in the dump (float name for QDQ-exposed tensors)
    output: str  # graph value to expose
    op_type: str  # producer op type (for QDQ: the op that produced the float tensor)
    node: str  # producer node name
    order: int  # topological position of the producer
    scope: str | None  # module path from exporter scopes / metadata
    encoding: dict[str, Any] | None = None  # for QDQ-exposed tensors: how to dequantize


def scope_of(node: Any) -> str | None:
    """Module path of an ONNX node, from dynamo ``pkg.torch.onnx.name_scopes`` or legacy scope names.

    Legacy node names look like ``/vision_tower/encoder/layer.0/attention/q_proj/MatMul``: the module
    path is the components between the first and the last ``/`` joined by ``.``. Dynamo nodes carry the
    full module path as the second-to-last entry of the ``name_scopes`` metadata.
    """
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            import ast

            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                break
            if isinstance(scopes, list) and len(scopes) >= 2:
                return str(scopes[-2]) or None
    name = node.name
    if name.startswith("/") and name.count("/") >= 2:
        parts = name.split("/")[1:-1]
        return ".".join(parts) or None
    return None


def _initializer_arrays(model: Any, names: set[str], base_dir: str = "") -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    out: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        if init.name in names:
            out[init.name] = numpy_helper.to_array(init, base_dir)  # external data resolved from the model folder
    for node in model.graph.node:  # Constant nodes can also hold scales / zero points
        if node.op_type == "Constant" and node.output and node.output[0] in names:
            for a in node.attribute:
                if a.name == "value":
                    out[node.output[0]] = numpy_helper.to_array(a.t)
    return out


def is_qdq_model(model: Any) -> bool:
    """True when the graph holds QuantizeLinear nodes."""
    return any(n.op_type == "QuantizeLinear" and n.domain in QDQ_DOMAINS for n in model.graph.node)


def list_sites(model: Any, mode: str = "auto", base_dir: str = "") -> list[TensorSite]:
    """All capturable tensors of a model, in topological order.

    ``mode``: ``"float"`` exposes every node output; ``"qdq"`` exposes activation QuantizeLinear outputs
    keyed by their float names; ``"auto"`` picks ``"qdq"`` when the model has Q nodes.
    """
    if mode == "auto":
        mode = "qdq" if is_qdq_model(model) else "float"
    if mode not in ("float", "qdq"):
        raise UsageError(f"unknown exposure mode {mode!r} (float, qdq, auto)")
    nodes = list(model.graph.node)
    producer: dict[str, tuple[int, Any]] = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = (i, n)
    graph_inputs = {i.name for i in model.graph.input}
    initializers = {i.name for i in model.graph.initializer}
    sites: list[TensorSite] = []
    # values computed from initializers only (weight Identity copies, shape constants): not activations
    _, const = constant_nodes(nodes, initializers)
    if mode == "float":
        for i, n in enumerate(nodes):
            if n.output and all((not o) or o in const for o in n.output):
                continue
            for o in n.output:
                if o:
                    sites.append(TensorSite(o, o, n.op_type, n.name, i, scope_of(n)))
        return sites
    # qdq: Q nodes whose input is an activation (not an initializer / constant)
    qparams: set[str] = set()
    qnodes: list[Any] = []
    for n in nodes:
        if n.op_type == "QuantizeLinear" and n.domain in QDQ_DOMAINS:
            src = n.input[0]
            if src in const:  # a weight or a value computed from weights only
                continue
            qnodes.append(n)
            qparams.update(x for x in n.input[1:3] if x)
    params = _initializer_arrays(model, qparams, base_dir)
    seen: set[str] = set()
    for n in qnodes:
        src = n.input[0]
        name = src[: -len(Q_INPUT_SUFFIX)] if src.endswith(Q_INPUT_SUFFIX) else src
        if name in seen:
            continue
        seen.add(name)
        scale = params.get(n.input[1])
        zp = params.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        if scale is None:
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
        qdtype = zp.dtype.name if zp is not None else "uint8"
        bits = np.dtype(qdtype).itemsize * 8
        enc = {
            "bitwidth": bits,
            "dtype": qdtype,
            "scale": scale.tolist(),
            "zero_point": zp.tolist() if zp is not None else 0,
            "axis": axis if np.ndim(scale) > 0 and np.size(scale) > 1 else None,
            "qmin": int(np.iinfo(qdtype).min),
            "qmax": int(np.iinfo(qdtype).max),
        }
        if src in producer:
            pi, pn = producer[src]
            op_type, node_name, order, scope = pn.op_type, pn.name, pi, scope_of(pn)
        elif src in graph_inputs:
            op_type, node_name, order, scope = "GraphInput", "", -1, None
        else:
            continue
        sites.append(TensorSite(name, n.output[0], op_type, node_name, order, scope, enc))
    sites.sort(key=lambda s: s.order)
    return sites


def dequantize(q: np.ndarray, enc: dict[str, Any]) -> np.ndarray:
    """``(q - zero_point) * scale`` in float32, as ONNX DequantizeLinear computes it."""
    scale = np.asarray(enc["scale"], dtype=np.float32)
    zp = np.asarray(enc["zero_point"], dtype=np.int64)
    axis = enc.get("axis")
    if axis is not None and scale.ndim == 1 and scale.size > 1:
        shape = [1] * q.ndim
        shape[axis] = scale.size
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return (q.astype(np.int64) - zp).astype(np.float32) * scale


def _opt_level(level: str):
    import onnxruntime as ort

    if level not in OPT_LEVELS:
        raise UsageError(f"unknown graph optimization level {level!r} ({', '.join(OPT_LEVELS)})")
    return getattr(ort.GraphOptimizationLevel, OPT_LEVELS[level])


def load_model(path: str | os.PathLike, in_place: bool | None = None) -> Any:
    """Load an ONNX model's graph; weights never leave the disk when they can stay there.

    External data stays external. With ``in_place`` (default: files over ``graph.IN_PLACE_MIN_BYTES``), even
    embedded weights are referenced in place (:func:`ivq_debug.graph.load_in_place`) instead of parsed into
    memory; tensor values are then read with ``numpy_helper.to_array(t, <model folder>)``.
    """
    import onnx

    from ivq_debug.graph import IN_PLACE_MIN_BYTES, load_in_place

    p = Path(path)
    if not p.exists():
        raise InputError("no such ONNX model", p)
    try:
        if in_place or (in_place is None and p.stat().st_size >= IN_PLACE_MIN_BYTES):
            return load_in_place(p)
        return onnx.load(str(p), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError / various
        raise InputError(f"not a readable ONNX model ({type(e).__name__})", p) from None


def _has_external_data(model: Any) -> bool:
    from onnx.external_data_helper import uses_external_data

    return any(uses_external_data(t) for t in model.graph.initializer)


class OrtRunner:
    """Run an ONNX model with ONNX Runtime and capture intermediate tensors.

    Args:
        model_path: the ONNX model (external data > 2 GB supported; weights are never copied).
        selection: which tensors to capture (``None`` captures nothing: a plain run).
        exposure: ``"auto"`` / ``"float"`` / ``"qdq"`` (see :func:`list_sites`).
        optimization: ``"disable"`` (default, exact reference), ``"basic"``, ``"extended"``, ``"all"``.
        max_outputs_per_run: capture in several runs of at most this many extra outputs (bounds memory).
        partition: with ``max_outputs_per_run``, run consecutive subgraphs that each expose one group, so
            the capture costs one forward (:mod:`ivq_debug.capture.partition`) instead of one per group.
            Default: when the runner supports it (:attr:`can_partition`: the CPU EP at
            ``optimization="disable"``, where the result is bit-identical) and the graph can be cut.
        verify: on the first capture run, also run the unmodified model and check the model's own
            outputs are bit-identical with and without exposure (recorded in ``info``). Default: only when
            graph optimizations are on (with ``optimization="disable"`` extra outputs cannot change which
            kernels run, so the check would cost a session and a forward for nothing).
        threads: intra-op threads (``None``: ORT default).
    """

    backend = "onnxruntime-cpu"
    #: partitioned capture gives bit-identical tensors on this runner (not on EPs that compile the graph)
    can_partition = True

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        selection: Selection | None = None,
        exposure: str = "auto",
        optimization: str = "disable",
        max_outputs_per_run: int | None = None,
        verify: bool | None = None,
        threads: int | None = None,
        partition: bool | None = None,
    ) -> None:
        self.model_path = Path(model_path)
        self.model = load_model(self.model_path)
        self.selection = selection
        self.optimization = optimization
        self.max_outputs_per_run = max_outputs_per_run
        self.verify = (optimization != "disable") if verify is None else verify
        self.threads = threads
        self.qdq = is_qdq_model(self.model)
        if self.qdq and type(self) is OrtRunner:
            self.backend = "onnxruntime-cpu-qdq"
        self.output_names = [o.name for o in self.model.graph.output]
        self.input_names = [i.name for i in self.model.graph.input]
        all_sites = list_sites(self.model, exposure, str(self.model_path.parent)) if selection is not None else []
        outputs = set(self.output_names)
        self.sites = [
            s for s in all_sites if s.output not in outputs and selection is not None
            and selection.accepts(s.name, s.op_type)
        ]
        # graph outputs are captured too (under their own names) so the logits align
        self._producers = {o: (i, n) for i, n in enumerate(self.model.graph.node) for o in n.output if o}
        self.sessions: dict[int, Any] = {}
        self._plain: Any = None
        self._verified: dict[str, Any] | None = None
        self.plan = self._partition_plan(partition)
        self.info: dict[str, Any] = self.base_info()
        if len(self.groups()) > 1:
            self.info["capture_runs"] = {"mode": "partitioned" if self.plan else "whole-model",
                                         "runs": len(self.plan) if self.plan else len(self.groups())}

    def _partition_plan(self, partition: bool | None) -> Any:
        from ivq_debug.capture.partition import plan_partitions

        if partition is False or not self.max_outputs_per_run or len(self.groups()) < 2:
            return None
        if not (self.can_partition and self.optimization == "disable"):
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
        """``info`` before any run: versions, optimization level, providers, exposure (subclasses extend)."""
        import onnx
        import onnxruntime as ort

        return {
            "onnxruntime": ort.__version__,
            "onnx": onnx.__version__,
            "graph_optimization_level": OPT_LEVELS.get(self.optimization, self.optimization),
            "providers": ["CPUExecutionProvider"],
            "exposure": "qdq" if self.qdq else "float",
            "exposed_tensors": len(self.sites),
            "opset": {o.domain or "ai.onnx": o.version for o in self.model.opset_import},
            "model_path": str(self.model_path),
        }

    def session_options(self):
        """Session options shared by every session of this runner (subclasses add EP settings)."""
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = _opt_level(self.optimization)
        so.log_severity_level = 3
        if self.threads:
            so.intra_op_num_threads = self.threads
        return so

    def create_session(self, model_bytes_or_path: bytes | str):
        """Create one session (subclasses override to register execution providers)."""
        import onnxruntime as ort

        return ort.InferenceSession(model_bytes_or_path, sess_options=self.session_options(),
                                    providers=["CPUExecutionProvider"])

    def model_with_outputs(self, outputs: list[str]) -> bytes | str:
        """The model with ``outputs`` added as graph outputs: bytes, or the path of a temporary file in the
        model's folder when it has external data (removed by :meth:`session_for` after loading)."""
        import onnx

        if not outputs:
            return str(self.model_path)
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        existing = {o.name for o in m.graph.output}
        for name in outputs:
            if name not in existing:
                m.graph.output.append(onnx.ValueInfoProto(name=name))
        return self.serialized(m)

    def serialized(self, m: Any) -> bytes | str:
        """A derived model (same folder, same weights) as bytes, or as a temporary file in the model's folder
        when its weights are external data (see :meth:`model_with_outputs`)."""
        import onnx

        if not _has_external_data(m):  # (weights referenced in place count as external data)
            return m.SerializeToString()
        # external data (> 2 GB models): ORT only reads data files inside the model's folder, so the
        # augmented graph is written there under a hidden temporary name and removed once the session
        # has loaded it (see _session); the weights themselves are never copied.
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".ivq-{os.getpid()}-", suffix=".onnx", dir=self.model_path.parent)
            os.close(fd)
            onnx.save(m, tmp, save_as_external_data=False)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise CaptureError(f"cannot write the derived graph next to the model (external data must stay in "
                               f"its folder): {one_line(e, 200)}", self.model_path.parent) from None
        return tmp

    def groups(self) -> list[list[TensorSite]]:
        """The capture sites split into runs of at most ``max_outputs_per_run``."""
        if not self.sites:
            return [[]]
        n = self.max_outputs_per_run or len(self.sites)
        return [self.sites[i : i + n] for i in range(0, len(self.sites), n)]

    def session_for(self, gi: int, group: list[TensorSite]):
        """The (cached) session of capture group ``gi`` exposing ``group``; ``gi = -1`` is the plain model.

        Sessions live in :attr:`sessions` (a dict keyed by ``gi``); subclasses may drop entries to force
        re-creation (e.g. after pruning sites).
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
            raise CaptureError(f"session creation failed: {one_line(e, 400)}",
                               self.model_path) from None

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
            if isinstance(model, str) and model != str(self.model_path):
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
            names = self.output_names + [s.output for s in group]
            try:
                values = sess.run(names, feeds)
            except Exception as e:
                raise CaptureError(f"run failed: {one_line(e, 400)}", self.model_path) from None
            out = dict(zip(self.output_names, values[: len(self.output_names)], strict=True))
            if result is None:
                result = out
            if writer is not None:
                for site, val in zip(group, values[len(self.output_names) :], strict=True):
                    self._write_site(writer, site, val)
                    del val
        assert result is not None
        if writer is not None:
            self._finish(feeds, result, writer)
        return result

    def _run_partitioned(self, feeds: dict[str, np.ndarray], writer: Any) -> dict[str, np.ndarray]:
        """One forward through the plan's pieces; each piece's exposed tensors are written as it finishes."""
        from ivq_debug.capture.partition import piece_model

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
        for name in self.output_names:
            if name not in site_names:  # a QDQ graph output is already captured from its Q node
                i, node = self._producers.get(name, (len(self.model.graph.node), None))
                writer.add_tensor(name, result[name], op_type=node.op_type if node else "GraphOutput",
                                  order=i, scope=scope_of(node) if node else None)
        if self.verify and self._verified is None and self.sites:
            self._verify(feeds, result)
            writer.update_backend_info(exposure_check=self._verified)

    def _write_site(self, writer: Any, site: TensorSite, val: np.ndarray) -> None:
        if site.encoding is not None:
            writer.add_tensor(site.name, dequantize(val, site.encoding), op_type=site.op_type,
                              order=site.order, scope=site.scope, encoding=site.encoding, raw=val)
        else:
            writer.add_tensor(site.name, val, op_type=site.op_type, order=site.order, scope=site.scope)

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

    def __enter__(self) -> OrtRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
