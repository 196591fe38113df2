"""The reference-VLM story, run once per session: ``ivq demo`` into a temp folder (about 75 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("onnxruntime_qnn")
    from ivq_debug.demo import run_demo

    root = tmp_path_factory.mktemp("demo")
    res = run_demo("internvl-tiny", golden=root / "golden", reports=root / "reports", workdir=root / "work",
                   n_capture=2, n_eval=16, log=lambda m: None)
    res.root = root  # type: ignore[attr-defined]
    return res


def by_kind(findings: list[Any], kind: str, severity: str | None = None) -> list[Any]:
    """Findings of one kind (and severity)."""
    return [f for f in findings if f.kind == kind and (severity is None or f.severity == severity)]


def label(res: Any, needle: str) -> str:
    """The demo comparison whose label contains ``needle``."""
    return next(k for k in res.comparisons if needle in k)


@pytest.fixture(scope="session")
def work(demo: Any) -> Path:
    return Path(demo.root) / "work"
