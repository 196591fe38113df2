"""A real Ray cluster for the scale-out tests (issue 15): a local cluster on loopback with two CPUs, and a run during
which one Ray worker process is SIGKILLed while it runs a job (as a preempted node).

The kill is made deterministic (a job retried exactly once), against the three races a title scan alone has:

* **another test's cluster**: under ``pytest -n 2`` two Ray tests run side by side, each with its own cluster, and a
  worker titled ``ray::run_job`` may be the other test's (the last stop's CI run: one test saw 0 retries, the other
  2). Only a descendant of this process (its raylet's workers) is a candidate.
* **a job that ends between the scan and the kill** (an idle worker dies, nothing is retried): the candidate is
  stopped first (``SIGSTOP``; then it cannot finish), and killed only if it still runs the job. Ray's worker sets its
  title back to ``ray::IDLE`` before it returns the task's result, so a stopped worker still titled
  ``ray::run_job`` has not delivered it, and its death fails that job; otherwise it is let go on (``SIGCONT``) and
  the scan goes on.
* **a job not started yet**: the title is set when the worker executes the task, so a worker titled ``ray::run_job``
  holds one job, not an idle lease.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: the process title of a Ray worker while it runs :func:`ivq_debug.executor.run_job`
TITLE = b"ray::run_job"


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """``ray`` initialized on a local two-CPU cluster on 127.0.0.1 for the module's tests (skipped without ray)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from ``/proc/<pid>/stat``; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": the name may hold spaces and parentheses
    return fields[0], int(fields[1])


def _title(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _descends(pid: int, ancestor: int) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        st = _stat(pid)
        if st is None:
            return False
        pid, seen = st[1], seen + 1
        if pid == ancestor:
            return True
    return False


def running_tasks(ancestor: int | None = None) -> list[int]:
    """Pids of the Ray worker processes running a job (title ``ray::run_job``) that descend from ``ancestor``
    (default: this process, whose ``ray.init`` started the raylet that forks the workers)."""
    ancestor = os.getpid() if ancestor is None else ancestor
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and _title(int(d.name)).startswith(TITLE) and _descends(int(d.name), ancestor):
            pids.append(int(d.name))
    return pids


def _stopped(pid: int, timeout_s: float = 10.0) -> bool:
    """Wait until ``pid`` is stopped (``SIGSTOP`` is delivered asynchronously); False when it is gone, or not
    stopped within ``timeout_s`` (then let go on: ``SIGCONT`` also drops a pending stop)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = _stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return False
        if st[0] in ("T", "t"):
            return True
        time.sleep(0.001)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    return False


def kill_if_running_a_job(pid: int) -> bool:
    """SIGKILL worker ``pid`` if it is running a job: stopped first, killed only when, stopped, it still holds the
    job's title (module docstring); True when killed, else it continues."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    if not _stopped(pid):
        return False
    if _title(pid).startswith(TITLE):
        os.kill(pid, signal.SIGKILL)
        return True
    os.kill(pid, signal.SIGCONT)
    return False


def run_killing_a_worker(fn: Callable[[], Any], poll_s: float = 0.05, timeout_s: float = 300) -> Any:
    """``fn()`` in a thread while one Ray worker of this process's cluster is SIGKILLed in the middle of a job
    (:func:`kill_if_running_a_job`: exactly one job's attempt fails); ``fn``'s result (an ``AssertionError`` when
    no worker was seen running a job, or when ``fn`` raised)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["r"] = fn()
        except BaseException as e:  # reported by the assertion below
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and t.is_alive() and time.monotonic() < deadline:
        killed = next((pid for pid in running_tasks() if kill_if_running_a_job(pid)), None)
        if killed is None:
            time.sleep(poll_s)
    t.join(timeout_s)
    assert not t.is_alive(), f"the run did not end within {timeout_s} s"
    assert killed is not None and "e" not in out, out.get("e")
    return out["r"]
