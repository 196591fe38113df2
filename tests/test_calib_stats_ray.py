"""Calibration statistics on a real Ray cluster (issue 15): a local cluster on loopback (two CPUs), 24 calibration
samples in 8 jobs per pass as Ray tasks, one worker process killed mid-run (SIGKILL, as a preempted node): its job is
retried once, and the merged statistics and coverage equal the local pool's and the in-process run's, to the bit."""

from __future__ import annotations

from typing import Any

import pytest

from ivq_debug.calib_stats import calib_stats
from ivq_debug.executor import LocalExecutor, RayExecutor
from tests.support import vit
from tests.support.ray_cluster import ray_cluster, run_killing_a_worker  # noqa: F401 (the fixture)
from tests.test_calib_stats import same

pytestmark = pytest.mark.slow
SAMPLES, PER = 24, 3


def test_ray_calibration_stats_survive_a_killed_worker_and_equal_the_local_executor(ray_cluster,  # noqa: F811
                                                                                     tmp_path_factory) -> None:
    m = vit.models(tmp_path_factory)
    samples = vit.calibration(SAMPLES, bright=1.0)
    kw: dict[str, Any] = dict(encodings=m["qdq"], samples_per_job=PER, progress=False)
    seq = calib_stats(m["float"], samples, **kw)
    local = calib_stats(m["float"], samples, executor=LocalExecutor(2), **kw)
    same(seq, local)
    assert seq.calibration["samples"] == SAMPLES and seq.jobs["total"] == 2 * SAMPLES // PER
    r = run_killing_a_worker(lambda: calib_stats(m["float"], samples, executor=RayExecutor(),
                                                 shards=tmp_path_factory.mktemp("cs"), **kw), poll_s=0.02)
    assert len(r.jobs["retried"]) == 1 and r.jobs["total"] == seq.jobs["total"]
    same(seq, r)
    assert r.low_coverage() == seq.low_coverage()
