"""``ivq.diagnose`` and ``ivq diagnose`` (issue 27) on a real ViT (transformers' ViTModel quantized with ORT's QNN
flow, an injected activation-scale fault): each model file parsed once and every derived model handed to ONNX
Runtime in memory, the input contract (exit 6), the CLI and the API giving one document, and the session flags
reaching the QNN replay."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import ivq_debug as ivq
from ivq_debug import api
from ivq_debug.cli.main import build_parser
from ivq_debug.cli.sessions import session_options
from ivq_debug.errors import ContractError
from tests.support import vit
from tests.support.cli import ivq_cli
from tests.support.parses import counting
from tests.support.qnn_models import HAVE_QNN

PACKAGE = Path(__file__).resolve().parent.parent / "ivq_debug"


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> dict[str, Any]:
    out: dict[str, Any] = dict(vit.models(tmp_path_factory))
    d = tmp_path_factory.mktemp("api")
    out["test"] = vit.cpu_qdq(out["act"], [7, 8], d / "act.h5")
    out["other"] = vit.cpu_qdq(out["act"], [9, 8], d / "other.h5")  # another first image: the contract is broken
    return out


@pytest.mark.parametrize("backend", ["cpu", pytest.param("qnn", marks=pytest.mark.skipif(
    not HAVE_QNN, reason="onnxruntime-qnn is not installed"))])
def test_cli_parses_each_model_file_once_and_writes_no_model(m, tmp_path: Path, backend: str) -> None:
    out = tmp_path / "r.json"
    forks: list[Any] = []
    fork = api.fork_call
    with counting() as c, pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "fork_call", lambda fn: forks.append(fork(fn)) or forks[-1])
        mp.setattr(api.threading, "active_count", lambda: 1)  # as in the `ivq` process (tests may leave threads)
        code = ivq_cli("diagnose", m["ref"], m["test"], "--model", m["act"], "--float-model", m["float"],
                       "--backend", backend, "--json", out)
    assert code == 1  # the injected fault breaks the budget
    # on the exact CPU path the comparison ran in a forked child (ivq_debug/forked.py), reaped once done; the
    # replay on another backend compares first, in this process
    assert len(forks) == (1 if backend == "cpu" else 0)
    for f in forks:
        with pytest.raises(ChildProcessError):
            os.waitpid(f.pid, os.WNOHANG)
    doc = json.loads(out.read_text())
    head = doc["findings"][0]
    assert head["kind"] == "introduced_error" and head["where"]["node"] == vit.ACT_NODE
    assert doc["backend"] == ("onnxruntime-cpu-qdq" if backend == "cpu" else "qnn-htp")
    # the QDQ model and the float model: one parse each (measured before issue 27: 2 each, plus one parse of
    # every temporary replay / lift model written to disk)
    assert dict(c["onnx_parse"]) == {Path(m["act"]).name: 1, Path(m["float"]).name: 1}
    # every session (the shadow batch, the backend batch, each effect run) from a model serialized in memory
    assert set(c["ort_session"]) == {"<bytes>"}
    assert sum(c["ort_session"].values()) >= (2 if backend == "cpu" else 3)
    assert not c["onnx_save"]


def test_no_model_is_written_to_disk_in_diagnose() -> None:
    hits = [f"{p.name}:{i}" for p in sorted((PACKAGE / "diagnose").glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\bmkstemp\b|onnx\.save|save_model\(|NamedTemporaryFile", line)]
    assert hits == []


def test_dumps_fed_different_inputs_exit_6(m, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    assert ivq_cli("diagnose", m["ref"], m["other"], "--model", m["act"], "--json", tmp_path / "r.json") == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "x" in err[0] and "input" in err[0]
    assert not (tmp_path / "r.json").exists()
    assert ivq_cli("diff", m["ref"], m["other"]) == 6  # as ivq-diff
    with pytest.raises(ContractError):
        ivq.diagnose(m["ref"], m["other"], m["act"], lift=False, progress=False)
    # allowed: diagnosed anyway (the fault is still the worst unit)
    assert ivq_cli("diagnose", m["ref"], m["other"], "--model", m["act"], "--allow-input-mismatch", "--no-lift",
                   "--json", tmp_path / "r.json") == 1
    assert json.loads((tmp_path / "r.json").read_text())["findings"][0]["where"]["node"] == vit.ACT_NODE


def _timeless(doc: Any) -> Any:
    """A JSON document without its wall times (``seconds`` at any depth)."""
    if isinstance(doc, dict):
        return {k: _timeless(v) for k, v in doc.items() if k != "seconds"}
    return [_timeless(v) for v in doc] if isinstance(doc, list) else doc


def test_the_api_gives_the_cli_document(m, tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    assert ivq_cli("diagnose", m["ref"], m["test"], "--model", m["act"], "--record", "all", "--attribution", "iso",
                   "--json", out) == 1
    r = ivq.diagnose(m["ref"], m["test"], m["act"], record="all", attribution="iso", progress=False)
    cli, notebook = _timeless(json.loads(out.read_text())), _timeless(json.loads(json.dumps(r.to_json())))
    assert cli == notebook and len(notebook["records"]) == 2
    assert r.first_breaking["node"] == vit.ACT_NODE


# slow: four diagnoses of the ViT, 48 s at load ~3 (the default suite stays within 6 min)
@pytest.mark.slow
def test_the_comparison_beside_the_replay_gives_the_sequential_replay(m, monkeypatch) -> None:
    """On the exact CPU path ``ivq.diagnose`` computes the comparison beside the replay, which fills the cumulative
    columns after its effect runs: in a forked child when this process runs no other thread, else in a thread. The
    document is the one of the comparison made first, to the bit, either way."""
    from ivq_debug.diagnose.replay import replay

    seq = replay(m["act"], m["ref"], record="all", progress=False,
                 cumulative=ivq.compare(m["ref"], m["test"], diagnose=False, progress=False))
    want = _timeless(json.loads(json.dumps(seq.to_json())))
    forks: list[Any] = []
    fork = api.fork_call
    monkeypatch.setattr(api, "fork_call", lambda fn: forks.append(fork(fn)) or forks[-1])
    monkeypatch.setattr(api.threading, "active_count", lambda: 1)  # as in the `ivq` process (tests may leave threads)
    r = ivq.diagnose(m["ref"], m["test"], m["act"], record="all", progress=False)
    assert len(forks) == 1 and r.effects["runs"] >= 2
    assert r.table["cum_sqnr_db"].notna().sum() > 50 and r.table["inherited_share"].notna().sum() > 50
    assert _timeless(json.loads(json.dumps(r.to_json()))) == want
    # the child guessed other records than the replayed ones: it compares again for them (its pairs for the guess
    # are left), the same document
    monkeypatch.setattr(api, "_guessed", lambda ref_d, test_d, record: set(sorted(ref_d.record_keys())[:1]))
    r = ivq.diagnose(m["ref"], m["test"], m["act"], record="all", progress=False)
    assert len(forks) == 2 and _timeless(json.loads(json.dumps(r.to_json()))) == want
    threads = []
    start = api._PendingComparison.start
    monkeypatch.setattr(api._PendingComparison, "start", lambda *a, **k: threads.append(1) or start(*a, **k))
    monkeypatch.setattr(api._ForkedComparison, "start", classmethod(lambda cls, *a: None))  # as with other threads
    r = ivq.diagnose(m["ref"], m["test"], m["act"], record="all", progress=False)
    assert threads == [1] and len(forks) == 2
    assert _timeless(json.loads(json.dumps(r.to_json()))) == want


def test_a_comparison_without_the_fit_gets_the_same_fit_later(m) -> None:
    """``ivq diagnose`` compares without the encoding fit and fills it only when its replay reads it
    (``Comparison.fit_encodings``): the table is then the one compared with the fit, to the bit."""
    import pandas as pd

    from ivq_debug.comparator.comparison import FIT_COLUMNS

    full = ivq.compare(m["ref"], m["test"], diagnose=False, progress=False)
    later = ivq.compare(m["ref"], m["test"], diagnose=False, progress=False, fit=False)
    fit = list(FIT_COLUMNS)
    assert later.table[fit].isna().all().all() and full.table["grid_snr_db"].notna().sum() > 50
    assert later.table.drop(columns=fit).equals(full.table.drop(columns=fit))
    later.fit_encodings()
    pd.testing.assert_frame_equal(later.table, full.table, check_exact=True)
    assert later.unfitted is None


def test_the_replay_links_to_the_alignment_only_for_tensors_the_reference_does_not_name(m) -> None:
    """A replay's reference index reads the comparison's alignment the first time a tensor is not in the reference
    by name, so ``ivq diagnose`` starts replaying before the alignment ends; every source is the one of the index
    built with the pairs."""
    from ivq_debug.diagnose.refs import RefIndex, pairs_for
    from ivq_debug.diagnose.units import lineage_aliases, model_units
    from ivq_debug.dump import open_dump
    from ivq_debug.onnxgraph.load import load

    qdq, ref = load(m["act"]), open_dump(m["ref"])
    cmp = ivq.compare(ref, m["test"], diagnose=False, progress=False, fit=False)
    rid = ref.records["rid"].iloc[0]
    aliases = lineage_aliases(qdq)
    links: list[int] = []
    lazy = RefIndex(ref, rid, {}, aliases, shapes=qdq.value_shapes,
                    link=lambda: links.append(1) or pairs_for(cmp, rid))
    pairs, test, test_rid = pairs_for(cmp, rid)
    eager = RefIndex(ref, rid, pairs, aliases, test, test_rid, qdq.value_shapes)
    names = list(dict.fromkeys(x for u in model_units(qdq) for x in [*u.inputs, u.output]))
    named = [x for x in names if x in lazy.by_name]
    assert len(named) > 50 and all(lazy.source(x).how == "name" for x in named) and links == []
    for x in names:
        a, b = lazy.source(x), eager.source(x)
        assert (a is None) == (b is None) and (a is None or (a.entry, a.how) == (b.entry, b.how))
        if a is not None:
            assert lazy.read(x).tobytes() == eager.read(x).tobytes()
    assert links == [1] and lazy.rejected == eager.rejected
    assert any(lazy.source(x).how.startswith("alignment:") for x in names if lazy.source(x) is not None)


def test_session_flags_reach_the_replay_runner() -> None:
    p = build_parser()
    args = p.parse_args(["diagnose", "r.h5", "t.h5", "--model", "q.onnx", "--backend", "qnn", "--optimization",
                         "all", "--soc-model", "60", "--fast-compile"])
    f = api.replay_factory(args.backend, **session_options(args, api.REPLAY_BACKENDS[args.backend]))
    assert f.args == ("qnn",) and f.keywords == {"optimization": "all", "soc_model": "60", "fast_compile": True}
    args = p.parse_args(["diagnose", "r.h5", "t.h5", "--model", "q.onnx"])
    assert api.replay_factory(args.backend, **session_options(args, "onnx")) is None  # the exact CPU path
    args = p.parse_args(["diagnose", "r.h5", "t.h5", "--model", "q.onnx", "--session-option",
                         "session.x64quantprecision=1"])
    f = api.replay_factory(args.backend, **session_options(args, "onnx"))
    assert f.keywords == {"session_config": {"session.x64quantprecision": "1"}}


@pytest.mark.skipif(not HAVE_QNN, reason="onnxruntime-qnn is not installed")
def test_optimization_reaches_the_qnn_replay(m) -> None:
    r = ivq.diagnose(m["ref"], m["test"], m["act"], backend="qnn", optimization="all", lift=False, progress=False)
    assert r.backend == "qnn-htp" and r.info["graph_optimization_level"] == "ORT_ENABLE_ALL"
    assert r.first_breaking["node"] == vit.ACT_NODE
