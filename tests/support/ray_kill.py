"""A run on a Ray cluster with one of its job workers SIGKILLed mid-run (a preempted node), for the scale-out tests."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def run_killing_one_worker(fn: Callable[[], Any], timeout: float = 120) -> tuple[Any, int | None]:
    """``fn()`` in a thread while the first worker seen running a job is SIGKILLed; (its result, the killed pid).
    An exception of ``fn`` is raised here."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["r"] = fn()
        except BaseException as e:  # raised below, in the test's thread
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    killed = None
    deadline = time.monotonic() + timeout
    while killed is None and t.is_alive() and time.monotonic() < deadline:
        pids = running_tasks()
        if pids:
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    t.join(300)
    if "e" in out:
        raise out["e"]
    return out.get("r"), killed
