"""A runner in a worker process: its records come back whole, as :meth:`MemorySink.take` gives them.

Two QNN HTP sessions in one process run one at a time: the x86 HTP emulation (``onnxruntime-qnn``) holds a lock
of its own across a graph's execution. Measured on PP-OCRv4's a16w16 recognizer (``docs/scale.md``, "Two HTP
runners: threads take turns, processes do not"): one line alone 9.6 s; two lines on two sessions in two threads
10.1 and 20.0 s (the second waited for the first); two lines in two processes 10.9 s for both. So the second HTP
runner of a tune trial (:class:`~ivq_debug.tune.verify._Samples`) lives here, in another process, where it runs
beside the first.

The worker is one process per parent process (``forkserver``, made at the first use and kept for the next
trials: its imports and the QNN EP's registration are paid once); it holds the runners opened in it by token, each
with its own :class:`~ivq_debug.dump.memory.MemorySink`, and runs one call at a time. A record crosses the
process boundary as the :class:`~ivq_debug.dump.memory.MemoryDump` the worker's sink gives (its arrays pickled
as they are: the same bytes, ``tests/tune/test_trial.py``); that is the only data the parent reads from it, and it
is data this package made, not a file. Ctrl-C reaches the worker too (the terminal's process group): it ignores
SIGINT and finishes its call, as the thread it replaces did; the parent handles the signal.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from ivq_debug.capture.base import make_runner
from ivq_debug.dump.memory import MemorySink

#: the worker of this process (made at the first :class:`ProcessRunner` that opens), and its lock
_POOL: cf.ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_TOKENS = itertools.count(1)

#: in the worker: token -> (runner, its sink)
_OPEN: dict[int, tuple[Any, Any]] = {}


def _pool() -> cf.ProcessPoolExecutor:
    """The worker process of this process (a new one when the last one broke)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"),
                                           initializer=_init)
        return _POOL


def _broken(pool: cf.ProcessPoolExecutor) -> None:
    """Forget a worker that died (the next runner starts another)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is pool:
            _POOL = None
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown() -> None:
    """Stop this process's worker (waits for its call in progress); the next :class:`ProcessRunner` starts one."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------------- the worker's side
def _init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` in the worker, and the worker's CPU seconds for it (every thread of the process)."""
    c0 = time.process_time()
    out = fn(*args)
    return out, time.process_time() - c0


def _open(token: int, backend: str, model: str, options: dict[str, Any], path: str) -> dict[str, Any]:
    runner = make_runner(backend, model, **options)
    try:
        if hasattr(runner, "prepare"):  # (a QNN runner's sessions, compiled or loaded from the cache)
            runner.prepare()
        sink = MemorySink(runner.backend, runner.info, path=path)
    except BaseException:
        runner.close()
        raise
    _OPEN[token] = (runner, sink)
    return {"backend": runner.backend, "info": runner.info, "sites": list(runner.sites), "pid": os.getpid()}


def _record(token: int, feeds: dict[str, Any], sample: int, part: str, step: int) -> Any:
    runner, sink = _OPEN[token]
    sink.begin_record(sample=sample, part=part, step=step)
    runner.run(feeds, sink)
    return sink.take()


def _close(token: int) -> None:
    got = _OPEN.pop(token, None)
    if got is not None:
        got[0].close()


# ---------------------------------------------------------------------------------------------- the parent's side
class ProcessRunner:
    """A runner of ``backend`` on ``model`` (:func:`~ivq_debug.capture.base.make_runner`'s arguments: picklable
    options) made and run in this process's worker.

    :meth:`prepare` makes it there (its sessions compiled, or loaded from the QNN context cache); :meth:`record`
    runs one sample into the worker's sink and returns the record (a
    :class:`~ivq_debug.dump.memory.MemoryDump`, as the sink's ``take`` gives it); :meth:`close` closes it there.
    ``path``: the records' name in messages; :attr:`cpu_s`: the worker's CPU seconds for this runner. A worker that
    dies raises :class:`RuntimeError` from the call."""

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
        self._pool: cf.ProcessPoolExecutor | None = None

    def _call(self, fn: Any, *args: Any) -> Any:
        pool = self._pool if self._pool is not None else _pool()
        try:
            out, cpu = pool.submit(_timed, fn, *args).result()
            self.cpu_s += cpu
            return out
        except BrokenProcessPool as e:
            _broken(pool)
            self._token = None
            raise RuntimeError(f"the worker process of {self.path} died: {e}") from None

    def prepare(self) -> None:
        """Make the runner in the worker and create its sessions."""
        if self._token is not None:
            return
        self._pool, token = _pool(), next(_TOKENS)
        got = self._call(_open, token, self.backend, self.model_path, self.options, self.path)
        self._token = token
        self.backend, self.info, self.sites, self.pid = got["backend"], got["info"], got["sites"], got["pid"]

    def record(self, feeds: dict[str, Any], sample: int = 0, part: str = "model", step: int = 0) -> Any:
        """Run ``feeds`` as record (``sample``, ``part``, ``step``): its :class:`MemoryDump`."""
        self.prepare()
        return self._call(_record, self._token, feeds, int(sample), part, int(step))

    def close(self) -> None:
        """Close the runner in the worker (the worker stays for the next one)."""
        token, self._token = self._token, None
        if token is not None and self._pool is not None:
            try:
                self._call(_close, token)
            except RuntimeError:
                pass  # (the worker died: nothing is left open)
