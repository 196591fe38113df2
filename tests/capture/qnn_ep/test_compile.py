"""Bounded QNN HTP compile and the compiled-context cache, on real emulated-HTP runs of OCR-like torch models.

* channels-last exposure (``capture/qnn_ep/plan.py``): the same integers as plain NCHW exposure, without the
  Transpose QNN adds per exposed conv tensor (the compile-time explosion of issue 18);
* dead tensors (an LSTM's unused ``Y_h`` / ``Y_c``) left out with their reason;
* the unexposable search: a refused tensor kept with its neighbour, channels-last exposure undone next to a
  refusal, and the probe cap saying what it did not probe;
* the context cache: a second ``ivq capture qnn`` loads the compiled graph (hit in backend_info, on the console,
  the same bits, the same partition / op trace / joined profile), a corrupted or foreign entry is ignored with
  a warning, and the key changes with everything that changes the compile;
* the compile phase in the progress output.

The PP-OCRv4-sized case (``ocr``, a compile that explodes when every conv tensor is exposed as NCHW) is under
``slow``; its timings are in ``bench/bench_qnn_compile.py`` (timings are never asserted in tests).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ivq_debug.capture.base import Selection, capture
from ivq_debug.dump import open_dump
from ivq_debug.qnn.quantize import quantize_for_qnn
from tests.support import ocr_models
from tests.support import qnn_models as models
from tests.support.qnn_models import FEED_SEED, needs_qnn

pytestmark = [pytest.mark.qnn, needs_qnn]


def _build(name: str, preset: str, folder: Path) -> dict[str, Any]:
    path, shape, sample = ocr_models.build(name, folder)
    qdq = quantize_for_qnn(path, folder / f"{name}.{preset}.onnx", ocr_models.calibration(shape),
                           preset=preset).model_path
    np.savez(folder / "sample.npz", **sample)
    return {"float": path, "qdq": qdq, "sample": sample, "npz": folder / "sample.npz", "dir": folder}


def _runner(model: Path, **kw: Any) -> Any:
    from ivq_debug.capture.qnn_ep.runner import QnnHtpRunner

    return QnnHtpRunner(model, selection=kw.pop("selection", Selection()), **kw)


def _raw(dump: Any) -> dict[str, bytes]:
    return {e.name: (dump.read_raw(e) if e.has_raw else dump.read(e.name)).tobytes() for e in dump.tensors()}


def _ops(info: dict[str, Any], label: str) -> int:
    return info["sessions"][label]["op_trace_summary"]["total_qnn_ops"]


def _ivq(args: list[str]) -> int:
    from ivq_debug.cli.main import main

    with pytest.raises(SystemExit) as ei:
        main([str(a) for a in args])
    return int(ei.value.code or 0)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``ocr-small`` (LCNetV3-like backbone + BiLSTM, 1x3x32x64) at a16w8, captured with and without the
    channels-last plan (no cache)."""
    d = tmp_path_factory.mktemp("ocr-small")
    m = _build("ocr-small", "a16w8", d)
    for label, nhwc in (("nhwc", True), ("nchw", False)):
        r = _runner(m["qdq"], channels_last=nhwc, qnn_cache=False)
        capture(r, [m["sample"]], d / f"{label}.h5", progress=None)
        m[label] = r.info
    return m


def test_channels_last_exposure_is_exact_without_transposes(small: dict[str, Any]) -> None:
    nhwc, nchw = small["nhwc"], small["nchw"]
    assert nhwc["exposed_tensors"] == nchw["exposed_tensors"] >= 60
    n_cl = nhwc["channels_last_exposure"]
    assert n_cl >= 0.75 * nhwc["exposed_tensors"]  # the conv backbone's tensors
    assert "channels_last_exposure" not in nchw
    # QNN adds one Transpose per exposed NCHW conv tensor; through the plan the graph is the plain one (+ a few)
    plain_ops = _ops(nhwc, "plain")
    assert _ops(nchw, "plain") == plain_ops
    assert _ops(nhwc, "capture") <= plain_ops + 4
    assert _ops(nchw, "capture") >= plain_ops + n_cl // 2
    with open_dump(small["dir"] / "nhwc.h5") as a, open_dump(small["dir"] / "nchw.h5") as b:
        ra, rb = _raw(a), _raw(b)
        assert set(ra) == set(rb) and len(ra) >= nhwc["exposed_tensors"]
        assert [k for k in ra if ra[k] != rb[k]] == []
        conv = [e for e in a.tensors() if e.op_type == "Conv"]
        assert conv and all(len(e.shape) == 4 for e in conv)  # stored NCHW, as the model computes them
    assert nhwc["exposure_check"] == nchw["exposure_check"] == {"bit_identical": True, "max_abs": 0.0}


