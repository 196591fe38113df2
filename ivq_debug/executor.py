"""Jobs on a pluggable executor: content-hash keys, one atomic shard per job, resumable runs (issue 15).

A :class:`Job` is a module-level function with its keyword arguments and a content-hash key (:func:`job_key`
over the model file's hash, the inputs' hash, the override set, the backend and the versions that change its
numbers). An executor runs a list of jobs against a shard folder:

* a job whose shard ``<folder>/<key>.json`` exists is skipped (a rerun after a crash or a preempted worker
  redoes only what is missing);
* a job writes its own shard atomically (:func:`~ivq_debug.outputs.atomic_write_text`: temp file + rename), in the
  worker, so a shard on disk is always complete;
* a job that raises (or whose worker dies) is retried once; a second failure is recorded with its key and error,
  the other jobs go on (a dead pool worker breaks the whole pool: the jobs lost with it are not charged an
  attempt and rerun alone, so only the job whose worker dies is), and :meth:`RunReport.raise_failures` ends the run with every failure listed
  (:class:`JobsFailedError`, exit 1) while every completed shard stays on disk;
* a progress bar over jobs with an ETA (:func:`~ivq_debug.console.track`) on every executor.

Every executor is one ``submit(job) -> concurrent.futures.Future`` under the same loop (:func:`_drive`: skip,
submit, collect, retry, progress): :class:`LocalExecutor` (a ``concurrent.futures`` process pool of ``workers``
started by ``forkserver``, so a worker inherits no ONNX Runtime session or thread of the parent; in-process and
sequential when ``workers == 1``: ONNX Runtime and the QNN emulator are process-bound; threads of this process
with ``threads``, for jobs that release the GIL) and :class:`RayExecutor`
(``ray.init(address=...)`` or an already-initialized cluster; each task writes its shard on shared storage and
returns its path, its ``ObjectRef.future()`` is the future; the optional extra ``ivq-debug[ray]``). Shards are small JSON documents; numbers round-trip
exactly (Python's ``repr`` of a float is the shortest string that reads back to the same double).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ivq_debug import __version__, interrupt
from ivq_debug.console import track
from ivq_debug.errors import (
    EXIT_FAIL,
    InputError,
    IvqError,
    ToolNotFoundError,
    UsageError,
    one_line,
    require_extra,
)
from ivq_debug.forked import end_with
from ivq_debug.inputfiles import file_in_folder_problem, is_inside
from ivq_debug.jsonio import load_json
from ivq_debug.outputs import atomic_write_text, partial_files
from ivq_debug.schema import check_schema

#: the executors of ``--executor``
EXECUTORS = ("local", "ray")
#: attempts per job: the first run and one retry
ATTEMPTS = 2
SHARD_SCHEMA = "ivq-shard/1"


def size_runs(items: Iterable[Any], size: Callable[[Any], int], limit: int, most: int | None = None) -> list[list[Any]]:
    """``items`` cut into runs of consecutive items whose ``size`` adds up to at most ``limit`` (an item larger than
    ``limit`` alone), of at most ``most`` items each: the batches the replay's jobs are made of, the comparator's
    tasks."""
    runs: list[list[Any]] = []
    cur: list[Any] = []
    total = 0
    for x in items:
        n = size(x)
        if cur and (total + n > limit or (most is not None and len(cur) >= most)):
            runs.append(cur)
            cur, total = [], 0
        cur.append(x)
        total += n
    if cur:
        runs.append(cur)
    return runs


def versions() -> dict[str, str]:
    """The versions that change a job's numbers: ivq-debug, numpy, onnx, onnxruntime (and onnxruntime-qnn)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"ivq-debug": __version__}
    for pkg in ("numpy", "onnx", "onnxruntime", "onnxruntime-qnn"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def job_key(**parts: Any) -> str:
    """A content-hash key: SHA-256 (hex, first 32 digits) of the canonical JSON of ``parts`` (the model file's
    hash, the inputs' hash, the override set, the backend, :func:`versions`, the job's own selection)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class Job:
    """One unit of work: ``fn(**kwargs)`` returns a JSON-able dict, stored as the job's shard under ``key``.

    ``fn`` must be a module-level function (it is pickled by reference into worker processes) and ``kwargs``
    plain picklable values; ``meta`` is copied into the shard (hashes a merge step checks for agreement).
    """

    key: str
    fn: Callable[..., dict[str, Any]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobFailure:
    """A job that failed on both attempts."""

    key: str
    error: str


class JobsFailedError(IvqError):
    """Jobs failed twice (exit 1); the message lists each job's key and error; completed shards are kept."""

    exit_code = EXIT_FAIL

    def __init__(self, failures: list[JobFailure], folder: str | os.PathLike) -> None:
        self.failures = failures
        listed = "; ".join(f"{f.key}: {f.error}" for f in failures)
        super().__init__(f"{len(failures)} job(s) failed after a retry (completed shards kept in {folder}): {listed}")


@dataclass
class RunReport:
    """What a run left: every completed shard by key, the keys skipped because their shard existed, failures."""

    folder: Path
    shards: dict[str, Path]
    skipped: list[str]
    failures: list[JobFailure]
    retried: list[str] = field(default_factory=list)

    def raise_failures(self) -> None:
        """:class:`JobsFailedError` when a job failed twice."""
        if self.failures:
            raise JobsFailedError(self.failures, self.folder)

    def load(self, key: str, result_schema: dict[str, Any] | None = None) -> dict[str, Any]:
        """The shard document of one job, its ``result`` checked against the kind's ``result_schema``
        (:func:`read_shard`; :class:`InputError` when the file holds another job's)."""
        doc = read_shard(self.shards[key], self.folder, result_schema)
        if doc.get("key") != key:
            raise InputError(f"the shard of job {key} holds job {one_line(str(doc.get('key')), 80)}", self.shards[key])
        return doc


def shard_path(folder: str | os.PathLike, key: str) -> Path:
    """Where the shard of job ``key`` lives."""
    return Path(folder) / f"{key}.json"


#: the envelope of every shard; each kind's ``result`` has its own schema (:meth:`RunReport.load`)
ENVELOPE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema", "key", "meta", "result"],
    "properties": {"schema": {"const": SHARD_SCHEMA}, "key": {"type": "string"}, "meta": {"type": "object"},
                   "result": {"type": "object"}},
}


