"""The QNN HTP session factory of :class:`~ivq_debug.capture.onnxrt.runner.OrtRunner` (its ``sessions``): one
compiled session per derived graph through the context cache, each labelled (``plain``, ``capture``,
``capture-1``, ...) with its partition, compile and run times and per-session profile files; what
:class:`~ivq_debug.capture.qnn_ep.runner.QnnHtpRunner` composes with the ORT runner.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ivq_debug import defaults
from ivq_debug.capture.qnn_ep.cache import ContextCache, default_root
from ivq_debug.capture.qnn_ep.session import (
    EP_NAME,
    QnnSession,
    QnnSessionConfig,
    QnnUnsupportedError,
    create_qnn_session,
    qnn_backend_info,
    require_qnn_ep,
)
from ivq_debug.console import phase
from ivq_debug.errors import CaptureError, UsageError


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
                 overwrite: bool = False, cache: ContextCache | None = None) -> None:
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
        #: compiled contexts are loaded from / published to this cache (None: every session compiles)
        self.cache = cache
        #: what the next session is, for the progress display (set by the runner: "capture 1/2, 369 tensors")
        self.what: str | None = None
        #: seconds of every compile (not cache loads) and of every refused attempt so far
        self.compile_seconds: list[float] = []

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
        what = self.what or ("model outputs only (exposure check)" if plain else label)
        try:
            qs = self._compile(model, cfg, options, proto, what)
        except BaseException:
            _remove_profile(self.profiling_files.pop(label, None))  # written by this failed attempt
            raise
        self.sessions[label] = qs
        return _TimedSession(qs.session, self.run_times.setdefault(label, []))

    def _compile(self, model: bytes | str, cfg: QnnSessionConfig, options: Callable[[], Any], proto: Any,
                 what: str) -> QnnSession:
        """One session through the cache, shown as a compile phase; its compile seconds recorded."""
        t0 = time.perf_counter()
        try:
            with phase(f"compiling QNN HTP graph: {what}"):
                qs = create_qnn_session(model, cfg, session_options_factory=options, model_proto=proto,
                                        cache=self.cache)
        except QnnUnsupportedError:
            self.compile_seconds.append(time.perf_counter() - t0)
            raise
        if not (qs.cache or {}).get("hit"):
            self.compile_seconds.append(qs.create_seconds)
        return qs

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

    def accepts(self, model: bytes | str, options: Callable[[], Any], proto: Any, what: str = "probe") -> bool:
        """Whether QNN takes ``model`` at all (a throw-away session: no profile; an accepted graph is published
        to the cache, so the capture session that follows on the same tensors loads it instead of compiling)."""
        cfg = self.config.with_changes(log_severity_level=4, record_op_trace=self.cache is not None,
                                       profiling_level=None)
        try:
            self._compile(model, cfg, options, proto, what)
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
        if self.cache is not None:
            caches = {k: v.cache for k, v in self.sessions.items() if v.cache is not None}
            hits = sorted(k for k, c in caches.items() if c.get("hit"))
            saved = sum(float(caches[k].get("compile_seconds") or 0) - float(caches[k].get("load_seconds") or 0)
                        for k in hits)
            out["context_cache"] = {"root": str(self.cache.root), "hits": hits,
                                    "misses": sorted(k for k in caches if k not in hits),
                                    "compile_seconds_saved": round(saved, 3), "warnings": list(self.cache.warnings)}
        return out


#: how far :meth:`QnnHtpRunner._unplan` looks upstream of a refused tensor (tensors: Q out, float, DQ out, ...)
def cache_of(option: str | os.PathLike | ContextCache | bool | None) -> ContextCache | None:
    """The runner's ``qnn_cache`` argument as a cache (None: off). ``$IVQ_QNN_CACHE=off`` turns the default off."""
    if option is False:
        return None
    if isinstance(option, ContextCache):
        return option
    if option is None or option is True:
        if os.environ.get(defaults.QNN_CACHE_ENV, "").strip().lower() in ("off", "0", "none", "false"):
            return None
        return ContextCache(default_root())
    return ContextCache(option)


