"""The reference-VLM story, run once per session: ``ivq demo`` into a temp folder, with a QNN context cache of its
own that starts empty (a first run's cost)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("onnxruntime_qnn")
    from ivq_debug.demo import run_demo

    root = tmp_path_factory.mktemp("demo")
    # a user's first `ivq demo`: the QNN context cache on and empty (tests/conftest.py turns it off for the others),
    # so the demo's HTP captures of one graph share its compiled contexts and exposure search, as they do for users
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IVQ_QNN_CACHE", str(root / "qnn-cache"))
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
