"""Terminal output: a command's results on stdout, everything else (progress, notes, errors) on stderr; progress
bars for long work, and phases with their elapsed time.

:func:`results` is the console for what a command produces (tables, verdicts, ``wrote ...`` lines): stdout, so
``ivq ls d.h5 | less`` and ``ivq-diff a.h5 b.h5 | grep FAIL`` work, except when stdout carries JSON
(``--json -``), where the results go to stderr and stdout holds only the document. :func:`console` (stderr) is
for progress bars, notes and diagnostics. On a terminal, :func:`track` bars and :func:`phase` lines share one live
display (a phase started while a bar runs, e.g. a QNN compile inside ``capturing``, is one more line of it:
``compiling QNN HTP graph: capture 1/2, 369 tensors  12 s``). Off a terminal (logs, CI) a phase that lasts longer
than :data:`PHASE_NOTE_S` prints one line when it passes that mark and one when it ends, so a log shows what a long
step was doing. ``IVQ_NO_PROGRESS`` silences both.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from ivq_debug import defaults

T = TypeVar("T")
#: off a terminal, a phase running longer than this (s) is announced in the log
PHASE_NOTE_S = defaults.PROGRESS_PHASE_NOTE_S

_console = None
_results = None
_live: Any = None  # the rich Progress shared by the running track()/phase() blocks
_live_users = 0
_live_lock = threading.RLock()


def _make(stderr: bool):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None
    if not stream.isatty():  # pipes, logs and CI: wide enough for tensor names
        width = int(os.environ.get("COLUMNS", "160"))
    # no highlighting and no :emoji: codes: names from files are shown as they are (escaped by the callers)
    return Console(stderr=stderr, highlight=False, emoji=False, soft_wrap=False, width=width)


def console():
    """The shared ``rich.console.Console`` writing to stderr (progress, notes, diagnostics)."""
    global _console
    if _console is None:
        _console = _make(stderr=True)
    return _console


def results(json_to_stdout: bool = False):
    """The console for a command's results: stdout, or stderr when ``json_to_stdout`` (``--json -``)."""
    global _results
    if json_to_stdout:
        return console()
    if _results is None:
        _results = _make(stderr=False)
    return _results


def progress_enabled() -> bool:
    """Progress bars show on a terminal unless ``IVQ_NO_PROGRESS`` is set."""
    if os.environ.get("IVQ_NO_PROGRESS"):
        return False
    return sys.stderr.isatty() or bool(os.environ.get("IVQ_FORCE_PROGRESS"))


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(str(text))


def warn(message: str) -> None:
    """Print ``warning: <message>`` on the console (stderr), whatever the progress setting."""
    console().print(f"[yellow]warning[/yellow]: {_escape(message)}")


def note(message: str) -> None:
    """Print an informational line on the console (stderr) unless ``IVQ_NO_PROGRESS`` is set."""
    if not os.environ.get("IVQ_NO_PROGRESS"):
        console().print(_escape(message))


def _elapsed_column() -> Any:
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Times(ProgressColumn):
        """``12 s`` for a phase, ``12 s, ETA 0:03`` for a bar with a total."""

        def render(self, task: Any) -> Any:
            text = f"{task.elapsed or 0:.0f} s"
            if task.total is not None and task.time_remaining is not None and not task.finished:
                m, s = divmod(int(task.time_remaining), 60)
                text += f", ETA {m}:{s:02d}"
            return Text(text, style="progress.elapsed")

    return Times()


@contextmanager
def _live_progress() -> Iterator[Any]:
    """The shared live display (started by the outermost user, stopped when the last one leaves)."""
    global _live, _live_users
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    with _live_lock:
        if _live is None:
            _live = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), _elapsed_column(),
                             console=console(), transient=True)
            _live.start()
        _live_users += 1
        prog = _live
    try:
        yield prog
    finally:
        with _live_lock:
            _live_users -= 1
            if _live_users == 0:
                _live.stop()
                _live = None


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar on stderr (a plain iteration when not on a terminal)."""
    if not progress_enabled():
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with _live_progress() as prog:
        task = prog.add_task(_escape(description), total=total)
        try:
            for item in items:
                yield item
                prog.advance(task)
        finally:
            prog.remove_task(task)


@contextmanager
def phase(message: str) -> Iterator[None]:
    """Show ``message`` with its elapsed seconds while a block runs (see the module docstring)."""
    if os.environ.get("IVQ_NO_PROGRESS"):
        yield
        return
    if progress_enabled():
        with _live_progress() as prog:
            task = prog.add_task(_escape(message), total=None)
            try:
                yield
            finally:
                prog.remove_task(task)
        return
    t0 = time.perf_counter()
    announced = threading.Event()

    def announce() -> None:
        announced.set()
        note(f"{message}: still running after {PHASE_NOTE_S:.0f} s")

    timer = threading.Timer(PHASE_NOTE_S, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if announced.is_set():
            note(f"{message}: done in {time.perf_counter() - t0:.1f} s")


@contextmanager
def status(message: str) -> Iterator[None]:
    """:func:`phase` on a terminal (silent when progress is disabled)."""
    if not progress_enabled():
        yield
        return
    with phase(message):
        yield