def read_shard(path: str | os.PathLike, folder: str | os.PathLike | None = None,
               result_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A shard document (``ivq-shard/1``), read as the untrusted input it is (shards on shared storage are where
    stale or edited files appear).

    ``stat`` before open: a regular file inside ``folder`` (default: its own folder; a symlink leaving it, a FIFO,
    a folder are refused unread); the bounded JSON loader (:func:`~ivq_debug.jsonio.load_json`: nesting, encoding);
    :data:`ENVELOPE_SCHEMA`, then ``result_schema`` on the ``result`` (the kind's: finite, ordered, non-negative
    numbers; docs/input-formats.md "Job shards").

    Raises:
        InputError: naming the shard (exit 3).
    """
    p = Path(path)
    problem = file_in_folder_problem(p, p.parent if folder is None else folder, "shard", allow_outside=True)
    if problem is None and not is_inside(p, p.parent if folder is None else folder):
        problem = "shard is a symlink to a file outside the shard folder"
    if problem is not None:
        raise InputError(problem, p)
    doc = load_json(p, "shard")
    if not isinstance(doc, dict) or doc.get("schema") != SHARD_SCHEMA:
        raise InputError(f"not an {SHARD_SCHEMA} shard", p)
    check_schema(doc, ENVELOPE_SCHEMA, p, "shard")
    if result_schema is not None:
        check_schema(doc["result"], result_schema, p, result_schema.get("title", "result"))
    return doc


def run_job(job: Job, folder: str) -> str:
    """Run one job and write its shard atomically (in the worker); returns the shard's path."""
    result = job.fn(**job.kwargs)
    doc = {"schema": SHARD_SCHEMA, "key": job.key, "meta": job.meta, "result": result}
    # allow_nan: a metric may legitimately be inf (identical tensors) or NaN; Python's json reads them back
    text = json.dumps(doc, allow_nan=True)
    path = shard_path(folder, job.key)
    atomic_write_text(path, text, overwrite=True)
    return str(path)


def merge_check(docs: Iterable[dict[str, Any]], fields: Iterable[str]) -> dict[str, Any]:
    """The common value of each ``meta`` field over shards (model hash, inputs hash, backend, SDK, ...); a
    :class:`UsageError` names the first field on which two shards disagree (they are not one run's)."""
    common: dict[str, Any] = {}
    fields = list(fields)
    for doc in docs:
        meta = doc.get("meta", {})
        for f in fields:
            if f not in common:
                common[f] = meta.get(f)
            elif meta.get(f) != common[f]:
                raise UsageError(f"shards disagree on {f}: {common[f]!r} vs {meta.get(f)!r} (shard {doc.get('key')})")
    return common


class Executor(Protocol):
    """Runs jobs into a shard folder (skip existing shards, retry once, progress over jobs)."""

    def run(self, jobs: list[Job], folder: str | os.PathLike, description: str = "jobs",
            progress: bool = True) -> RunReport:
        """Run ``jobs``; shards under ``folder``."""
        ...


def _pending(jobs: list[Job], folder: Path) -> tuple[list[Job], dict[str, Path], list[str]]:
    if len({j.key for j in jobs}) != len(jobs):
        raise UsageError("two jobs share one key")
    if folder.exists() and not folder.is_dir():
        raise UsageError("the shard folder is not a folder", folder)
    folder.mkdir(parents=True, exist_ok=True)
    done: dict[str, Path] = {}
    todo: list[Job] = []
    for j in jobs:
        p = shard_path(folder, j.key)
        if os.path.lexists(p):  # whatever it is (a FIFO, a symlink out, a folder): read_shard refuses it, exit 3
            done[j.key] = p
        else:
            todo.append(j)
    return todo, done, list(done)


def _progress(it: Iterator[Any], description: str, total: int, progress: bool) -> Iterator[Any]:
    return track(it, description, total=total) if progress else it


def _error(e: BaseException) -> str:
    return one_line(f"{type(e).__name__}: {e}", 300)


def _done(fn: Callable[[], Any]) -> cf.Future:
    """``fn()`` run now, as a completed future (its result or its exception)."""
    f: cf.Future = cf.Future()
    try:
        f.set_result(fn())
    except Exception as e:
        f.set_exception(e)
    return f


def _drive(todo: list[Job], submit: Callable[[Job], cf.Future], report: RunReport, description: str,
           progress: bool, limit: int | None = None, lost: Callable[[cf.Future], bool] | None = None) -> None:
    """The one run loop of every executor: ``submit`` each job (at most ``limit`` in flight), collect the futures as
    they complete, record each shard, retry a failed job once (:data:`ATTEMPTS`), then report it.

    ``lost(future)`` is called for a broken pool (a worker died: every job of the pool fails with it) and says whether
    the pool ran other jobs too, so the death may not be this job's. Such a job is not charged an attempt and reruns
    alone, with nothing else in flight, so that a death is then its own."""
    attempts = dict.fromkeys((j.key for j in todo), 0)
    queue = list(todo)
    alone: set[str] = set()
    inflight: dict[cf.Future, Job] = {}

    def fill() -> None:
        while queue and not any(j.key in alone for j in inflight.values()):
            if queue[0].key in alone and inflight:
                return
            if limit is not None and len(inflight) >= limit:
                return
            j = queue.pop(0)
            inflight[submit(j)] = j
            if j.key in alone:
                return

    def results() -> Iterator[None]:
        fill()
        while inflight:
            finished, _ = cf.wait(list(inflight), timeout=0.5, return_when=cf.FIRST_COMPLETED)
            interrupt.raise_if_signalled()  # (a signal whose exception was lost: not a wait for the next job's end)
            for f in finished:
                j = inflight.pop(f)
                try:
                    report.shards[j.key] = Path(f.result())
                except Exception as e:  # a job's failure is data: retried once, then reported
                    shared = lost is not None and isinstance(e, BrokenProcessPool) and lost(f)
                    if shared and j.key not in alone:
                        alone.add(j.key)
                    else:
                        attempts[j.key] += 1
                    if attempts[j.key] < ATTEMPTS:
                        report.retried.append(j.key)
                        queue.append(j)
                        continue
                    # RayTaskError carries the job's own exception as its cause
                    report.failures.append(JobFailure(j.key, _error(getattr(e, "cause", None) or e)))
                yield None
            fill()

    for _ in _progress(results(), description, len(todo), progress):
        pass


class LocalExecutor:
    """A ``concurrent.futures`` process pool of ``workers`` processes started by ``forkserver`` (a worker is a fresh
    interpreter: no ONNX Runtime session of the parent is inherited, so none can hang in a forked destructor);
    ``workers == 1`` runs the jobs in this process, one after the other (no pool). With ``threads``, ``workers``
    threads of this process instead: for jobs whose work releases the GIL (ONNX Runtime CPU sessions: ``ivq
    diagnose``'s counterfactual runs without ``--executor``), without a new interpreter's imports."""

    def __init__(self, workers: int = 1, threads: bool = False) -> None:
        if int(workers) < 1:
            raise UsageError(f"--workers must be at least 1, got {workers}")
        self.workers = int(workers)
        self.threads = threads

    def run(self, jobs: list[Job], folder: str | os.PathLike, description: str = "jobs",
            progress: bool = True) -> RunReport:
        """Run ``jobs`` (module docstring)."""
        folder = Path(folder)
        todo, done, skipped = _pending(jobs, folder)
        report = RunReport(folder, done, skipped, [])
        if self.workers == 1:
            _drive(todo, lambda j: _done(lambda: run_job(j, str(folder))), report, description, progress, limit=1)
            return report
        if self.threads:
            with cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ivq-job") as threads:
                _drive(todo, lambda j: threads.submit(run_job, j, str(folder)), report, description, progress,
                       limit=self.workers)
            return report
        pools: list[cf.ProcessPoolExecutor | None] = [None]
        owner: dict[cf.Future, cf.ProcessPoolExecutor] = {}
        served: dict[cf.ProcessPoolExecutor, int] = {}
        ctx = multiprocessing.get_context("forkserver")

        def submit(j: Job) -> cf.Future:
            if pools[0] is None:  # (its workers end with this process, killed or not: forked.end_with)
                pools[0] = cf.ProcessPoolExecutor(max_workers=min(self.workers, len(todo)), mp_context=ctx,
                                                  initializer=end_with, initargs=(os.getpid(),))
            f = pools[0].submit(run_job, j, str(folder))
            owner[f] = pools[0]
            served[pools[0]] = served.get(pools[0], 0) + 1
            return f

        def lost(f: cf.Future) -> bool:  # a broken pool is replaced for the jobs that follow (once)
            pool = owner.pop(f, None)
            if pool is not None and pool is pools[0]:
                pool.shutdown(wait=False, cancel_futures=True)
                pools[0] = None
            return pool is not None and served.get(pool, 0) > 1

        try:
            _drive(todo, submit, report, description, progress, lost=lost)
        except BaseException:  # a signal (Signalled) or an error: the jobs in flight are stopped, not waited for
            if pools[0] is not None:
                _stop(pools[0], [shard_path(folder, j.key) for j in todo])
            raise
        if pools[0] is not None:
            pools[0].shutdown(wait=True)
        return report


def _stop(pool: cf.ProcessPoolExecutor, shards: list[Path]) -> None:
    """Cancel ``pool``'s queued jobs and kill its workers at once: ``shutdown(wait=True)`` after a ``SIGTERM`` ran
    every job submitted to the end first (measured: 60 s for four 30 s jobs on 2 workers, the signal at 4 s).
    The finished jobs' shards are kept; a killed job leaves no shard (written atomically), and the temporary file it
    may have left beside one of ``shards`` is removed (``outputs.partial_files``)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # (Python < 3.14 has no kill_workers())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        try:
            if proc.is_alive():  # (one that has ended may have its pid taken again)
                proc.kill()
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(5)
    if manager is not None:  # (its teardown done before the interpreter's exit handlers run)
        manager.join(5)
    for shard in shards:
        for tmp in partial_files(shard):
            tmp.unlink(missing_ok=True)


def _ray() -> Any:
    require_extra("ray", "--executor ray")
    import ray

    return ray


def _probe(address: str | None, timeout: float = 5.0) -> None:
    """Refuse a ``HOST:PORT`` (or ``ray://HOST:PORT``) address where nothing accepts a TCP connection within
    ``timeout`` seconds: ``ray.init`` would wait for it without end."""
    import socket

    if not address or address in ("local", "auto"):
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ToolNotFoundError(f"cannot reach the Ray cluster at {address}: nothing accepts a connection there "
                                f"({e.strerror or type(e).__name__}; start it with `ray start --head`)") from None


def _token_auth(address: str | None) -> bool:
    """Send this machine's Ray auth token to a cluster named by ``address``: ``ray start`` turns token
    authentication on by itself when a token exists (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN_PATH``,
    ``RAY_AUTH_TOKEN``), but a client whose ``RAY_AUTH_MODE`` is unset sends none and ``ray.init`` fails after
    ~20 s. Sets ``RAY_AUTH_MODE=token`` (as ``ray start`` does) when a token is there; returns whether one is.
    Ray reads the mode from the environment when it is first imported (its documented interface): call this
    before ``import ray``."""
    token = bool(os.environ.get("RAY_AUTH_TOKEN")) or any(
        Path(p).expanduser().is_file() for p in (os.environ.get("RAY_AUTH_TOKEN_PATH"), "~/.ray/auth_token") if p)
    if address and address != "local" and token and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
    return token


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """File descriptor 2 into a discarded temporary file: Ray's core writes a warning per connection retry
    straight to it (about 20 lines for a refused token), which would bury the one-line error."""
    import tempfile

    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class RayExecutor:
    """Jobs as Ray tasks: ``ray.init(address=address)`` unless Ray is already initialized (a notebook's own
    cluster; ``address=None`` starts a new local one for the run, ``"auto"`` joins the one ``ray start`` runs
    here); each task writes its shard on storage the driver
    shares (the shard folder) and returns its path.
    ``num_cpus`` is each task's resource request. Ray's own task retries are off: a failed task (an exception or
    a dead worker) is resubmitted once by this executor, like the local one."""

    def __init__(self, address: str | None = None, num_cpus: float = 1.0) -> None:
        self.address = address
        self.num_cpus = num_cpus

    def run(self, jobs: list[Job], folder: str | os.PathLike, description: str = "jobs",
            progress: bool = True) -> RunReport:
        """Run ``jobs`` (module docstring)."""
        require_extra("ray", "--executor ray")
        import sys

        fresh = "ray" not in sys.modules
        token = _token_auth(self.address) if fresh else False  # before Ray reads RAY_AUTH_MODE at its import
        ray = _ray()
        owned = not ray.is_initialized()  # a caller's own cluster (a notebook's) stays connected after the run
        if owned:
            _probe(self.address)
            if not fresh:
                token = _token_auth(self.address) and os.environ.get("RAY_AUTH_MODE") == "token"
            try:
                # no address: a new local cluster ("local"), never a stale one named by RAY_ADDRESS or /tmp/ray
                with _quiet_fd2():
                    ray.init(address=self.address or "local", log_to_driver=False, include_dashboard=False,
                             logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as e:  # none there, refused, bad
                hint = ("" if token or not self.address else "; a cluster started with token authentication needs "
                        "its token here (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)")
                raise ToolNotFoundError(f"cannot start or reach the Ray cluster"
                                        f"{f' at {self.address}' if self.address else ''}: {_error(e)}{hint}") from None
        try:
            return self._run(ray, jobs, Path(folder), description, progress)
        finally:
            if owned:  # the local cluster started for this run stops; a remote one is only disconnected
                ray.shutdown()

    def _run(self, ray: Any, jobs: list[Job], folder: Path, description: str, progress: bool) -> RunReport:
        todo, done, skipped = _pending(jobs, folder)
        report = RunReport(folder, done, skipped, [])
        remote = ray.remote(num_cpus=self.num_cpus, max_retries=0)(run_job)
        where = str(folder.resolve())
        # RayTaskError (the job raised), WorkerCrashedError (its worker died): both charged, as a local job's
        _drive(todo, lambda j: remote.remote(j, where).future(), report, description, progress)
        return report


def make_executor(name: str | None = "local", workers: int = 1, address: str | None = None) -> Executor:
    """The executor of ``--executor NAME --workers N [--ray-address ADDR]``."""
    if name in (None, "local"):
        return LocalExecutor(workers)
    if name == "ray":
        require_extra("ray", "--executor ray")  # imports nothing: Ray reads RAY_AUTH_MODE when imported
        return RayExecutor(address)
    raise UsageError(f"unknown executor {name!r} ({', '.join(EXECUTORS)})")
