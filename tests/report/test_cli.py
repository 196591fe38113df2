"""``ivq report``: outputs, ``--force``, ``--check`` and the exit codes (through the CLI error wrapper)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.report.conftest import need_htp


def _ivq_report(argv: list[str]) -> int:
    """``ivq report ARGV`` as the CLI runs it (parser errors and IvqErrors become exit codes; the one output
    check of every writer runs in the entry point, ``cli.common.check_args``)."""
    from ivq_debug.cli.common import run
    from ivq_debug.cli.main import _main

    return run("ivq", _main, ["report", *argv])


def test_report_and_exports_then_no_overwrite(pipeline: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    htp = need_htp(pipeline)
    out = {k: tmp_path / n for k, n in (("html", "r.html"), ("trace", "t.json"), ("me", "m.json"), ("xml", "j.xml"))}
    argv = [str(pipeline["float"]), str(htp), "-o", str(out["html"]), "--perfetto", str(out["trace"]),
            "--model-explorer", str(out["me"]), "--junit", str(out["xml"]), "--min-sqnr", "30",
            "--extra", str(pipeline["float"]), str(pipeline["cpu"]), "--replay", str(pipeline["qdq"])]
    assert _ivq_report(argv) == 0
    assert "FAIL" in capsys.readouterr().out  # the verdict line (results go to stdout)
    assert out["html"].read_text().startswith("<!DOCTYPE html>")
    assert json.loads(out["trace"].read_text())["traceEvents"]
    assert json.loads(out["me"].read_text())["main_graph"]["results"]
    assert ET.parse(out["xml"]).getroot().tag == "testsuites"
    before = out["html"].read_bytes()
    assert _ivq_report(argv) == 2  # outputs exist: usage error before any work
    assert "--force" in capsys.readouterr().err
    assert out["html"].read_bytes() == before
    assert _ivq_report([*argv, "--force", "--check"]) == 1  # tensors over budget


def test_usage_and_input_errors(pipeline: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    assert _ivq_report([str(pipeline["float"]), str(pipeline["cpu"]), "-o", str(out), "--perfetto",
                        str(tmp_path / "t.json")]) == 2  # CPU-QDQ dump: no profile
    assert not out.exists()
    assert _ivq_report([str(pipeline["float"]), str(tmp_path / "missing.h5"), "-o", str(out)]) == 3
    assert _ivq_report([str(pipeline["float"]), str(pipeline["cpu"])]) == 2  # -o is required
    assert _ivq_report([str(pipeline["float"]), str(pipeline["cpu"]), "-o", str(out), "--junit", str(out)]) == 2
    assert _ivq_report([str(pipeline["float"]), str(pipeline["cpu"]), "-o", str(out), "--budget", "bad"]) == 2
    assert _ivq_report([str(pipeline["float"]), str(pipeline["cpu"]), "-o", str(out), "--check"]) == 0
    assert out.exists()


def test_ivq_diff_report_option(pipeline: dict[str, Path], tmp_path: Path) -> None:
    from ivq_debug.cli.common import run
    from ivq_debug.cli.diff import _main

    out = tmp_path / "diff.html"
    argv = [str(pipeline["float"]), str(pipeline["cpu"]), "--report", str(out), "-q"]
    assert run("ivq-diff", _main, argv) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="layers"' in page
    assert run("ivq-diff", _main, argv) == 2  # exists
    assert run("ivq-diff", _main, [*argv, "--force", "--min-sqnr", "60"]) == 1
    assert "sqnr_db&gt;=60" in out.read_text()
