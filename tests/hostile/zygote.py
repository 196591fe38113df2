"""A pre-imported interpreter that runs each hostile case in its own forked child process.

The test process starts this module once (``python -m tests.hostile.zygote``); it imports everything the
CLI commands load lazily (h5py, pandas, rich, onnx, onnxruntime and its quantization tools, the report
code), then serves requests on its stdin: one JSON object per line, one JSON result per line. Each
request forks a child that runs ``ivq`` or ``ivq-diff`` (``ivq_debug.cli.main.main`` / ``cli.diff.main``)
exactly as the console scripts do, with

* its own process group, working directory, ``TMPDIR``, stdin (``/dev/null``, or a pipe that stays open
  and never gets data: reading it blocks, like a terminal nobody types into), stdout and stderr files
  (stderr with ``backslashreplace``, stdout ``strict``: Python's defaults for a UTF-8 locale);
* optional resource limits (``RLIMIT_FSIZE`` for a full disk, ``RLIMIT_AS`` as a safety net against
  inputs that ask for terabytes) and an optional private mount namespace with a small tmpfs (``ENOSPC``)
  or a read-only bind mount on one folder (``EROFS``);
* an audit hook recording every path the Python side opens or lists (for outside-read checks).

The server watches the child: exit code, the signal that killed it, or a hang. A hang is declared when
the child sits in a blocking pipe / FIFO wait (``/proc/<pid>/wchan`` is ``wait_for_partner``,
``pipe_read``, …) for a moment, or at the request's timeout; the whole process group is then killed.
A fork costs milliseconds, so several hundred cases run in well under a minute, each isolated.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

#: kernel wait channels of a process blocked on a pipe or FIFO nobody will write to
BLOCKED_WCHANS = {"wait_for_partner", "pipe_read", "anon_pipe_read", "pipe_wait", "pipe_wait_readable",
                  "fifo_open", "unix_stream_read_generic", "n_tty_read"}
#: how long a child may sit in one of those waits before it counts as hung (seconds)
BLOCKED_FOR = 0.4

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def preimport() -> None:
    """Import what the commands import lazily, so that a forked child starts warm."""
    import importlib

    os.environ.setdefault("IVQ_NO_PROGRESS", "1")
    for m in (
        "numpy", "pandas", "h5py", "rich.console", "rich.table", "rich.text", "rich.markup", "onnx",
        "onnx.numpy_helper", "onnxruntime", "onnxruntime.quantization",
        "onnxruntime.quantization.execution_providers.qnn", "ivq_debug.cli.main", "ivq_debug.cli.diff",
        "ivq_debug.cli.render", "ivq_debug.comparator", "ivq_debug.comparator.comparison", "ivq_debug.dump",
        "ivq_debug.report", "ivq_debug.report.html", "ivq_debug.report.exports", "ivq_debug.report.timeline",
        "ivq_debug.capture.onnxrt.runner", "ivq_debug.capture.base", "ivq_debug.capture.qnn_net_run.ingest",
        "ivq_debug.qnn.quantize", "ivq_debug.qnn.encodings", "ivq_debug.qnn.netjson", "ivq_debug.qnn.profiling",
        "ivq_debug.capture.qnn_net_run.io", "ivq_debug.qnn.names", "ivq_debug.onnxgraph.load", "ivq_debug.diagnose.replay", "ivq_debug.tune.suggest",
        "ivq_debug.tune.verify", "jsonschema",
    ):
        try:
            importlib.import_module(m)
        except Exception:  # a module a case needs will fail in the child with its real error
            pass
    from ivq_debug.cli.main import build_parser

    build_parser()  # imports every command module


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _private_mounts(req: dict) -> None:
    """Enter a private mount namespace and mount a small tmpfs or a read-only bind on one folder."""
    libc = _libc()
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    else:
        _check(libc.unshare(CLONE_NEWNS), "unshare")
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    if "tmpfs" in req:
        target = os.fsencode(req["tmpfs"])
        opts = f"size={int(req.get('tmpfs_size', 16384))}".encode()
        _check(libc.mount(b"tmpfs", target, b"tmpfs", 0, opts), "mount tmpfs")
    if "readonly" in req:
        target = os.fsencode(req["readonly"])
        _check(libc.mount(target, target, None, MS_BIND, None), "bind")
        _check(libc.mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None), "remount ro")


def _listing(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            out.append(os.path.relpath(os.path.join(dirpath, n), root))
    return sorted(out)


def _child(req: dict, proto_fds: tuple[int, int], stdin_r: int | None, pipes: tuple[int, int]) -> None:
    """Body of the forked child: never returns."""
    code = 125
    opened: list[str] = []
    listed: list[str] = []
    setup_error = None
    try:
        os.setpgid(0, 0)
        for fd in proto_fds:
            os.close(fd)
        if stdin_r is None:
            stdin_r = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin_r, 0)
        out_fd, err_fd = pipes
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="strict")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        os.chdir(req["cwd"])
        os.environ.update(req.get("env", {}))
        import tempfile

        tempfile.tempdir = req["env"]["TMPDIR"] if "TMPDIR" in req.get("env", {}) else None
        import ivq_debug.console

        ivq_debug.console._console = None
        if req.get("tmpfs") or req.get("readonly"):
            try:
                _private_mounts(req)
            except OSError as e:
                setup_error = f"mount namespace unavailable: {e}"
        if req.get("fsize") is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], resource.RLIM_INFINITY))
        with open("/proc/self/statm") as f:
            vsz = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = vsz + int(req.get("memory") or 3 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as a fresh interpreter has it: writes fail with EFBIG

        def hook(event: str, args: tuple) -> None:
            if event == "open" and args and isinstance(args[0], (str, bytes)):
                opened.append(os.fsdecode(args[0]))
            elif event in ("os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)):
                listed.append(os.fsdecode(args[0]))

        if setup_error is None:
            sys.addaudithook(hook)
            if req["prog"] == "ivq-diff":
                from ivq_debug.cli.diff import main
            elif req["prog"] == "selftest":
                main = _selftest
            else:
                from ivq_debug.cli.main import main
            sys.argv = [req["prog"], *req["argv"]]
            try:
                main(req["argv"])
                code = 0
            except SystemExit as e:
                c = e.code
                code = c if isinstance(c, int) else (0 if c is None else 1)
                if not isinstance(c, int) and c is not None:
                    print(c, file=sys.stderr)
            except BaseException:  # what the interpreter would do with an uncaught exception
                traceback.print_exc()
                code = 1
    except BaseException:
        try:
            setup_error = traceback.format_exc()
        except BaseException:
            setup_error = "child setup failed"
    try:
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        try:
            sys.stderr.flush()
        except BaseException:
            pass
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)  # the report is ours
        watch = req.get("watch_dir")
        report = {"opened": opened, "listed": listed, "setup_error": setup_error,
                  "listing": _listing(watch) if watch and (req.get("tmpfs") or req.get("readonly")) else None}
        with open(os.path.join(req["io_dir"], "report.json"), "w", encoding="utf-8", errors="surrogateescape") as f:
            json.dump(report, f)
    finally:
        os._exit(code if setup_error is None else 124)


def _selftest(argv: list[str]) -> None:
    """Misbehaviours the harness must catch (``tests/hostile/test_harness.py``)."""
    what, *args = argv
    if what == "hang":
        with open(args[0]) as f:  # a FIFO: blocks until a writer comes
            f.read()
    elif what == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif what == "traceback":
        raise ValueError("boom")
    elif what == "write":
        with open(args[0], "w") as f:
            f.write("x")
    elif what == "read":
        with open(args[0], "rb") as f:
            f.read()
    elif what == "tempfile":
        import tempfile

        tempfile.mkstemp()
    elif what == "print":
        print(args[0], file=sys.stderr)
    raise SystemExit(int(os.environ.get("SELFTEST_EXIT", "3")))


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip()
    except OSError:
        return ""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Running:
    """One forked child being watched."""

    def __init__(self, req: dict, proto_fds: tuple[int, int]) -> None:
        self.req = req
        stdin_r = stdin_w = None
        if req.get("stdin") == "pipe":
            stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            for fd in (stdin_w, out_r, err_r):
                if fd is not None:
                    os.close(fd)
            _child(req, proto_fds, stdin_r, (out_w, err_w))
        for fd in (stdin_r, out_w, err_w):
            if fd is not None:
                os.close(fd)
        # the child's stdout / stderr are pipes copied to files here: no RLIMIT_FSIZE on them, no full disk
        self.sinks = {out_r: open(os.path.join(req["io_dir"], "stdout"), "wb"),
                      err_r: open(os.path.join(req["io_dir"], "stderr"), "wb")}
        for fd in self.sinks:
            os.set_blocking(fd, False)
        self.pid, self.stdin_w = pid, stdin_w
        self.pidfd = os.pidfd_open(pid)
        self.timeout = float(req.get("timeout", 30.0))
        self.blocked_since: float | None = None
        self.hang: str | None = None

    def watch(self, now: float) -> bool:
        """Check for a hang; kill the group when there is one. True when the child must be reaped."""
        w = _wchan(self.pid)
        if w in BLOCKED_WCHANS:
            self.blocked_since = self.blocked_since or now
            if now - self.blocked_since >= BLOCKED_FOR:
                self.hang = f"blocked in {w}"
        else:
            self.blocked_since = None
        if now - self.t0 > self.timeout:
            self.hang = f"timeout after {self.timeout:g} s"
        if self.hang:
            _kill_group(self.pid)
            return True
        return False

    def pump(self, fd: int) -> None:
        """Copy what the child wrote to one of its pipes."""
        try:
            while chunk := os.read(fd, 1 << 16):
                self.sinks[fd].write(chunk)
        except BlockingIOError:
            pass

    def reap(self) -> dict:
        """Wait for the (exited or killed) child; its result."""
        _, status, ru = os.wait4(self.pid, 0)
        os.close(self.pidfd)
        if self.stdin_w is not None:
            os.close(self.stdin_w)
        _kill_group(self.pid)  # anything the child left running in its group
        for fd, f in self.sinks.items():
            self.pump(fd)
            f.close()
            os.close(fd)
        res = {"id": self.req.get("id"), "seconds": round(time.monotonic() - self.t0, 4), "hang": self.hang,
               "rc": None, "signal": None, "cpu": round(ru.ru_utime + ru.ru_stime, 4)}
        if self.hang is None:
            if os.WIFSIGNALED(status):
                res["signal"] = signal.Signals(os.WTERMSIG(status)).name
            else:
                res["rc"] = os.WEXITSTATUS(status)
        return res


def serve() -> None:
    """Read requests (JSON lines, each with an ``id``) on stdin and run up to ``IVQ_HOSTILE_JOBS`` at once;
    answer each on stdout when it finishes (JSON lines, same ``id``); exit at EOF once all are done."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # stray prints go to the server's stderr, never into the protocol
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    jobs = max(1, int(os.environ.get("IVQ_HOSTILE_JOBS", "1")))
    preimport()
    wr = os.fdopen(proto_out, "wb", buffering=0)
    wr.write(b'{"ready": true}\n')
    buf, queue, running, eof = b"", [], {}, False
    while not (eof and not queue and not running):
        while queue and len(running) < jobs:
            req = queue.pop(0)
            try:
                r = Running(req, (proto_in, proto_out))
                running[r.pidfd] = r
            except Exception as e:  # report, keep serving
                wr.write(json.dumps({"id": req.get("id"), "error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        pipes = {fd: r for r in running.values() for fd in r.sinks}
        fds = list(running) + list(pipes) + ([] if eof else [proto_in])
        ready, _, _ = select.select(fds, [], [], 0.05)
        now = time.monotonic()
        for fd in ready:
            if fd in pipes:
                pipes[fd].pump(fd)
        done = [fd for fd in ready if fd in running]
        if proto_in in ready:
            chunk = os.read(proto_in, 1 << 16)
            if not chunk:
                eof = True
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                queue.append(json.loads(line))
        for fd, r in running.items():
            if fd not in done and r.watch(now):
                done.append(fd)
        for fd in done:
            r = running.pop(fd)
            wr.write(json.dumps(r.reap()).encode() + b"\n")


if __name__ == "__main__":
    serve()
