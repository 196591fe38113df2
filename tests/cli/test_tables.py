"""Issue 32: terminal tables keep the tensor name, piped output keeps one row per line, the verdict is the last line.

A real model (the tiny MLP exported by torch) whose tensors are renamed to the long scoped names a VLM export has
(``/model/vision_tower/vision_model/encoder/layers/blocks.1/fc1/MatMul_output_0``: 76 characters), captured by ORT
through the CLI; a copy with one layer's weights perturbed is the failing side. ``ivq ls`` and ``ivq-diff`` run as
a user runs them: in an 80-column pseudo-terminal (every name whole or shortened in the middle, one line per row)
and through a pipe (every full name greppable, tab-separated, the verdict last)."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ivq_debug import defaults
from ivq_debug.cli.render import ELLIPSIS, Col, TableData, ellipsize_middle, rich_table
from ivq_debug.dump import open_dump
from tests.support import tiny

REPO = Path(__file__).resolve().parents[2]
PREFIX = "/model/vision_tower/vision_model/encoder/layers"
IVQ = "import sys\nfrom ivq_debug.cli.main import main\nmain(sys.argv[1:])"
IVQ_DIFF = "import sys\nfrom ivq_debug.cli.diff import main\nmain(sys.argv[1:])"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _env(columns: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "IVQ_NO_PROGRESS": "1"}
    env.pop("FORCE_COLOR", None)
    if columns:
        env["COLUMNS"] = str(columns)
    return env


def _pipe(script: str, *args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env=_env(), timeout=300)


def _pty(script: str, *args: object, cwd: Path, columns: int = 80) -> tuple[int, list[str]]:
    """Run in a pseudo-terminal ``columns`` wide; the exit code and the lines shown (ANSI codes removed)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    p = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=cwd, stdin=slave, stdout=slave,
                         stderr=slave, env=_env(columns), close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    code = p.wait(timeout=300)
    os.close(master)
    text = ANSI.sub("", b"".join(chunks).decode("utf-8", "replace")).replace("\r", "")
    return code, text.splitlines()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tables")
    _m, x, onnx_path = tiny.build(tmp)
    model = onnx.load(str(onnx_path))
    outputs = {o.name for o in model.graph.output}
    rename = {o: PREFIX + o for n in model.graph.node for o in n.output if o not in outputs}
    for n in model.graph.node:
        n.input[:] = [rename.get(v, v) for v in n.input]
        n.output[:] = [rename.get(v, v) for v in n.output]
    onnx.save(model, str(tmp / "long.onnx"))
    node = next(n for n in model.graph.node if n.name == "/blocks.1/fc1/MatMul")
    init = next(i for i in model.graph.initializer if i.name == node.input[1])
    w = numpy_helper.to_array(init)
    noise = 0.05 * np.random.default_rng(0).standard_normal(w.shape)
    init.CopyFrom(numpy_helper.from_array((w + noise).astype(w.dtype), init.name))
    onnx.save(model, str(tmp / "long.perturbed.onnx"))
    np.savez(tmp / "x.npz", x=x)
    for name in ("long", "long.perturbed"):
        r = _pipe(IVQ, "capture", "onnx", f"{name}.onnx", "--inputs", "x.npz", "-o", f"{name}.h5", cwd=tmp)
        assert r.returncode == 0, r.stderr
    return {"dir": tmp, "ref": tmp / "long.h5", "test": tmp / "long.perturbed.h5"}


def _names(path: Path) -> list[str]:
    with open_dump(path) as d:
        return [e.name for e in d.entries]


def _shown_as(cell: str, names: list[str]) -> str | None:
    """The name a table cell shows: whole, or shortened in the middle (head … tail of one name)."""
    cell = cell.strip()
    if cell in names:
        return cell
    if ELLIPSIS in cell:
        head, _, tail = cell.partition(ELLIPSIS)
        hits = [n for n in names if n.startswith(head) and n.endswith(tail) and len(n) > len(cell)]
        return hits[0] if hits else None
    return None


def _rows(lines: list[str], header: str) -> tuple[list[str], list[list[str]]]:
    """The header cells and body rows of the rich table whose header row holds ``header``."""
    start = next(i for i, ln in enumerate(lines) if "┃" in ln and f" {header} " in ln)
    head = [c.strip() for c in lines[start].strip().strip("┃").split("┃")]
    body = []
    for ln in lines[start + 2:]:
        if not ln.startswith("│"):
            break
        body.append([c for c in ln.strip().strip("│").split("│")])
    return head, body


def test_ls_at_80_columns_keeps_every_name(dumps) -> None:
    names = _names(dumps["ref"])
    assert max(map(len, names)) > 80  # the names are longer than the terminal
    code, lines = _pty(IVQ, "ls", dumps["ref"], cwd=dumps["dir"])
    assert code == 0, lines
    assert all(len(ln) <= 80 for ln in lines), [ln for ln in lines if len(ln) > 80]
    head, body = _rows(lines, "name")
    assert len(body) == len(names)  # one line per row: nothing wrapped
    col = head.index("name")
    shown = [_shown_as(r[col], names) for r in body]
    assert shown == [e for e in names], [r[col] for r in body]
    assert any(ELLIPSIS in r[col] for r in body)  # the long ones are shortened in the middle, never cut at the end
    assert "record" in head and any("not shown at 80 columns" in ln for ln in lines)


