"""The hostile-case harness catches each kind of misbehaviour (so a passing case means something)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.hostile import harness
from tests.hostile.harness import Case


def _run(zygote: harness.Zygote, tmp_path: Path, *cases: Case) -> dict[str, harness.Result]:
    return harness.run_cases(zygote, list(cases), tmp_path, {})


def test_each_misbehaviour_gets_its_outcome(zygote: harness.Zygote, tmp_path: Path) -> None:
    def c(id_: str, build, exit_: int = 3, **kw) -> Case:
        return Case(id_, "selftest", build, exit_, prog="selftest", **kw)

    def inside(ws: harness.Workspace) -> list[str]:
        ws.write("in.txt", "data")
        return ["write", "in.txt"]

    rs = _run(zygote, tmp_path,
              c("ok", lambda ws: ["print", "selftest: error: bad input"]),
              c("hang", lambda ws: ["hang", ws.fifo("f")], timeout=30),
              c("segv", lambda ws: ["segv"]),
              c("traceback", lambda ws: ["traceback"]),
              c("clobber", inside, 0, env={"SELFTEST_EXIT": "0"}),
              c("outside", lambda ws: ["read", str(ws.secret())], 0, env={"SELFTEST_EXIT": "0"}),
              c("exit", lambda ws: ["print", "selftest: error: x"], exit_=2),
              c("two-lines", lambda ws: ["print", "selftest: error: a\nb"]),
              c("ansi", lambda ws: ["print", "selftest: error: \x1b[2J"]),
              c("leftover", lambda ws: ["write", "new.txt"], 0, env={"SELFTEST_EXIT": "0"}),
              c("temp", lambda ws: ["tempfile"], 0, env={"SELFTEST_EXIT": "0"}),
              c("allowed-output", lambda ws: ["write", "out.txt"], 0, creates=("out.txt",), env={"SELFTEST_EXIT": "0"}))
    got = {k: r.outcome for k, r in rs.items()}
    assert got == {"ok": "pass", "hang": "hang", "segv": "signal", "traceback": "traceback",
                   "clobber": "clobbered input", "outside": "outside read", "exit": "wrong exit",
                   "two-lines": "not one line", "ansi": "unescaped", "leftover": "leftovers", "temp": "leftovers",
                   "allowed-output": "pass"}, {k: r.describe() for k, r in rs.items()}
    assert rs["hang"].seconds < 10  # found blocked on the FIFO, not at the timeout


def test_table_counts_by_format_and_outcome() -> None:
    rows = [{"fmt": "dump", "outcome": "pass"}, {"fmt": "dump", "outcome": "hang"}, {"fmt": "npz", "outcome": "pass"}]
    t = harness.table(rows)
    assert "| dump | 2 | 1 | 1 |" in t and "| **total** | 3 | 2 | 1 |" in t
    assert os.path.basename(harness.__file__) == "harness.py"
