"""A call in a forked child of this process, its messages read back as it sends them.

``ivq diagnose`` compares its two dumps (the alignment, then the metrics of every pair) beside its replay. That work
is Python under the GIL: in a thread of the same process it took turns with the replay's own Python (the reference
reads, the sums, the table), and the replay waited for the alignment. A forked child is this process as it was at
the fork, its imports done, with a GIL of its own: it starts at once, on the core the parent's start leaves idle
(``docs/scale.md``, eighth pass).

The child runs ``fn(channel)`` and ends with ``os._exit`` (no ``atexit`` handler, no buffered output and no temporary
file of the parent's is touched); the parent and the child each ``send(kind, value)`` and ``recv()`` the other's
messages over a socket pair, in order. What ``fn`` raises comes back as ``("error", exception)`` and the parent's
:meth:`Channel.recv` raises it. The messages are our own child's data over a socket
(:class:`multiprocessing.connection.Connection`), never a file. The child ignores SIGINT (the terminal's Ctrl-C is
the parent's to handle); the parent's :meth:`Forked.close` kills and reaps it, and a parent that ends without closing
it (killed outright) takes the child with it (:func:`end_with`). Fork the child before this process opens the files
it reads (an HDF5 file open across a fork is shared with the child) and before it starts threads of its own.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


class Channel:
    """One end of the socket pair: ``(kind, value)`` messages, pickled, in order."""

    def __init__(self, conn: Connection, other: str) -> None:
        self._conn: Connection | None = conn
        self._other = other

    def send(self, kind: str, value: Any = None) -> None:
        """Send a message to the other end."""
        if self._conn is None:
            raise EOFError(f"the channel to the {self._other} is closed")
        self._conn.send((kind, value))

    def recv(self, timeout: float | None = None) -> tuple[str, Any]:
        """The other end's next ``(kind, value)``; raises what the child's call raised (``kind == "error"``),
        :class:`EOFError` when the other end ended without a word, :class:`TimeoutError` after ``timeout`` seconds
        without a message."""
        if self._conn is None:
            raise EOFError(f"the channel to the {self._other} is closed")
        try:
            ready = timeout is None or self._conn.poll(timeout)
            kind, value = self._conn.recv() if ready else (None, None)
        except (OSError, EOFError) as e:
            raise EOFError(f"the {self._other} ended before its answer ({e or 'end of file'})") from None
        if not ready:
            raise TimeoutError(f"no message from the {self._other} in {timeout:g} s")
        if kind == "error":
            raise value
        return kind, value


class Forked(Channel):
    """The parent's end: the channel to the child, then its reaping."""

    def __init__(self, pid: int, conn: Connection) -> None:
        super().__init__(conn, f"child (pid {pid})")
        self.pid = pid

    def close(self) -> None:
        """Kill the child if it still runs, reap it, then close this end (a thread reading it sees the end)."""
        if self._conn is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        conn, self._conn = self._conn, None
        conn.close()


def end_with(owner: int, parent: bool = False) -> None:
    """End this process as soon as process ``owner`` ends (at once if it already has): a daemon thread waits on a
    pidfd of ``owner`` (Linux 5.3+; elsewhere it looks twice a second) and calls ``os._exit(1)``.

    Every child process of ivq-debug calls it first with the pid of the process that owns it — the forked
    comparison (:func:`fork_call`), a :class:`~ivq_debug.executor.LocalExecutor` worker (whose parent is the
    ``forkserver``, which outlives the owner), the capture worker (:mod:`ivq_debug.capture.worker`) — so that an
    owner killed outright (the OOM killer, a CI timeout's ``SIGKILL``), which cannot close them, takes them with
    it instead of leaving them computing on, orphans holding their memory, until their next message. ``parent``: the
    owner is this process's parent (the forked child, the capture worker), checked once the pidfd is open: a parent
    that has gone already, its pid perhaps another process's by now, ends this one at once. (A pool worker's parent
    is the forkserver; its owner's pid is not checked.)"""
    import select
    import threading
    import time

    try:
        fd: int | None = os.pidfd_open(owner)
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):  # (no pidfd here, or refused: look instead)
        fd = None
    if parent and os.getppid() != owner:  # (after the pidfd is open: that pid cannot be another's from here on)
        os._exit(1)

    def watch() -> None:
        try:
            if fd is not None:  # (poll, not select: the fd may be 1024 or above in a process with many files open)
                p = select.poll()
                p.register(fd, select.POLLIN)
                while not p.poll():
                    pass
                os._exit(1)
        except OSError:
            pass
        while not _gone(owner):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="ivq-end-with-owner", daemon=True).start()


def _gone(pid: int) -> bool:
    """``pid`` has ended: no such process, another user's (its pid taken again), or a zombie (``/proc``)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def fork_call(fn: Callable[[Channel], None]) -> Forked | None:
    """Run ``fn(channel)`` in a forked child (module docstring); None off Linux (no ``fork`` on Windows; on macOS
    a forked child may not use the system's frameworks, NumPy's BLAS among them)."""
    if not sys.platform.startswith("linux"):
        return None
    for stream in (sys.stdout, sys.stderr):  # (what is buffered would be written again by the child)
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    parent, child = socket.socketpair()
    me = os.getpid()
    with warnings.catch_warnings():  # (Python 3.12+ warns of a fork beside native threads: BLAS's, idle here)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            # what this process held at the fork stays as it is: a collection here would run the destructors of
            # the parent's garbage (an ONNX Runtime session in a cycle waits for thread-pool threads the child has
            # not: measured, a child hung in pthread_cond_destroy)
            gc.freeze()
            end_with(me, parent=True)
            parent.close()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            channel = Channel(Connection(child.detach()), "parent")
            try:
                fn(channel)
            except BaseException as e:  # every failure goes back to the parent
                try:
                    channel.send("error", e)
                except Exception:  # an exception that cannot be pickled: its text
                    channel.send("error", RuntimeError(f"{type(e).__name__}: {e}"))
        except BaseException:  # the parent has gone: nothing to tell
            code = 1
        finally:
            os._exit(code)
    child.close()
    return Forked(pid, Connection(parent.detach()))
