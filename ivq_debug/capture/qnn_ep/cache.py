"""Compiled QNN HTP graphs cached on disk as EPContext models: a model compiles once across samples and commands.

A QNN HTP compile of an OCR-sized graph takes seconds to minutes on the x86 emulator (an unrolled LSTM: 15-45 s
per session, ``docs/qnn-compile.md``); loading the same graph from its EPContext model takes 0.01-0.15 s and
gives the same bits. Every HTP session ivq makes (``ivq capture qnn``, ``ivq tune``, ``ivq diagnose --backend
qnn``, the exposure check) goes through :class:`ContextCache` when it is on.

**The key** is the SHA-256 of a JSON *material* holding everything that changes what QNN compiles: the exact
graph (SHA-256 of the model bytes handed to ORT, which hold the exposed outputs and the channels-last plan, and
of every external-data file they reference), soc_model and htp_arch, the onnxruntime / onnxruntime-qnn / QNN
SDK versions and the host machine, every provider option except the runtime-only ones (profiling, op-trace and
JSON-dump paths, performance mode), every session config entry (CPU fallback, ...), the ORT graph optimization
level and the embed mode. The context model does not record soc_model / htp_arch (a v68 context loads silently
under v73 options and keeps its v68 numerics), so they must be in the key.

**An entry** is a folder ``<root>/<key>/`` holding the EPContext model (``ctx.onnx`` + ``ctx_qnn.bin``, embed
mode 0: no protobuf size limit) and ``meta.json``: the material, the SHA-256 and size of each file, and what a
load cannot give back (the compile-time op trace with its compiled target, the partition, the compile seconds).
It is built in a temporary folder inside the root and published with one ``os.replace``, so a reader never sees
half an entry and two writers of the same key cannot mix files. A hit re-checks the whole material and every
file hash: an entry that does not match (corrupt, truncated, written by other code) is ignored with a warning
and compiled afresh, never loaded.

**Exposure memory.** A graph QNN refuses is never cached, so the search for the tensors QNN will not expose (up
to ``defaults.QNN_MAX_PROBES`` throw-away compiles: 24-28 for the demo's vision tower) would run again for every
capture of the same model. :class:`ExposureMemory` keeps its outcome next to the contexts, in
``<root>/exposure/<key>.json``: the tensors left out with their reasons, the tensors kept in one session and the
channels-last exposures undone. Its key is the same material as a context's but for the *unmodified* model
(SHA-256 of the model and its external data, target, provider and session options, optimization level,
versions, host) plus the exposure request (the tensors asked for, the group size, the channels-last plan). A
remembered outcome is applied before the first compile; the capture sessions then load their contexts, and
when QNN still refuses a group (an entry written by other code) the search runs as without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ivq_debug import defaults
from ivq_debug.console import warn
from ivq_debug.errors import InputError, UsageError, one_line
from ivq_debug.inputfiles import file_in_folder_problem, sha256_file
from ivq_debug.jsonio import load_json
from ivq_debug.outputs import atomic_write_text

#: bump when the material or the entry layout changes (old entries then miss)
CACHE_FORMAT = 1
CTX_FILE = "ctx.onnx"
META_FILE = "meta.json"
#: embed mode of the cached context (0: the QNN binary in ``ctx_qnn.bin`` beside the model)
EMBED_MODE = "0"
#: provider options that do not change the compiled graph (left out of the key)
RUNTIME_OPTIONS = frozenset({"profiling_level", "profiling_file_path", "enable_framework_op_trace",
                             "framework_op_trace_dir", "dump_json_qnn_graph", "json_qnn_graph_dir",
                             "htp_performance_mode", "backend_path"})

#: the folder (inside the cache root) of the remembered exposure searches
EXPOSURE_DIR = "exposure"
#: bump when the remembered document changes (older documents then miss)
EXPOSURE_FORMAT = 1

#: staging folders older than this are removed when pruning (a killed process left them)
STALE_STAGING_S = 24 * 3600

def key_of(material: dict[str, Any]) -> str:
    """The cache key: SHA-256 of the canonical JSON of ``material``."""
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def default_root() -> Path:
    """``$IVQ_QNN_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/ivq-debug/qnn-contexts``."""
    env = os.environ.get(defaults.QNN_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / defaults.QNN_CACHE_SUBDIR


@dataclass(frozen=True)
class CacheEntry:
    """A verified cache entry: its folder and ``meta.json``."""

    key: str
    folder: Path
    meta: dict[str, Any]

    @property
    def model(self) -> Path:
        """The EPContext model to load."""
        return self.folder / CTX_FILE


class ContextCache:
    """The folder of cached EPContext models (see the module docstring).

    Args:
        root: the cache folder (created on first write).
        max_bytes: after a write, the least recently used entries are removed until the cache holds at most
            this many bytes (the new entry is always kept).
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int = defaults.QNN_CACHE_MAX_BYTES) -> None:
        self.root = Path(root).expanduser()
        if os.path.lexists(self.root) and not self.root.is_dir():
            kind = "a symlink loop" if not self.root.exists() else "a file" if self.root.is_file() else "a special file"
            raise UsageError(f"QNN context cache is {kind}, not a folder (--qnn-cache DIR, $IVQ_QNN_CACHE)", self.root)
        self.max_bytes = max_bytes
        #: what was wrong with the entries ignored so far (also printed as warnings)
        self.warnings: list[str] = []

    def __repr__(self) -> str:
        return f"ContextCache({str(self.root)!r})"

    def lookup(self, material: dict[str, Any]) -> CacheEntry | None:
        """The entry of ``material`` when present and intact; None on a miss or a bad entry (with a warning)."""
        key = key_of(material)
        folder = self.root / key
        if not folder.is_dir():
            return None
        problem, meta = self._checked(folder, key, material)
        if problem is not None:
            self._warn(f"ignoring QNN context cache entry {folder}: {problem}; compiling afresh")
            return None
        try:
            os.utime(folder / META_FILE)  # least recently used goes first when pruning
        except OSError:
            pass
        return CacheEntry(key, folder, meta)

    def _check(self, folder: Path, key: str, material: dict[str, Any]) -> str | None:
        """Why an entry may not be loaded (None when it is intact). Entries and their files are never symlinks
        (a cache entry is what this code wrote), nor FIFOs or folders; ``meta.json`` is bounded JSON."""
        return self._checked(folder, key, material)[0]

    def _checked(self, folder: Path, key: str, material: dict[str, Any]) -> tuple[str | None, Any]:
        """:meth:`_check`'s answer and the ``meta.json`` it read (one read per lookup: the file is ~0.7 MB)."""
        if folder.is_symlink():
            return "it is a symlink (cache entries are never followed)", None
        try:
            meta = load_json(folder / META_FILE, META_FILE)
        except InputError as e:
            return f"unreadable {META_FILE} ({e.message})", None
        return self._meta_problem(folder, key, material, meta), meta

    @staticmethod
    def _meta_problem(folder: Path, key: str, material: dict[str, Any], meta: Any) -> str | None:
        """What is wrong with an entry whose ``meta.json`` reads as ``meta`` (None when it is intact)."""
        if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
            return "written by another cache format"
        if meta.get("key") != key or meta.get("material") != material:
            return "its key material differs from this session's"
        files = meta.get("files")
        if not isinstance(files, dict) or CTX_FILE not in files:
            return "no file list"
        for name, want in files.items():
            p = folder / name
            if Path(name).name != name or not os.path.lexists(p):
                return f"{name} is missing"
            bad = file_in_folder_problem(p, folder, name)
            if bad or p.is_symlink():
                return bad or f"{name} is a symlink (cache files are never followed)"
            if not isinstance(want, dict) or p.stat().st_size != want.get("bytes") or sha256_file(p) != want.get("sha256"):
                return f"{name} does not match its recorded size / SHA-256"
        return None

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        warn(message)

    @contextmanager
    def staging(self) -> Iterator[Path | None]:
        """A temporary folder inside the root to compile into (None when the root is not writable)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".staging-{os.getpid()}-", dir=self.root))
        except OSError as e:
            self._warn(f"QNN context cache {self.root} is not writable ({one_line(e, 120)}); not caching")
            yield None
            return
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def publish(self, staging: Path, material: dict[str, Any], meta: dict[str, Any]) -> CacheEntry | None:
        """Turn a staging folder holding a freshly written EPContext model into the entry of ``material``.

        Returns None (with a warning) when the context files are missing or the folder cannot be renamed; an
        entry another process published first for the same key is kept (it is the same compile).
        """
        key = key_of(material)
        names = sorted(p.name for p in staging.iterdir() if p.is_file())
        if CTX_FILE not in names:
            self._warn(f"the QNN EP wrote no EPContext model into {staging}; not caching")
            return None
        files = {}
        for name in names:
            p = staging / name
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        doc = {"format": CACHE_FORMAT, "key": key, "material": material, "files": files,
               "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
        atomic_write_text(staging / META_FILE, json.dumps(doc, indent=1, default=str))
        dst = self.root / key
        try:
            if os.path.lexists(dst):  # a bad entry (lookup ignored it) or a concurrent writer's
                if self._check(dst, key, material) is None:
                    return CacheEntry(key, dst, json.loads((dst / META_FILE).read_text()))
                if dst.is_symlink() or not dst.is_dir():  # removed itself, never what it points to
                    dst.unlink()
                else:
                    shutil.rmtree(dst, ignore_errors=True)
            os.replace(staging, dst)
        except OSError as e:
            if dst.is_dir() and self._check(dst, key, material) is None:
                return CacheEntry(key, dst, json.loads((dst / META_FILE).read_text()))
            self._warn(f"cannot publish QNN context cache entry {dst} ({one_line(e, 120)}); not caching")
            return None
        self.prune(keep=key)
        return CacheEntry(key, dst, doc)

    def entries(self) -> list[tuple[float, int, Path]]:
        """``(last use, bytes, folder)`` of every entry, least recently used first."""
        out = []
        if not self.root.is_dir():
            return out
        for d in self.root.iterdir():
            m = d / META_FILE
            if d.name.startswith(".") or d.is_symlink() or not m.is_file():
                continue
            try:
                size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
                out.append((m.stat().st_mtime, size, d))
            except OSError:
                continue
        return sorted(out)

    def prune(self, keep: str | None = None) -> list[Path]:
        """Remove least recently used entries until the cache fits ``max_bytes``; returns the removed folders."""
        for d in self.root.glob(".staging-*") if self.root.is_dir() else []:
            try:  # left by a killed process
                if time.time() - d.stat().st_mtime > STALE_STAGING_S:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass
        ents = self.entries()
        total = sum(s for _, s, _ in ents)
        removed = []
        for _, size, d in ents:
            if total <= self.max_bytes:
                break
            if d.name == keep:
                continue
            shutil.rmtree(d, ignore_errors=True)
            total -= size
            removed.append(d)
        return removed


@dataclass
class ExposureMemory:
    """The remembered outcome of the search for tensors QNN HTP will not expose (see the module docstring).

    Attributes:
        unexposable: ``{"name", "output", "op_type", "reason"}`` of every tensor the search left out.
        bonds: groups of tensor outputs that must share one capture session.
        nchw: tensor outputs exposed in their plain NCHW layout instead of channels-last.
        probes: the throw-away compiles the search made (what remembering saves).
        seconds: the time it took.
    """

    unexposable: list[dict[str, Any]]
    bonds: list[list[str]]
    nchw: list[str]
    probes: int = 0
    seconds: float = 0.0

    def empty(self) -> bool:
        """Nothing to apply: every requested tensor was exposed as planned."""
        return not (self.unexposable or self.bonds or self.nchw)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (without its key)."""
        return {"unexposable": self.unexposable, "bonds": self.bonds, "nchw": self.nchw, "probes": self.probes,
                "seconds": round(self.seconds, 3)}


