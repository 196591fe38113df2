"""A runner in the worker process (``capture/worker.py``): its records are those of the same runner in this process,
to the bit; it runs in another process, kept for the next runner; a worker that dies raises one error and the next
runner starts another; closing twice is harmless. Real ORT CPU-QDQ sessions of a small model (the HTP runner of a
tune trial is tested in ``tests/tune/test_trial.py``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ivq_debug.capture import worker
from ivq_debug.capture.base import Selection, make_runner
from ivq_debug.capture.worker import ProcessRunner
from ivq_debug.dump.memory import MemorySink
from ivq_debug.qnn.quantize import quantize_for_qnn
from tests.support.lever_models import build_two_causes, two_causes_sample


@pytest.fixture(scope="module")
def qdq(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("worker")
    model = build_two_causes(d / "two.onnx")
    quantize_for_qnn(model, d / "two.qdq.onnx", [two_causes_sample(i) for i in range(8)], preprocess=False)
    return {"model": d / "two.qdq.onnx", "feeds": [two_causes_sample(100 + i) for i in range(3)]}


def _tensors(rec) -> dict[str, tuple]:
    return {e.name: (str(rec.read(e).dtype), rec.read(e).shape, rec.read(e).tobytes()) for e in rec.tensors()}


def _here(qdq: dict) -> list:
    r = make_runner("onnx", qdq["model"], selection=Selection(), optimization="disable")
    sink = MemorySink(r.backend, r.info, path="<here>")
    out = []
    for i, f in enumerate(qdq["feeds"]):
        sink.begin_record(sample=i, part="model", step=0)
        r.run(f, sink)
        out.append(sink.take())
    r.close()
    return out


def test_the_worker_records_what_this_process_records(qdq) -> None:
    here = _here(qdq)
    there = ProcessRunner("onnx", qdq["model"], path="<there>", selection=Selection(), optimization="disable")
    there.prepare()
    assert there.pid not in (None, os.getpid()) and there.backend == "onnxruntime-cpu-qdq"
    assert [s.output for s in there.sites] == [s.output for s in make_runner(
        "onnx", qdq["model"], selection=Selection(), optimization="disable").sites]
    got = [there.record(f, sample=i, part="model") for i, f in enumerate(qdq["feeds"])]
    there.close()
    there.close()  # a second close does nothing
    assert len(_tensors(got[0])) > 3
    for a, b in zip(here, got, strict=True):
        assert _tensors(a) == _tensors(b)  # dtype, shape and bytes of every tensor
        assert a.record_keys() == b.record_keys() and a.records["meta"].tolist() == b.records["meta"].tolist()
    # the worker stays for the next runner; Ctrl-C (SIGINT to the process group) is the parent's to handle
    os.kill(there.pid, signal.SIGINT)
    again = ProcessRunner("onnx", qdq["model"], selection=Selection(), optimization="disable")
    again.prepare()
    assert again.pid == there.pid
    assert _tensors(again.record(qdq["feeds"][0], sample=0)) == _tensors(here[0])
    again.close()


def test_a_worker_that_dies_raises_and_the_next_runner_starts_another(qdq) -> None:
    r = ProcessRunner("onnx", qdq["model"], path="<dies>", selection=Selection(), optimization="disable")
    r.prepare()
    os.kill(r.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="the worker process of <dies> died"):
        r.record(qdq["feeds"][0])
    r.close()  # nothing left to close
    nxt = ProcessRunner("onnx", qdq["model"], selection=Selection(), optimization="disable")
    rec = nxt.record(qdq["feeds"][0])  # (prepared at its first record)
    assert nxt.pid not in (None, r.pid) and len(rec.tensors()) > 3
    nxt.close()
    proc = worker._WORKER.proc
    worker.shutdown()  # the worker exits once its socket closes
    assert proc.returncode == 0
    worker.shutdown()  # nothing left to stop


def test_a_failure_in_the_worker_is_named_and_the_worker_serves_on(qdq, tmp_path) -> None:
    bad = ProcessRunner("onnx", tmp_path / "missing.onnx", path="<missing>", selection=Selection())
    with pytest.raises(RuntimeError, match=r"the worker process of <missing>: .*missing\.onnx"):
        bad.prepare()
    ok = ProcessRunner("onnx", qdq["model"], selection=Selection(), optimization="disable")
    assert len(ok.record(qdq["feeds"][0]).tensors()) > 3 and ok.cpu_s > 0
    ok.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_worker_ends_with_its_parent(qdq, sig) -> None:
    """A parent killed (SIGTERM: exits through Python; SIGKILL: its socket closed by the system) leaves no worker."""
    import subprocess
    import sys
    import time

    code = ("import sys, time\n"
            "from ivq_debug.capture.base import Selection\n"
            "from ivq_debug.capture.worker import ProcessRunner\n"
            f"r = ProcessRunner('onnx', {str(qdq['model'])!r}, selection=Selection())\n"
            "r.prepare()\n"
            "print(r.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    pid = int(parent.stdout.readline())
    os.kill(pid, 0)  # the worker runs
    parent.send_signal(sig)
    parent.wait(timeout=30)
    for _ in range(100):  # (its own child: reaped by init once it exits)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the worker {pid} outlived its parent ({sig!r})")
