"""``ivq_debug.forked``: a call in a forked child, its messages both ways in order, its errors raised in the parent,
and the child always reaped."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.errors import InputError
from ivq_debug.forked import fork_call
from tests.support.procs import running


def _gone(pid: int) -> bool:
    """Whether ``pid`` is no child of this process any more (reaped)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_messages_go_both_ways_in_order_and_the_child_is_reaped() -> None:
    parent_pid = os.getpid()
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)

    def child(ch) -> None:
        _, n = ch.recv()
        for i in range(n):
            ch.send("item", (i, os.getpid() != parent_pid))
        ch.send("array", arr * 2)  # the parent's memory as it was at the fork, then computed on

    f = fork_call(child)
    assert f is not None
    f.send("count", 3)
    assert [f.recv() for _ in range(3)] == [("item", (i, True)) for i in range(3)]
    kind, got = f.recv()
    assert kind == "array" and got.dtype == np.float32 and np.array_equal(got, arr * 2)
    f.close()
    assert _gone(f.pid)
    f.close()  # twice: nothing left to do


def test_what_the_child_raises_is_raised_in_the_parent() -> None:
    def child(ch) -> None:
        ch.send("started")
        raise InputError("manifest row 3: bad dtype", "/data/ref.h5")

    f = fork_call(child)
    assert f.recv() == ("started", None)
    with pytest.raises(InputError) as e:
        f.recv()
    assert str(e.value) == "/data/ref.h5: manifest row 3: bad dtype"
    f.close()
    assert _gone(f.pid)


def test_an_exception_that_cannot_be_pickled_comes_back_as_its_text() -> None:
    class Local(Exception):  # a class defined in a function: pickle cannot name it
        pass

    def child(ch) -> None:
        raise Local("no pickle for me")

    f = fork_call(child)
    with pytest.raises(RuntimeError, match="Local: no pickle for me"):
        f.recv()
    f.close()


def test_a_child_that_dies_without_a_word_is_an_eof() -> None:
    def child(ch) -> None:
        os._exit(3)

    f = fork_call(child)
    with pytest.raises(EOFError, match="ended before its answer"):
        f.recv()
    f.close()
    assert _gone(f.pid)


def test_close_kills_a_child_still_at_work_and_reaps_it() -> None:
    def child(ch) -> None:
        ch.send("busy")
        time.sleep(60)

    f = fork_call(child)
    assert f.recv() == ("busy", None)
    t = time.monotonic()
    f.close()
    assert time.monotonic() - t < 5 and _gone(f.pid)
    with pytest.raises(EOFError):
        f.recv()


def test_the_parent_s_garbage_is_not_collected_in_the_child() -> None:
    """The child freezes what it inherited: an ONNX Runtime session left in a reference cycle by the parent (its
    thread pool's threads are not in the child) is not destroyed by a collection there, which hung in
    ``pthread_cond_destroy`` (a slow test's ``ivq diagnose`` after earlier sessions in the same process)."""
    import gc

    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2  # a thread pool of its own
    sess = ort.InferenceSession(onnx.shape_inference.infer_shapes(m).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    sess.run(None, {"x": np.ones((64, 64), np.float32)})

    class Cycle:
        pass

    c = Cycle()
    c.me, c.sess = c, sess
    del c, sess
    gc.disable()  # the cycle stays garbage in the parent until the fork
    time.sleep(1)  # the pool's threads stop spinning and wait on their condition variable
    try:
        def child(ch) -> None:
            gc.collect()
            ch.send("collected")

        f = fork_call(child)
        try:
            assert f.recv(timeout=60) == ("collected", None)
        finally:
            f.close()
    finally:
        gc.enable()
        gc.collect()


def test_a_child_at_work_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    """A parent killed outright (``SIGKILL``: the OOM killer, a CI timeout) cannot close its child: the child at
    work ends with it instead of computing on, an orphan holding its memory, until its next message."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time\n"
        "from ivq_debug.forked import fork_call\n"
        "def child(ch):\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "f = fork_call(child)\n"
        "print(f.pid, flush=True)\n"
        "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        kid = int(p.stdout.readline())
        os.kill(kid, 0)  # at work
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while running(kid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if running(kid):
            os.kill(kid, signal.SIGKILL)
            raise AssertionError("the child still runs 10 s after its parent was killed")
    finally:
        p.kill()
        p.wait()
