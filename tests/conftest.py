"""Shared pytest setup: no progress bars, deterministic threads, an artifacts folder for humans."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("IVQ_NO_PROGRESS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Folder where tests leave files for people to look at (screenshots, reports); git-ignored."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
