"""Issue 32: the README's demo figures (``docs/demo-figures.json``, rendered into README.md by
``scripts/readme_demo.py``) are those of the demo this suite runs: its ``reports/demo.json`` gives the same figures,
rounded as printed. When the demo changes, rerun ``python scripts/readme_demo.py reports/demo.json``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "readme_demo.py"


def test_readme_figures_are_the_demos(demo: Any) -> None:
    spec = importlib.util.spec_from_file_location("readme_demo", SCRIPT)
    rd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rd)
    fresh = rd.figures(json.loads(Path(demo.summary).read_text()))
    snap = json.loads(rd.SNAPSHOT.read_text())
    assert fresh == snap, {k: (snap.get(k), fresh[k]) for k in fresh if snap.get(k) != fresh[k]}
    assert rd.check(demo_json=Path(demo.summary)) == []
