"""Terminal output: one rich console on stderr, and progress bars for long work.

Everything human-facing goes to stderr so that stdout stays clean for JSON (``ivq-diff --json -``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

_console = None


def console():
    """The shared ``rich.console.Console`` writing to stderr."""
    global _console
    if _console is None:
        from rich.console import Console

        width = None
        if not sys.stderr.isatty():  # logs and CI: wide enough for tensor names
            width = int(os.environ.get("COLUMNS", "160"))
        # no highlighting and no :emoji: codes: names from files are shown as they are (escaped by the callers)
        _console = Console(stderr=True, highlight=False, emoji=False, soft_wrap=False, width=width)
    return _console


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
