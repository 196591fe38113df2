"""A dump listed from two threads (commit 7e01307): :meth:`~ivq_debug.dump.reader.Dump.tensors` builds its index once
and publishes it whole, so a thread listing the dump while another builds the index gets every entry (the index used
to be assigned empty, then filled: a second thread could list nothing or part of a record; the diagnose's comparison
thread and the replay list the same dumps).

Deterministic, on a real dump read by h5py: the first thread's listing is traced (``sys.settrace``), and at every
line the reader runs for it once the listing calls into the reader (reading the entries, the sort's key), the first
thread waits while a second thread lists the same dump every way (all tensors, the inputs, each record); every list
must be whole."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest

import ivq_debug.dump.reader as reader
from ivq_debug.dump import DumpWriter, open_dump
from ivq_debug.dump.reader import Dump

LISTINGS: dict[str, Callable[[Dump], list[Any]]] = {
    "tensors": lambda d: d.tensors(),
    "inputs": lambda d: d.tensors(kind="input"),
    "sample 0": lambda d: d.tensors((0, "prefill", 0)),
    "sample 1": lambda d: d.tensors((1, "prefill", 0)),
}


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("race") / "two.h5"
    with DumpWriter(p, backend="x") as w:
        for sample in range(2):
            w.begin_record(sample=sample, part="prefill", step=0)
            w.add_input("x", rng.standard_normal((1, 8)).astype(np.float32))
            for i in range(6):
                w.add_tensor(f"/layer{i}/out", rng.standard_normal((1, 8)).astype(np.float32), op_type="Relu")
    return p


def _keys(entries: list[Any]) -> list[tuple[str, str, str]]:
    return [(e.rid, e.kind, e.name) for e in entries]


def _listed_at_every_line(path: Path, first: str, read_entries: bool) -> tuple[int, set[str]]:
    """List a fresh :class:`Dump` of ``path`` in this thread (``LISTINGS[first]``), paused at every line the reader
    runs for it once the listing calls into the reader; at each pause another thread lists the same dump every way
    (:data:`LISTINGS`). Returns the number of pauses and what the other thread found not whole."""
    with open_dump(path) as d:
        want = {k: _keys(f(d)) for k, f in LISTINGS.items()}
    d = open_dump(path)
    if read_entries:
        assert len(d.entries) == 14  # the entries read before: the sort's key is the listing's only call
    pauses, wrong, started = 0, set(), False

    def other() -> None:
        for k, f in LISTINGS.items():
            got = _keys(f(d))
            if got != want[k]:
                wrong.add(f"{k}: {len(got)} of {len(want[k])} entries")

    def line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal pauses
        if event == "line" and started:
            pauses += 1
            t = threading.Thread(target=other)  # (untraced: sys.settrace is this thread's)
            t.start()
            t.join()
        return line

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal started
        if frame.f_code.co_filename != reader.__file__:
            return None
        started = started or frame.f_code.co_name != "tensors"  # a call beneath the listing
        return line

    old = sys.gettrace()
    sys.settrace(call)
    try:
        mine = _keys(LISTINGS[first](d))
    finally:
        sys.settrace(old)
        d.close()
    assert mine == want[first]
    return pauses, wrong


@pytest.mark.parametrize("read_entries", [False, True], ids=["entries-unread", "entries-read"])
@pytest.mark.parametrize("first", ["tensors", "inputs"])
def test_a_dump_listed_while_another_thread_builds_its_index_is_listed_whole(dump: Path, first: str,
                                                                            read_entries: bool) -> None:
    pauses, wrong = _listed_at_every_line(dump, first, read_entries)
    assert pauses >= 14  # at least one pause per entry sorted (the key of each) while the index is built
    assert not wrong, sorted(wrong)  # (before 7e01307: "sample 0: 0 of 6 entries", "sample 0: 1 of 6 entries", …)
