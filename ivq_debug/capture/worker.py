"""A runner in a worker process: its records come back whole, as :meth:`MemorySink.take` gives them.

Two QNN HTP sessions in one process take turns: the x86 HTP emulation (``onnxruntime-qnn``) serializes their
runs. Measured on PP-OCRv4's recognizer (``docs/scale.md``, "Two HTP runners: threads take turns, processes do
not"): a16w16, one line alone 9.0-9.6 s; two lines on two sessions in two threads 10.2 and 18.4 s (the second
waited for the first); two lines in two processes 8.6 and 9.4 s, both at once. So the second HTP runner of a tune
trial (:class:`~ivq_debug.tune.verify._Samples`) lives here, in another process, where it runs beside the first.

The worker is one child process per parent process (``python -m ivq_debug.capture.worker``, made at the first use
and kept for the next trials: its imports and the QNN EP's registration are paid once). It is a plain subprocess,
not a :mod:`multiprocessing` one: those import the parent's ``__main__`` again, and a user's script that calls the
tune API without an ``if __name__ == "__main__"`` guard would run again inside it. It holds the runners opened in
it by token, each with its own :class:`~ivq_debug.dump.memory.MemorySink`, and serves one call at a time over a
socket pair (:class:`multiprocessing.connection.Connection`). A record crosses as the
:class:`~ivq_debug.dump.memory.MemoryDump` the worker's sink gives (its arrays pickled as they are: the same bytes,
``tests/capture/test_worker.py``); that is the only data the parent reads from it, made by this package in its own
child, not a file. The worker is in a process group of its own, so the terminal's Ctrl-C reaches only the parent,
which handles it (as it did with the thread this replaces: the call in progress finishes); the worker ends when the
parent's end of the socket closes, and with the parent when it is killed outright (:func:`ivq_debug.forked.end_with`:
at once, not after the call in progress).
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ivq_debug.capture.base import make_runner
from ivq_debug.dump.memory import MemorySink
from ivq_debug.forked import end_with


# ---------------------------------------------------------------------------------------------- the worker's side
class _Served:
    """The runners open in the worker, by token."""

    def __init__(self) -> None:
        self.open: dict[int, tuple[Any, MemorySink]] = {}

    def open_runner(self, token: int, backend: str, model: str, options: dict[str, Any], path: str
                    ) -> dict[str, Any]:
        runner = make_runner(backend, model, **options)
        try:
            if hasattr(runner, "prepare"):  # (a QNN runner's sessions, compiled or loaded from the cache)
                runner.prepare()
            sink = MemorySink(runner.backend, runner.info, path=path)
        except BaseException:
            runner.close()
            raise
        self.open[token] = (runner, sink)
        return {"backend": runner.backend, "info": runner.info, "sites": list(runner.sites), "pid": os.getpid()}

    def record(self, token: int, feeds: dict[str, Any], sample: int, part: str, step: int) -> Any:
        runner, sink = self.open[token]
        return sink.record(runner, feeds, sample, part, step)

    def close(self, token: int) -> None:
        got = self.open.pop(token, None)
        if got is not None:
            got[0].close()


def serve(fd: int, owner: int | None = None) -> None:
    """The worker's loop on socket ``fd``: ``(call, args)`` in, ``(ok, result or "Type: message", cpu seconds)``
    out, until the parent closes its end; the process ends with process ``owner`` (the parent) too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle
    if owner is not None:
        end_with(owner, parent=True)
    conn, served = Connection(fd), _Served()
    calls = {"open": served.open_runner, "record": served.record, "close": served.close}
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        c0 = time.process_time()
        try:
            out: tuple[bool, Any] = (True, calls[name](*args))
        except Exception as e:  # (said to the parent, which decides)
            out = (False, f"{type(e).__name__}: {e}")
        try:
            conn.send((*out, time.process_time() - c0))
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # (pickled before a byte is sent)
            conn.send((False, f"cannot send the result of {name}: {type(e).__name__}: {e}", 0.0))


