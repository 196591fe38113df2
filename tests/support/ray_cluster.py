"""A real Ray cluster for the scale-out tests (issue 15): a local cluster on loopback with two CPUs, and a run during
which one Ray worker process is SIGKILLed while it runs a job (as a preempted node)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """``ray`` initialized on a local two-CPU cluster on 127.0.0.1 for the module's tests (skipped without ray)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def running_tasks() -> list[int]:
    """Pids of Ray worker processes running a job (their process title is ``ray::run_job``)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "cmdline").read_bytes().startswith(b"ray::run_job"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def run_killing_a_worker(fn: Callable[[], Any], poll_s: float = 0.05, timeout_s: float = 300) -> Any:
    """``fn()`` in a thread while the first Ray worker seen running a job is SIGKILLed; ``fn``'s result (an
    ``AssertionError`` when no worker was seen running a job, or when ``fn`` raised)."""
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
        pids = running_tasks()
        if pids:
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(poll_s)
    t.join(timeout_s)
    assert killed is not None and "e" not in out, out.get("e")
    return out["r"]