def exposure_material(context_material: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The key material of an exposure search: the unmodified model's context material plus the request
    (``sites``: the tensor outputs asked for, ``max_outputs_per_run``, ``channels_last``: the planned outputs)."""
    return {"exposure_format": EXPOSURE_FORMAT, "context": context_material, "request": request}


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _memory_from(doc: Any, material: dict[str, Any]) -> ExposureMemory | str:
    """The memory in a parsed document, or why it cannot be used."""
    if not isinstance(doc, dict) or doc.get("format") != EXPOSURE_FORMAT:
        return "written by another format"
    if doc.get("material") != material:
        return "its key material differs from this capture's"
    unexp, bonds, nchw = doc.get("unexposable"), doc.get("bonds"), doc.get("nchw")
    fields = ("name", "output", "reason")
    if not (isinstance(unexp, list) and all(isinstance(u, dict) and all(isinstance(u.get(k), str) for k in fields)
                                            for u in unexp)):
        return "malformed unexposable list"
    if not (isinstance(bonds, list) and all(_str_list(b) for b in bonds)) or not _str_list(nchw):
        return "malformed bonds or layouts"
    probes, secs = doc.get("probes", 0), doc.get("seconds", 0.0)
    return ExposureMemory([{k: u.get(k) for k in ("name", "output", "op_type", "reason")} for u in unexp],
                          bonds, nchw, int(probes) if isinstance(probes, int) else 0,
                          float(secs) if isinstance(secs, int | float) else 0.0)


def recall_exposure(cache: ContextCache, material: dict[str, Any]) -> ExposureMemory | None:
    """The remembered search for ``material`` (None on a miss; a damaged document is ignored with a warning)."""
    path = cache.root / EXPOSURE_DIR / f"{key_of(material)}.json"
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        cache._warn(f"ignoring QNN exposure memory {path}: not a regular file; searching afresh")
        return None
    try:
        got = _memory_from(load_json(path, "exposure memory"), material)
    except InputError as e:
        got = e.message
    if isinstance(got, str):
        cache._warn(f"ignoring QNN exposure memory {path}: {got}; searching afresh")
        return None
    return got


def remember_exposure(cache: ContextCache, material: dict[str, Any], memory: ExposureMemory) -> Path | None:
    """Store the outcome of a search (atomically); None (with a warning) when the cache is not writable."""
    folder = cache.root / EXPOSURE_DIR
    path = folder / f"{key_of(material)}.json"
    doc = {"format": EXPOSURE_FORMAT, "material": material, **memory.to_dict(),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(doc, indent=1, default=str), overwrite=True)
    except (OSError, UsageError) as e:
        cache._warn(f"cannot remember the QNN exposure search in {folder} ({one_line(e, 120)})")
        return None
    return path
