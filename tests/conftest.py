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


@pytest.fixture(scope="session")
def session_parts(tmp_path_factory: pytest.TempPathFactory):
    """``get(model, cache, fault) -> ExportResult``: the split exports device sessions run, built on first use
    (``tests/fixtures/device_sessions.py``; dynamic-cache exports verified against torch)."""
    from ivq_debug.vlm.load import load_vlm
    from tests.fixtures.device_sessions import parts_exporter

    models: dict = {}

    def load(name: str):
        if name not in models:
            models[name] = load_vlm(name).model
        return models[name]

    return parts_exporter(tmp_path_factory.mktemp("session-parts"), load)


@pytest.fixture(scope="session")
def device_sessions(session_parts, tmp_path_factory: pytest.TempPathFactory):
    """name -> DeviceSession: every fixture of ``tests/fixtures/device_sessions.SESSIONS``, written into tmp."""
    from tests.fixtures.device_sessions import build_sessions

    return build_sessions(tmp_path_factory.mktemp("device-sessions"), session_parts)