def test_dead_lstm_states_are_unexposable(small: dict[str, Any]) -> None:
    from ivq_debug.capture.qnn_ep.plan import DEAD_REASON
    from ivq_debug.onnxgraph.load import load_model

    model = load_model(small["qdq"])
    lstm = next(n for n in model.graph.node if n.op_type == "LSTM")
    unexposable = small["nhwc"]["unexposable"]
    # the quantizer quantized Y_h and Y_c though nothing reads them: the deployed graph never computes them
    assert sorted(u["name"] for u in unexposable) == sorted(lstm.output[1:3])
    assert all(u["reason"] == DEAD_REASON and u["op_type"] == "LSTM" for u in unexposable)
    with open_dump(small["dir"] / "nhwc.h5") as d:
        names = {e.name for e in d.tensors()}
    assert lstm.output[0] in names and not names & set(lstm.output[1:3])


@pytest.fixture(scope="module")
def cached(small: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``ivq capture qnn`` of ocr-small twice into one cache folder (detailed profiling on both)."""
    d = tmp_path_factory.mktemp("cached")
    cache = d / "cache"
    out: dict[str, Any] = {"cache": cache, "dir": d}
    for label in ("miss", "hit"):
        code = _ivq(["capture", "qnn", small["qdq"], "--inputs", small["npz"], "-o", d / f"{label}.h5",
                     "--qnn-cache", cache, "--profiling", "detailed"])
        assert code == 0
        out[label] = d / f"{label}.h5"
    return out


def test_second_capture_hits_the_cache(cached: dict[str, Any]) -> None:
    with open_dump(cached["miss"]) as a, open_dump(cached["hit"]) as b:
        ia, ib = a.backend_info, b.backend_info
        assert ia["context_cache"]["misses"] == ["capture", "plain"] and ia["context_cache"]["hits"] == []
        assert ib["context_cache"]["hits"] == ["capture", "plain"] and ib["context_cache"]["misses"] == []
        assert ib["context_cache"]["compile_seconds_saved"] > 0 and ib["context_cache"]["warnings"] == []
        for label in ("capture", "plain"):
            miss, hit = ia["sessions"][label]["context_cache"], ib["sessions"][label]["context_cache"]
            assert hit["hit"] is True and hit["key"] == miss["key"] and Path(hit["folder"]).is_dir()
            assert hit["compile_seconds"] == miss["compile_seconds"]
        assert len({ib["sessions"][k]["context_cache"]["key"] for k in ("capture", "plain")}) == 2
        # the same bits, and what a load cannot give back restored from the entry
        assert _raw(a) == _raw(b)
        assert ib["exposure_check"] == {"bit_identical": True, "max_abs": 0.0}
        assert ib["target_verified"] is True and ib["compiled_target"] == ia["compiled_target"]
        assert b.meta("partition") == a.meta("partition") and b.meta("partition")["all_on_qnn"] is True
        assert b.meta("qnn_op_trace") == a.meta("qnn_op_trace")
        pa, pb = a.table("profiling"), b.table("profiling")
        ops_a, ops_b = pa[pa["is_op"].astype(bool)], pb[pb["is_op"].astype(bool)]
        assert len(ops_a) == len(ops_b) > 20
        assert list(ops_a["dump_tensors"].map(list)) == list(ops_b["dump_tensors"].map(list))  # joined alike
        assert list(ops_a["run"]) == list(ops_b["run"]) and set(ops_b["run"]) == {0}  # one sample, one run
        assert set(pb.loc[pb["phase"] == "init", "identifier"]) >= {"QNN (load binary) time"}
        assert sum(bool(list(t)) for t in ops_b["dump_tensors"]) >= 20


def test_cli_reports_the_hit_and_no_cache_compiles(small: dict[str, Any], cached: dict[str, Any], capfd: Any,
                                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("IVQ_NO_PROGRESS", raising=False)
    capfd.readouterr()
    assert _ivq(["capture", "qnn", small["qdq"], "--inputs", small["npz"], "-o", tmp_path / "again.h5",
                 "--qnn-cache", cached["cache"]]) == 0
    err = " ".join(capfd.readouterr().err.split())
    assert "QNN context cache hit: 2 of 2 QNN HTP session(s) loaded instead of compiled" in err
    assert _ivq(["capture", "qnn", small["qdq"], "--inputs", small["npz"], "-o", tmp_path / "fresh.h5",
                 "--no-qnn-cache"]) == 0
    assert "cache hit" not in capfd.readouterr().err
    with open_dump(tmp_path / "fresh.h5") as d, open_dump(cached["miss"]) as ref:
        assert "context_cache" not in d.backend_info
        assert all("context_cache" not in s for s in d.backend_info["sessions"].values())
        assert _raw(d) == _raw(ref)


def _entry(cache: Path, dump: Path, label: str) -> Path:
    with open_dump(dump) as d:
        return Path(d.backend_info["sessions"][label]["context_cache"]["folder"])


def test_bad_cache_entries_are_ignored_with_a_warning(small: dict[str, Any], cached: dict[str, Any],
                                                     tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(cached["cache"], cache)
    cap = cache / _entry(cached["cache"], cached["miss"], "capture").name
    plain = cache / _entry(cached["cache"], cached["miss"], "plain").name
    b = cap / "ctx_qnn.bin"  # one flipped byte in the compiled graph
    data = bytearray(b.read_bytes())
    data[len(data) // 2] ^= 0xFF
    b.write_bytes(bytes(data))
    meta = json.loads((plain / "meta.json").read_text())  # an entry recorded for another target
    meta["material"]["htp_arch"] = "68"
    (plain / "meta.json").write_text(json.dumps(meta))
    r = _runner(small["qdq"], qnn_cache=cache)
    capture(r, [small["sample"]], tmp_path / "out.h5", progress=None)
    info = r.info["context_cache"]
    assert info["misses"] == ["capture", "plain"] and info["hits"] == []
    warned = sorted(info["warnings"])
    assert len(warned) == 2
    assert any(str(cap) in w and "does not match its recorded size / SHA-256" in w for w in warned)
    assert any(str(plain) in w and "key material differs" in w for w in warned)
    with open_dump(tmp_path / "out.h5") as d, open_dump(cached["miss"]) as ref:
        assert _raw(d) == _raw(ref)
    # both entries were compiled afresh and published again: the next capture loads them
    r2 = _runner(small["qdq"], qnn_cache=cache)
    capture(r2, [small["sample"]], tmp_path / "out2.h5", progress=None)
    assert r2.info["context_cache"]["hits"] == ["capture", "plain"] and r2.info["context_cache"]["warnings"] == []


def test_cache_key_holds_what_changes_the_compile(qnn_models: dict[str, Path]) -> None:
    import onnxruntime as ort

    from ivq_debug.capture.qnn_ep.cache import key_of
    from ivq_debug.capture.qnn_ep.session import QnnSessionConfig, cache_material

    model = str(qnn_models["block.a8w8"])
    r = _runner(qnn_models["block.a8w8"], qnn_cache=False)

    def key(m: Any = model, cfg: QnnSessionConfig | None = None, level: str = "ORT_DISABLE_ALL") -> str:
        so = ort.SessionOptions()
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        return key_of(cache_material(m, cfg or QnnSessionConfig(), so, r.model))

    base = key()
    changed = {
        "htp_arch": key(cfg=QnnSessionConfig(htp_arch="75")),
        "soc_model": key(cfg=QnnSessionConfig(soc_model="57")),
        "cpu fallback": key(cfg=QnnSessionConfig(allow_cpu_fallback=True)),
        "provider option": key(cfg=QnnSessionConfig(provider_options={"htp_graph_finalization_optimization_mode": "1"})),
        "optimization level": key(level="ORT_ENABLE_ALL"),
        "exposed tensors": key(m=r.ort.model_with_outputs([r.sites[0].output])),
    }
    assert all(k != base for k in changed.values()) and len(set(changed.values())) == len(changed)
    same = {
        "profiling": key(cfg=QnnSessionConfig(profiling_level="detailed", profiling_file_path="/tmp/p.csv")),
        "op trace dir": key(cfg=QnnSessionConfig(op_trace_dir="/tmp/trace")),
        "performance mode": key(cfg=QnnSessionConfig(htp_performance_mode="burst")),
        "log level": key(cfg=QnnSessionConfig(log_severity_level=0)),
        "the same graph as bytes": key(m=Path(model).read_bytes()),
    }
    assert set(same.values()) == {base}


def test_probe_cap_says_what_it_did_not_probe(qnn_models: dict[str, Path], capfd: Any, tmp_path: Path) -> None:
    feeds = models.block_feeds(FEED_SEED)[0]
    r = _runner(qnn_models["block.a8w8"], qnn_cache=False, max_probes=0)
    capfd.readouterr()
    capture(r, [feeds], tmp_path / "capped.h5", progress=None)
    err = " ".join(capfd.readouterr().err.split())
    un = {u["name"]: u["reason"] for u in r.info["unexposable"]}
    # kT (a Transpose QNN fuses into the score MatMul) is refused; with no probe allowed its neighbours next to
    # the refused nodes are left out too, each said to be unprobed, and the capture still completes
    assert "kT" in un and all("not probed" in why for why in un.values())
    assert "warning: not exposing" in err and "not probed" in err and "kT" in err
    assert r.exposure_check["bit_identical"] is True
    full = _runner(qnn_models["block.a8w8"], qnn_cache=False)
    capture(full, [feeds], tmp_path / "full.h5", progress=None)
    assert [u["name"] for u in full.info["unexposable"]] == ["kT"]  # with probes: only the culprit
    assert set(un) >= {"kT"} and len(full.sites) > len(r.sites)


def test_exposure_search_is_remembered_next_to_the_contexts(qnn_models: dict[str, Path], capfd: Any,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe compiles that find kT (refused by QNN) run once per model, target and options: a second capture
    with the same cache applies the remembered outcome (no probe, one short note, the same bits); another target
    or a damaged memory searches afresh."""
    from ivq_debug.capture.qnn_ep.cache import EXPOSURE_DIR

    monkeypatch.delenv("IVQ_NO_PROGRESS", raising=False)
    feeds = models.block_feeds(FEED_SEED)[0]
    cache = tmp_path / "cache"
    first = _runner(qnn_models["block.a8w8"], qnn_cache=cache, profiling_level="detailed",  # as the demo captures
                    profiling_path=tmp_path / "p.csv")
    capfd.readouterr()
    capture(first, [feeds], tmp_path / "first.h5", progress=None)
    err1 = capfd.readouterr().err
    assert first._probes.used >= 2 and [u["name"] for u in first.info["unexposable"]] == ["kT"]
    assert "looking for the tensors it will not expose" in " ".join(err1.split())
    memo = list((cache / EXPOSURE_DIR).glob("*.json"))
    assert len(memo) == 1 and json.loads(memo[0].read_text())["probes"] == first._probes.used

    second = _runner(qnn_models["block.a8w8"], qnn_cache=cache)
    capture(second, [feeds], tmp_path / "second.h5", progress=None)
    err2 = capfd.readouterr().err
    assert second._probes.used == 0 and second.info["unexposable"] == first.info["unexposable"]
    assert second.info["exposure_memory"]["probes_saved"] == first._probes.used
    one = " ".join(err2.split())
    assert "refused" not in err2 and "warning" not in err2 and "QNN context cache hit" in one
    assert "1 tensor(s) QNN refuses to expose left out as an earlier capture found" in one
    # one message (the console may wrap it): the cache hit and the memory
    assert len([ln for ln in err2.splitlines() if ln.startswith(("QNN", "warning", "not exposing"))]) == 1
    assert second.info["context_cache"]["misses"] == []  # every session loaded: nothing compiled at all
    with open_dump(tmp_path / "first.h5") as a, open_dump(tmp_path / "second.h5") as b:
        assert _raw(a) == _raw(b)

    memo[0].write_text('{"format": 1, "material": {}, "unexposable": "x"}')  # damaged: ignored, searched again
    third = _runner(qnn_models["block.a8w8"], qnn_cache=cache)
    capture(third, [feeds], tmp_path / "third.h5", progress=None)
    err3 = " ".join(capfd.readouterr().err.split())
    assert "ignoring QNN exposure memory" in err3 and third._probes.used == first._probes.used
    assert json.loads(memo[0].read_text())["unexposable"][0]["name"] == "kT"  # and remembered again
    other = _runner(qnn_models["block.a8w8"], qnn_cache=cache, max_outputs_per_run=4)  # another request
    assert other._exposure_key() != third._exposure_key()


def test_refused_group_keeps_pairs_together_and_undoes_channels_last(tmp_path: Path, capfd: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """ViT (transformers' ViTModel, 1 layer) in capture groups of 17: a boundary separates the attention's Kᵀ
    Transpose from the Mul reading it (refused), and the patch embedding's conv exposed channels-last meets a
    layout transpose QNN cannot fold (refused); both are resolved without leaving a tensor out."""
    monkeypatch.delenv("IVQ_NO_PROGRESS", raising=False)
    m = _build("vit-tiny", "a8w8", tmp_path)
    whole = _runner(m["qdq"], qnn_cache=tmp_path / "cache")
    capture(whole, [m["sample"]], tmp_path / "whole.h5", progress=None)
    assert "unexposable" not in whole.info
    capfd.readouterr()
    r = _runner(m["qdq"], qnn_cache=tmp_path / "cache", max_outputs_per_run=17)
    capture(r, [m["sample"]], tmp_path / "groups.h5", progress=None)
    err = " ".join(capfd.readouterr().err.split())  # (the console wraps long lines)
    assert "unexposable" not in r.info and r.info["exposed_tensors"] == whole.info["exposed_tensors"]
    assert "Transpose_2_output_0 without" in err and "Mul_1_output_0; keeping them in one session" in err
    assert "patch_embeddings/projection/Conv_output_0 in the NCHW layout instead" in err
    assert r._probes.used == 0  # no throw-away compile was needed
    with open_dump(tmp_path / "whole.h5") as a, open_dump(tmp_path / "groups.h5") as b:
        assert _raw(a) == _raw(b)
        orders = [e.order for e in b.tensors()]
        assert orders == sorted(orders)  # the dump keeps the topological order


def test_compile_phase_is_shown_off_a_terminal(qnn_models: dict[str, Path], capfd: Any,
                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import ivq_debug.console as con

    monkeypatch.delenv("IVQ_NO_PROGRESS", raising=False)
    monkeypatch.setattr(con, "PHASE_NOTE_S", 0.0)
    r = _runner(qnn_models["block.a8w8"], qnn_cache=False)
    capfd.readouterr()
    capture(r, models.block_feeds(FEED_SEED), tmp_path / "phase.h5", progress=None)
    err = " ".join(capfd.readouterr().err.split())
    n = r.info["exposed_tensors"] + 1  # (kT was still in the first attempt)
    assert f"compiling QNN HTP graph: capture 1/2, {n} tensors: still running" in err
    assert f"compiling QNN HTP graph: capture 1/2, {n - 1} tensors: done in" in err
    assert "compiling QNN HTP graph: model outputs only" in err


@pytest.mark.slow
def test_ocr_recognizer_capture_acceptance(tmp_path: Path, capfd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 18 on the PP-OCRv4-like recognizer (1x3x48x320, a16w8): every tensor exposed without one QNN op per
    conv tensor (the compile that exploded: ``bench/bench_qnn_compile.py --models ocr`` times it), the same
    integers as plain NCHW exposure, and a second ``ivq capture qnn`` that loads both sessions from the cache."""
    monkeypatch.delenv("IVQ_NO_PROGRESS", raising=False)
    m = _build("ocr", "a16w8", tmp_path)
    cache = tmp_path / "cache"
    for label in ("first", "second"):
        assert _ivq(["capture", "qnn", m["qdq"], "--inputs", m["npz"], "-o", tmp_path / f"{label}.h5",
                     "--qnn-cache", cache]) == 0
    err = " ".join(capfd.readouterr().err.split())
    assert "QNN context cache hit: 2 of 2 QNN HTP session(s) loaded instead of compiled" in err
    nchw = _runner(m["qdq"], channels_last=False, qnn_cache=False)
    capture(nchw, [m["sample"]], tmp_path / "nchw.h5", progress=None)
    with open_dump(tmp_path / "first.h5") as a, open_dump(tmp_path / "second.h5") as b, \
            open_dump(tmp_path / "nchw.h5") as c:
        ia, ib = a.backend_info, b.backend_info
        assert "unexposable" not in ia and ia["exposed_tensors"] >= 300
        assert ia["channels_last_exposure"] >= 200
        plain_ops = _ops(ia, "plain")
        assert _ops(ia, "capture") <= plain_ops + 8  # (an NCHW capture session adds one Transpose per conv tensor)
        assert _ops(nchw.info, "capture") >= plain_ops + 200
        assert ia["exposure_check"] == {"bit_identical": True, "max_abs": 0.0}
        assert ib["context_cache"]["hits"] == ["capture", "plain"] and ib["context_cache"]["misses"] == []
        assert _raw(a) == _raw(b) == _raw(c)
