"""Untrusted input files: regular files and folders only, decided with ``stat`` / ``fstat`` and an open that
cannot block, never by reading (a FIFO, a socket, a device, a directory, a symlink loop or a name too long
is a one-line :class:`~ivq_debug.errors.InputError`, exit 3); bounded reads of text and bytes; a file's
SHA-256; paths that must stay inside a folder.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import IO

from ivq_debug.errors import InputError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


#: why an input could not be opened, by errno (``{what}``: the input's role)
_OPEN_ERRORS = {
    errno.ENOENT: "no such {what}",
    errno.ELOOP: "{what} is a symlink loop",
    errno.ENAMETOOLONG: "{what} path is too long",
    errno.ENOTDIR: "no such {what} (a parent is not a folder)",
    errno.EACCES: "{what} is not readable (permission denied)",
    errno.ENXIO: "{what} is a socket or device, not a regular file",
}


def _stat_error(e: OSError, p: Path, what: str) -> InputError:
    msg = _OPEN_ERRORS.get(e.errno or 0)
    return InputError(msg.format(what=what) if msg else f"cannot open {what} ({e.strerror or type(e).__name__})", p)


def _kind(mode: int) -> str | None:
    """What a non-regular file is (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | os.PathLike, what: str = "input file") -> Path:
    """``path`` when it names a regular file (symlinks followed); else a one-line :class:`InputError`.

    ``what`` names the input in the message (``"overrides file"``, ``"profiling file"``, …).
    """
    p = Path(path)
    st = _stat(p, what)
    kind = _kind(st.st_mode)
    if kind:
        raise InputError(f"{what} is {kind}, not a regular file", p)
    return p


def _stat(p: Path, what: str) -> os.stat_result:
    try:
        return os.stat(p)
    except OSError as e:
        raise _stat_error(e, p, what) from None
    except ValueError:  # an embedded NUL byte
        raise InputError(f"{what} path holds a NUL byte", p) from None


def regular_folder(path: str | os.PathLike, what: str = "input folder") -> Path:
    """``path`` when it names a folder (symlinks followed); else a one-line :class:`InputError`."""
    p = Path(path)
    st = _stat(p, what)
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{what} is {_kind(st.st_mode) or 'a file'}, not a folder", p)
    return p


def is_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """True when ``path``'s real path (symlinks resolved) is ``folder``'s real path or lies under it."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def file_in_folder_problem(path: str | os.PathLike, folder: str | os.PathLike, what: str = "file",
                           allow_outside: bool = False) -> str | None:
    """Why a file found under ``folder`` may not be read, or ``None``: it cannot be ``stat``-ed (a symlink
    loop, a dangling link, permissions), is not a regular file, or is a symlink whose target leaves
    ``folder`` (unless ``allow_outside``). Decided without opening the file."""
    p = Path(path)
    try:
        st = _stat(p, what)
    except InputError as e:
        return e.message
    kind = _kind(st.st_mode)
    if kind:
        return f"{what} is {kind}, not a regular file"
    if not allow_outside and not is_inside(p, folder):
        return f"{what} is a symlink to a file outside {os.fspath(folder)!r} (--allow-outside-inputs reads it)"
    return None


def open_input(path: str | os.PathLike, what: str = "input file") -> IO[bytes]:
    """Open a regular file for binary reading without ever blocking on a FIFO or device.

    The open uses ``O_NONBLOCK`` (a FIFO with no writer opens at once instead of waiting) and the opened
    descriptor is checked with ``fstat``, so a file swapped for a FIFO after a ``stat`` is still refused.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _stat_error(e, p, what) from None
    except ValueError:
        raise InputError(f"{what} path holds a NUL byte", p) from None
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind:
            raise InputError(f"{what} is {kind}, not a regular file", p)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input_bytes(path: str | os.PathLike, what: str = "input file") -> bytes:
    """The bytes of a regular file (:func:`open_input`); read errors are one-line :class:`InputError`."""
    with open_input(path, what) as f:
        try:
            return f.read()
        except OSError as e:
            raise InputError(f"cannot read {what} ({e.strerror or type(e).__name__})", path) from None


def read_input_text(path: str | os.PathLike, what: str = "input file", allow_nul: bool = False) -> str:
    """A regular file's UTF-8 text; undecodable bytes or NUL bytes (a cut or corrupt file) are refused."""
    data = read_input_bytes(path, what)
    if not allow_nul and b"\x00" in data:
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise InputError(f"{what} holds NUL bytes (line {line}): a binary, cut or corrupt file", path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"{what} is not UTF-8 text (line {line}, byte offset {e.start})", path) from None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a regular file, read in chunks (a FIFO or device is an :class:`InputError`)."""
    h = hashlib.sha256()
    with open_input(path) as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def file_version(path: str | os.PathLike) -> tuple[str, int, int]:
    """``(resolved path, size, mtime in ns)``: a file's identity for what is computed from it once per process."""
    st = os.stat(path)
    return str(Path(path).resolve()), st.st_size, st.st_mtime_ns


_DIGESTS: dict[tuple[str, int, int], str] = {}


def sha256_file_once(path: str | os.PathLike) -> str:
    """:func:`sha256_file`, computed once per :func:`file_version` in this process (model and weights files are
    large and hashed by every capture, cache look-up and shard key of the same run)."""
    key = file_version(path)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]
