"""Run one hostile case and judge it against the CLI contract (README, ``docs/cli.md``, issue 16).

A case gets its own folder::

    <case>/work/     the working directory: the inputs the case built, and where outputs go
    <case>/outside/  files no command may read (traversal targets, external-data targets)
    <case>/tmp/      TMPDIR of the run: must be empty afterwards
    <case>/io/       stdout, stderr and the child's report (paths it opened)

and is run by the zygote (:mod:`tests.hostile.zygote`) in a forked child. :func:`judge` turns what
happened into problems, each with an outcome category (:data:`OUTCOMES`, worst first).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

#: outcome categories of a failing case, most serious first (a case is counted under its first problem)
OUTCOMES = ("signal", "hang", "traceback", "clobbered input", "outside read", "wrong exit", "not one line",
            "unescaped", "leftovers", "broken case")

#: what others leave in TMPDIR, not the tool: ``.ses``, the session file ONNX Runtime's telemetry (the 1DS SDK in
#: ``libonnxruntime.so``) writes there when a process imports ``onnxruntime`` (``TMPDIR=d python -c "import
#: onnxruntime"`` leaves ``d/.ses``). The cases run in processes forked from a zygote that imported it already; a
#: child the tool starts (the HTP worker of ``ivq tune``, ``capture/worker.py``) imports it afresh.
TMP_OTHERS = frozenset({".ses"})
#: characters that must never reach a terminal or a report raw: C0 controls but tab/newline, DEL, C1
_RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass
class Case:
    """One hostile input run against one command.

    Attributes:
        id: ``<format>/<what>/<command>``, unique.
        fmt: the input format under attack (the table's rows).
        build: prepares the inputs in ``ws.work`` and returns the argv (after the program name).
        exit: the documented exit code (or the codes allowed when the input's effect cannot be known in
            advance, e.g. a flipped bit in tensor data without a checksum).
        prog: ``ivq`` or ``ivq-diff``.
        creates: globs (relative to ``work/``) of the files the command may leave; anything else new is a
            leftover.
        stdin: ``devnull`` or ``pipe`` (a pipe that never gets data).
        fsize: ``RLIMIT_FSIZE`` in bytes (a full disk).
        tmpfs: a ``work/`` sub folder mounted as a tmpfs of ``tmpfs_size`` bytes (``ENOSPC``).
        readonly: a ``work/`` sub folder bind-mounted read-only (``EROFS``).
        payloads: strings that must not appear raw in the outputs named by ``scan`` (HTML / text outputs).
        scan: output files (relative to ``work/``) checked for ``payloads`` and raw control characters.
        timeout: seconds before the run counts as a hang.
        env: extra environment variables.
        memory: address space the run may add to the server's (``RLIMIT_AS``; default 3 GiB), so that an
            input that asks for terabytes fails fast instead of swapping the machine.
    """

    id: str
    fmt: str
    build: Callable[[Workspace], list[str]]
    exit: int | tuple[int, ...]
    prog: str = "ivq"
    creates: tuple[str, ...] = ()
    stdin: str = "devnull"
    fsize: int | None = None
    tmpfs: str | None = None
    tmpfs_size: int = 16384
    readonly: str | None = None
    payloads: tuple[str, ...] = ()
    scan: tuple[str, ...] = ()
    timeout: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    memory: int | None = None

    @property
    def exits(self) -> tuple[int, ...]:
        """The allowed exit codes."""
        return self.exit if isinstance(self.exit, tuple) else (self.exit,)


class Workspace:
    """The folders of one case, with helpers to place valid inputs and hostile files."""

    def __init__(self, root: Path, corpus: dict[str, Path]) -> None:
        self.root = root
        self.corpus = corpus
        self.work = root / "work"
        self.outside = root / "outside"
        self.tmp = root / "tmp"
        self.io = root / "io"
        for d in (self.work, self.outside, self.tmp, self.io):
            d.mkdir(parents=True, exist_ok=True)

    def copy(self, name: str, as_: str | None = None) -> str:
        """Copy a corpus file (or folder) into ``work/``; returns its path relative to ``work/``."""
        src = self.corpus[name]
        dst = self.work / (as_ or name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copyfile(src, dst)
        return os.path.relpath(dst, self.work)

    def write(self, rel: str, data: bytes | str) -> str:
        """Write a file under ``work/``."""
        p = self.work / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)
        return rel

    def secret(self, name: str = "secret.bin", data: bytes = b"SECRET" * 64) -> Path:
        """A file outside the inputs (reads of it are reported)."""
        p = self.outside / name
        p.write_bytes(data)
        return p

    def fifo(self, rel: str) -> str:
        """A FIFO nobody writes to."""
        os.mkfifo(self.work / rel)
        return rel

    def socket(self, rel: str) -> str:
        """A Unix socket file with no listener."""
        target = self.work / rel
        s = socket.socket(socket.AF_UNIX)
        try:
            if len(os.fsencode(target)) < 100:  # sun_path holds 108 bytes
                s.bind(str(target))
            else:  # a deep tmp path (pytest-xdist's popen-gwN): bound in a short folder, then moved into place
                with tempfile.TemporaryDirectory() as short:
                    s.bind(os.path.join(short, "s"))
                    os.replace(os.path.join(short, "s"), target)
        finally:
            s.close()
        return rel

    def symlink(self, rel: str, target: str | Path) -> str:
        """A symbolic link (target as given: relative, absolute, dangling or looping)."""
        (self.work / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, self.work / rel)
        return rel


# ---------------------------------------------------------------------------------------- the zygote
class Zygote:
    """Client of :mod:`tests.hostile.zygote` (one server process per test session)."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   IVQ_NO_PROGRESS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", COLUMNS="160")
        env.pop("IVQ_TRACEBACK", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.hostile.zygote"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
        line = self.proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError("hostile-case server did not start")

    def run_all(self, reqs: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
        """Send requests (each with a unique ``id``), return ``id`` → result once all have finished."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        import threading

        def send() -> None:
            for r in reqs:
                self.proc.stdin.write(json.dumps(r).encode() + b"\n")
                self.proc.stdin.flush()

        t = threading.Thread(target=send, daemon=True)
        t.start()
        out: dict[Any, dict[str, Any]] = {}
        while len(out) < len(reqs):
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("hostile-case server died")
            res = json.loads(line)
            out[res["id"]] = res
        t.join()
        return out

    def close(self) -> None:
        """Stop the server."""
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------- snapshots
def _digest(p: Path) -> str:
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        return "link:" + os.readlink(p)
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if not stat.S_ISREG(st.st_mode):
        return f"special:{stat.S_IFMT(st.st_mode):o}"
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return f"{st.st_mode & 0o7777:o}:" + h.hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    """relative path → digest of every entry under ``root`` (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            try:
                out[os.path.relpath(p, root)] = _digest(p)
            except OSError:
                out[os.path.relpath(p, root)] = "unreadable"
    return out


def _age_atimes(root: Path) -> dict[str, float]:
    """Set every outside file's atime before its mtime (relatime then records any read); returns them."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            os.utime(p, (st.st_mtime - 3 * 86400, st.st_mtime))
            out[str(p)] = p.stat().st_atime
    return out


# ---------------------------------------------------------------------------------------- running
@dataclass
class Result:
    """What one case did, and what was wrong with it."""

    case: Case
    rc: int | None
    signal: str | None
    hang: str | None
    seconds: float
    stdout: str
    stderr: str
    problems: list[tuple[str, str]] = field(default_factory=list)
    skipped: str | None = None
    cpu: float | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        """``ivq-diff`` or the ``ivq`` subcommand the case ran."""
        return self.case.prog if self.case.prog != "ivq" else (self.argv[0] if self.argv else "")

    @property
    def outcome(self) -> str:
        """``pass`` or the first (worst) problem's category."""
        if not self.problems:
            return "pass"
        return min((p[0] for p in self.problems), key=OUTCOMES.index)

    def describe(self) -> str:
        """A readable summary for assertion messages."""
        lines = [f"{self.case.id}: rc={self.rc} signal={self.signal} hang={self.hang} ({self.seconds:.2f} s)"]
        lines += [f"  {cat}: {why}" for cat, why in self.problems]
        lines.append("  stderr: " + (self.stderr[-1500:] if self.stderr else "(empty)").replace("\n", "\n          "))
        return "\n".join(lines)


@dataclass
class Prepared:
    """A case whose inputs are built and snapshotted, ready to send."""

    case: Case
    ws: Workspace
    req: dict[str, Any]
    before: dict[str, str]
    atimes: dict[str, float]


def prepare(case: Case, root: Path, corpus: dict[str, Path]) -> Prepared:
    """Build the case's inputs in a fresh folder and record their state."""
    ws = Workspace(root, corpus)
    argv = case.build(ws)
    req: dict[str, Any] = {
        "id": case.id, "prog": case.prog, "argv": argv, "cwd": str(ws.work), "io_dir": str(ws.io),
        "stdin": case.stdin, "env": {"TMPDIR": str(ws.tmp), "IVQ_NO_PROGRESS": "1", "COLUMNS": "160"},
        "timeout": case.timeout, "fsize": case.fsize, "watch_dir": str(ws.work),
    }
    req["env"].update(case.env)
    if case.memory is not None:
        req["memory"] = case.memory
    if case.tmpfs:
        (ws.work / case.tmpfs).mkdir(parents=True, exist_ok=True)
        req.update(tmpfs=str(ws.work / case.tmpfs), tmpfs_size=case.tmpfs_size)
    if case.readonly:
        (ws.work / case.readonly).mkdir(parents=True, exist_ok=True)
        req["readonly"] = str(ws.work / case.readonly)
    return Prepared(case, ws, req, snapshot(ws.work), _age_atimes(ws.outside))


def finish(p: Prepared, res: dict[str, Any]) -> Result:
    """Judge a finished case."""
    if "error" in res:
        raise RuntimeError(f"{p.case.id}: the case server failed: {res['error']}")
    report = {}
    rp = p.ws.io / "report.json"
    if rp.exists():
        report = json.loads(rp.read_text(encoding="utf-8", errors="surrogateescape"))
    out = Result(p.case, res["rc"], res["signal"], res["hang"], res["seconds"], _text(p.ws.io / "stdout"),
                 _text(p.ws.io / "stderr"), cpu=res.get("cpu"), argv=p.req["argv"])
    if report.get("setup_error"):
        out.skipped = report["setup_error"].strip().splitlines()[-1]
        return out
    judge(out, p.ws, p.before, p.atimes, report)
    return out


def run_cases(zygote: Zygote, cases: Sequence[Case], root: Path, corpus: dict[str, Path],
              keep: bool = False) -> dict[str, Result]:
    """Prepare, run (concurrently, as the server allows) and judge cases; ``id`` → result. The folders of
    passing cases are removed unless ``keep``."""
    prepared, broken = {}, {}
    for c in cases:
        try:
            prepared[c.id] = prepare(c, root / _slug(c.id), corpus)
        except Exception:  # a bug in the case itself: reported as such, the others still run
            import traceback

            broken[c.id] = Result(c, None, None, None, 0.0, "", "", [("broken case", traceback.format_exc())])
    results = zygote.run_all([p.req for p in prepared.values()])
    out = {}
    for cid, p in prepared.items():
        out[cid] = r = finish(p, results[cid])
        if not r.problems and not keep:
            shutil.rmtree(p.ws.root, ignore_errors=True)  # failing cases keep their folder for a look
    out.update(broken)
    return out


def _slug(case_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", case_id)


def _text(p: Path) -> str:
    try:
        return p.read_bytes().decode("utf-8", "backslashreplace")
    except FileNotFoundError:
        return ""


def _matches(rel: str, globs: Sequence[str]) -> bool:
    parts = Path(rel).parts
    prefixes = {"/".join(parts[: i + 1]) for i in range(len(parts))}
    return any(fnmatch.fnmatch(rel, g) or any(fnmatch.fnmatch(p, g) for p in prefixes) for g in globs)


def judge(r: Result, ws: Workspace, before: dict[str, str], atimes: dict[str, float], report: dict) -> None:
    """Fill ``r.problems`` from the run and the folders."""
    case, add = r.case, r.problems.append
    if r.signal:
        add(("signal", f"killed by {r.signal}"))
    if r.hang:
        add(("hang", r.hang))
    if "Traceback (most recent call last)" in r.stderr or ": internal error:" in r.stderr:
        add(("traceback", _last_line(r.stderr)))
    after = snapshot(ws.work)
    for rel in report.get("listing") or ():  # a private mount: what the child saw inside it at the end
        after.setdefault(rel, "new")
    changed = sorted(k for k, v in before.items() if after.get(k) != v and not _matches(k, case.creates))
    if changed:
        add(("clobbered input", ", ".join(changed[:5])))
    outside_real = os.path.realpath(ws.outside)
    seen = set()
    for kind in ("opened", "listed"):
        for p in report.get(kind, []):
            full = os.path.realpath(os.path.join(ws.work, p))
            if (full == outside_real or full.startswith(outside_real + os.sep)) and full not in seen:
                seen.add(full)
                add(("outside read", f"{kind} {os.path.relpath(full, ws.root)}"))
    for p, a in atimes.items():
        try:
            if os.stat(p).st_atime != a and os.path.realpath(p) not in seen:
                add(("outside read", f"read {os.path.relpath(p, ws.root)} (atime)"))
        except FileNotFoundError:
            add(("clobbered input", f"removed {os.path.relpath(p, ws.root)}"))
    if r.rc is not None and r.rc not in case.exits:
        add(("wrong exit", f"exit {r.rc}, expected {'/'.join(map(str, case.exits))}: {_last_line(r.stderr)}"))
    if r.rc is not None and r.rc in (2, 3, 5) and not any(c == "traceback" for c, _ in r.problems):
        lines = [ln for ln in r.stderr.split("\n") if ln.strip()]
        prog = case.prog
        if len(lines) != 1 or not lines[0].startswith(f"{prog}: error: "):
            add(("not one line", f"{len(lines)} stderr line(s): {r.stderr[:300]!r}"))
    for name, text in (("stderr", r.stderr), ("stdout", r.stdout)):
        m = _RAW_CONTROL.search(text)
        if m:
            add(("unescaped", f"raw {m.group()!r} in {name}"))
    for rel in case.scan:
        p = ws.work / rel
        if p.is_file():
            text = p.read_bytes().decode("utf-8", "backslashreplace")
            for pl in case.payloads:
                if pl in text:
                    add(("unescaped", f"payload {pl[:40]!r} raw in {rel}"))
            m = _RAW_CONTROL.search(text.replace("\r\n", "\n"))
            if m:
                add(("unescaped", f"raw {m.group()!r} in {rel}"))
    new = sorted(k for k in after if k not in before and not _matches(k, case.creates))
    if new:
        add(("leftovers", ", ".join(new[:5])))
    tmp_left = sorted(set(os.listdir(ws.tmp)) - TMP_OTHERS)
    if tmp_left:
        add(("leftovers", "TMPDIR: " + ", ".join(tmp_left[:5])))


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().split("\n") if ln.strip()]
    return lines[-1][:300] if lines else "(no stderr)"


# ---------------------------------------------------------------------------------------- the table
def table(rows: list[dict[str, str]]) -> str:
    """A markdown table: cases by format (rows) and outcome (columns), from recorded outcomes."""
    fmts = sorted({r["fmt"] for r in rows})
    cols = ["pass", *OUTCOMES]
    used = [c for c in cols if any(r["outcome"] == c for r in rows)]
    head = "| format | cases | " + " | ".join(used) + " |"
    sep = "|---|---:|" + "---:|" * len(used)
    lines = [head, sep]
    for f in [*fmts, "total"]:
        sel = [r for r in rows if f == "total" or r["fmt"] == f]
        cells = [str(sum(r["outcome"] == c for r in sel) or "") for c in used]
        name = f"**{f}**" if f == "total" else f
        lines.append(f"| {name} | {len(sel)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tests.hostile.harness OUTCOMES.jsonl
    rows = [json.loads(ln) for ln in Path(sys.argv[1]).read_text().splitlines() if ln.strip()]
    print(table(rows))
