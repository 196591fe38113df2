"""How a trial's evaluation samples run on two runners (``verify._Samples``; an HTP trial's second runner,
``defaults.TUNE_HTP_RUNNERS``): records yielded in order and bit for bit those of one runner, the second runner made
after the first prepared its sessions, at most ``AHEAD`` samples run past the awaited one, a sample the second runner
fails re-run on the first (the failure reported is the first's), a second runner exposing other tensors not used,
the second runner joined and closed on an early stop and on a signal.

The runners are real ORT CPU-QDQ sessions of a small model; :class:`Traced` wraps each to log which thread ran which
sample, to slow every run to 50 ms (a slow backend: the HTP emulation takes seconds a sample) and to inject a fault.
The HTP runners of a trial are tested in ``test_trial.py``."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest

from ivq_debug import interrupt
from ivq_debug.capture.base import Selection, make_runner
from ivq_debug.dump.memory import MemorySink
from ivq_debug.qnn.quantize import quantize_for_qnn
from ivq_debug.tune.verify import _Samples
from tests.support.lever_models import build_two_causes, two_causes_sample

N = 6
RUN_S = 0.05
THREAD = "ivq-tune-second-runner"


@pytest.fixture(scope="module")
def qdq(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("samples")
    model = build_two_causes(d / "two.onnx")
    quantize_for_qnn(model, d / "two.qdq.onnx", [two_causes_sample(i) for i in range(8)], preprocess=False)
    return {"model": d / "two.qdq.onnx", "feeds": [two_causes_sample(100 + i) for i in range(N)]}


class Traced:
    """A real runner, logged: ``(name, event, sample)`` for ``prepare`` / ``run`` / ``done`` / ``close``; each run
    takes at least ``run_s``; ``fail``: the samples whose run raises (an injected fault); ``starts``: each run's
    ``(name, sample, records the consumer had received then)`` (``got``: the consumer's count)."""

    def __init__(self, runner: Any, name: str, feeds: list, log: list, fail: tuple[int, ...] = (),
                 run_s: float = RUN_S, got: list | None = None) -> None:
        self.runner, self.name, self.feeds, self.log, self.fail = runner, name, feeds, log, fail
        self.run_s, self.got, self.starts = run_s, got if got is not None else [], []
        self.backend, self.info, self.sites = runner.backend, runner.info, runner.sites

    def prepare(self) -> None:
        self.log.append((self.name, "prepare", None))

    def run(self, feeds: dict, sink: Any) -> Any:
        i = next(k for k, f in enumerate(self.feeds) if f is feeds)
        self.log.append((self.name, "run", i))
        self.starts.append((self.name, i, len(self.got)))
        time.sleep(self.run_s)
        if i in self.fail:
            raise RuntimeError(f"{self.name} failed sample {i}")
        out = self.runner.run(feeds, sink)
        self.log.append((self.name, "done", i))
        return out

    def close(self) -> None:
        self.log.append((self.name, "close", None))
        self.runner.close()


def _runner(qdq: dict, name: str, log: list, fail: tuple[int, ...] = (), selection: Selection | None = None,
            **kw: Any) -> Traced:
    r = make_runner("onnx", qdq["model"], selection=selection or Selection(), optimization="disable")
    return Traced(r, name, qdq["feeds"], log, fail, **kw)


def _samples(qdq: dict, log: list, fail_a: tuple[int, ...] = (), fail_b: tuple[int, ...] = (),
             second: Any = "same", b_s: float = RUN_S, got: list | None = None, made: list | None = None,
             order: list[int] | None = None, a_s: float = RUN_S) -> _Samples:
    a = _runner(qdq, "a", log, fail_a, got=got, run_s=a_s)
    if made is not None:
        made.append(a)

    def make_b() -> Traced:
        log.append(("b", "made", None))
        b = _runner(qdq, "b", log, fail_b, run_s=b_s, got=got)
        if made is not None:
            made.append(b)
        return b

    return _Samples(a, MemorySink(a.backend, a.info), qdq["feeds"], "model", make_b if second == "same" else second,
                    order=order)


def _tensors(rec: Any) -> dict[str, tuple]:
    """A record's tensors, name -> bytes (with dtype and shape)."""
    return {e.name: (str(rec.read(e).dtype), rec.read(e).shape, rec.read(e).tobytes()) for e in rec.tensors()}


def _one_runner(qdq: dict) -> list[dict[str, tuple]]:
    log: list = []
    out = []
    for _i, rec in _samples(qdq, log, second=None):
        out.append(_tensors(rec))
        rec.close()
    assert {e[0] for e in log} == {"a"}
    return out


def _ran(log: list, who: str) -> list[int]:
    return [i for name, ev, i in log if name == who and ev == "done"]


def _no_thread_left() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith(THREAD)]


