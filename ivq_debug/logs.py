"""Warnings of third-party libraries that log through the root logger, collected instead of printed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Warnings(logging.Handler):
    """WARNING and above, one line each, without repeats."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = " ".join(record.getMessage().split())
        if msg not in self.messages:
            self.messages.append(msg)


@contextmanager
def root_warnings() -> Iterator[list[str]]:
    """Keep the root logger off the console for the block (ONNX Runtime's quantizers log through it) and yield
    the list its warnings are collected in (one line each, without repeats)."""
    cap = _Warnings()
    root = logging.getLogger()
    others = list(root.handlers)
    for h in others:
        root.removeHandler(h)
    root.addHandler(cap)
    try:
        yield cap.messages
    finally:
        root.removeHandler(cap)
        for h in others:
            root.addHandler(h)
