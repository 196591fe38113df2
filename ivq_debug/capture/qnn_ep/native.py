"""What the QNN library prints: the native banner goes to file descriptor 1 at the first HTP session; session
creation runs with fd 1 captured (:func:`capture_native_stdout`) so that a CLI writing JSON to stdout stays clean."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

_STDOUT_LOCK = threading.RLock()


@dataclass
class CapturedText:
    """Text a block printed on file descriptor 1 (filled when the block exits)."""

    text: str = ""


def _fflush_all() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def capture_native_stdout() -> Iterator[CapturedText]:
    """Capture what native code writes to file descriptor 1 (the QNN ``LIBNATIVE`` banner).

    fd 1 is process-wide: while the block runs, every thread's stdout goes to a temp file. The C stdio
    buffers are flushed before fd 1 is restored, so buffered native output is captured too.
    """
    out = CapturedText()
    with _STDOUT_LOCK:
        try:
            sys.stdout.flush()
        except (AttributeError, ValueError, OSError):
            pass
        try:
            saved = os.dup(1)
        except OSError:  # fd 1 closed: nothing to protect
            yield out
            return
        with tempfile.TemporaryFile() as tmp:
            _fflush_all()
            os.dup2(tmp.fileno(), 1)
            try:
                yield out
            finally:
                _fflush_all()
                os.dup2(saved, 1)
                os.close(saved)
                tmp.seek(0)
                out.text = tmp.read().decode("utf-8", "replace")
