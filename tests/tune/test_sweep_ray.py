"""``ivq tune --sweep`` on real Ray clusters (issue 15): a local cluster on loopback with one worker SIGKILLed mid-run
(its job is retried once; the merged result equals the local executor's), and ``--ray-address`` against a cluster
that ``ray start --head`` runs in a subprocess with token authentication (the CLI sends the token it is given; without
one the error is one line naming it), stopped after."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.executor import LocalExecutor, RayExecutor
from ivq_debug.tune.sweep import sweep
from ivq_debug.tune.verify import Tuner
from tests.support import vit
from tests.support.ray_cluster import ray_cluster, run_killing_a_worker  # noqa: F401 (the fixture)
from tests.tune.test_sweep import ROOT, args, comparable, user  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow
#: a trial's backend session opens this late here (a QNN HTP compile takes seconds): a job lives long enough to kill
SESSION_DELAY_S = 1.5


def slow_cpu(qdq: Path, profile: Path) -> Any:
    """CPU-QDQ after :data:`SESSION_DELAY_S` (a :class:`Tuner` runner factory)."""
    time.sleep(SESSION_DELAY_S)
    return make_runner("onnx", qdq, selection=Selection(), optimization="disable")


def _tuner(u: dict[str, Path], wd: Path) -> Tuner:
    ref = wd / "reference.h5"
    if not ref.exists():
        wd.mkdir(parents=True, exist_ok=True)
        capture(make_runner("onnx", u["model"], selection=Selection()), [vit.image(7)], ref, progress=None)
    return Tuner(u["model"], vit.calibration(), [vit.image(7)], ref, wd / "trials", backend="cpu",
                 runner_factory=slow_cpu)


def same(a: Any, b: Any) -> None:
    """Two sweeps hold the same candidates' numbers and the same verified set (wall times aside)."""
    assert a.table.equals(b.table)
    assert a.chosen == b.chosen and a.predicted_db == b.predicted_db
    da, db = a.report.to_dict(), b.report.to_dict()
    assert da["end_to_end"] == db["end_to_end"] and da["overrides"] == db["overrides"]


def test_ray_sweep_survives_a_killed_worker_and_equals_the_local_executor(ray_cluster, user,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    local = sweep(_tuner(user, tmp_path / "local"), groups=6, executor=LocalExecutor(1), progress=False)
    assert local.jobs["total"] == 12 and local.jobs["run"] == 12
    tuner = _tuner(user, tmp_path / "ray")
    r = run_killing_a_worker(lambda: sweep(tuner, groups=6, executor=RayExecutor(), progress=False))
    assert r.jobs["executor"] == "RayExecutor" and len(r.jobs["retried"]) == 1 and r.jobs["total"] == 12
    same(local, r)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """``ray start --head --block`` on loopback with 2 CPUs and token authentication, in its own process group;
    yields (address, token); stopped after (SIGTERM to its group, SIGKILL after 10 s: Ray drains up to 30 s)."""
    pytest.importorskip("ray")
    port, token = _free_port(), secrets.token_hex(16)
    temp = tempfile.mkdtemp(prefix="ivq-ray-", dir="/tmp")  # short: Ray's unix sockets live there (108 bytes)
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    ray_bin = Path(sys.executable).with_name("ray")
    proc = subprocess.Popen([str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2",
                             "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp}", "--block"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, "ray start exited"
                time.sleep(0.5)
        yield f"127.0.0.1:{port}", token
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):  # the group: raylet, GCS, workers
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def _cli(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivq_debug", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_ray_address_of_a_ray_start_cluster(ray_head, user, tmp_path: Path) -> None:  # noqa: F811
    address, token = ray_head
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"PYTHONPATH": str(ROOT), "IVQ_NO_PROGRESS": "1", "HOME": str(tmp_path / "home")}  # no ~/.ray token
    # without the token: one line naming what is missing, exit 5
    r = _cli(args(user, tmp_path / "denied", "--executor", "ray", "--ray-address", address), env)
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr[-2000:]
    # one error line, the last (a warning about the evaluation set may come before it)
    errors = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("ivq:")]
    assert len(errors) == 1 and "RAY_AUTH_TOKEN" in errors[0], r.stderr
    assert r.stderr.strip().splitlines()[-1] == errors[0], r.stderr
    ok = _cli(args(user, tmp_path / "ray", "--executor", "ray", "--ray-address", address),
              env | {"RAY_AUTH_TOKEN": token})
    assert ok.returncode == 0, ok.stderr[-2000:]
    seq = _cli(args(user, tmp_path / "seq"), env)
    assert seq.returncode == 0, seq.stderr[-2000:]
    a, b = (json.loads((tmp_path / n / "tune.json").read_text()) for n in ("ray", "seq"))
    assert a["sweep"]["jobs"]["executor"] == "RayExecutor" and a["sweep"]["jobs"]["run"] == 12
    assert comparable(a) == comparable(b)
