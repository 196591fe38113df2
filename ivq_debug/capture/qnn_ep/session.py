"""QNN HTP sessions through ONNX Runtime's QNN execution provider (the ``onnxruntime-qnn`` plugin).

On Linux x86_64 the same ``libQnnHtp.so`` runs Qualcomm's x86 HTP emulation (HexNN); on a Snapdragon
machine it drives the real NPU. Everything here is written so that a silent CPU run can never be taken
for "QNN numerics" (see ``/work/shared/notes/qnn-htp-on-x86.md``):

* the plugin is registered under the name ``QNNExecutionProvider`` and sessions are created **only**
  with ``SessionOptions.add_provider_for_devices`` (the legacy ``providers=[...]`` argument is silently
  ignored for plugin EPs);
* ``soc_model`` and ``htp_arch`` are always set (the emulator's own default, SM8350 / v68, fails on
  several ops and gives different bits) and recorded;
* CPU fallback is disabled by default (``session.disable_cpu_ep_fallback=1``); when nodes are unsupported
  the error names them with QNN's reason (from the framework op trace ``qnn_op_trace.json``);
* the partition (which node ran on which EP) is always recorded
  (``session.record_ep_graph_assignment_info=1``);
* the Python wrapper's own "EP Error ... Falling back to CPU and retrying" is turned off
  (``enable_fallback=0``) and the session's providers are checked;
* the native library prints to file descriptor 1 at the first HTP session; session creation runs with
  fd 1 captured so that a CLI writing JSON to stdout stays clean (the text is kept in ``native_stdout``).

``onnxruntime`` and ``onnxruntime_qnn`` are imported inside functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ivq_debug import defaults
from ivq_debug.capture.qnn_ep.assignment import (
    OP_TRACE_FILE,
    Partition,
    PartitionNode,
    compiled_target,
    io_offload_names,
    partition_of,
    read_op_trace,
    source_ops,
    unsupported_from_trace,
)
from ivq_debug.capture.qnn_ep.cache import (
    CACHE_FORMAT,
    CTX_FILE,
    EMBED_MODE,
    RUNTIME_OPTIONS,
    CacheEntry,
    ContextCache,
)
from ivq_debug.capture.qnn_ep.native import CapturedText, capture_native_stdout
from ivq_debug.errors import CaptureError, InputError, ToolNotFoundError, UsageError, one_line
from ivq_debug.onnxgraph.load import load_model, model_digest

EP_NAME = defaults.QNN_EP_NAME
CPU_EP = "CPUExecutionProvider"
PROFILING_LEVELS = ("off", "basic", "detailed", "optrace")
#: ORT's message when nodes are left for the CPU EP and fallback is disabled
_FALLBACK_DISABLED_MSG = "fallback to CPU EP has been explicitly disabled"

_LOCK = threading.RLock()
_REGISTERED: dict[str, str] = {}


class QnnUnsupportedError(CaptureError):
    """Nodes QNN HTP does not take while CPU fallback is disabled; ``unsupported`` lists them.

    Each item is ``{"name", "op_type", "reason"}`` (from the framework op trace); names may also be
    QNN-internal nodes (e.g. ``Transpose_token_6``) that the EP created while fusing.
    """

    def __init__(self, message: str, unsupported: list[dict[str, Any]], path: str | os.PathLike | None = None):
        super().__init__(message, path)
        self.unsupported = unsupported


# ---------------------------------------------------------------------------------------- availability
@dataclass(frozen=True)
class QnnEpStatus:
    """Whether the QNN EP can run here, and what it is.

    ``emulated`` is True on x86_64 hosts (Qualcomm's x86 HTP emulation) and False on Arm64 hosts
    (a Snapdragon device: the real NPU). Results from an emulated HTP must be labelled as such.
    """

    available: bool
    reason: str | None
    ep_version: str | None
    qnn_sdk_version: str | None
    onnxruntime_version: str | None
    library_path: str | None
    htp_backend_path: str | None
    machine: str
    system: str
    emulated: bool
    target: str

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)


def _is_emulated(machine: str) -> bool:
    return machine.lower() not in ("aarch64", "arm64", "armv8", "armv8l")


def qnn_ep_status() -> QnnEpStatus:
    """Probe ``onnxruntime-qnn`` without raising: importable, libraries present, host kind."""
    machine, system = platform.machine(), platform.system()
    emulated = _is_emulated(machine)
    target = "x86_64 HTP emulation (QNN HexNN)" if emulated else "Snapdragon HTP (NPU)"
    ort_version = None
    try:
        import onnxruntime as ort

        ort_version = ort.__version__
    except ImportError as e:
        return QnnEpStatus(False, f"onnxruntime is not importable ({e})", None, None, None, None, None,
                           machine, system, emulated, target)
    try:
        import onnxruntime_qnn as oq
    except ImportError as e:
        return QnnEpStatus(
            False, f"onnxruntime-qnn is not installed ({e}); `pip install onnxruntime-qnn` "
            "(Linux x86_64 / Windows Arm64, Python >= 3.11)", None, None, ort_version, None, None,
            machine, system, emulated, target)
    ep_version = getattr(oq, "__version__", None)
    sdk = getattr(getattr(oq, "build_and_package_info", None), "qnn_version", None)
    lib, htp = oq.get_library_path(), oq.get_qnn_htp_path()
    reason = None
    if not os.path.exists(lib):
        reason = f"QNN EP library missing: {lib}"
    elif not os.path.exists(htp):
        reason = f"QNN HTP backend library missing: {htp}"
    elif not hasattr(ort, "register_execution_provider_library"):
        reason = f"onnxruntime {ort_version} has no plugin-EP API (need >= 1.24)"
    return QnnEpStatus(reason is None, reason, ep_version, sdk, ort_version, lib, htp, machine, system,
                       emulated, target)


def require_qnn_ep() -> QnnEpStatus:
    """The :class:`QnnEpStatus`, or :class:`ToolNotFoundError` (exit 5) when the QNN EP cannot run."""
    st = qnn_ep_status()
    if not st.available:
        raise ToolNotFoundError(f"QNN execution provider unavailable: {st.reason}")
    return st


def register_qnn_ep() -> QnnEpStatus:
    """Register the QNN plugin EP with ONNX Runtime (idempotent, thread-safe). Returns the status."""
    st = require_qnn_ep()
    import onnxruntime as ort

    with _LOCK:
        if EP_NAME in _REGISTERED:
            return st
        if not any(d.ep_name == EP_NAME for d in ort.get_ep_devices()):
            try:
                ort.register_execution_provider_library(EP_NAME, st.library_path)
            except Exception as e:  # registered by someone else in this process: fine
                if "already registered" not in str(e):
                    raise ToolNotFoundError(f"cannot register the QNN EP: {one_line(e)}") from None
        if not any(d.ep_name == EP_NAME for d in ort.get_ep_devices()):
            raise ToolNotFoundError("QNN EP registered but it exposes no device")
        _REGISTERED[EP_NAME] = str(st.library_path)
    return st


def qnn_ep_devices() -> list[Any]:
    """The ``OrtEpDevice`` objects of the QNN EP (registers it first)."""
    register_qnn_ep()
    import onnxruntime as ort

    return [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]


def _device_info(devices: list[Any]) -> list[dict[str, Any]]:
    out = []
    for d in devices:
        hw = d.device
        out.append({
            "ep_vendor": d.ep_vendor,
            "ep_device_version": dict(d.ep_metadata).get("version"),
            "hardware_type": str(hw.type).rsplit(".", 1)[-1],
            "hardware_vendor": hw.vendor,
        })
    return out


# ---------------------------------------------------------------------------------------- configuration
def _opt_bool(v: bool | None) -> str | None:
    return None if v is None else ("1" if v else "0")


@dataclass
class QnnSessionConfig:
    """How to build a QNN HTP session.

    Args:
        soc_model: QNN SoC id (``"60"`` = Snapdragon X Elite). Always sent to the EP.
        htp_arch: HTP architecture (``"73"``, ``"75"``, ``"79"``, ``"81"``, ``"68"``, ``"69"``). Always sent.
        allow_cpu_fallback: let ORT put unsupported nodes on the CPU EP (they are then listed in the
            partition). Default False: an unsupported node is a :class:`CaptureError`.
        profiling_level: ``"basic"``, ``"detailed"`` or ``"optrace"`` (QNN per-op profile CSV).
        profiling_file_path: the CSV path (required with ``profiling_level``; the EP appends one block
            of rows per run and writes a binary ``<stem>_qnn.log`` beside it).
        op_trace_dir: enable ``enable_framework_op_trace``: the EP writes ``qnn_op_trace.json`` (ONNX ->
            QNN op mapping, unsupported nodes with reasons, compilation target) there and the profile
            CSV gains an ``ONNX Source Ops`` column.
        json_graph_dir: enable ``dump_json_qnn_graph``: the QNN graph JSON (ops, tensors, exact QNN
            scale/offset of every tensor) is written there.
        offload_graph_io_quantization: ``None`` keeps the EP default (graph-input Q / graph-output DQ on
            the CPU EP when fallback is allowed).
        enable_htp_fp16_precision: float models on HTP in fp16 (``None`` keeps the EP default).
        htp_performance_mode: e.g. ``"burst"`` (does not change numerics).
        record_op_trace: when ``op_trace_dir`` is None, still enable the op trace into a temp dir and keep
            it in memory: it confirms the compilation target (soc_model / htp_arch) the EP really used and
            gives the reasons for unsupported nodes at no measurable cost (outputs are bit-identical).
        log_severity_level: ORT session log level (default 4 = fatal only: every failure reaches the
            caller as a :class:`CaptureError` carrying ORT's message and QNN's reasons; use 3 or 0 to see
            the EP's own log lines on stderr).
        provider_options: extra QNN provider options (strings), applied last.
        session_config: extra session config entries (strings), applied last.
    """

    soc_model: str = defaults.QNN_SOC_MODEL
    htp_arch: str = defaults.QNN_HTP_ARCH
    allow_cpu_fallback: bool = False
    profiling_level: str | None = None
    profiling_file_path: str | os.PathLike | None = None
    op_trace_dir: str | os.PathLike | None = None
    json_graph_dir: str | os.PathLike | None = None
    offload_graph_io_quantization: bool | None = None
    enable_htp_fp16_precision: bool | None = None
    htp_performance_mode: str | None = None
    record_op_trace: bool = True
    log_severity_level: int = 4
    provider_options: dict[str, str] = field(default_factory=dict)
    session_config: dict[str, str] = field(default_factory=dict)

    def validate(self, *, paths: bool = True) -> None:
        """Raise :class:`UsageError` on inconsistent options (``paths=False``: artifact paths not checked)."""
        if not str(self.soc_model).strip() or not str(self.htp_arch).strip():
            raise UsageError("soc_model and htp_arch must be set (the emulator default v68 gives other bits)")
        if not str(self.htp_arch).isdigit() or str(self.htp_arch) not in defaults.QNN_HTP_ARCHS:
            raise UsageError(f"htp_arch must be one of {', '.join(defaults.QNN_HTP_ARCHS)}, got {self.htp_arch!r}")
        if not str(self.soc_model).isdigit():
            raise UsageError(f"soc_model must be a QNN SoC id (a number like {defaults.QNN_SOC_MODEL}), "
                             f"got {self.soc_model!r}")
        if self.profiling_level not in (None, *PROFILING_LEVELS):
            raise UsageError(f"profiling_level must be one of {', '.join(PROFILING_LEVELS)}, "
                             f"got {self.profiling_level!r}")
        if paths and self.profiling_level not in (None, "off") and not self.profiling_file_path:
            raise UsageError("profiling_level needs profiling_file_path (the CSV to write)")
        for k in ("backend_type", "backend_path"):
            if k in self.provider_options:
                raise UsageError(f"provider option {k!r} is fixed to the HTP backend here")

    def ep_options(self) -> dict[str, str]:
        """The QNN provider options (all strings) this config sends to the EP."""
        import onnxruntime_qnn as oq

        self.validate()
        opts: dict[str, str] = {
            "backend_path": oq.get_qnn_htp_path(),
            "soc_model": str(self.soc_model),
            "htp_arch": str(self.htp_arch),
        }
        if self.profiling_level not in (None, "off"):
            opts["profiling_level"] = str(self.profiling_level)
            opts["profiling_file_path"] = str(Path(self.profiling_file_path).resolve())  # type: ignore[arg-type]
        if self.op_trace_dir is not None:
            opts["enable_framework_op_trace"] = "1"
            opts["framework_op_trace_dir"] = str(Path(self.op_trace_dir).resolve())
        if self.json_graph_dir is not None:
            opts["dump_json_qnn_graph"] = "1"
            opts["json_qnn_graph_dir"] = str(Path(self.json_graph_dir).resolve())
        for key, val in (("offload_graph_io_quantization", _opt_bool(self.offload_graph_io_quantization)),
                         ("enable_htp_fp16_precision", _opt_bool(self.enable_htp_fp16_precision)),
                         ("htp_performance_mode", self.htp_performance_mode)):
            if val is not None:
                opts[key] = val
        opts.update({str(k): str(v) for k, v in self.provider_options.items()})
        return opts

    def session_entries(self) -> dict[str, str]:
        """The session config entries this config sets."""
        entries = {
            "session.disable_cpu_ep_fallback": "0" if self.allow_cpu_fallback else "1",
            "session.record_ep_graph_assignment_info": "1",
        }
        entries.update({str(k): str(v) for k, v in self.session_config.items()})
        return entries

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (paths as strings)."""
        d = asdict(self)
        for k in ("profiling_file_path", "op_trace_dir", "json_graph_dir"):
            if d[k] is not None:
                d[k] = str(d[k])
        return d

    def with_changes(self, **changes: Any) -> QnnSessionConfig:
        """A copy with some fields replaced."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["provider_options"] = dict(self.provider_options)
        d["session_config"] = dict(self.session_config)
        d.update(changes)
        return QnnSessionConfig(**d)


def apply_qnn_ep(so: Any, config: QnnSessionConfig) -> dict[str, str]:
    """Add the QNN HTP EP (and the no-fallback / partition entries) to ORT ``SessionOptions`` ``so``.

    Returns the provider options used. Registers the plugin EP if needed.
    """
    devices = qnn_ep_devices()
    opts = config.ep_options()
    for k, v in config.session_entries().items():
        so.add_session_config_entry(k, v)
    so.log_severity_level = int(config.log_severity_level)
    so.add_provider_for_devices(devices, opts)
    return opts


# ---------------------------------------------------------------------------------------- sessions
@dataclass
class QnnSession:
    """An ORT session on the QNN HTP EP, with what was recorded while creating it."""

    session: Any
    config: QnnSessionConfig
    provider_options: dict[str, str]
    partition: Partition
    create_seconds: float
    native_stdout: str = ""
    op_trace: dict[str, Any] | None = None
    #: the context cache's verdict: ``{"hit", "key", "folder", "compile_seconds", ...}`` (None: not cached)
    cache: dict[str, Any] | None = None

    def info(self) -> dict[str, Any]:
        """Plain-JSON summary (providers, partition counts, compiled target, timings, context cache)."""
        out = {
            "providers": list(self.session.get_providers()),
            "provider_options": dict(self.provider_options),
            "session_seconds": round(self.create_seconds, 4),
            "partition": self.partition.to_dict(with_nodes=False),
            "compiled_target": compiled_target(self.op_trace),
            "target_verified": _target_matches(self.config, compiled_target(self.op_trace)),
            "op_trace_summary": (self.op_trace or {}).get("summary"),
            "native_stdout": self.native_stdout.strip(),
        }
        if self.cache is not None:
            out["context_cache"] = dict(self.cache)
        return out


def _new_options(factory: Callable[[], Any] | None) -> Any:
    if factory is not None:
        return factory()
    import onnxruntime as ort

    return ort.SessionOptions()


def _inference_session(model: bytes | str | os.PathLike, so: Any) -> tuple[Any, str, float]:
    import onnxruntime as ort

    src = bytes(model) if isinstance(model, bytes | bytearray) else os.fspath(model)
    t0 = time.perf_counter()
    with capture_native_stdout() as cap:
        try:
            sess = ort.InferenceSession(src, sess_options=so, enable_fallback=0)
        except BaseException as e:
            e.native_stdout = cap  # type: ignore[attr-defined]
            raise
    return sess, cap.text, time.perf_counter() - t0


def _optimization_advice(model: bytes | str | os.PathLike, so: Any, config: QnnSessionConfig,
                         session_options_factory: Callable[[], Any] | None) -> str:
    """What to say about ``--optimization all`` when nodes are unsupported at ORT level "disable" ("" otherwise).

    ORT at "disable" folds nothing: Shape -> Gather -> Concat -> Reshape chains (what paddle2onnx and torch's
    legacy exporter write for dynamic reshapes) reach QNN, which refuses ``Shape`` and then cannot get the
    shapes downstream ("Cannot get shape"). At "all" ORT constant-folds them first. For models up to
    :data:`~ivq_debug.defaults.QNN_RETRY_ALL_MAX_BYTES` one more session at "all" says whether that is enough.
    """
    import onnxruntime as ort

    if so.graph_optimization_level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL:
        return ""
    size = len(model) if isinstance(model, bytes | bytearray) else os.path.getsize(model)
    why = ("; ORT optimization 'disable' folds nothing (e.g. Shape -> Reshape chains QNN refuses): "
           "--optimization all lets ORT fold and fuse first (the captured graph is then ORT's optimized one)")
    if size > defaults.QNN_RETRY_ALL_MAX_BYTES:
        return why + ", try it"
    so2 = _new_options(session_options_factory)
    so2.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    apply_qnn_ep(so2, config.with_changes(op_trace_dir=None, profiling_level=None, profiling_file_path=None,
                                          json_graph_dir=None, log_severity_level=4))
    try:
        _inference_session(model, so2)
    except Exception:
        return "; --optimization all does not fix it either (checked)"
    return why + " (checked: at --optimization all every node runs on HTP)"


def diagnose_unsupported(model: bytes | str | os.PathLike, config: QnnSessionConfig,
                         session_options_factory: Callable[[], Any] | None = None) -> list[dict[str, Any]]:
    """Which nodes QNN refuses, with reasons: one extra session with the framework op trace enabled."""
    with tempfile.TemporaryDirectory(prefix="ivq-qnn-trace-") as td:
        so = _new_options(session_options_factory)
        cfg = config.with_changes(op_trace_dir=td, profiling_level=None, profiling_file_path=None,
                                  json_graph_dir=None, log_severity_level=4)
        apply_qnn_ep(so, cfg)
        try:
            _inference_session(model, so)
        except Exception:
            pass  # with fallback disabled it fails again; the trace is written before that
        return unsupported_from_trace(read_op_trace(td))


def create_qnn_session(
    model: bytes | str | os.PathLike,
    config: QnnSessionConfig | None = None,
    *,
    session_options_factory: Callable[[], Any] | None = None,
    model_proto: Any = None,
    cache: ContextCache | None = None,
) -> QnnSession:
    """Create an ORT session on the QNN HTP EP (see the module docstring for what is enforced).

    Args:
        model: ONNX model path or serialized bytes.
        config: EP settings (defaults: soc/htp from :mod:`ivq_debug.defaults`, CPU fallback disabled).
        session_options_factory: returns fresh ``ort.SessionOptions`` (graph optimization level, threads,
            ...) to which the EP is added; called again for the diagnostic session on failure.
        model_proto: the loaded graph, if the caller has it (used to flag graph-I/O Q/DQ on the CPU, and to find
            the external-data files the cache key hashes).
        cache: load the compiled graph from this context cache when it holds it; otherwise compile, dump the
            EPContext model and publish it (:mod:`ivq_debug.capture.qnn_ep.cache`). Not used with
            ``json_graph_dir`` (the QNN graph JSON is written only by a compile). The session's ``cache`` says
            what happened.

    Raises:
        ToolNotFoundError: onnxruntime-qnn is absent.
        QnnUnsupportedError: nodes are unsupported with fallback disabled (named, with reasons).
        CaptureError: the session fails otherwise, or it did not get the QNN EP.
    """
    config = config or QnnSessionConfig()
    config.validate()
    register_qnn_ep()
    if cache is not None and config.json_graph_dir is None:
        return _cached_session(model, config, session_options_factory, model_proto, cache)
    with contextlib.ExitStack() as stack:
        eff = config
        if config.op_trace_dir is None and config.record_op_trace:
            td = stack.enter_context(tempfile.TemporaryDirectory(prefix="ivq-qnn-trace-"))
            eff = config.with_changes(op_trace_dir=td)
        qs = _create(model, config, eff, session_options_factory, model_proto)
    if cache is not None:
        qs.cache = {"hit": False, "used": False, "reason": "json_graph_dir is set: the QNN graph JSON is written "
                    "only by a compile"}
    return qs


def cache_material(model: bytes | str | os.PathLike, config: QnnSessionConfig, options: Any,
                   model_proto: Any = None) -> dict[str, Any]:
    """Everything that changes what QNN compiles for ``model`` (the context cache key, see its module)."""
    st = require_qnn_ep()
    if model_proto is None and not isinstance(model, bytes | bytearray | memoryview):
        try:
            model_proto = load_model(model)
        except InputError:
            model_proto = None
    return {
        "format": CACHE_FORMAT,
        "model": model_digest(model, model_proto),
        "soc_model": str(config.soc_model),
        "htp_arch": str(config.htp_arch),
        "provider_options": {k: v for k, v in sorted(config.ep_options().items()) if k not in RUNTIME_OPTIONS},
        "session_config": {k: v for k, v in sorted(config.session_entries().items())
                           if not k.startswith("ep.context")},
        "graph_optimization_level": str(options.graph_optimization_level),
        "embed_mode": EMBED_MODE,
        "onnxruntime": st.onnxruntime_version,
        "onnxruntime_qnn": st.ep_version,
        "qnn_sdk_version": st.qnn_sdk_version,
        "machine": st.machine,
    }


def _cached_session(model: bytes | str | os.PathLike, config: QnnSessionConfig,
                    session_options_factory: Callable[[], Any] | None, model_proto: Any,
                    cache: ContextCache) -> QnnSession:
    """A hit loads the cached context; a miss compiles (with the op trace, which meta.json keeps) and publishes."""
    material = cache_material(model, config, _new_options(session_options_factory), model_proto)
    entry = cache.lookup(material)
    if entry is not None:
        try:
            return _load_entry(entry, config, session_options_factory)
        except CaptureError as e:
            cache._warn(f"ignoring QNN context cache entry {entry.folder}: it does not load ({one_line(e, 200)}); "
                        f"compiling afresh")
    with contextlib.ExitStack() as stack:
        stage = stack.enter_context(cache.staging())
        td = config.op_trace_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="ivq-qnn-trace-"))
        entries = dict(config.session_config)
        if stage is not None:
            entries.update({"ep.context_enable": "1", "ep.context_file_path": str(stage / CTX_FILE),
                            "ep.context_embed_mode": EMBED_MODE})
        eff = config.with_changes(op_trace_dir=td, session_config=entries)
        qs = _create(model, config, eff, session_options_factory, model_proto)
        published = None
        if stage is not None:
            meta = {"compile_seconds": round(qs.create_seconds, 4), "op_trace": qs.op_trace,
                    "partition": qs.partition.to_dict(with_nodes=True),
                    "outputs": [o.name for o in qs.session.get_outputs()]}
            published = cache.publish(stage, material, meta)
    qs.cache = {"hit": False, "used": True, "key": published.key if published else None,
                "folder": str(published.folder) if published else None,
                "compile_seconds": round(qs.create_seconds, 4), "root": str(cache.root)}
    return qs


def _load_entry(entry: CacheEntry, config: QnnSessionConfig,
                session_options_factory: Callable[[], Any] | None) -> QnnSession:
    """A session on a cached EPContext model, with the compile-time partition and op trace of its meta.json."""
    meta = entry.meta
    so = _new_options(session_options_factory)
    with contextlib.ExitStack() as stack:
        # with profiling, the op trace keeps the CSV's ``ONNX Source Ops`` column (a load leaves it empty)
        td = (stack.enter_context(tempfile.TemporaryDirectory(prefix="ivq-qnn-trace-"))
              if config.profiling_level not in (None, "off") else None)
        eff = config.with_changes(op_trace_dir=td, record_op_trace=False, json_graph_dir=None)
        opts = apply_qnn_ep(so, eff)
        try:
            sess, native, seconds = _inference_session(str(entry.model), so)
        except Exception as e:
            raise CaptureError(one_line(e)) from None
    if td is not None:
        opts = {**opts, "framework_op_trace_dir": "<temporary>"}
    if EP_NAME not in sess.get_providers():
        raise CaptureError(f"the session did not get the QNN EP (providers {sess.get_providers()})")
    outputs = [o.name for o in sess.get_outputs()]
    if outputs != meta.get("outputs"):
        raise CaptureError("its outputs are not the ones recorded at compile time")
    trace = meta.get("op_trace")
    target = compiled_target(trace)
    if _target_matches(config, target) is False:
        raise CaptureError(f"it was compiled for {target}")
    try:
        part = Partition.from_dict(meta["partition"])
    except (KeyError, TypeError, ValueError) as e:
        raise CaptureError(f"its partition record is malformed ({one_line(e, 100)})") from None
    if config.op_trace_dir is not None and trace is not None:  # the trace the user asked for, as compiled
        Path(config.op_trace_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.op_trace_dir) / OP_TRACE_FILE).write_text(json.dumps(trace))
    compile_s = meta.get("compile_seconds")
    cache = {"hit": True, "used": True, "key": entry.key, "folder": str(entry.folder), "created": meta.get("created"),
             "compile_seconds": compile_s, "load_seconds": round(seconds, 4), "root": str(entry.folder.parent)}
    return QnnSession(sess, config, opts, part, seconds, native, trace, cache)


def _target_matches(config: QnnSessionConfig, targets: list[dict[str, Any]]) -> bool | None:
    """Whether the op trace's compilation target is the requested one (None when it cannot be told)."""
    if not targets:
        return None
    want_soc, want_arch = str(config.soc_model).strip(), str(config.htp_arch).strip()
    for t in targets:
        soc = str(t.get("soc_model", "")).strip()
        arch = "".join(ch for ch in str(t.get("htp_arch", "")) if ch.isdigit())
        if (soc and soc != want_soc) or (arch and arch != want_arch):
            return False
    return True


#: nodes named per distinct refusal reason (the rest counted): the line stays one line whatever the model's size
REFUSAL_NODES_SHOWN = 3


def refusal_reasons(unsupported: Sequence[Mapping[str, Any]]) -> str:
    """Every distinct reason of a QNN refusal, once, with how many nodes it refuses and the first of them:
    ``Failed to add node [2: p2o.Shape.2 (Shape), p2o.Shape.0 (Shape)]; Cannot get shape [142: p2o.Reshape.64
    (Reshape), … +139 more]`` (the PP-OCRv4 recognizer's 144 refused nodes, unfolded).

    A reason that names its own node (``Erf node `bare_erf` will not be assigned``) is grouped with the same
    reason of other nodes (the name written ``…``). The whole list, per node, is ``QnnUnsupportedError.unsupported``.
    """
    groups: dict[str, list[str]] = {}
    for u in unsupported:
        name, reason = str(u.get("name", "")), one_line(str(u.get("reason", ""))).rstrip(". ")
        key = reason.replace(name, "…") if len(name) > 1 else reason
        groups.setdefault(key or "no reason given", []).append(f"{name} ({u.get('op_type', '?')})")
    parts = []
    for reason, nodes in groups.items():
        more = f" +{len(nodes) - REFUSAL_NODES_SHOWN} more" if len(nodes) > REFUSAL_NODES_SHOWN else ""
        parts.append(f"{reason} [{len(nodes)}: {', '.join(nodes[:REFUSAL_NODES_SHOWN])}{more}]")
    return "; ".join(parts)


def _create(model: bytes | str | os.PathLike, config: QnnSessionConfig, eff: QnnSessionConfig,
            session_options_factory: Callable[[], Any] | None, model_proto: Any) -> QnnSession:
    so = _new_options(session_options_factory)
    opts = apply_qnn_ep(so, eff)
    target = f"soc_model {config.soc_model}, htp_arch v{config.htp_arch}"
    try:
        sess, native, seconds = _inference_session(model, so)
    except Exception as e:
        msg = one_line(e)
        if not config.allow_cpu_fallback:
            trace = read_op_trace(eff.op_trace_dir) if eff.op_trace_dir is not None else None
            unsupported = unsupported_from_trace(trace) if trace else []
            if not unsupported and _FALLBACK_DISABLED_MSG in msg:
                unsupported = diagnose_unsupported(model, config, session_options_factory)
            if unsupported:
                ops = [u for u in unsupported if u.get("op_type") not in ("QuantizeLinear", "DequantizeLinear")]
                shown = ops or unsupported
                advice = _optimization_advice(model, so, config, session_options_factory)
                raise QnnUnsupportedError(
                    f"{len(shown)} node(s) not supported by QNN HTP ({target}) and CPU fallback is disabled: "
                    f"{refusal_reasons(shown)} [{len(unsupported)} node(s) incl. their Q/DQ]{advice}",
                    unsupported) from None
            if _FALLBACK_DISABLED_MSG in msg:
                raise CaptureError(f"nodes would fall back to the CPU EP ({target}) and fallback is disabled; "
                                   f"QNN gave no reason: {msg}") from None
        native_txt = getattr(getattr(e, "native_stdout", None), "text", "")
        extra = [ln for ln in native_txt.splitlines() if ln.strip() and "LIBNATIVE" not in ln]
        tail = f" | native: {one_line(' '.join(extra))}" if extra else ""
        raise CaptureError(f"QNN HTP session creation failed ({target}): {msg}{tail}") from None
    providers = list(sess.get_providers())
    if EP_NAME not in providers:
        raise CaptureError(f"session did not get the QNN EP (providers {providers})")
    trace = read_op_trace(eff.op_trace_dir) if eff.op_trace_dir is not None else None
    if _target_matches(config, compiled_target(trace)) is False:
        raise CaptureError(f"the EP compiled for {compiled_target(trace)}, not the requested {target}")
    try:
        graph = load_model(model_proto if model_proto is not None else model)
    except InputError:
        graph = None
    part = partition_of(sess, fallback_allowed=config.allow_cpu_fallback, model=graph)
    if part.cpu_nodes:
        reasons = {u["name"]: u["reason"] for u in unsupported_from_trace(trace)}
        if not reasons and any(n for n in part.cpu_nodes if n.name not in io_offload_names(graph)):
            reasons = {u["name"]: u["reason"] for u in diagnose_unsupported(model, config, session_options_factory)}
        part = partition_of(sess, fallback_allowed=config.allow_cpu_fallback, model=graph, reasons=reasons)
        if not config.allow_cpu_fallback:
            names = ", ".join(f"{n.name} ({n.op_type})" for n in part.cpu_nodes[:8])
            raise CaptureError(f"nodes were assigned to the CPU although fallback is disabled: {names}")
    if not part.nodes:
        raise CaptureError("the session reports an empty EP assignment; cannot prove the graph ran on QNN")
    if eff.op_trace_dir != config.op_trace_dir:  # our temp dir: do not record a path that is gone
        opts = {**opts, "framework_op_trace_dir": "<temporary>"}
    return QnnSession(sess, config, opts, part, seconds, native, trace)


def qnn_backend_info(config: QnnSessionConfig | None = None) -> dict[str, Any]:
    """What every QNN result must carry: target, emulation flag, EP / SDK / ORT versions, settings."""
    config = config or QnnSessionConfig()
    st = require_qnn_ep()
    devices = qnn_ep_devices()
    return {
        "execution_provider": EP_NAME,
        "qnn_backend": "htp",
        "soc_model": str(config.soc_model),
        "htp_arch": str(config.htp_arch),
        "emulated": st.emulated,
        "device": st.target,
        "host": {"machine": st.machine, "system": st.system},
        "onnxruntime_qnn": st.ep_version,
        "qnn_sdk_version": st.qnn_sdk_version,
        "onnxruntime": st.onnxruntime_version,
        "ep_devices": _device_info(devices),
        "cpu_fallback": "allowed" if config.allow_cpu_fallback else "disabled",
        "qnn_config": config.to_dict(),
    }


#: names callers import from here (the partition and op trace live in :mod:`~ivq_debug.capture.qnn_ep.assignment`,
#: the native stdout capture in :mod:`~ivq_debug.capture.qnn_ep.native`)
__all__ = ["CPU_EP", "EP_NAME", "OP_TRACE_FILE", "PROFILING_LEVELS", "CapturedText", "Partition", "PartitionNode",
           "QnnEpStatus", "QnnSession", "QnnSessionConfig", "QnnUnsupportedError", "apply_qnn_ep", "cache_material",
           "capture_native_stdout", "compiled_target", "create_qnn_session", "diagnose_unsupported",
           "partition_of", "qnn_backend_info", "qnn_ep_devices", "qnn_ep_status", "read_op_trace", "refusal_reasons",
           "register_qnn_ep", "require_qnn_ep", "source_ops", "unsupported_from_trace"]
