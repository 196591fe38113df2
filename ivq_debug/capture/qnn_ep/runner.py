"""QNN HTP capture through ONNX Runtime's QNN execution provider.

:class:`QnnHtpRunner` is an :class:`~ivq_debug.capture.onnxrt.runner.OrtRunner` given the QNN session factory
:class:`QnnSessions` (sessions on the QNN HTP backend: Qualcomm's x86 emulation on Linux x86_64, the NPU on a
Snapdragon machine), plus what only HTP needs: pruning tensors whose exposure makes QNN refuse the graph, and
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ivq_debug.capture.base import Closing, Selection
from ivq_debug.capture.onnxrt.runner import OrtRunner
from ivq_debug.capture.qnn_ep.session import (
    EP_NAME,
    Partition,
    QnnSession,
    QnnSessionConfig,
    QnnUnsupportedError,
    create_qnn_session,
    qnn_backend_info,
    require_qnn_ep,
)
from ivq_debug.errors import CaptureError, UsageError
from ivq_debug.onnxgraph.sites import TensorSite
from ivq_debug.qnn.profiling import join_tensors, read_qnn_ep_csv


class _TimedSession:
    """Delegates to an ORT session and records the wall time of each ``run``."""

    def __init__(self, session: Any, times: list[float]) -> None:
        self._session = session
        self._times = times

    def run(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._session.run(*args, **kwargs)
        finally:
            self._times.append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def _remove_profile(csv: str | None) -> None:
    """Delete a profile CSV and the binary ``<stem>_qnn.log`` the EP writes beside it."""
    for p in (csv, csv[: -len(".csv")] + "_qnn.log" if csv and csv.endswith(".csv") else None):
        if p and os.path.exists(p):
            os.unlink(p)


class QnnSessions:
    """The session factory of HTP runners: every session on the QNN HTP EP, labelled and recorded.

    Sessions are labelled ``plain`` (the unmodified model), ``capture``, ``capture-1``, ... (derived graphs that
    expose tensors); each gets its own profile CSV (``<stem>.<label>.csv`` beyond the main one), op-trace and
    QNN-JSON folders, partition and run times. :meth:`state` is what the runner's ``info`` carries about them.
    """

    can_partition = False  # a cut graph would change what QNN compiles (partition, boundary quantization)

    def __init__(self, config: QnnSessionConfig, *, profiling_path: str | os.PathLike | None = None,
                 op_trace_dir: str | os.PathLike | None = None, json_graph_dir: str | os.PathLike | None = None,
                 overwrite: bool = False) -> None:
        self.status = require_qnn_ep()
        config.validate(paths=False)
        if config.profiling_level not in (None, "off") and profiling_path is None:
            raise UsageError("profiling_level needs profiling_path (the QNN profile CSV to write)")
        self.config = config
        self.profiling_path = Path(profiling_path).resolve() if profiling_path is not None else None
        self.op_trace_dir = Path(op_trace_dir) if op_trace_dir is not None else None
        self.json_graph_dir = Path(json_graph_dir) if json_graph_dir is not None else None
        self.overwrite = overwrite
        if self.profiling_path is not None and self.profiling_path.exists() and not overwrite:
            raise UsageError("profiling CSV exists; pass overwrite=True (CLI: --force) to replace it",
                             self.profiling_path)
        self.sessions: dict[str, QnnSession] = {}
        self.run_times: dict[str, list[float]] = {}
        self.profiling_files: dict[str, str] = {}
        #: the label whose profile is the main CSV: ``capture`` when the runner exposes tensors
        self.main_profile = "capture"

    # ---------------------------------------------------------------- factory protocol
    def backend(self, qdq: bool) -> str:
        """``qnn-htp``."""
        return "qnn-htp"

    def info(self) -> dict[str, Any]:
        """Target, emulation flag, versions and settings (before any session exists)."""
        info = qnn_backend_info(self.config)
        info["providers"] = [EP_NAME, "CPUExecutionProvider"]
        info["label"] = ("QNN HTP (x86_64 emulation, not a device measurement)" if self.status.emulated
                         else "QNN HTP (device)")
        if self.profiling_path is not None:
            info["profiling"] = {"level": self.config.profiling_level, "csv": str(self.profiling_path)}
        return info

    def create(self, model: bytes | str, options: Callable[[], Any], *, plain: bool, proto: Any) -> Any:
        """One QNN HTP session (no CPU fallback unless allowed), its partition recorded."""
        label = "plain" if plain else self._capture_label()
        cfg = self._config_for(label)
        try:
            qs = create_qnn_session(model, cfg, session_options_factory=options, model_proto=proto)
        except BaseException:
            _remove_profile(self.profiling_files.pop(label, None))  # written by this failed attempt
            raise
        self.sessions[label] = qs
        return _TimedSession(qs.session, self.run_times.setdefault(label, []))

    # ---------------------------------------------------------------- labels and per-session files
    def _capture_label(self) -> str:
        n = sum(1 for k in self.sessions if k.startswith("capture"))
        return "capture" if n == 0 else f"capture-{n}"

    def _config_for(self, label: str) -> QnnSessionConfig:
        changes: dict[str, Any] = {}
        if self.profiling_path is not None and self.config.profiling_level not in (None, "off"):
            csv = (self.profiling_path if label == self.main_profile
                   else self.profiling_path.with_name(f"{self.profiling_path.stem}.{label}.csv"))
            if csv.exists():
                if not self.overwrite:
                    raise UsageError("profiling CSV exists; pass overwrite=True to replace it", csv)
                csv.unlink()
            csv.parent.mkdir(parents=True, exist_ok=True)
            changes["profiling_file_path"] = csv
            self.profiling_files[label] = str(csv)
        for attr, key in (("op_trace_dir", "op_trace_dir"), ("json_graph_dir", "json_graph_dir")):
            base = getattr(self, attr)
            if base is not None:
                d = base / label
                d.mkdir(parents=True, exist_ok=True)
                changes[key] = d
        return self.config.with_changes(**changes)

    def drop_capture_sessions(self) -> None:
        """Forget every session but ``plain`` (and delete the profiles they wrote)."""
        for label in [k for k in self.sessions if k != "plain"]:
            del self.sessions[label]
            self.run_times.pop(label, None)
            _remove_profile(self.profiling_files.pop(label, None))

    def accepts(self, model: bytes | str, options: Callable[[], Any], proto: Any) -> bool:
        """Whether QNN takes ``model`` at all (a throw-away session: no profile, no trace)."""
        cfg = self.config.with_changes(log_severity_level=4, record_op_trace=False, profiling_level=None)
        try:
            create_qnn_session(model, cfg, session_options_factory=options, model_proto=proto)
        except CaptureError:
            return False
        return True

    # ---------------------------------------------------------------- what was recorded
    @property
    def main_label(self) -> str | None:
        """The capture session's label (the plain one when nothing was exposed); None before any session."""
        if not self.sessions:
            return None
        return "capture" if "capture" in self.sessions else next(iter(self.sessions))

    def state(self) -> dict[str, Any]:
        """The ``info`` entries about the sessions created so far (sessions, partition, providers, profiles)."""
        out: dict[str, Any] = {}
        if not self.sessions:
            return out
        sessions = {k: v.info() for k, v in self.sessions.items()}
        main = sessions[self.main_label]  # type: ignore[index]
        out["sessions"] = sessions
        out["partition"] = self.sessions[self.main_label].partition.to_dict(with_nodes=False)  # type: ignore[index]
        for k in ("providers", "compiled_target", "target_verified"):
            out[k] = main[k]
        if self.profiling_files:
            out["profiling"] = {"level": self.config.profiling_level, "csv": str(self.profiling_path),
                                "files": dict(self.profiling_files)}
        runs = {k: [round(t, 5) for t in v[-3:]] for k, v in self.run_times.items() if v}
        if runs:
            out["run_seconds"] = runs
        return out


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
            that tensor out and list it in ``info["unexposable"]`` instead of failing the capture.
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
        threads: intra-op threads of the (CPU side of the) session.
        input_shapes: static shapes for dynamic inputs (see :class:`OrtRunner`): QNN HTP takes only static
            shapes ("Having zero graph inputs is not supported on this backend" otherwise).

    Raises:
        ToolNotFoundError: onnxruntime-qnn is not installed (at construction).
    """

    backend = "qnn-htp"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        selection: Selection | None = None,
        exposure: str = "auto",
        optimization: str = "disable",
        max_outputs_per_run: int | None = None,
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
        threads: int | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        if config is None:
            config = QnnSessionConfig(allow_cpu_fallback=allow_cpu_fallback, profiling_level=profiling_level)
            if soc_model is not None:
                config.soc_model = str(soc_model)
            if htp_arch is not None:
                config.htp_arch = str(htp_arch)
        artifacts = {
            "profiling_path": profiling_path if profiling_path is not None else config.profiling_file_path,
            "op_trace_dir": op_trace_dir if op_trace_dir is not None else config.op_trace_dir,
            "json_graph_dir": json_graph_dir if json_graph_dir is not None else config.json_graph_dir,
        }
        config = config.with_changes(profiling_file_path=None, op_trace_dir=None, json_graph_dir=None)
        self.qnn = QnnSessions(config, overwrite=overwrite, **artifacts)
        self.ort = OrtRunner(model_path, selection=selection, exposure=exposure, optimization=optimization,
                             max_outputs_per_run=max_outputs_per_run, verify=verify, threads=threads,
                             sessions=self.qnn, input_shapes=input_shapes)
        self.qnn.main_profile = "capture" if self.ort.sites else "plain"
        self.require_bit_identical = require_bit_identical
        self.drop_unexposable = drop_unexposable
        self.unexposable: list[dict[str, Any]] = []
        self._prepared = False
        self._written: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()

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
    def _prepare(self) -> None:
        """Create every capture session before anything is written; prune tensors QNN cannot expose."""
        ort = self.ort
        for _ in range(4):
            failure = None
            for gi, group in enumerate(ort.groups()):
                try:
                    ort.session_for(gi, group)
                except QnnUnsupportedError as e:
                    failure = (group, e)
                    break
            if failure is None:
                self._prepared = True
                return
            group, err = failure
            if not group or not self.drop_unexposable:
                raise err
            ort.session_for(-1, [])  # the unmodified model must run on HTP; if not, its error is the real one
            bad = self._culprits(group, err)
            if not bad:
                raise err
            reasons = "; ".join(sorted({f"{u['name']} ({u['op_type']}): {u['reason']}" for u in err.unsupported}))
            for site in bad:
                self.unexposable.append({"name": site.name, "output": site.output, "op_type": site.op_type,
                                         "reason": f"exposing it makes QNN refuse the graph: {reasons}"[:600]})
            drop = {s.output for s in bad}
            ort.sites = [s for s in ort.sites if s.output not in drop]
            for k in [k for k in ort.sessions if k != -1]:
                del ort.sessions[k]
            self.qnn.drop_capture_sessions()
            ort.info["unexposable"] = list(self.unexposable)
            ort.info["exposed_tensors"] = len(ort.sites)
        raise CaptureError("could not find a set of exposed tensors QNN accepts", self.model_path)

    def _accepts(self, sites: list[TensorSite]) -> bool:
        """Whether QNN takes the model with these tensors exposed (a throw-away session)."""
        with self.ort.augmented([s.output for s in sites]) as model:
            return self.qnn.accepts(model, self.ort.session_options, self.model)

    def _culprits(self, group: list[TensorSite], err: QnnUnsupportedError) -> list[TensorSite]:
        """The exposed tensors that make QNN refuse the graph: the ones next to the refused nodes, else
        found by bisection."""
        refused = {str(u.get("name")) for u in err.unsupported}
        consumers: dict[str, set[str]] = {}
        for n in self.model.graph.node:
            for i in n.input:
                consumers.setdefault(i, set()).add(n.name)
        dq_of: dict[str, list[str]] = {}
        for n in self.model.graph.node:
            if n.op_type == "DequantizeLinear" and n.input:
                dq_of.setdefault(n.input[0], []).extend(o for o in n.output if o)
        near = []
        for s in group:
            users = set(consumers.get(s.output, set()))
            for dq in dq_of.get(s.output, []):
                users |= consumers.get(dq, set())
            if s.node in refused or users & refused:
                near.append(s)
        if near and self._accepts([s for s in group if s not in near]):
            bad = list(near)
            for s in near:  # keep the neighbours whose exposure is harmless on its own
                trial = [x for x in group if x not in bad or x is s]
                if self._accepts(trial):
                    bad.remove(s)
            return bad

        def bisect(sites: list[TensorSite]) -> list[TensorSite]:
            if not sites or self._accepts(sites):
                return []
            if len(sites) == 1:
                return sites
            half = len(sites) // 2
            return bisect(sites[:half]) + bisect(sites[half:])

        return bisect(group)

    # ---------------------------------------------------------------- running
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
        return out

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
                "target_verified", "run_seconds", "profiling", "exposure_check")
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
        if table is not None:
            writer.add_table("profiling", join_tensors(table, self.model))

    def close(self) -> None:
        """Release the sessions."""
        self.ort.close()