def test_diff_at_80_columns_keeps_every_name_and_ends_with_the_verdict(dumps) -> None:
    names = _names(dumps["ref"])
    code, lines = _pty(IVQ_DIFF, dumps["ref"], dumps["test"], "--min-sqnr", "30", cwd=dumps["dir"])
    assert code == 1, lines
    head, body = _rows(lines, "tensor")
    assert len(body) == defaults.TOP_N and "sqnr_db" in head and "status" in head  # the rank metric and the status are kept
    col = head.index("tensor")
    assert all(_shown_as(r[col], names) for r in body), [r[col] for r in body]
    assert "blocks.1" in _shown_as(body[0][col], names)  # the perturbed block is the worst
    assert [ln for ln in lines if ln.strip()][-1].startswith("FAIL: ")


def test_ls_piped_is_one_row_per_line_with_every_full_name(dumps) -> None:
    r = _pipe(IVQ, "ls", dumps["ref"], cwd=dumps["dir"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    names = _names(dumps["ref"])
    header = lines[1].split("\t")
    assert lines[0].startswith("# ") and header[:3] == ["record", "#", "name"]
    size = os.path.getsize(dumps["ref"])
    assert lines[-1] == f"# on disk {size / 1024:.1f} KiB: {size / _held(dumps['ref']):.2f}× the " + lines[-1].split("the ")[1]
    rows = [ln.split("\t") for ln in lines[2:-1]]
    assert len(rows) == len(names) and all(len(row) == len(header) for row in rows)
    for name in names:  # `ivq ls d.h5 | grep NAME` finds every full name
        assert [ln for ln in lines if name in ln], name
    assert [row[2] for row in rows] == names


def test_ls_json_is_one_document(dumps) -> None:
    import json

    r = _pipe(IVQ, "ls", dumps["ref"], "--format", "json", "--kind", "tensor", cwd=dumps["dir"])
    doc = json.loads(r.stdout)
    assert [row["name"] for row in doc["rows"]] == [n for n in _names(dumps["ref"]) if n != "x"]
    assert all(isinstance(row["max"], float) for row in doc["rows"])
    size = doc["size"]  # the whole dump's size, whatever --kind shows
    assert size["file"] == os.path.getsize(dumps["ref"]) and size["data"] == _held(dumps["ref"]) > 0
    assert size["raw"] == 0 and size["data"] == size["tensors"] + size["inputs"]


def _held(path: Path) -> int:
    """The bytes of values a float dump holds: its manifest's sizes."""
    with open_dump(path) as d:
        return sum(e.nbytes for e in d.entries)


def test_diff_piped_verdict_is_the_last_line(dumps) -> None:
    fail = _pipe(IVQ_DIFF, dumps["ref"], dumps["test"], "--min-sqnr", "30", cwd=dumps["dir"])
    assert fail.returncode == 1, fail.stderr
    last = fail.stdout.splitlines()[-1]  # `ivq-diff … | tail -1`
    assert last.startswith("FAIL: ") and "sqnr_db>=30" in last
    rows = [ln.split("\t") for ln in fail.stdout.splitlines() if ln.count("\t") >= 8]
    names = _names(dumps["ref"])
    assert rows[0][2] == "tensor" and all(row[2] in names for row in rows[1:])
    ok = _pipe(IVQ_DIFF, dumps["ref"], dumps["ref"], cwd=dumps["dir"])
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("PASS: ")


def test_middle_ellipsis_and_column_dropping() -> None:
    name = PREFIX + "/blocks.0/fc1/MatMul_output_0"
    short = ellipsize_middle(name, 30)
    assert len(short) == 30 and short.startswith("/model/vision") and short.endswith("MatMul_output_0")
    assert ellipsize_middle("abc", 30) == "abc"
    td = TableData("t", [Col("name", "name", "name"), Col("a", "a", "num", drop=2), Col("b", "b", "num", drop=1)],
                   [{"name": name, "a": 1.0, "b": 2.0}])
    from rich.console import Console

    con = Console(width=50, record=True, file=open(os.devnull, "w"))
    con.print(rich_table(td, 50))
    lines = con.export_text().splitlines()
    head = next(ln for ln in lines if "name" in ln)
    assert " b " in head and " a " not in head  # the column with the highest drop goes first
    row = next(ln for ln in lines if ELLIPSIS in ln)
    assert len(row) <= 50 and row.split("│")[1].strip().endswith("MatMul_output_0")


def test_diff_format_json_is_the_ivq_diff_document(dumps) -> None:
    import json

    r = _pipe(IVQ_DIFF, dumps["ref"], dumps["test"], "--min-sqnr", "30", "--format", "json", cwd=dumps["dir"])
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)  # stdout holds only the document; the tables and the verdict went to stderr
    assert doc["schema"] == "ivq-diff/1" and doc["verdict"]["passed"] is False
    assert r.stderr.strip().splitlines()[-1].startswith("FAIL: ")
