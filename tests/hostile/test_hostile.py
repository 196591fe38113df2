"""Issue 16: every command against broken and hostile inputs (one forked process per case, see harness.py).

Each case asserts the CLI contract: the documented exit code, one line on stderr for errors, no
traceback, no signal, no hang, inputs unchanged, no read outside the inputs, names escaped, no output
or temp file left behind. Cases that still fail are ``xfail(strict=True)`` under the module that must
change (``known.py``): fixing one flips its xfail.

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


def _marks(case_id: str) -> list[pytest.MarkDecorator]:
    for module, (_, globs) in KNOWN.items():
        if any(fnmatch.fnmatchcase(case_id, g) for g in globs):
            return [pytest.mark.xfail(strict=True, reason=f"{module} must change (tests/hostile/known.py)")]
    return []


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
    """Every command and every input format of issue 16 has cases (a catalog that lost some is a defect)."""
    if len(hostile_results) < len(CASES):
        pytest.skip("only part of the catalog was selected")
    commands = {r.command for r in hostile_results.values()}
    assert commands >= {"ls", "show", "diff", "capture", "ingest", "quantize", "diagnose", "tune", "report",
                        "ivq-diff"}
    assert {c.fmt for c in CASES} >= {"dump", "npz", "overrides", "netjson", "netrun", "profiling", "onnx",
                                      "special", "outputs", "disk", "names", "diffjson"}
    assert len(CASES) >= 300


def test_known_failures_name_real_cases() -> None:
    """Every case id in known.py is in the catalog (a renamed case must not leave a stale xfail behind)."""
    ids = {c.id for c in CASES}
    stale = [g for _, globs in KNOWN.values() for g in globs if not any(fnmatch.fnmatchcase(i, g) for i in ids)]
    assert not stale
