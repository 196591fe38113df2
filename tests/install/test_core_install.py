"""The core install for real: a fresh venv (``python -m venv``), ``pip install`` of this checkout with its core
dependencies only (PyPI through pip's own cache: a rerun downloads nothing new), then ``ivq quantize --dynamic``,
``ivq capture onnx`` and ``ivq ls`` with no torch, transformers, pandas or matplotlib in the venv (slow: about a
minute with a warm pip cache). The installed size goes to ``test-artifacts/core-install.json``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.dynamic_models import build_mlp, mlp_input

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("torch", "transformers", "pandas", "matplotlib", "PIL", "onnxscript", "onnxruntime_qnn")


def sizes(site: Path) -> dict[str, int]:
    """Bytes per top-level entry of site-packages (a package with its .dist-info counted apart)."""
    out = {}
    for p in site.iterdir():
        out[p.name] = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
    return out


def test_fresh_venv_core_install_captures_without_torch(tmp_path: Path, artifacts_dir: Path) -> None:
    src = tmp_path / "src"  # the checkout's package files (pip builds in place: keep build/ out of the checkout)
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "ivq_debug", src / "ivq_debug", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py, bin_ = venv / "bin" / "python", venv / "bin"
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)), "IVQ_NO_PROGRESS": "1"}
    r = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", str(src)], env=env,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    freeze = subprocess.run([str(py), "-m", "pip", "freeze"], env=env, capture_output=True, text=True).stdout
    names = {line.replace(" @ ", "==").split("==")[0].strip().lower().replace("_", "-")
             for line in freeze.splitlines() if "==" in line or " @ " in line}
    assert {"ivq-debug", "numpy", "onnx", "onnxruntime", "h5py", "rich"} <= names
    assert not names & {"torch", "transformers", "pandas", "matplotlib", "pillow", "onnxscript", "onnxruntime-qnn", "psutil"}

    build_mlp(tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", **mlp_input())

    def ivq(*args: str, prog: str = "ivq") -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_ / prog), *args], cwd=tmp_path, env=env, capture_output=True, text=True)

    for args in (("quantize", "m.onnx", "-o", "q.onnx", "--dynamic"),
                 ("capture", "onnx", "q.onnx", "--inputs", "x.npz", "-o", "q.h5", "--optimization", "all"),
                 ("capture", "onnx", "m.onnx", "--inputs", "x.npz", "-o", "m.h5")):
        r = ivq(*args)
        assert r.returncode == 0, (args, r.stderr[-2000:])
    r = ivq("ls", "q.h5")  # (results go to stdout)
    assert r.returncode == 0 and "/blocks.0/fc1/Add_output_0" in r.stdout and "_quantized" not in r.stdout, r.stderr
    r = ivq("ls", "q.h5", "--records")
    assert r.returncode == 0 and "r000000" in r.stdout, r.stderr
    # what needs an extra says which, in one line, exit 5
    r = ivq("m.h5", "q.h5", prog="ivq-diff")
    assert r.returncode == 5 and r.stderr.strip() == ("ivq-diff: error: `ivq-diff` needs pandas, which is not "
                                                      "installed: pip install 'ivq-debug[analysis]'")
    r = ivq("demo")
    assert r.returncode == 5 and "pip install 'ivq-debug[torch]'" in r.stderr.strip().splitlines()[-1]
    probe = f"import importlib.util as u; print([m for m in {EXTRAS!r} if u.find_spec(m)])"
    check = subprocess.run([str(py), "-c", probe], env=env, capture_output=True, text=True)
    assert check.stdout.strip() == "[]", check.stdout
    site = next((venv / "lib").glob("python*/site-packages"))
    by_entry = sizes(site)
    report = {"total_bytes": sum(by_entry.values()),
              "largest": dict(sorted(by_entry.items(), key=lambda kv: -kv[1])[:12]), "freeze": sorted(names)}
    (artifacts_dir / "core-install.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"core install: {report['total_bytes'] / 2**20:.0f} MiB in site-packages")
