"""Small shared helpers: atomic file writes, file hashing, user array files, JSON-safe values."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError, UsageError, one_line


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename.

    Raises :class:`UsageError` when ``path`` exists and ``overwrite`` is False.
    """
    p = Path(path)
    if p.exists() and not overwrite:
        raise UsageError("output exists; pass --force to replace it", p)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"), overwrite=overwrite)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def as_float(v: object) -> float | None:
    """``float(v)``, or None for None, NaN and values that are not numbers (table cells, JSON fields)."""
    if v is None:
        return None
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def read_arrays(path: str | os.PathLike, what: str = "inputs file") -> dict:
    """Named arrays of an ``.npz`` (or one ``.npy``, named after the file), never unpickling anything.

    Raises :class:`~ivq_debug.errors.InputError` with a one-line message naming the file when it is missing,
    not a NumPy file, or holds object arrays.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no such {what}" if not p.exists() else f"{what} is not a file", p)
    with open(p, "rb") as f:
        magic = f.read(6)
    try:
        if magic == b"\x93NUMPY":
            return {p.stem: np.load(p, allow_pickle=False)}
        if not zipfile.is_zipfile(p):
            raise InputError("not an .npz archive (a NumPy zip of named arrays) or an .npy array", p)
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except InputError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        kind = "object arrays (pickles are never loaded)" if "pickle" in str(e) else one_line(e, 160)
        raise InputError(f"not a readable NumPy file: {kind}", p) from None


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """A JSON document from a file; one-line :class:`~ivq_debug.errors.InputError` naming it when it is
    missing, unreadable or not JSON (``what`` names the kind of file in the message)."""
    import json

    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"no such {what}", p) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"not a readable {what} ({type(e).__name__})", p) from None


def json_safe(obj: Any) -> Any:
    """Replace non-finite floats by the strings ``"inf"``, ``"-inf"``, ``"nan"`` (strict JSON)."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, (np.floating,)):
        return json_safe(float(obj))
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


class _Warnings(logging.Handler):
    """WARNING and above, one line each, without repeats."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = " ".join(record.getMessage().split())
        if msg not in self.messages:
            self.messages.append(msg)


@contextmanager
def root_warnings() -> Iterator[list[str]]:
    """Keep the root logger off the console for the block (ONNX Runtime's quantizers log through it) and yield
    the list its warnings are collected in (one line each, without repeats)."""
    cap = _Warnings()
    root = logging.getLogger()
    others = list(root.handlers)
    for h in others:
        root.removeHandler(h)
    root.addHandler(cap)
    try:
        yield cap.messages
    finally:
        root.removeHandler(cap)
        for h in others:
            root.addHandler(h)


def publish_staged(staged: Path, out: Path, externals: Iterable[str], *, overwrite: bool = False) -> None:
    """Move a model written into a staging folder beside ``out`` into place: its external data files (names
    relative to the staging folder) first, the model last, so that it appears only when complete. Refuses to
    replace an existing file without ``overwrite``."""
    for name in externals:
        dst = out.parent / name
        if dst.exists() and not overwrite:
            raise UsageError("external data file exists; pass overwrite=True", dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged.parent / name, dst)
    if out.exists() and not overwrite:
        raise UsageError("output appeared while quantizing; not overwritten", out)
    os.replace(staged, out)
