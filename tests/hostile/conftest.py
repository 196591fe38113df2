"""One pre-imported case server for the session (its start costs a few seconds: it imports everything)."""

from __future__ import annotations

import os

import pytest

from tests.hostile import harness


@pytest.fixture(scope="session")
def zygote():
    """The :class:`~tests.hostile.harness.Zygote` all hostile tests share."""
    os.environ.setdefault("IVQ_HOSTILE_JOBS", str(min(2, os.cpu_count() or 1)))
    z = harness.Zygote()
    yield z
    z.close()
