"""Terminal output: a command's results on stdout, everything else (progress, notes, errors) on stderr.

:func:`results` is the console for what a command produces (tables, verdicts, ``wrote ...`` lines): stdout, so
``ivq ls d.h5 | less`` and ``ivq-diff a.h5 b.h5 | grep FAIL`` work, except when stdout carries JSON
(``--json -``), where the results go to stderr and stdout holds only the document. :func:`console` (stderr) is
for progress bars, notes and diagnostics.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

_console = None
_results = None


def _make(stderr: bool):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None
    if not stream.isatty():  # pipes, logs and CI: wide enough for tensor names
        width = int(os.environ.get("COLUMNS", "160"))
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


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


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar on stderr (a plain iteration when not on a terminal)."""
    if not progress_enabled():
        yield from items
        return
    from rich.progress import track as _track

    yield from _track(items, description=description, total=total, console=console(), transient=True)


@contextmanager
def status(message: str):
    """A spinner with a message while a block runs (silent when progress is disabled)."""
    if not progress_enabled():
        yield
        return
    with console().status(message):
        yield
