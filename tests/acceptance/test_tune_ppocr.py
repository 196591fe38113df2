"""Issue 29's acceptance on a real third-party model: ``ivq tune --search`` on the PP-OCRv4 text recognizer
(``rapidocr-onnxruntime==1.4.4``, fetched with ``pip download`` at set-up; tests/support/ppocr.py), from the CLI a
user takes, verified on QNN HTP (emulated):

* the recommended set compiles for HTP and reads >= 85 % of 48 held-out lines exactly (:data:`ISSUE_GOAL`; lines
  neither calibrated on nor tuned on; float reads them all, a8w8 none: measured in the test);
* ``ivq quantize`` with the printed flags and the delivered ``overrides.json`` reproduces its encodings exactly;
* no weight op of it reads a precision pair the HTP table forbids.

HTP emulation of this model is slow (about 3-10 s per line at a8w8 / a16w8, a minute at a16w16, on 2 loaded
cores; a trial 1.5-2 min with 4 lines at load 15), so the search verifies on two evaluation lines: the global
levers, then the combination step (``--combinations 4``): its first round is the diagnosis of the best global
lever within the size budget (a16w8 + per-channel; captured whole and replayed on CPU-QDQ), whose unit levers are
measured on HTP at its knobs. ``--no-diagnose`` leaves out the baseline's replay (its whole-model HTP capture is
the slow part; its levers, measured on CPU-QDQ, add at most 0.75 held-out, docs/tune.md). ``--max-size 1.5``
keeps a16w16 (+87 % bytes, about a minute per line on HTP, 1 of 12 lines read there today) out. The 48 held-out
lines are read once, on the recommended model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ivq_debug.dump import open_dump
from ivq_debug.tune.legal import violations
from tests.support import ppocr
from tests.support.cli import ivq_cli
from tests.support.ppocr_metric import score
from tests.tune.test_deliver import reproduces

pytestmark = pytest.mark.slow

METRIC = Path(__file__).resolve().parents[1] / "support" / "ppocr_metric.py"
#: evaluation lines of the HTP search (each trial reads them on the emulated HTP)
TUNE_LINES = 2
HELD_OUT = 48
#: the combination step's budget of extra HTP trials (it stops earlier when a round adds < 0.5 dB)
COMBINATIONS = 4
#: issue 29's acceptance: exact match on >= 40 held-out lines on HTP
ISSUE_GOAL = 0.85


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recognizer, fetched once per module (pip's own cache serves a second session)."""
    pytest.importorskip("onnxruntime_qnn")
    try:
        return ppocr.fetch(tmp_path_factory.mktemp("ppocr"))
    except ppocr.Unavailable as e:
        if os.environ.get(ppocr.REQUIRE_ENV) == "1":
            pytest.fail(f"{ppocr.REQUIRE_ENV}=1: {e}", pytrace=False)
        pytest.skip(f"the PP-OCRv4 recognizer could not be fetched: {e}")


@pytest.fixture(scope="module")
def lines(rec: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return ppocr.write_dataset(tmp_path_factory.mktemp("lines"), rec, calibration=16, evaluation=TUNE_LINES,
                               held_out=HELD_OUT)


def read_lines(model: Path, files: list[Path], labels: Path, tmp: Path, backend: str) -> float:
    """Exact match of ``model`` on ``files`` through ``ivq capture`` (the model output only)."""
    chars = json.loads(labels.read_text())["characters"]
    out = tmp / f"{model.stem}-{backend}-{len(files)}.h5"
    extra = ["--optimization", "all"] if backend == "qnn" else []
    assert ivq_cli("capture", backend, model, *[a for f in files for a in ("--inputs", f)], "--include",
                   "softmax_11.tmp_0", "-o", out, "--force", *extra) == 0
    with open_dump(out) as d:
        outs = [{e.name: d.read(e)} for rid in d.records.sort_values("sample")["rid"] for e in d.tensors(rid)]
    return score(outs, chars, json.loads(labels.read_text())["labels"])


def test_tune_search_on_htp_recommends_what_htp_reads(rec: Path, lines: dict, tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    monkeypatch.setenv(ppocr.LABELS_ENV, str(lines["eval_labels"]))
    wd = tmp_path / "t"
    code = ivq_cli("tune", rec, "--calibration", lines["cal"], *[a for f in lines["eval"] for a in ("--inputs", f)],
                   "-o", wd, "--backend", "qnn", "--optimization", "all", "--task-metric", f"{METRIC}:exact_match",
                   "--search", "--no-diagnose", "--max-size", "1.5", "--combinations", str(COMBINATIONS))
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    doc = json.loads((wd / "tune.json").read_text())
    search = doc["search"]
    assert doc["recommended"] and search["chosen"]
    row = next(r for r in search["table"] if r["lever"] == search["chosen"])
    assert row["status"] == "chosen" and row["gain_db"] > 0
    # the combination step grew the best lever on HTP: each combination one measured HTP trial (its cycles), a job
    grown = [r for r in search["table"] if r["kind"] == "combination" and r["lever"] != "a16w8 + per-channel"]
    assert 1 <= len(grown) <= COMBINATIONS, search["table"]
    assert all(r["lever"].startswith("a16w8 + per-channel + ") for r in grown), grown  # grown from the best
    assert any(r["cycles"] for r in grown) and search["jobs"]["total"] >= len(grown)
    # the trials ran on HTP: the recommended model compiled and ran there
    assert doc["target_check"].get("same_as_trials") and doc["backend"] == "qnn"
    # the printed command reproduces the verified model's encodings (the flags, the delivered overrides file)
    assert f"--calibration CALIBRATION {search['command']}" in " ".join(out.split())
    knobs = search["command"].split()
    rep = reproduces(rec, lines["cal"], wd, tmp_path, *knobs)
    verified = Path(rep["after"]["qdq_model"])
    assert violations(verified, "qnn") == []
    # the 48 held-out lines on HTP: float reads them, the baseline does not, the recommendation does
    held, labels = lines["held"], lines["held_labels"]
    assert read_lines(rec, held, labels, tmp_path, "onnx") >= 0.95
    base = Path(rep["before"]["qdq_model"])
    assert read_lines(base, held[:8], ppocr.write_labels(tmp_path / "held8.json", json.loads(
        labels.read_text())["characters"], lines["texts"]["held"][:8]), tmp_path, "qnn") <= 0.25
    got = read_lines(verified, held, labels, tmp_path, "qnn")
    print(f"exact match on {len(held)} held-out lines, QNN HTP: {got:.3f} ({search['chosen']})")
    # issue 29 asks >= 0.85 (ISSUE_GOAL). The global levers alone do not reach it (a16w8 + per-channel, the largest
    # gain within the budget, reads 32 of 48: 0.667); the combination step's diagnosis of that lever names the 20
    # weights whose 8-bit grid is left (16-bit weights there: 9.7 -> 44 dB on CPU-QDQ, 13.1 -> 21.4 dB on HTP)
    # (measured: a16w8 + per-channel + remedy all (its diagnosis), 48 of 48 held-out lines on HTP, 1.000)
    assert got >= ISSUE_GOAL, (got, search["chosen"])