def test_two_runners_yield_in_order_the_bits_of_one_and_the_second_is_made_after_the_first_prepared(qdq) -> None:
    alone = _one_runner(qdq)
    log: list = []
    s = _samples(qdq, log)
    got = []
    for i, rec in s:
        got.append(i)
        assert _tensors(rec) == alone[i], i  # the same bits whichever runner made it
        assert len(alone[i]) > 3
        rec.close()
    assert got == list(range(N))
    assert log.index(("a", "prepare", None)) < log.index(("b", "made", None))  # b loads what a compiled
    assert _ran(log, "a")[0] == 0  # sample 0 is the first runner's (its profile: the trial's cycles)
    assert s.helped and sorted(s.helped) == sorted(_ran(log, "b")) and s.helped_s >= RUN_S * len(s.helped)
    assert sorted(_ran(log, "a") + _ran(log, "b")) == list(range(N))  # each sample run once
    assert ("b", "close", None) in log and _no_thread_left()


def test_no_sample_runs_more_than_ahead_of_the_awaited_one(qdq) -> None:
    """A slow second runner (5x): the first runs ahead while the awaited sample is the second's, AHEAD at most."""
    log: list = []
    got: list = []
    made: list = []
    s = _samples(qdq, log, b_s=5 * RUN_S, got=got, made=made)
    for i, rec in s:
        got.append(i)
        rec.close()
    assert got == list(range(N))
    starts = [x for r in made for x in r.starts]
    # the first runner: while the consumer awaits sample c, it runs c + AHEAD at most
    assert all(j <= c + s.AHEAD for name, j, c in starts if name == "a"), starts
    assert any(j == c + s.AHEAD for name, j, c in starts if name == "a"), starts  # and it does run ahead
    # the second is handed its sample before a record is yielded (awaited c + 1)
    assert all(j <= c + 1 + s.AHEAD for name, j, c in starts if name == "b"), starts


def test_the_awaited_record_of_one_runner_is_yielded_while_the_other_runs(qdq) -> None:
    """A slow first runner (5x): the second runner's records are compared while the first still runs its sample,
    and the second takes most samples (each runner in a thread of its own: neither waits for the other)."""
    log: list = []
    s = _samples(qdq, log, a_s=5 * RUN_S)
    for i, rec in s:
        log.append(("consumer", "got", i))
        rec.close()
    running: set[int] = set()
    during = []
    for name, ev, i in log:
        if name == "a" and ev in ("run", "done"):
            (running.add if ev == "run" else running.discard)(i)
        elif name == "consumer" and running:
            during.append(i)
    assert during and len(_ran(log, "b")) > N // 2, log
    assert [i for name, _, i in log if name == "consumer"] == list(range(N))


