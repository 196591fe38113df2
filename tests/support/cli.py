"""The ``ivq`` CLI in-process, as a user calls it."""

from __future__ import annotations

import pytest

from ivq_debug.cli.main import main


def ivq_cli(*args: object) -> int:
    """``ivq ARGS`` in-process; its exit code."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return int(e.value.code or 0)
