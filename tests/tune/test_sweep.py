"""``ivq tune --sweep`` from the CLI a user takes (issue 15): a real 2-block ViT quantized a8w8 on ORT CPU-QDQ, 6
layer groups × {a16, fp16} as jobs; a run interrupted by SIGINT resumes and runs only the jobs it had not finished;
a pool of two workers picks the same set with the same numbers; the selection is a function of the shards alone."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.executor import JobsFailedError, LocalExecutor
from ivq_debug.tune.sweep import select, sweep
from ivq_debug.tune.verify import Tuner
from tests.support import vit
from tests.support.cli import ivq_cli

ROOT = Path(__file__).resolve().parents[2]
#: the fields of a shard's result that differ between two runs of one candidate: its wall time
RUN_FIELDS = ("seconds",)


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict[str, Path]:
    """The ViT, a calibration folder of 8 images and one evaluation image, as a user has them."""
    d = tmp_path_factory.mktemp("sweep")
    model = vit.build(d, layers=2)
    (d / "cal").mkdir()
    for i, f in enumerate(vit.calibration()):
        np.savez(d / "cal" / f"{i}.npz", **f)
    np.savez(d / "eval.npz", **vit.image(7))
    return {"model": model, "cal": d / "cal", "eval": d / "eval.npz"}


def args(user: dict[str, Path], wd: Path, *extra: object) -> list[str]:
    return [str(a) for a in ("tune", user["model"], "--calibration", user["cal"], "--inputs", user["eval"], "-o", wd,
                             "--backend", "cpu", "--sweep", "--groups", "6", "--precisions", "a16,fp16", *extra)]


def shards(wd: Path) -> list[Path]:
    return sorted((wd / "trials" / "sweep" / "shards").glob("*.json"))


def interrupted(user: dict[str, Path], wd: Path, after: int) -> int:
    """``ivq tune --sweep`` in a subprocess, SIGINT once ``after`` shards are on disk; the exit code."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), IVQ_NO_PROGRESS="1")
    proc = subprocess.Popen([sys.executable, "-m", "ivq_debug", *args(user, wd)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and len(shards(wd)) < after and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err, err.decode()[-2000:]
    return proc.returncode


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """A sweep's table and chosen set without what differs between runs (wall times, paths)."""
    sw = doc["sweep"]
    return {"chosen": sw["chosen"], "predicted_db": sw["predicted_db"], "table": sw["table"],
            "end_to_end": doc["end_to_end"], "overrides": doc["overrides"]}


@pytest.fixture(scope="module")
def resumed(user, tmp_path_factory) -> dict[str, Any]:
    """A sweep interrupted after 4 of its 12 jobs, then resumed to the end."""
    wd = tmp_path_factory.mktemp("resumed") / "wd"
    code = interrupted(user, wd, after=4)
    done = len(shards(wd))
    assert code == 130 and 4 <= done < 12  # SIGINT: exit 130, the shards written so far kept
    assert ivq_cli(*args(user, wd, "--resume")) == 0
    return {"user": user, "wd": wd, "before_resume": done, "doc": json.loads((wd / "tune.json").read_text())}


def test_an_interrupted_sweep_resumes_without_redoing_finished_jobs(resumed) -> None:
    doc, jobs = resumed["doc"], resumed["doc"]["sweep"]["jobs"]
    assert len(doc["sweep"]["groups"]) == 6 and doc["sweep"]["precisions"] == ["a16", "fp16"]
    assert jobs["total"] == 12 == len(doc["sweep"]["table"]) == len(shards(resumed["wd"]))
    assert jobs["resumed"] == resumed["before_resume"] and jobs["run"] == 12 - resumed["before_resume"]
    # the chosen set is verified by one trial, recommended only when it lifts the output (measured 23.1 -> 25.5 dB)
    assert doc["recommended"] and doc["sweep"]["chosen"]
    e2e = {r["what"]: r for r in doc["end_to_end"]}
    assert e2e["sqnr_db y"]["change"] > 1.0
    picked = [r for r in doc["sweep"]["table"] if r["picked"]]
    assert [r["label"] for r in sorted(picked, key=lambda r: r["rank"])] == doc["sweep"]["chosen"]
    assert all(r["gain_db"] >= 0.5 for r in picked) and len({r["group"] for r in picked}) == len(picked)
    ov = json.loads((resumed["wd"] / "overrides.json").read_text())  # the delivered file (legacy)
    assert len(ov["activation_encodings"]) == len(doc["overrides"])
    # a rerun finds every shard: no job runs again
    assert ivq_cli(*args(resumed["user"], resumed["wd"], "--resume")) == 0
    again = json.loads((resumed["wd"] / "tune.json").read_text())["sweep"]["jobs"]
    assert again["run"] == 0 and again["resumed"] == 12


@pytest.mark.slow  # a third full sweep (12 trials, ~30 s idle); the pool's bit-identity is a default test in test_executor.py
def test_two_workers_pick_the_same_set_with_the_same_numbers(user, resumed, tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    assert ivq_cli(*args(user, wd, "--workers", "2")) == 0
    doc = json.loads((wd / "tune.json").read_text())
    assert doc["sweep"]["jobs"]["executor"] == "LocalExecutor" and doc["sweep"]["jobs"]["run"] == 12
    assert comparable(doc) == comparable(resumed["doc"])
    a = {p.name: json.loads(p.read_text()) for p in shards(wd)}
    b = {p.name: json.loads(p.read_text()) for p in shards(resumed["wd"])}
    assert a.keys() == b.keys()  # the same content-hash keys in both workdirs
    for k in a:
        for f in RUN_FIELDS:
            a[k]["result"].pop(f)
            b[k]["result"].pop(f)
        assert a[k] == b[k]


def test_the_selection_is_a_function_of_the_shards_alone(resumed) -> None:
    doc = resumed["doc"]
    watch = doc["watch"]
    by_label = {json.loads(p.read_text())["result"]["label"]: json.loads(p.read_text())["result"]
                for p in shards(resumed["wd"])}
    groups = [g["name"] for g in doc["sweep"]["groups"]]
    cands = [{"group": lb.split("-")[0], "group_index": groups.index(lb.split("-")[0]),
              "precision": lb.split("-")[1], "precision_index": ["a16", "fp16"].index(lb.split("-")[1]),
              "label": lb, **r} for lb, r in by_label.items()]
    base = {"sqnr": {w: next(r["before"] for r in doc["end_to_end"] if r["what"] == f"sqnr_db {w}") for w in watch},
            "model_bytes": next(r["before"] for r in doc["end_to_end"] if r["what"] == "model bytes"), "task": {}}
    first = select(base, cands, watch)
    for seed in range(3):
        random.Random(seed).shuffle(cands)
        table, picked = select(base, cands, watch)
        assert picked == first[1]
        assert table.equals(first[0])
    assert first[1]["chosen"] == doc["sweep"]["chosen"]
    # a budget stops adding groups once the predicted SQNR reaches it: the top-ranked group alone here
    one = select(base, cands, watch, budget_sqnr_db=base["sqnr"][watch[0]] + 0.1)[1]
    assert one["chosen"] == doc["sweep"]["chosen"][:1]


def test_a_tampered_shard_is_one_line_naming_it(resumed, capsys) -> None:
    victim = shards(resumed["wd"])[0]
    good = victim.read_text()
    doc = json.loads(good)
    doc["result"]["sqnr"] = {w: "high" for w in doc["result"]["sqnr"]}
    try:
        victim.write_text(json.dumps(doc))
        assert ivq_cli(*args(resumed["user"], resumed["wd"], "--resume")) == 3
        err = capsys.readouterr().err
        assert f"{victim}: sweep shard result: sqnr." in err and "must be a number" in err and "Traceback" not in err, err
    finally:
        victim.write_text(good)



@pytest.mark.slow  # a whole sweep again (12 jobs)
def test_force_without_resume_runs_every_job_again(resumed) -> None:
    """``--force`` reuses the workdir, not its results: an earlier run's shards (here one tampered with, which
    ``--resume`` refuses) are replaced by this run's, every job runs."""
    wd = resumed["wd"]
    victim = shards(wd)[0]
    good = victim.read_text()
    doc = json.loads(good)
    doc["result"]["sqnr"] = {w: "high" for w in doc["result"]["sqnr"]}
    victim.write_text(json.dumps(doc))
    assert ivq_cli(*args(resumed["user"], wd, "--force")) == 0
    jobs = json.loads((wd / "tune.json").read_text())["sweep"]["jobs"]
    assert jobs["run"] == 12 and jobs["resumed"] == 0
    assert victim.read_text() != json.dumps(doc) and json.loads(victim.read_text())["result"]["sqnr"] == \
        json.loads(good)["result"]["sqnr"]  # the same job measured again: the same numbers

@pytest.mark.slow
def test_suggested_groups_sweep_finds_the_x2_pattern(tmp_path: Path) -> None:
    """The outlier ViT (x² encodings set by outlier channels): ``--groups suggest`` sweeps the replay's pattern
    groups; the LayerNorm x² (Pow) group at 16 bits is picked and lifts the output (measured 3.1 -> 9.0 dB)."""
    model = vit.build(tmp_path, layers=2, outliers=True, name="vit_x2")
    (tmp_path / "cal").mkdir()
    for i, f in enumerate(vit.calibration(bright=3.0)):
        np.savez(tmp_path / "cal" / f"{i}.npz", **f)
    np.savez(tmp_path / "eval.npz", **vit.image(7, bright=1.0))
    u = {"model": model, "cal": tmp_path / "cal", "eval": tmp_path / "eval.npz"}
    argv = args(u, tmp_path / "wd")
    argv[argv.index("6")] = "suggest"
    assert ivq_cli(*argv) == 0
    doc = json.loads((tmp_path / "wd" / "tune.json").read_text())
    picked = [r for r in doc["sweep"]["table"] if r["picked"]]
    assert [r["precision"] for r in picked] == ["a16"]
    assert {o["tensor"].rsplit("/", 1)[-1] for o in doc["overrides"]} == {"Pow_output_0"}
    assert {r["what"]: r for r in doc["end_to_end"]}["sqnr_db y"]["change"] > 4


def dies_on_g02(qdq: Path, profile: Path) -> Any:
    """CPU-QDQ, except that the worker trying candidate ``g02`` dies (a crashed backend, a preempted node)."""
    if "g02" in Path(qdq).name:
        os._exit(3)
    return make_runner("onnx", qdq, selection=Selection(), optimization="disable")


@pytest.mark.slow  # a sweep of 3 trials in a pool (~17 s idle); a worker-killing job: default test in test_executor.py
def test_a_job_that_kills_its_worker_twice_is_listed_and_the_other_shards_kept(user, tmp_path: Path) -> None:
    ref = capture(make_runner("onnx", user["model"], selection=Selection()), [vit.image(7)], tmp_path / "ref.h5",
                  progress=None)
    tuner = Tuner(user["model"], vit.calibration(), [vit.image(7)], ref, tmp_path / "trials", backend="cpu",
                  runner_factory=dies_on_g02)
    with pytest.raises(JobsFailedError) as e:
        sweep(tuner, groups=3, precisions=["a16"], executor=LocalExecutor(2), progress=False)
    assert [f.key.split()[0] for f in e.value.failures] == ["g02-a16"] and e.value.exit_code == 1
    assert len(shards(tmp_path)) == 2  # g01 and g03 kept for the rerun