def test_the_second_runner_works_during_the_comparison(qdq) -> None:
    """A slow comparison (4 runs long): the second runner runs the next sample meanwhile, within AHEAD."""
    log: list = []
    s = _samples(qdq, log)
    reached = 0
    for i, rec in s:
        rec.close()
        time.sleep(4 * RUN_S)
        started = max(j for _, ev, j in log if ev == "run")
        assert started <= i + 1 + s.AHEAD, (i, log)
        reached += started == min(N - 1, i + 1 + s.AHEAD)
    assert reached >= 2, log


def test_a_sample_the_second_runner_fails_runs_on_the_first_and_the_second_is_not_used_again(qdq) -> None:
    alone = _one_runner(qdq)
    log: list = []
    s = _samples(qdq, log, fail_b=tuple(range(N)))  # the second runner fails whatever sample it runs
    out = {i: _tensors(rec) for i, rec in s}
    assert out == dict(enumerate(alone))
    tried = [i for name, ev, i in log if name == "b" and ev == "run"]
    assert len(tried) == 1 and _ran(log, "b") == [] and s.helped == []  # one failure: not used again
    assert sorted(_ran(log, "a")) == list(range(N))  # its sample again on the first runner, and every other one
    assert ("b", "close", None) in log and _no_thread_left()


def test_a_failure_is_the_first_runners(qdq) -> None:
    log: list = []
    s = _samples(qdq, log, fail_a=(3,), fail_b=tuple(range(N)))
    seen = []
    with pytest.raises(RuntimeError, match=r"^a failed sample 3$"):
        for i, rec in s:
            seen.append(i)
            rec.close()
    assert seen == [0, 1, 2]  # the samples before the failing one, as one runner after the other gives them
    assert ("b", "close", None) in log and _no_thread_left()


def test_a_second_runner_exposing_other_tensors_is_not_used(qdq) -> None:
    alone = _one_runner(qdq)
    log: list = []

    def outputs_only() -> Traced:
        return _runner(qdq, "b", log, selection=Selection(include=("y",)))

    s = _samples(qdq, log, second=outputs_only)
    out = {i: _tensors(rec) for i, rec in s}
    assert out == dict(enumerate(alone)) and s.helped == [] and _ran(log, "b") == []
    assert _ran(log, "a") == list(range(N)) and ("b", "close", None) in log and _no_thread_left()


def test_an_early_stop_and_a_signal_join_and_close_the_second_runner(qdq, monkeypatch) -> None:
    log: list = []
    s = _samples(qdq, log)
    for i, rec in s:
        rec.close()
        if i == 1:
            break
    s.close()  # as compare_in_memory does after an early stop
    assert ("b", "close", None) in log and _no_thread_left()
    assert max(j for _, ev, j in log if ev == "run") <= 1 + 1 + s.AHEAD

    log.clear()
    monkeypatch.setattr(interrupt, "_SIGNALLED", [])
    s = _samples(qdq, log)
    seen = []
    with pytest.raises(interrupt.Signalled):
        for i, rec in s:
            seen.append(i)
            rec.close()
            interrupt._SIGNALLED.append(signal.SIGTERM)  # a SIGTERM during the comparison of sample 0
    assert seen == [0] and ("b", "close", None) in log and _no_thread_left()


def test_samples_run_in_the_order_given_each_once_with_the_bits_of_one_runner(qdq) -> None:
    """``order`` (``Tuner.order``: a search's hardest samples first): the records come in that order, each with its
    sample's index and bits, on one runner or two; an order that is not a permutation is refused."""
    alone = _one_runner(qdq)
    order = list(reversed(range(N)))
    for second in (None, "same"):
        log: list = []
        got = []
        for i, rec in _samples(qdq, log, second=second, order=order):
            got.append(i)
            assert _tensors(rec) == alone[i], i
            assert rec.records["sample"].tolist() == [i]
            rec.close()
        assert got == order
        assert sorted(_ran(log, "a") + _ran(log, "b")) == list(range(N))
    with pytest.raises(ValueError, match="not a permutation"):
        _samples(qdq, [], second=None, order=[0] * N)
