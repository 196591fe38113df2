"""Processes as the tests see them through ``/proc``."""

from __future__ import annotations


def running(pid: int) -> bool:
    """``pid`` runs: it exists and is no zombie (one that has ended and waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
