"""Issue 16: every command against broken and hostile inputs (one forked process per case, see harness.py).

Each case asserts the CLI contract: the documented exit code, one line on stderr for errors, no
traceback, no signal, no hang, inputs unchanged, no read outside the inputs, names escaped, no output
or temp file left behind. Cases that still fail are ``xfail(strict=True)`` under the module that must
change (``known.py``): fixing one flips its xfail.

The default run takes a representative subset (:data:`DEFAULT_IDS`, about 150 cases); the rest of the catalog
is ``-m slow``; ``pytest -m '' tests/hostile`` runs all of it (docs/input-formats.md has the timings).

``IVQ_HOSTILE_OUTCOMES=FILE`` appends one JSON line per case (id, format, outcome, problems) to FILE;
``python -m tests.hostile.harness FILE`` prints the table by format and outcome.
"""

from __future__ import annotations

import fnmatch
import json
import os

import pytest

from tests.hostile import cases, corpus, harness
from tests.hostile.known import KNOWN

CASES = cases.all_cases()

#: cases of the default run besides the first of each (format, command) pair: the issue's headline
#: failures (native crashes, hangs, outside reads, clobbered inputs, a full disk, the valid overrides
#: ``ivq quantize`` refused) and one of each special-file kind
DEFAULT_EXTRA = (
    "dump/string-dtype/show", "dump/vlen-int-dtype/show", "dump/compound-dtype/diff", "dump/soft-link/show",
    "dump/soft-link-loop/diff", "dump/external-link/diff", "dump/external-storage/diff",
    "dump/virtual-dataset/show", "dump/dataset-is-group/show", "dump/shape-lie-bigger/diff",
    "dump/shape-lie-huge/show", "dump/dtype-lie-float64/diff", "dump/fletcher32-flip/diff",
    "dump/manifest-shape-negative/ls", "dump/records-dataset/ls", "dump/backend-info-list/ls",
    "dump/not-finalized/ls", "dump/model-path-outside/report",
    "special/socket/ls-dump", "special/stdin/diff-map", "special/loop/quantize-overrides",
    "special/dir/capture-model", "special/devzero/ingest-profiling",
    "disk/tmpfs-full/capture", "disk/tmpfs-full/diff-report", "disk/readonly/ingest",
    "overrides/v1-valid/quantize", "overrides/aimet2-valid/quantize", "overrides/ort-valid/quantize",
    "overrides/legacy-bitwidth-1e9/quantize", "overrides/v1-per-channel-bw-huge/quantize",
    "overrides/ort-rmin-gt-rmax/quantize", "overrides/deep-nesting/quantize",
    "npz/member-header-huge/capture", "npz/member-shape-huge/quantize", "npz/pickled-npy/capture",
    "npz/member-traversal-name/quantize",
    "netrun/input-list-traversal/ingest", "netrun/input-list-absolute/ingest",
    "netrun/raw-symlink-outside/ingest", "netrun/missing-result-folder/ingest",
    "netjson/data-type-string/ingest", "netjson/offset-huge/ingest",
    "profiling/csv-huge-field/ingest", "profiling/csv-nul-byte/ingest", "profiling/csv-truncated-mid-row/ingest",
    "onnx/external-data-outside/capture", "onnx/external-data-fifo/quantize",
    "outputs/capture-o-model/same-force", "outputs/ingest-o-graph/symlink-force",
    "outputs/quantize-o-calibration/hardlink-force", "outputs/report-o-ref/dot-force",
    "names/tensor-surrogate/show", "names/tensor-html/report", "names/path-too-long/ls",
    "diffjson/baseline-deep/diff", "diffjson/baseline-findings-ints/diff",
    # the commands that came later (device sessions, the reference replay, dynamic INT8, the QNN cache, tune)
    "session/spec-absolute-outside/ingest-session", "netrun-model/output-raw-symlink-outside/ingest",
    "reference/config-theta-string/reference", "reference/export-json-path-traversal/reference",
    "qnncache/meta-is-fifo/capture", "tune/checkpoint-is-fifo/tune", "tune/metric-exits-on-import/tune",
    "dynamic/exclude-nodes-missing/quantize",
    # issue 31: job shards (a 100,000-deep shard, forged numbers, a symlink out, a FIFO)
    "shards/deep/calib-stats", "shards/nan/calib-stats", "shards/unordered/calib-stats", "shards/deep/diagnose",
    "shards/symlink-outside/diagnose", "shards/fifo/calib-stats", "shards/deep/tune",
    # issue 31: the one output check (ivq reference, diagnose --json into its --shards, --dynamic -o a hard link)
    "outputs/reference-o-session/same-force", "outputs/reference-o-decode-model/hardlink-force",
    "outputs/diagnose-json-shards/same-force", "outputs/quantize-dynamic-o-model/hardlink-force",
    "outputs/tune-workdir-is-file/force",
    # issue 31: dump fields, option values, the rest of the reproducers
    "dumpfield/encoding-bitwidth-1e9/diff", "dumpfield/encoding-scale-string/ls", "dumpfield/meta-partition-list/diff",
    "dumpfield/meta-cpu-nodes-strings/report", "dumpfield/object-header-checksum/show",
    "dumpfield/shape-declared-1tib/show", "dumpfield/integers-float32/show-tq", "dumpfield/integers-missing/diff",
    "dumpfield/integers-encoding-channels/ls", "dump/expected-other-model/diff-expected", "netrun/result-index-huge/ingest",
    "options/min-sqnr-nan/ivq-diff", "options/min-gain-nan/tune", "options/workers-below-min/calib-stats",
    "options/top-below-min/diagnose", "options/soc-model-abc/capture-qnn", "options/htp-arch-9999/capture-qnn",
    "options/overlay-metric-nosuch/report", "onnx/zero-nodes/diagnose", "onnx/empty/report-replay",
    "profiling/trace-begin-end-args-list/ingest", "profiling/csv-extra-fields/ingest",
    "reference/dump-config-attr-list/reference",
)


