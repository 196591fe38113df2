"""The executor (issue 15): content-hash keys, one atomic shard per job, a rerun skips the shards there, a failed job
(an exception, or its worker process killed) is retried once and then reported with its key while the other shards
stay, on the in-process loop and on a real process pool."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from ivq_debug.errors import EXIT_FAIL, UsageError
from ivq_debug.executor import (
    Job,
    JobsFailedError,
    LocalExecutor,
    job_key,
    merge_check,
    read_shard,
    shard_path,
)
from tests.support.procs import running


def square(x: int, log: str, fail: str = "") -> dict[str, int]:
    """A job: logs its call (pid, x) to ``log``; ``fail``: ``raise`` always raises, ``once`` raises on the first
    call, ``kill`` SIGKILLs its own worker on the first call (a marker file next to the log tells), ``kill always``
    on every call."""
    with open(log, "a") as f:
        f.write(f"{os.getpid()} {x}\n")
    marker = Path(f"{log}.{x}.tried")
    first = not marker.exists()
    marker.touch()
    if fail == "raise" or (fail == "once" and first):
        raise ValueError(f"job {x} failed")
    if (fail == "kill" and first) or fail == "kill always":
        os.kill(os.getpid(), signal.SIGKILL)
    return {"x": x, "y": x * x}


def jobs(log: Path, n: int = 5, fail: dict[int, str] | None = None) -> list[Job]:
    return [Job(job_key(kind="square", x=i), square, {"x": i, "log": str(log), "fail": (fail or {}).get(i, "")},
                {"model_sha256": "m"}) for i in range(n)]


def calls(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines()] if log.exists() else []


def test_job_keys_hash_every_part() -> None:
    base = {"model_sha256": "a" * 64, "inputs_sha256": "b" * 64, "overrides": {"x": "a16"}, "backend": "qnn",
            "versions": {"onnxruntime": "1.32.0"}}
    k = job_key(**base)
    assert k == job_key(**dict(reversed(list(base.items())))) and len(k) == 32  # canonical: order does not count
    for part, other in [("model_sha256", "c" * 64), ("inputs_sha256", "d" * 64), ("overrides", {"x": "a8"}),
                        ("backend", "cpu"), ("versions", {"onnxruntime": "1.31.0"})]:
        assert job_key(**(base | {part: other})) != k, part


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_are_written_and_a_rerun_skips_them(tmp_path: Path, workers: int) -> None:
    log, out = tmp_path / "log", tmp_path / "shards"
    js = jobs(log)
    rep = LocalExecutor(workers).run(js, out, progress=False)
    assert not rep.failures and sorted(rep.shards) == sorted(j.key for j in js) and rep.skipped == []
    for j in js:
        doc = read_shard(shard_path(out, j.key))
        assert doc["key"] == j.key and doc["result"] == {"x": j.kwargs["x"], "y": j.kwargs["x"] ** 2}
    pids = {int(line.split()[0]) for line in log.read_text().splitlines()}
    assert (pids == {os.getpid()}) == (workers == 1)  # workers=1: in this process; 2: in pool workers
    assert not list(out.glob("*.partial*")) and not list(out.glob(".*"))  # atomic: no temp file left
    # resumable: one shard lost (a preempted worker), the rerun does only that job
    shard_path(out, js[3].key).unlink()
    n = len(calls(log))
    rep2 = LocalExecutor(workers).run(js, out, progress=False)
    assert calls(log)[n:] == [3] and sorted(rep2.skipped) == sorted(j.key for j in js if j is not js[3])


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_job_is_retried_once_then_reported_and_the_others_kept(tmp_path: Path, workers: int) -> None:
    log, out = tmp_path / "log", tmp_path / "shards"
    js = jobs(log, fail={1: "once", 2: "raise"})
    rep = LocalExecutor(workers).run(js, out, progress=False)
    assert sorted(calls(log)) == [0, 1, 1, 2, 2, 3, 4]  # 1 and 2 twice, no third attempt
    assert [f.key for f in rep.failures] == [js[2].key] and "ValueError: job 2 failed" in rep.failures[0].error
    assert sorted(rep.shards) == sorted(j.key for i, j in enumerate(js) if i != 2)
    assert all(shard_path(out, j.key).is_file() for i, j in enumerate(js) if i != 2)
    with pytest.raises(JobsFailedError) as e:
        rep.raise_failures()
    assert e.value.exit_code == EXIT_FAIL and js[2].key in e.value.one_line() and str(out) in e.value.one_line()


def test_a_killed_pool_worker_loses_only_a_retry(tmp_path: Path) -> None:
    log, out = tmp_path / "log", tmp_path / "shards"
    js = jobs(log, n=6, fail={2: "kill"})
    rep = LocalExecutor(2).run(js, out, progress=False)
    assert not rep.failures and js[2].key in rep.retried and len(rep.shards) == 6
    assert json.loads(shard_path(out, js[2].key).read_text())["result"] == {"x": 2, "y": 4}


def test_a_job_that_kills_every_worker_fails_alone(tmp_path: Path) -> None:
    # a dead worker breaks the whole pool: the jobs lost with it rerun alone, so only the killer is charged
    log, out = tmp_path / "log", tmp_path / "shards"
    js = jobs(log, n=4, fail={1: "kill always"})
    rep = LocalExecutor(2).run(js, out, progress=False)
    assert [f.key for f in rep.failures] == [js[1].key] and len(rep.shards) == 3
    assert calls(log).count(1) == 3  # lost with its pool once (not charged), then twice alone


def test_merge_check_refuses_shards_of_another_run() -> None:
    a = {"key": "a", "meta": {"model_sha256": "m", "soc": "v73"}}
    assert merge_check([a, a], ["model_sha256", "soc"]) == {"model_sha256": "m", "soc": "v73"}
    with pytest.raises(UsageError, match="shards disagree on model_sha256"):
        merge_check([a, {"key": "b", "meta": {"model_sha256": "n", "soc": "v73"}}], ["model_sha256", "soc"])
    with pytest.raises(UsageError, match="share one key"):
        LocalExecutor(1).run([jobs(Path("x"))[0]] * 2, "unused", progress=False)


def test_ray_address_where_nothing_listens_is_refused_not_waited_for(tmp_path) -> None:
    """``ray.init`` waits without end for an address where nothing listens: refused up front (exit 5)."""
    pytest.importorskip("ray")
    import socket

    from ivq_debug.errors import ToolNotFoundError
    from ivq_debug.executor import RayExecutor

    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ToolNotFoundError, match="nothing accepts a connection"):
        RayExecutor(f"127.0.0.1:{port}").run([], tmp_path / "shards")


_OWNER = '''
import os, signal, sys, time
from pathlib import Path
from ivq_debug import interrupt
from ivq_debug.executor import Job, LocalExecutor

def work(i: int, folder: str) -> dict:
    Path(folder, f"pid-{os.getpid()}").touch()
    if i:  # what a job killed while writing its shard leaves: its temporary file
        Path(folder, "shards", f".k{i}.json.x{os.getpid()}.partial").write_text("{")
    t = time.monotonic()
    while i and time.monotonic() - t < 120:  # job 0 ends at once, the others are at work for 2 minutes
        sum(range(10000))
    return {"i": i}

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupt.on_signal)  # as the CLI does
    folder = sys.argv[1]
    try:
        LocalExecutor(2).run([Job(f"k{i}", work, {"i": i, "folder": folder}, {}) for i in range(4)],
                             Path(folder, "shards"), "jobs", progress=False)
    except interrupt.Signalled as e:
        sys.exit(128 + e.signum)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signalled_or_killed_owner_leaves_no_pool_worker_at_work(tmp_path: Path, sig: int) -> None:
    """``SIGTERM`` (the CLI's ``Signalled``) stops the jobs in flight instead of running every submitted job to the end
    first (60 s for four 30 s jobs, measured before), keeps the finished job's shard and removes the temporary files
    of the killed ones; an owner killed outright
    (``SIGKILL``: the OOM killer, a CI timeout) cannot stop its workers, which end with it (``forked.end_with``)
    instead of computing on."""
    import subprocess
    import sys
    import time

    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid-*"))) < 2 or not shard_path(tmp_path / "shards", "k0").exists():
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.05)
        workers = {int(f.name[4:]) for f in tmp_path.glob("pid-*")}
        t0 = time.monotonic()
        p.send_signal(sig)
        code = p.wait(30)
        left = time.monotonic() - t0
        while any(running(w) for w in workers) and time.monotonic() - t0 < 15:
            time.sleep(0.05)
        alive = [w for w in workers if running(w)]
        for w in alive:
            os.kill(w, signal.SIGKILL)
        assert not alive, f"workers {alive} still run {time.monotonic() - t0:.1f} s after the owner's {sig!r}"
        if sig == signal.SIGTERM:
            assert code == 143 and left < 15, (code, left, p.stderr.read())
            assert not list((tmp_path / "shards").glob(".*.partial"))  # the killed jobs' temporary files removed
        assert shard_path(tmp_path / "shards", "k0").exists()  # the finished job's shard is kept
    finally:
        p.kill()
        p.wait()