# ---------------------------------------------------------------------------------------------- the parent's side
class _Worker:
    """The parent's handle on one worker process: one call at a time."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the folder holding this ivq_debug
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "ivq_debug.capture.worker", str(theirs.fileno()),
                                      str(os.getpid())],
                                     pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                     stdout=2,  # (its console lines on stderr: this process's stdout is its own)
                                     process_group=0)  # (the terminal's Ctrl-C is this process's to handle)
        theirs.close()
        self.conn = Connection(os.dup(mine.fileno()))
        mine.close()
        self.lock = threading.Lock()
        self.dead: str | None = None

    def call(self, name: str, *args: Any) -> tuple[bool, Any, float]:
        with self.lock:
            if self.dead is None:
                try:
                    self.conn.send((name, args))
                    return self.conn.recv()
                except (EOFError, OSError) as e:
                    code = self.proc.poll()
                    self.dead = f"exit {code}" if code is not None else type(e).__name__
                except BaseException:  # (a signal between a call and its answer: the next answer is not ours)
                    self.dead = "interrupted"
                    self.proc.kill()
                    raise
            raise BrokenPipeError(self.dead)

    def stop(self) -> None:
        self.conn.close()  # the worker's recv ends: it exits
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


#: the worker of this process (made at the first :class:`ProcessRunner` that opens), and its lock
_WORKER: _Worker | None = None
_LOCK = threading.Lock()
_TOKENS = iter(range(1, sys.maxsize))


def _worker() -> _Worker:
    global _WORKER
    with _LOCK:
        if _WORKER is not None and _WORKER.dead is not None:
            _WORKER.stop()  # (reaped)
            _WORKER = None
        if _WORKER is None:
            _WORKER = _Worker()
        return _WORKER


def shutdown() -> None:
    """Stop this process's worker (after its call in progress; at exit too, so that its CPU time is in this
    process's children's); the next :class:`ProcessRunner` starts one."""
    global _WORKER
    with _LOCK:
        w, _WORKER = _WORKER, None
    if w is not None:
        w.stop()


atexit.register(shutdown)


class ProcessRunner:
    """A runner of ``backend`` on ``model`` (:func:`~ivq_debug.capture.base.make_runner`'s arguments: picklable
    options) made and run in this process's worker.

    :meth:`prepare` makes it there (its sessions compiled, or loaded from the QNN context cache); :meth:`record`
    runs one sample into the worker's sink and returns the record (a
    :class:`~ivq_debug.dump.memory.MemoryDump`, as the sink's ``take`` gives it); :meth:`close` closes it there.
    ``path``: the records' name in messages; :attr:`cpu_s`: the worker's CPU seconds for this runner. A failure
    in the worker, or a worker that died, raises :class:`RuntimeError` naming it."""

    def __init__(self, backend: str, model: str | os.PathLike, path: str | os.PathLike = "<memory>",
                 **options: Any) -> None:
        self.backend, self.model_path, self.path = backend, str(model), str(Path(path))
        self.options = options
        self.info: dict[str, Any] = {}
        self.sites: list[Any] = []
        self.pid: int | None = None
        #: the worker's CPU seconds for this runner's calls (a benchmark of the parent alone does not see them)
        self.cpu_s = 0.0
        self._token: int | None = None
        self._worker: _Worker | None = None

    def _call(self, name: str, *args: Any) -> Any:
        w = self._worker if self._worker is not None else _worker()
        try:
            ok, out, cpu = w.call(name, *args)
        except BrokenPipeError as e:
            self._token = None
            raise RuntimeError(f"the worker process of {self.path} died ({e})") from None
        self.cpu_s += cpu
        if not ok:
            raise RuntimeError(f"the worker process of {self.path}: {out}")
        return out

    def prepare(self) -> None:
        """Make the runner in the worker and create its sessions."""
        if self._token is not None:
            return
        self._worker, token = _worker(), next(_TOKENS)
        got = self._call("open", token, self.backend, self.model_path, self.options, self.path)
        self._token = token
        self.backend, self.info, self.sites, self.pid = got["backend"], got["info"], got["sites"], got["pid"]

    def record(self, feeds: dict[str, Any], sample: int = 0, part: str = "model", step: int = 0) -> Any:
        """Run ``feeds`` as record (``sample``, ``part``, ``step``): its :class:`MemoryDump`."""
        self.prepare()
        return self._call("record", self._token, feeds, int(sample), part, int(step))

    def close(self) -> None:
        """Close the runner in the worker (the worker stays for the next one)."""
        token, self._token = self._token, None
        if token is not None and self._worker is not None:
            try:
                self._call("close", token)
            except RuntimeError:
                pass  # (the worker died: nothing is left open)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
