"""A tune trial is a partial capture (issue 33): each evaluation sample runs once and is compared in memory with the
cached reference, no dump written, and its figures are those of a capture to a file compared afterwards, to the bit
(on ORT CPU-QDQ and on the emulated QNN HTP); the calibration runs once per quantizer setting and the written model
is the same bytes with or without that cache."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ivq_debug.capture.base import Selection, make_runner
from ivq_debug.dump import open_dump
from ivq_debug.dump.memory import MemorySink
from ivq_debug.errors import UsageError
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.qnn.encodings import to_ort_overrides
from ivq_debug.qnn.quantize import calibration_cache_key, quantize_for_qnn
from ivq_debug.tune.suggest import Suggestion, read_overrides
from ivq_debug.tune.sweep import sweep
from ivq_debug.tune.verify import CALIBRATION_CACHE, Tuner, one_trial, prune_workdir
from tests.support.lever_models import build_two_causes, two_causes_sample, two_causes_trial_inputs
from tests.support.qnn_models import needs_qnn


def mean_abs(outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """A task metric on the model outputs (module level: the tuner keys it by name)."""
    return {"neg_mean_abs": -float(np.mean([np.abs(o["y"]).mean() for o in outputs]))}


@pytest.fixture(scope="module")
def lever(tmp_path_factory) -> dict:
    return two_causes_trial_inputs(tmp_path_factory.mktemp("trial"), evaluation=3)


def _tuner(lever: dict, wd: Path, backend: str) -> Tuner:
    return Tuner(lever["model"], lever["cal"], lever["feeds"], lever["ref"], wd, backend=backend, resume=False,
                 output_metric=mean_abs, preprocess=False)


#: an activation on 16 bits and head A's weight per channel: the quantizer resolves types, the trial measures them
SUGGESTIONS = [Suggestion("rb", "a16", "test", 0.0, 4.0), Suggestion("wa", "w_per_channel", "test", axis=0)]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("qnn", marks=needs_qnn)])
def test_a_trial_in_memory_gives_the_figures_of_a_dump(lever, tmp_path: Path, backend: str) -> None:
    tuner = _tuner(lever, tmp_path, backend)
    dumped = tuner.trial("dumped", list(SUGGESTIONS), keep_dump=True)
    mem = one_trial(tuner, "memory", SUGGESTIONS)
    assert dumped.error is None and mem.error is None, (dumped.error, mem.error)
    assert dumped.dump.exists() and not mem.dump.exists()  # no dump unless asked
    assert not list(tmp_path.glob("memory*.h5")) and not list(tmp_path.glob("memory*.csv"))
    # what the report reads: the watched output, the suggestions' tensors (and the types the quantizer resolved)
    names = {"y", "rb", *(s.tensor for s in mem.suggestions)}
    assert {"y", "rb"} <= set(mem.sqnr_table) and set(mem.sqnr_table) <= set(dumped.sqnr_table)
    for n in mem.sqnr_table:  # the same numbers, to the bit
        assert mem.sqnr_table[n] == dumped.sqnr_table[n], n
    assert all(mem.sqnr(n) == dumped.sqnr(n) for n in names)
    assert mem.samples == dumped.samples and mem.samples["y"]["n"] == 3
    assert mem.task == dumped.task and mem.task["task neg_mean_abs"] < 0
    assert mem.model_bytes == dumped.model_bytes and mem.fixes == dumped.fixes
    # the in-memory comparison's table: the rows of the whole one for the measured tensors, in the same order
    full = dumped.comparison.table
    part = mem.comparison.table
    keep = full["ref_name"].isin(names) | full["test_name"].isin(names)
    assert part["sqnr_db"].tolist() == full.loc[keep, "sqnr_db"].tolist()
    assert part[["sample", "ref_name", "test_name", "match"]].values.tolist() == \
        full.loc[keep, ["sample", "ref_name", "test_name", "match"]].values.tolist()
    if backend == "qnn":  # the HTP profile is read from memory too (emulated cycles vary from run to run)
        assert mem.cycles and dumped.cycles and mem.cycles > 0


def test_the_calibration_runs_once_per_setting_and_changes_no_byte(lever, tmp_path: Path) -> None:
    tuner = _tuner(lever, tmp_path / "t", "cpu")
    a = tuner.trial("a", [SUGGESTIONS[0]], keep_dump=False)
    b = tuner.trial("b", [SUGGESTIONS[1]], keep_dump=False)
    assert a.error is None and b.error is None
    # both trials are a8w8 MinMax with 8-bit / 16-bit overrides: one calibration each type set, none per trial
    cached = sorted((tmp_path / "t" / CALIBRATION_CACHE).glob("*.json"))
    assert 1 <= len(cached) <= 2
    # the quantized model from the cache is the same bytes as one calibrated afresh
    for s, tr in ((SUGGESTIONS[0], a), (SUGGESTIONS[1], b)):
        fresh = tmp_path / f"fresh-{tr.label}.onnx"
        ov = tr.overrides
        encs, _ = read_overrides(ov, load_model(lever["model"]))
        quantize_for_qnn(lever["model"], fresh, lever["cal"], overrides=to_ort_overrides(encs), preprocess=False)
        digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (fresh, tr.qdq_model)]
        assert digest[0] == digest[1], s


def test_keep_dumps_makes_every_trial_write_its_dump(lever, tmp_path: Path) -> None:
    tuner = replace(_tuner(lever, tmp_path, "cpu"), keep_dumps=True)
    tr = tuner.trial("lever", [SUGGESTIONS[0]])
    assert tr.error is None and tr.dump.exists() and tr.comparison.test.path == tr.dump
    assert len(tr.sqnr_table) > 3  # a whole comparison: every aligned tensor


def test_an_in_memory_capture_reads_like_a_dump(lever) -> None:
    runner = make_runner("onnx", lever["model"], selection=Selection())
    sink = MemorySink(runner.backend, runner.info)
    sink.begin_record(sample=0)
    runner.run(lever["feeds"][0], sink)
    mem = sink.take()
    with open_dump(lever["ref"]) as ref:
        for e in mem.tensors():
            want = ref.read(e.name, (0, "model", 0))
            assert np.array_equal(mem.read(e), want) and mem.stored_dtype(e) == want.dtype
            assert np.array_equal(np.concatenate(list(mem.iter_flat(e, 7))), want.reshape(-1))
    assert mem.size().tensors == sum(e.nbytes for e in mem.tensors()) and mem.size().file == 0
    assert mem.record_meta((0, "model", 0))["inputs"]["x"]["sha256"]  # the contract facts of the inputs
    mem.close()
    with pytest.raises(UsageError):
        mem.read(mem.tensors()[0])


def test_the_calibration_key_covers_the_weights_in_external_data(tmp_path: Path) -> None:
    """Two models of the same graph whose weights differ only in their external-data files: two calibrations."""
    cfg = SimpleNamespace(extra_options={}, calibrate_method="MinMax", op_types_to_quantize=["Conv"],
                          activation_type="QUInt8", weight_type="QUInt8", per_channel=False,
                          use_external_data_format=True, calibration_providers=None)
    keys = []
    for i, outlier in enumerate((40.0, 41.0)):
        d = tmp_path / f"m{i}"
        d.mkdir()
        build_two_causes(d / "two.onnx", outlier=outlier)
        m = onnx.load(str(d / "two.onnx"))
        onnx.save(m, str(d / "two.onnx"), save_as_external_data=True, location="w.data", size_threshold=0)
        keys.append(calibration_cache_key(d / "two.onnx", [two_causes_sample(0)], cfg))
    assert (tmp_path / "m0" / "two.onnx").read_bytes() == (tmp_path / "m1" / "two.onnx").read_bytes()
    assert keys[0] != keys[1]


def test_pruning_keeps_the_weights_of_a_kept_model_with_external_data(tmp_path: Path) -> None:
    for name in ("after.qdq.onnx", "other.qdq.onnx"):
        build_two_causes(tmp_path / name)
        onnx.save(onnx.load(str(tmp_path / name)), str(tmp_path / name), save_as_external_data=True,
                  location=name + ".data", size_threshold=256)  # the weights, not the split sizes
    (tmp_path / "after.h5").write_bytes(b"x")
    prune_workdir(tmp_path, [tmp_path / "after.qdq.onnx"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after.qdq.onnx", "after.qdq.onnx.data"]
    y = ort.InferenceSession(str(tmp_path / "after.qdq.onnx")).run(None, two_causes_sample(0))[0]
    assert np.isfinite(y).all() and np.abs(y).max() > 0  # the weights are there


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True])
def test_a_sweep_job_keeps_its_trial_files_only_with_keep_dumps(lever, tmp_path: Path, keep: bool) -> None:
    """``--keep-dumps`` keeps every sweep candidate's model and dump (the job folders were removed regardless;
    about 18 s per case on a loaded machine: slow)."""
    tuner = replace(_tuner(lever, tmp_path, "cpu"), keep_dumps=keep)
    res = sweep(tuner, groups=1, precisions=["a16"], progress=False)
    jobs = tmp_path / "sweep" / "jobs"
    kept = sorted(p.name for p in jobs.glob("*/*")) if jobs.exists() else []
    assert len(res.table) == 1 and res.table["sqnr_db"].notna().all()  # the candidate ran and was measured
    if keep:
        assert any(n.endswith(".h5") for n in kept) and any(n.endswith(".qdq.onnx") for n in kept), kept
    else:
        assert kept == []


@pytest.fixture(scope="module")
def five(tmp_path_factory) -> dict:
    return two_causes_trial_inputs(tmp_path_factory.mktemp("five"), evaluation=5)


@needs_qnn
def test_an_htp_trial_runs_its_samples_on_two_runners_with_the_figures_of_one(five, tmp_path: Path,
                                                                              monkeypatch) -> None:
    """The emulated HTP runs a session on one core: a trial's samples run on two runners at once (the second in the
    worker process, ``capture/worker.py``), and every figure is the one of a single runner, to the bit (the live
    reference, the task metric too)."""
    import threading

    from ivq_debug import defaults

    def tuner(wd: Path) -> Tuner:
        return Tuner(five["model"], five["cal"], five["feeds"], None, wd, backend="qnn", resume=False,
                     output_metric=mean_abs, preprocess=False)

    two = tuner(tmp_path / "two")
    a = one_trial(two, "two", SUGGESTIONS)
    monkeypatch.setattr(defaults, "TUNE_HTP_RUNNERS", 1)
    one = tuner(tmp_path / "one")
    b = one_trial(one, "one", SUGGESTIONS)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert two.timings["second_runner"] >= 1 and "second_runner" not in one.timings  # the second runner ran some
    assert a.sqnr_table == b.sqnr_table and {"y", "rb"} <= set(a.sqnr_table) and a.samples == b.samples
    assert a.samples["y"]["n"] == 5 and a.task == b.task and a.model_bytes == b.model_bytes
    cols = ["sample", "ref_name", "test_name", "sqnr_db"]
    assert a.comparison.table[cols].equals(b.comparison.table[cols])
    assert not list((tmp_path / "two").glob("*.csv"))  # both runners' profiles read and removed
    # an early stop: the figures of the samples run, the second runner joined
    monkeypatch.setattr(defaults, "TUNE_HTP_RUNNERS", 2)
    stopped = replace(two, resume=False, _checkpoint=two._ckpt(), _ran=set()).trial(
        "stop", list(SUGGESTIONS), keep_dump=False, stop=lambda worst: True)
    assert stopped.stopped == {"samples": 1, "of": 5} and stopped.samples["y"]["n"] == 1
    assert stopped.sqnr_table["y"] == min(v for k, v in b.comparison.table.query("sample == 0")
                                          .groupby("ref_name")["sqnr_db"].min().items() if k == "y")
    assert not [t for t in threading.enumerate() if t.name.startswith("ivq-tune-second-runner")]


@needs_qnn
def test_a_second_runner_that_cannot_be_made_leaves_every_sample_to_the_first(five) -> None:
    from ivq_debug.tune.verify import _Samples

    qdq = five["model"].with_name("two.qdq.onnx")
    quantize_for_qnn(five["model"], qdq, five["cal"], preprocess=False)
    runner = make_runner("qnn", qdq, selection=Selection())
    sink = MemorySink(runner.backend, runner.info)

    def broken() -> None:
        raise RuntimeError("no second session")

    samples = _Samples(runner, sink, five["feeds"], "model", broken)
    got = [(i, len(rec.tensors())) for i, rec in samples]
    assert [i for i, _ in got] == list(range(5)) and len({n for _, n in got}) == 1 and got[0][1] > 3
    assert samples.helped == []
