"""The replay's work beside the comparison (``docs/scale.md``, sixth pass), on a real ViT (transformers' ViTModel
quantized with ORT's QNN flow, whose ``gemm_*_reshape_arg*`` tensors the reference names only through the
alignment's ``reshape`` pairs): the replay starts on the pairs it expects and checks them against the alignment
(replaying again on it when one differs), and the shadow model's session is made while its feeds are read. Every
document is the one of the replay given the finished comparison, to the bit."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

import ivq_debug as ivq
from ivq_debug.capture.onnxrt.runner import CpuSessions
from ivq_debug.comparator import comparison
from ivq_debug.diagnose import refs
from ivq_debug.diagnose import replay as replay_mod
from tests.support import vit


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> dict[str, Any]:
    out: dict[str, Any] = dict(vit.models(tmp_path_factory))
    out["test"] = vit.cpu_qdq(out["act"], [7, 8], tmp_path_factory.mktemp("overlap") / "act.h5")
    return out


@pytest.fixture(scope="module")
def sequential(m) -> dict[str, Any]:
    """The document of the replay given the comparison made first (no thread, no guess)."""
    cmp = ivq.compare(m["ref"], m["test"], diagnose=False, progress=False)
    return _timeless(replay_mod.replay(m["act"], m["ref"], cumulative=cmp, progress=False).to_json())


def _timeless(doc: Any) -> Any:
    """A document as JSON text would hold it, without its wall times (``seconds`` at any depth)."""
    def strip(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k != "seconds"}
        return [strip(v) for v in d] if isinstance(d, list) else d
    return strip(json.loads(json.dumps(doc)))


def _replayed(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The units of a document without the effect columns (a replay without the effect runs leaves them NaN)."""
    return [{k: v for k, v in u.items() if not k.startswith("effect_")} for u in doc["units"]]


def _batches(monkeypatch) -> list[int]:
    """Count the replay's batches run (a spy: each calls the real one)."""
    calls: list[int] = []
    real = replay_mod.replay_batch
    monkeypatch.setattr(replay_mod, "replay_batch", lambda ctx, b: calls.append(len(b)) or real(ctx, b))
    return calls


def test_the_replay_runs_before_the_alignment_ends_with_the_sequential_document(m, sequential, monkeypatch) -> None:
    """The alignment is held until the replay's batch starts: before, the replay waited for the alignment's pairs
    (the reshape-matched units), so it never started and the wait timed out."""
    batch_started = threading.Event()
    waited: list[bool] = []
    real_align, real_batch = comparison.align, replay_mod.replay_batch

    def held_align(*a: Any, **k: Any) -> Any:
        waited.append(batch_started.wait(20))
        return real_align(*a, **k)

    calls: list[int] = []
    monkeypatch.setattr(comparison, "align", held_align)
    monkeypatch.setattr(replay_mod, "replay_batch",
                        lambda ctx, b: batch_started.set() or calls.append(len(b)) or real_batch(ctx, b))
    r = ivq.diagnose(m["ref"], m["test"], m["act"], progress=False)
    assert waited == [True] and len(calls) == 1  # the guess held: one replay
    doc = _timeless(r.to_json())
    assert sum(u["ref_match"] == "alignment:reshape" for u in doc["units"]) >= 4
    assert doc == sequential


def test_a_wrong_guess_is_found_and_the_replay_runs_again_on_the_alignment(m, sequential, monkeypatch) -> None:
    """Injected fault: the guessed pairs give each reshape-matched tensor another one's reference. The check against
    the alignment finds it, the batch runs again on the alignment's pairs, and the document is the sequential one."""
    real = refs.guessed_pairs

    def shifted(by_name: dict[str, Any], aliases: dict[str, list[str]]) -> dict[str, Any]:
        got = real(by_name, aliases)
        names, vals = list(got), list(got.values())
        return dict(zip(names, vals[1:] + vals[:1], strict=True))

    monkeypatch.setattr(refs, "guessed_pairs", shifted)
    calls = _batches(monkeypatch)
    r = ivq.diagnose(m["ref"], m["test"], m["act"], progress=False)
    assert len(calls) == 2  # on the guess, then on the alignment
    assert _timeless(r.to_json()) == sequential


def test_the_shadow_session_is_made_while_its_feeds_are_read(m, sequential, monkeypatch) -> None:
    """The shadow model's session is made in a thread while the replay reads the first record's reference values
    (before, in the main thread after them); the sessions counted and the document are the sequential ones."""
    threads: list[str] = []
    real = CpuSessions.create

    def spy(self: Any, *a: Any, **k: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(self, *a, **k)

    monkeypatch.setattr(CpuSessions, "create", spy)
    cmp = ivq.compare(m["ref"], m["test"], diagnose=False, progress=False)
    r = replay_mod.replay(m["act"], m["ref"], cumulative=cmp, progress=False, lift=False)
    assert len(threads) == 1 and threads[0].startswith("ivq-session") and r.sessions == 1
    assert _replayed(_timeless(r.to_json())) == _replayed(sequential)


def test_a_session_made_for_other_feeds_is_closed_uncounted(m, sequential, monkeypatch) -> None:
    """Injected fault: the early session is typed for float64 feeds the reads do not give. The replay makes the
    right one as before, closes the other, counts one session and gives the sequential document."""
    import numpy as np

    real = refs.RefIndex.layout
    monkeypatch.setattr(refs.RefIndex, "layout",
                        lambda self, x: None if real(self, x) is None else np.broadcast_to(np.empty((), np.float64),
                                                                                           real(self, x).shape))
    made: list[str] = []
    real_create = CpuSessions.create
    monkeypatch.setattr(CpuSessions, "create",
                        lambda self, *a, **k: made.append(threading.current_thread().name) or real_create(self, *a, **k))
    cmp = ivq.compare(m["ref"], m["test"], diagnose=False, progress=False)
    r = replay_mod.replay(m["act"], m["ref"], cumulative=cmp, progress=False, lift=False)
    assert len(made) == 2 and sum(t.startswith("ivq-session") for t in made) == 1
    assert r.sessions == sequential["sessions"] == 1
    assert _replayed(_timeless(r.to_json())) == _replayed(sequential)
