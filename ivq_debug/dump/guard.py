"""A full disk while a dump is written: refuse the write before HDF5 sees it fail (issue 16).

HDF5 keeps metadata in a cache and writes it later, often while h5py deallocates an object. A write that
fails there (``ENOSPC``, ``EFBIG`` under ``RLIMIT_FSIZE``, ``EDQUOT``) is not raised: h5py prints it
("Exception ignored in: h5py._objects.ObjectID.__dealloc__") and the file's metadata cache is left
half-flushed; the next ``H5Fclose``, or HDF5's own clean-up at interpreter exit, then crashed the process
with SIGSEGV (measured: ``ivq ingest`` under an 8 KiB ``RLIMIT_FSIZE``, and a bare h5py loop; pointing the
descriptor at ``/dev/null`` first does not help: the crash is in the cache, not the I/O). No call after
such a failure is safe, so :class:`WriteGuard` keeps HDF5 from ever seeing one:

* before each write, :meth:`WriteGuard.reserve` allocates the file up to HDF5's end of allocation plus the
  bytes about to be written plus a margin for metadata (``posix_fallocate``: a full disk, a quota or the
  file size limit fails *there*, with ``ENOSPC`` / ``EDQUOT`` / ``EFBIG``, while HDF5's state is intact);
* the writer then closes the file with its descriptor on ``/dev/null`` (nothing reaches the disk),
  removes the temporary file and raises :func:`~ivq_debug.outputs.output_error` (exit 2, one line);
* :func:`trim` cuts the preallocated tail of a finished file at the end-of-file address its superblock
  records.

As a last resort, a write error HDF5 raises or reports (an I/O error the reservation cannot foresee) also
discards the file, without closing it (that close is the crash).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import struct
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ivq_debug.errors import IvqError
from ivq_debug.outputs import WRITE_ERRNOS, output_error

F = TypeVar("F", bound=Callable[..., Any])

_ERRNO = re.compile(r"errno = (\d+)")
_ACTIVE: dict[str, WriteGuard] = {}  # temporary file name -> its guard
_PREVIOUS: list[Any] = []  # the hook ours replaced


#: bytes reserved beyond what a write adds, for metadata HDF5 allocates later (object headers, indexes)
MARGIN = 256 << 10
#: reservations grow in steps of at least this (fewer calls); a step that does not fit is retried exactly
STEP = 4 << 20
_LEAKED: list[Any] = []  # files whose HDF5 state is broken: never closed, never deallocated


def write_errno(e: BaseException) -> int | None:
    """The errno of an exception that means "the output cannot be written" (full disk, file too large,
    quota, read-only file system), read from ``OSError.errno`` or HDF5's message; else None."""
    if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
        return e.errno
    m = _ERRNO.search(str(e))
    if m and int(m.group(1)) in WRITE_ERRNOS:
        return int(m.group(1))
    return None


def _hook(unraisable: Any) -> None:
    exc = unraisable.exc_value
    if _ACTIVE and isinstance(exc, OSError | RuntimeError) and "h5py" in str(unraisable.err_msg or "") + repr(
            unraisable.object):
        text = str(exc)
        named = [g for name, g in _ACTIVE.items() if name in text]
        for g in named or list(_ACTIVE.values()):  # an error that names no file: every open writer
            if g.failure is None:
                g.failure = exc
        return
    (_PREVIOUS[-1] if _PREVIOUS else sys.__unraisablehook__)(unraisable)


class WriteGuard:
    """The space reservation and failed-write watch of one dump being written to ``tmp`` (final ``path``)."""

    def __init__(self, tmp: Path, path: Path) -> None:
        self.tmp, self.path = tmp, path
        self.failure: BaseException | None = None  # a write HDF5 saw fail: its state is broken
        self.file: Any = None  # the h5py.File, once created
        self.reserved = 0
        if not _ACTIVE and sys.unraisablehook is not _hook:
            _PREVIOUS.append(sys.unraisablehook)
            sys.unraisablehook = _hook
        _ACTIVE[tmp.name] = self

    def reserve(self, nbytes: int) -> None:
        """Make sure the next ``nbytes`` (plus :data:`MARGIN`) fit in space already allocated to the file."""
        f = self.file
        if f is None or self.reserved < 0:
            return
        need = f.id.get_filesize() + nbytes + MARGIN + nbytes // 16
        if need <= self.reserved:
            return
        fd = f.id.get_vfd_handle()
        err: OSError | None = None
        for size in (need + max(STEP, nbytes), need):
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if write_errno(e) is None:  # the file system cannot preallocate: no reservation (best effort)
                    self.reserved = -1
                    return
                err = e
                continue
            self.reserved = size
            return
        assert err is not None
        self.discard(close=True)
        raise output_error(err, self.path) from None

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around HDF5 writes: a write error HDF5 raised or reported discards the file (exit 2)."""
        try:
            yield
        except Exception as e:
            # a usage error of the caller (a duplicate name) or a bug leaves the file as it was: re-raised
            if self.failure is None and (isinstance(e, IvqError) or write_errno(e) is None):
                raise
            self.failure = self.failure or e
        if self.failure is not None:
            first = self.failure
            self.discard(close=False)
            code = write_errno(first) or errno.EIO
            raise output_error(OSError(code, os.strerror(code)), self.path) from None

    def discard(self, close: bool = True) -> None:
        """Remove the file; stop watching. ``close``: close it first with its descriptor on ``/dev/null`` (HDF5's
        state is intact, nothing reaches the disk); otherwise it is left open for good (its close would
        crash) with the descriptor on ``/dev/null``."""
        f, self.file = self.file, None
        if f is not None:
            try:
                fd = f.id.get_vfd_handle()
                null = os.open(os.devnull, os.O_RDWR)
                try:
                    os.dup2(null, fd)
                finally:
                    os.close(null)
            except Exception:  # no descriptor (another driver)
                pass
            if close:
                try:
                    f.close()
                except Exception:
                    pass
            else:
                _LEAKED.append(f)
        self.tmp.unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        """Stop watching (the file was closed or discarded)."""
        _ACTIVE.pop(self.tmp.name, None)
        if not _ACTIVE and sys.unraisablehook is _hook:
            sys.unraisablehook = _PREVIOUS.pop() if _PREVIOUS else sys.__unraisablehook__


def trim(path: Path) -> None:
    """Cut a closed dump at the end-of-file address its superblock (version 2 or 3, 8-byte offsets) records:
    the tail :meth:`WriteGuard.reserve` preallocated and HDF5 did not use."""
    with open(path, "rb") as fh:
        head = fh.read(48)
    if len(head) < 36 or head[:8] != b"\x89HDF\r\n\x1a\n" or head[8] not in (2, 3) or head[9] != 8:
        return
    eof = struct.unpack_from("<Q", head, 28)[0]
    if 0 < eof < os.stat(path).st_size:
        os.truncate(path, eof)


def guarded(method: F) -> F:
    """A :class:`~ivq_debug.dump.writer.DumpWriter` method whose HDF5 writes are watched (``self._guard``)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._guard.writing():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
