"""The replay's batches as jobs (issue 15): on a process pool the result is the sequential replay's to the bit, a rerun
resumes from the shards, a failing batch is reported with its key while the others' shards stay, from the API and
from the CLI a user takes (a real ViT quantized with ORT's QNN flow, an injected activation fault, CPU-QDQ)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import ivq_debug as ivq
from ivq_debug import defaults
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.diagnose.replay import replay
from ivq_debug.executor import JobsFailedError, LocalExecutor
from ivq_debug.onnxgraph.load import load_model
from tests.support import vit
from tests.support.cli import ivq_cli


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> dict[str, Any]:
    out: dict[str, Any] = dict(vit.models(tmp_path_factory))
    d = tmp_path_factory.mktemp("executor")
    out["test"] = vit.cpu_qdq(out["act"], [7, 8], d / "act.h5")
    out["cmp"] = ivq.compare(out["ref"], out["test"], progress=False)
    out["seq"] = replay(out["act"], out["ref"], record="all", cumulative=out["cmp"], float_model=out["float"],
                        progress=False, lift=False)
    return out


#: what differs between an in-process replay and its jobs: the wall time, and the sessions (one per job)
RUN_FIELDS = ("seconds", "sessions")


def same(a: Any, b: Any) -> None:
    """Two replays hold the same numbers, to the bit (the table, and the JSON document but :data:`RUN_FIELDS`)."""
    pd.testing.assert_frame_equal(a.table, b.table, check_exact=True)
    ja, jb = a.to_json(), b.to_json()
    for f in RUN_FIELDS:
        ja.pop(f)
        jb.pop(f)
    assert ja == jb


def refuse_act_node(path: str) -> Any:
    """A backend that refuses the batch holding the faulty activation's unit (CPU-QDQ for the others)."""
    if any(n.name.endswith(vit.ACT_NODE) for n in load_model(path).graph.node):
        raise RuntimeError("backend refused the graph")
    return make_runner("onnx", path, optimization="disable")


@pytest.mark.slow  # three pooled replays (~7 s idle); pool = sequential: test_cli_workers_give_the_sequential_json,
# resume: test_a_recapture_of_the_same_data_resumes_every_shard (default set)
def test_a_pool_gives_the_sequential_replay_to_the_bit_and_resumes(m, tmp_path: Path) -> None:
    seq = m["seq"]
    assert seq.batches == 1 and seq.first_breaking["node"] == vit.ACT_NODE
    shards = tmp_path / "shards"
    pool = replay(m["act"], m["ref"], record="all", cumulative=m["cmp"], float_model=m["float"], progress=False,
                  lift=False, executor=LocalExecutor(2), shards=shards)
    same(seq, pool)
    n = pool.batches  # the one batch cut into jobs for the workers (defaults.REPLAY_MIN_JOBS)
    assert n == defaults.REPLAY_MIN_JOBS and pool.jobs["total"] == n and pool.jobs["resumed"] == 0
    assert len(list(shards.glob("*.json"))) == n
    lost = sorted(shards.glob("*.json"))[1]
    lost.unlink()  # a preempted job: the rerun runs only that one
    again = replay(m["act"], m["ref"], record="all", cumulative=m["cmp"], float_model=m["float"], progress=False,
                   lift=False, executor=LocalExecutor(2), shards=shards)
    same(seq, again)
    assert again.jobs["resumed"] == n - 1 and lost.is_file()
    # another test dump is another key: nothing is resumed from the first run's shards
    other = replay(m["act"], m["ref"], record="all", cumulative=ivq.compare(m["ref"], m["ref"], progress=False),
                   float_model=m["float"], progress=False, lift=False,
                   executor=LocalExecutor(1), shards=shards)
    assert other.jobs["resumed"] == 0


def test_a_recapture_of_the_same_data_resumes_every_shard(m, tmp_path: Path) -> None:
    """Shards name a dump by its content digest, not its file: a second capture of the same images (another
    file: another creation time) replays nothing again."""
    shards = tmp_path / "shards"
    first = replay(m["act"], m["ref"], record="all", cumulative=m["cmp"], progress=False, lift=False,
                   executor=LocalExecutor(2), shards=shards)
    again = capture(make_runner("onnx", m["act"], selection=Selection()), [vit.image(7), vit.image(8)],
                    tmp_path / "act-again.h5", progress=None)
    assert Path(again).read_bytes() != Path(m["test"]).read_bytes()
    rerun = replay(m["act"], m["ref"], record="all", cumulative=ivq.compare(m["ref"], again, progress=False),
                   progress=False, lift=False, executor=LocalExecutor(2), shards=shards)
    assert rerun.jobs["resumed"] == rerun.jobs["total"] == first.jobs["total"] > 1
    same(first, rerun)


@pytest.mark.slow  # ~7 s idle; a failing job reported, the others kept: tests/test_executor.py (default set)
def test_a_failing_batch_is_reported_and_the_other_shards_kept(m, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    with pytest.raises(JobsFailedError) as e:
        replay(m["act"], m["ref"], record="all", cumulative=m["cmp"], progress=False,
               lift=False, runner_factory=refuse_act_node, executor=LocalExecutor(2), shards=shards)
    assert len(e.value.failures) == 1 and "RuntimeError: backend refused the graph" in e.value.failures[0].error
    assert len(list(shards.glob("*.json"))) == defaults.REPLAY_MIN_JOBS - 1
    assert not (shards / f"{e.value.failures[0].key}.json").exists()
    with pytest.raises(Exception, match="module-level function"):  # a closure cannot go to a worker
        replay(m["act"], m["ref"], progress=False, lift=False, runner_factory=lambda p: make_runner("onnx", p),
               executor=LocalExecutor(2), shards=shards)


def test_cli_workers_give_the_sequential_json(m, tmp_path: Path, capsys) -> None:
    args = [m["ref"], m["test"], "--model", m["act"], "--float-model", m["float"], "--record", "all", "--no-lift"]
    assert ivq_cli("diagnose", *args, "--json", tmp_path / "seq.json") == 1  # the fault breaks the budget
    shards = tmp_path / "shards"
    assert ivq_cli("diagnose", *args, "--executor", "local", "--workers", "2", "--shards", shards,
                   "--json", tmp_path / "pool.json") == 1
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("seq", "pool"))
    for f in RUN_FIELDS:
        a.pop(f)
        b.pop(f)
    assert a == b and len(list(shards.glob("*.json"))) == defaults.REPLAY_MIN_JOBS
    # shards are untrusted: a truncated one, or another job's under this job's name, is exit 3 naming it
    first, second = sorted(shards.glob("*.json"))[:2]
    for content in ('{"schema": "ivq-shard/1", "resu', second.read_text()):
        first.write_text(content)
        assert ivq_cli("diagnose", *args, "--workers", "2", "--shards", shards, "--json", tmp_path / "x.json",
                       "--force") == 3
        assert first.name in capsys.readouterr().err
    assert ivq_cli("diagnose", *args, "--workers", "2", "--shards", second, "--json", tmp_path / "x.json",
                   "--force") == 2  # a file where the shard folder should be
