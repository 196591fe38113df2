"""Per-tensor statistics over a calibration set as jobs (issue 15): the merged shards equal one pass over every sample
(counts, extrema, histograms and clipped counts exactly, sums to 1e-12 relative, against numpy on a captured dump),
a process pool gives the in-process numbers to the bit, a rerun resumes from the shards, and an encoding whose
range is too narrow on one tensor is reported as low coverage there, from the API and from the CLI a user takes
(a real ViT from transformers, quantized with ORT's QNN flow)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ivq_debug.calib_stats import CalibStats, calib_stats, histogram_percentiles, read_activation_encodings
from ivq_debug.capture.base import Selection, capture, make_runner
from ivq_debug.dump import open_dump
from ivq_debug.encoding_fit import EncodingAccumulator
from ivq_debug.executor import LocalExecutor
from ivq_debug.qnn.encodings import encodings_from_qdq_model, write_encodings
from tests.support import vit
from tests.support.cli import ivq_cli
from tests.support.faults import corrupt_encoding

#: the 8 calibration samples the QDQ model was calibrated on, in jobs of 3: three jobs (3, 3, 2)
N, PER = 8, 3


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> dict[str, Any]:
    out: dict[str, Any] = dict(vit.models(tmp_path_factory))
    d = tmp_path_factory.mktemp("calib")
    out["samples"] = vit.calibration(N)
    out["narrow"] = corrupt_encoding(out["qdq"], vit.ACT_TENSOR, 0.05, d / "narrow.qdq.onnx")
    out["seq"] = calib_stats(out["float"], out["samples"], encodings=out["qdq"], samples_per_job=PER, progress=False)
    return out


def same(a: CalibStats, b: CalibStats) -> None:
    """The same numbers to the bit (every row, histogram and coverage; the jobs' bookkeeping aside)."""
    ja, jb = a.to_json(), b.to_json()
    ja.pop("jobs")
    jb.pop("jobs")
    assert ja == jb


def test_merged_shards_equal_one_pass_over_every_sample(m, tmp_path: Path) -> None:
    r: CalibStats = m["seq"]
    assert r.jobs["total"] == 2 * math.ceil(N / PER) and r.calibration["samples"] == N
    # one pass, independently of the tool: every sample captured into a dump, each tensor's values concatenated
    dump = open_dump(capture(make_runner("onnx", m["float"], selection=Selection()), m["samples"], tmp_path / "all.h5",
                             progress=None))
    rids = list(dump.records.sort_values("sample")["rid"])
    entries = {e.name: e for e in dump.tensors(rids[0])}
    encs = read_activation_encodings(m["qdq"])[0]
    checked = 0
    for name, acc in r.stats.items():
        if name not in entries:  # the model input: a record input, not a tensor
            assert name == "x"
            continue
        vals = np.concatenate([dump.read(e).astype(np.float64).reshape(-1) for rid in rids
                               for e in dump.tensors(rid) if e.name == name])
        assert (acc.count, acc.nonfinite) == (vals.size, 0), name
        assert (acc.min, acc.max) == (vals.min(), vals.max()), name
        edges = acc.edges
        assert edges is not None and acc.hist is not None and edges[0] == vals.min() and edges[-1] > vals.max()
        hist = np.bincount(np.searchsorted(edges, vals, side="right"), minlength=edges.size + 1)
        assert acc.hist.tolist() == hist.tolist() and acc.hist[0] == acc.hist[-1] == 0, name
        assert rel(acc.sum, math.fsum(vals)) < 1e-12 and rel(acc.sumsq, math.fsum(vals * vals)) < 1e-12, name
        fit = r.fits.get(name)
        if fit is not None:  # the coverage sums against one accumulator over every value
            one = EncodingAccumulator.for_encoding(encs[name])
            assert one is not None
            one.update(vals)
            assert (fit.n, fit.clipped, fit.n_inf) == (one.n, one.clipped, one.n_inf), name
            for f in ("sig_sq", "s1", "s2", "noise"):
                assert rel(getattr(fit, f), getattr(one, f)) < 1e-12, (name, f)
        checked += 1
    assert checked == len(r.stats) - 1 > 100 and len(r.fits) > 80
    # percentiles from the histogram: within one bin of numpy's on the same values
    name = vit.ACT_TENSOR
    vals = np.concatenate([dump.read(e).astype(np.float64).reshape(-1) for rid in rids for e in dump.tensors(rid)
                           if e.name == name])
    width = float(r.stats[name].edges[1] - r.stats[name].edges[0])
    for q, v in histogram_percentiles(r.stats[name], (1.0, 50.0, 99.0)).items():
        assert abs(v - np.percentile(vals, float(q[1:]))) <= width, q


@pytest.mark.slow  # four pooled passes (~10 s idle); test_the_cli runs a pool of 2 and its resume in the default set
def test_a_pool_gives_the_in_process_numbers_to_the_bit_and_resumes(m, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    kw: dict[str, Any] = dict(encodings=m["qdq"], samples_per_job=PER, progress=False, shards=shards)
    pool = calib_stats(m["float"], m["samples"], executor=LocalExecutor(2), **kw)
    same(m["seq"], pool)
    assert pool.jobs["resumed"] == 0 and len(list(shards.glob("*.json"))) == pool.jobs["total"]
    again = calib_stats(m["float"], m["samples"], **kw)  # every shard there: nothing runs
    assert again.jobs["resumed"] == again.jobs["total"]
    same(m["seq"], again)
    stamps = {p.name: p.stat().st_mtime_ns for p in shards.glob("*.json")}
    victim = sorted(stamps)[0]
    (shards / victim).unlink()  # a crashed run: one shard missing
    resumed = calib_stats(m["float"], m["samples"], executor=LocalExecutor(2), **kw)
    assert resumed.jobs["resumed"] == resumed.jobs["total"] - 1
    assert {p.name: p.stat().st_mtime_ns for p in shards.glob("*.json") if p.name != victim} == {
        k: v for k, v in stamps.items() if k != victim}
    same(m["seq"], resumed)
    # another calibration set is another run: its jobs have other keys, the old shards are not reused
    other = calib_stats(m["float"], m["samples"][:-1], **kw)
    assert other.jobs["resumed"] == 0 and other.calibration["sha256"] != m["seq"].calibration["sha256"]


def test_a_too_narrow_encoding_is_reported_as_low_coverage_on_its_tensor(m) -> None:
    clean: CalibStats = m["seq"]
    assert clean.low_coverage() == [] and min(r["coverage"] for r in clean.rows() if "coverage" in r) > 0.99
    bad = calib_stats(m["float"], m["samples"], encodings=m["narrow"], samples_per_job=PER, progress=False)
    low = bad.low_coverage()
    assert [r["tensor"] for r in low] == [vit.ACT_TENSOR]
    row = low[0]
    assert row["coverage"] < 0.5 and row["clipped_fraction"] == 1 - row["coverage"]
    assert row["enc_max"] - row["enc_min"] < 0.06 * (row["max"] - row["min"])
    # the same encodings as a QNN encodings file (legacy, 1.0.0): the same coverage
    for fmt in ("legacy", "1.0.0"):
        path = write_encodings(encodings_from_qdq_model(m["narrow"]), m["narrow"].with_suffix(f".{fmt}.json"), fmt,
                               overwrite=True)
        doc = calib_stats(m["float"], m["samples"], encodings=path, samples_per_job=PER, progress=False)
        assert [r["tensor"] for r in doc.low_coverage()] == [vit.ACT_TENSOR] and len(doc.fits) == len(bad.fits)
        assert doc.low_coverage()[0]["coverage"] == row["coverage"]
    # the statistics are the model's, whatever the encodings
    assert [(r["tensor"], r["count"], r["min"], r["max"]) for r in bad.rows()] == [
        (r["tensor"], r["count"], r["min"], r["max"]) for r in clean.rows()]


def test_the_cli(m, tmp_path: Path, capsys) -> None:
    cal = tmp_path / "cal"
    cal.mkdir()
    for i, s in enumerate(m["samples"]):
        np.savez(cal / f"s{i:03d}.npz", **s)
    out, shards = tmp_path / "stats.json", tmp_path / "shards"
    args = ["calib-stats", m["float"], "--calibration", cal, "-o", out, "--encodings", m["narrow"],
            "--samples-per-job", PER, "--workers", 2, "--shards", shards]
    assert ivq_cli(*args) == 1  # the narrow encoding: exit 1
    printed = capsys.readouterr().out
    assert "low coverage" in printed and vit.ACT_TENSOR in printed
    doc = json.loads(out.read_text())
    assert doc["schema"] == "ivq-calib-stats/1" and [x["tensor"] for x in doc["coverage"]["low"]] == [vit.ACT_TENSOR]
    assert doc["calibration"]["samples"] == N and len(doc["tensors"]) == len(m["seq"].stats)
    first = next(t for t in doc["tensors"] if t["tensor"] == vit.ACT_TENSOR)
    assert sum(first["histogram"]["counts"]) == first["count"] and len(first["histogram"]["edges"]) == 257
    # a rerun resumes from the shards; --force replaces the output; the clean model's encodings pass
    assert ivq_cli(*args, "--force") == 1
    assert "resumed from shards" in capsys.readouterr().out
    assert ivq_cli("calib-stats", m["float"], "--calibration", cal, "-o", tmp_path / "clean.json",
                   "--encodings", m["qdq"], "--tensors", "/m/layers.1/*") == 0
    doc = json.loads((tmp_path / "clean.json").read_text())
    assert doc["tensors"] and all(t["tensor"].startswith("/m/layers.1/") for t in doc["tensors"])
    capsys.readouterr()


@pytest.mark.parametrize("extra, code, message", [
    (["--bins", "1"], 2, "--bins must be between"),
    (["--samples-per-job", "0"], 2, "--samples-per-job must be at least 1"),
    (["--workers", "2", "--executor", "ray", "--ray-address", "x:1"], 2, "--workers is for --executor local"),
    (["--encodings", "missing.json"], 3, "missing.json"),
])
def test_bad_arguments_are_one_line_errors(m, tmp_path: Path, capsys, extra: list[str], code: int,
                                           message: str) -> None:
    np.savez(tmp_path / "s.npz", **m["samples"][0])
    extra = [str(tmp_path / e) if e.endswith(".json") else e for e in extra]
    assert ivq_cli("calib-stats", m["float"], "--calibration", tmp_path / "s.npz", "-o", tmp_path / "o.json",
                   *extra) == code
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_a_tampered_shard_is_an_input_error(m, tmp_path: Path, capsys) -> None:
    np.savez(tmp_path / "s.npz", **m["samples"][0])
    shards = tmp_path / "shards"
    args = ["calib-stats", m["float"], "--calibration", tmp_path / "s.npz", "-o", tmp_path / "o.json",
            "--shards", shards]
    assert ivq_cli(*args) == 0
    for p in shards.glob("*.json"):  # every shard: the range pass's is read first
        doc = json.loads(p.read_text())
        doc["result"]["tensors"] = {"x": {"count": "many"}}
        p.write_text(json.dumps(doc))
    assert ivq_cli(*args, "--force") == 3
    err = capsys.readouterr().err.strip()
    assert "calib-stats shard result: tensors.x: missing 'nonfinite'" in err and "\n" not in err


def test_a_failing_job_is_listed_with_its_key_and_the_other_shards_stay(tmp_path: Path, capsys) -> None:
    # a real model that ORT cannot run on one of the samples: Reshape of a vector to [2, -1] needs an even length
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, None])
    shape = numpy_helper.from_array(np.array([2, -1], dtype=np.int64), "shape")
    graph = helper.make_graph([helper.make_node("Relu", ["X"], ["R"]), helper.make_node("Reshape", ["R", "shape"], ["Y"])],
                              "g", [x], [y], [shape])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    cal = tmp_path / "cal"
    cal.mkdir()
    for i, n in enumerate((4, 6, 3, 8)):  # the third sample has an odd length
        np.savez(cal / f"s{i}.npz", X=np.linspace(-1, 1, n, dtype=np.float32))
    shards = tmp_path / "shards"
    assert ivq_cli("calib-stats", model, "--calibration", cal, "-o", tmp_path / "o.json", "--samples-per-job", 1,
                   "--shards", shards) == 1
    err = capsys.readouterr().err.strip()
    assert "1 job(s) failed after a retry" in err and "\n" not in err and "Reshape" in err
    assert len(list(shards.glob("*.json"))) == 3 and not (tmp_path / "o.json").exists()
