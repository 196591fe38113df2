"""The replay on a real Ray cluster (issue 15): a local cluster on loopback (two CPUs), the replay's jobs as Ray tasks,
one worker process killed mid-run (SIGKILL, as a preempted node): its job is retried once and the merged result
equals the local executor's and the in-process replay's, to the bit."""

from __future__ import annotations

import time
from typing import Any

import pytest

import ivq_debug as ivq
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.diagnose.replay import replay
from ivq_debug.executor import LocalExecutor, RayExecutor
from tests.diagnose.test_replay_executor import same
from tests.support import vit
from tests.support.ray_cluster import ray_cluster, run_killing_a_worker  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow
#: a backend session takes this long to open here (a slow backend): every job runs long enough to be killed
SESSION_DELAY_S = 1.5


def slow_cpu(path: str) -> Any:
    """CPU-QDQ, after :data:`SESSION_DELAY_S` (a QNN HTP compile takes seconds too)."""
    time.sleep(SESSION_DELAY_S)
    return make_runner("onnx", path, optimization="disable")


def test_ray_replay_survives_a_killed_worker_and_equals_the_local_executor(ray_cluster,  # noqa: F811
                                                                         tmp_path_factory) -> None:
    m = vit.models(tmp_path_factory)
    test = capture(make_runner("onnx", m["act"], selection=Selection()), [vit.image(7), vit.image(8)],
                   tmp_path_factory.mktemp("ray") / "act.h5", progress=None)
    cmp = ivq.compare(m["ref"], test, progress=False)
    kw: dict[str, Any] = dict(record="all", cumulative=cmp, float_model=m["float"], progress=False, lift=False,
                              runner_factory=slow_cpu)
    seq = replay(m["act"], m["ref"], **kw)
    local = replay(m["act"], m["ref"], executor=LocalExecutor(2), **kw)
    same(seq, local)
    r = run_killing_a_worker(lambda: replay(m["act"], m["ref"], executor=RayExecutor(),
                                            shards=tmp_path_factory.mktemp("shards"), **kw))
    assert len(r.jobs["retried"]) == 1 and r.jobs["total"] == local.jobs["total"]
    same(local, r)
    same(seq, r)