def _default_ids(catalog: list[harness.Case]) -> set[str]:
    """The default run's cases: every reader of every format is attacked at least once."""
    first: dict[tuple[str, str], str] = {}
    for c in catalog:
        first.setdefault((c.fmt, c.id.rsplit("/", 1)[1]), c.id)
    return set(first.values()) | set(DEFAULT_EXTRA)


DEFAULT_IDS = _default_ids(CASES)


def _marks(case_id: str) -> list[pytest.MarkDecorator]:
    marks = [] if case_id in DEFAULT_IDS else [pytest.mark.slow]
    for module, (_, globs) in KNOWN.items():
        if any(fnmatch.fnmatchcase(case_id, g) for g in globs):
            marks.append(pytest.mark.xfail(strict=True, reason=f"{module} must change (tests/hostile/known.py)"))
    return marks


@pytest.fixture(scope="session")
def hostile_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                    zygote: harness.Zygote) -> dict:
    """Run every selected case once (concurrently, in forked children of one pre-imported server)."""
    selected = [it.callspec.params["case"] for it in request.session.items
                if getattr(it, "callspec", None) is not None and isinstance(it.callspec.params.get("case"), harness.Case)]
    root = tmp_path_factory.mktemp("hostile")
    corp = corpus.build(root / "corpus")
    results = harness.run_cases(zygote, selected, root / "cases", corp)
    log = os.environ.get("IVQ_HOSTILE_OUTCOMES")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            for r in results.values():
                f.write(json.dumps({"id": r.case.id, "fmt": r.case.fmt, "outcome": "skipped" if r.skipped else r.outcome,
                                    "problems": r.problems, "rc": r.rc, "seconds": r.seconds, "cpu": r.cpu},
                                   ensure_ascii=True) + "\n")
    return results


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=_marks(c.id)) for c in CASES])
def test_hostile_input(case: harness.Case, hostile_results: dict) -> None:
    r = hostile_results[case.id]
    if r.skipped:
        pytest.skip(r.skipped)
    assert not r.problems, r.describe()


def test_catalog_covers_every_command_and_format(hostile_results: dict) -> None:
    """Every command and every input format of issue 16 has cases, in the default subset too (a catalog
    that lost some is a defect)."""
    if not DEFAULT_IDS <= hostile_results.keys():
        pytest.skip("only part of the default subset was selected")
    commands = {hostile_results[i].command for i in DEFAULT_IDS}
    assert commands >= {"ls", "show", "diff", "capture", "ingest", "quantize", "diagnose", "tune", "report",
                        "reference", "ivq-diff"}
    assert {c.fmt for c in CASES if c.id in DEFAULT_IDS} >= {
        "dump", "npz", "overrides", "netjson", "netrun", "profiling", "onnx", "special", "outputs", "disk",
        "names", "diffjson", "session", "netrun-model", "reference", "dynamic", "qnncache", "tune", "shards",
        "dumpfield", "options"}
    assert len(CASES) >= 300 and len(DEFAULT_IDS) < len(CASES) / 4


def test_known_failures_name_real_cases() -> None:
    """Every case id in known.py and :data:`DEFAULT_EXTRA` is in the catalog (a renamed case must not leave a
    stale xfail behind, nor silently drop out of the default run)."""
    ids = {c.id for c in CASES}
    stale = [g for _, globs in KNOWN.values() for g in globs if not any(fnmatch.fnmatchcase(i, g) for i in ids)]
    assert not stale
    assert not set(DEFAULT_EXTRA) - ids
