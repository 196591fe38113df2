"""Issue 32: the README's demo figures are generated (``scripts/readme_demo.py`` from ``reports/demo.json``, snapshot
``docs/demo-figures.json``), never typed. The README must be what the snapshot renders, its notebook snippet must
name files the demo writes, and a figure changed on either side is caught. (The snapshot against a fresh demo run:
``tests/acceptance/test_readme_figures.py``.)"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "readme_demo.py"


def _script():
    spec = importlib.util.spec_from_file_location("readme_demo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_is_what_the_demo_snapshot_renders() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rd = _script()
    block = rd.readme_block((ROOT / "README.md").read_text())
    snap = json.loads(rd.SNAPSHOT.read_text())
    assert f"{snap['export']['pairs']} aligned layers" in block
    assert f"mean relative error {snap['projector_miss']['mean_rel_err_pct']:.1f} %" in block


def test_a_changed_figure_is_caught(tmp_path: Path) -> None:
    rd = _script()
    snap = json.loads(rd.SNAPSHOT.read_text())
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text().replace(f"{snap['export']['pairs']} aligned layers",
                                                               "470 aligned layers"))
    problems = rd.check(readme=readme)
    assert len(problems) == 1 and "not what" in problems[0]
    assert rd.check() == []
    moved = json.loads(json.dumps(snap))
    moved["projector_miss"]["amplification"] = 5.5
    other = tmp_path / "snap.json"
    other.write_text(json.dumps(moved))
    (problem,) = rd.check(snapshot=other)  # the README no longer matches the snapshot
    assert "not what" in problem


def test_notebook_snippet_names_files_the_demo_writes() -> None:
    rd = _script()
    snap = json.loads(rd.SNAPSHOT.read_text())
    text = (ROOT / "README.md").read_text()
    snippet = text[text.index("In a notebook"):]
    snippet = snippet[:snippet.index("```", snippet.index("```python") + 3)]
    named = re.findall(r'"(golden/[^"]+\.h5)"', snippet)
    assert named and set(named) <= set(snap["dumps"]), (named, snap["dumps"])
