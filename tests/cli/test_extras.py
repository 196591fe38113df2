"""The core install: capture and listing work without the extras, and a command that needs a missing extra exits 5
with one line naming it. The extras' modules are made unimportable in a child process here (``sys.modules[m] =
None``: ``import m`` then fails as for an absent package); tests/install/ does it for real in a fresh venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.errors import EXTRAS, MissingExtraError, missing_extra, require_extra
from tests.support.dynamic_models import build_mlp, mlp_input

REPO = Path(__file__).resolve().parents[2]
BLOCK = "import sys\nfor m in sys.argv[1].split(','): sys.modules[m] = None\n"


def without(extras: tuple[str, ...], script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``script`` with the modules of ``extras`` unimportable (the console entry points' code path)."""
    mods = ",".join(m for m, e in EXTRAS.items() if e in extras)
    return subprocess.run([sys.executable, "-c", BLOCK + script, mods, *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "IVQ_NO_PROGRESS": "1"})


IVQ = "from ivq_debug.cli.main import main\nmain(sys.argv[2:])"
IVQ_DIFF = "from ivq_debug.cli.diff import main\nmain(sys.argv[2:])"


def test_core_commands_run_without_any_extra(tmp_path: Path) -> None:
    build_mlp(tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", **mlp_input())
    (tmp_path / "cal").mkdir()
    np.savez(tmp_path / "cal" / "x.npz", **mlp_input())
    script = (IVQ.replace("main(sys.argv[2:])", "") +
              "import subprocess\n"
              "for argv in (['quantize', 'm.onnx', '-o', 'q.onnx', '--dynamic'],\n"
              "             ['capture', 'onnx', 'q.onnx', '--inputs', 'x.npz', '-o', 'q.h5', '--optimization', 'all'],\n"
              "             ['ls', 'q.h5'], ['ls', 'q.h5', '--records'], ['show', 'q.h5', 'y'],\n"
              "             ['calib-stats', 'm.onnx', '--calibration', 'cal', '-o', 's.json']):\n"
              "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)\n"
              "bad = [m for m in ('torch', 'transformers', 'pandas', 'matplotlib', 'PIL') if sys.modules.get(m) is not None]\n"
              "assert not bad, bad\nprint('core ok')")
    r = without(("torch", "analysis", "qnn"), script, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "core ok" in r.stdout and (tmp_path / "q.h5").exists()


@pytest.mark.parametrize(("extras", "script", "args", "needle"), [
    (("analysis",), IVQ_DIFF, ("a.h5", "a.h5"), "`ivq-diff` needs pandas, which is not installed: "
                                                 "pip install 'ivq-debug[analysis]'"),
    (("analysis",), IVQ, ("diff", "a.h5", "a.h5"), "`ivq diff` needs pandas"),
    (("torch",), IVQ, ("demo", "--golden", "g", "--reports", "r", "--workdir", "w"), "pip install 'ivq-debug[torch]'"),
    (("qnn",), IVQ, ("tune", "m.onnx", "--calibration", "cal", "--inputs", "x.npz", "-o", "wd"),
     "`ivq tune --backend qnn` (the default; --backend cpu verifies on ORT CPU-QDQ) needs onnxruntime_qnn, which is "
     "not installed: pip install 'ivq-debug[qnn]'"),
    (("ray",), IVQ, ("diagnose", "a.h5", "a.h5", "--model", "m.onnx", "--executor", "ray"),
     "--executor ray needs ray, which is not installed: pip install 'ivq-debug[ray]'"),
])
def test_a_missing_extra_exits_5_naming_it(tmp_path: Path, extras, script, args, needle) -> None:
    from ivq_debug.capture.base import Selection, capture, make_runner

    model = build_mlp(tmp_path / "m.onnx")
    capture(make_runner("onnx", model, selection=Selection()), [mlp_input()], tmp_path / "a.h5", progress=None)
    r = without(extras, script, *args, cwd=tmp_path)
    assert r.returncode == 5, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.strip().splitlines() if "error" in line]  # (ivq demo prints a banner first)
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in r.stderr
    assert not [p for p in ("g", "r", "w", "wd") if (tmp_path / p).exists()]  # no folder made before failing


def test_diff_version_exits_0(tmp_path: Path) -> None:
    r = without((), IVQ_DIFF, "--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("ivq-debug "), r.stderr


def test_helpers() -> None:
    e = missing_extra(ModuleNotFoundError("No module named 'pandas.core'", name="pandas.core"), "`ivq diff`")
    assert isinstance(e, MissingExtraError) and e.extra == "analysis" and e.exit_code == 5
    assert missing_extra(ModuleNotFoundError("x", name="numpy")) is None
    assert missing_extra(ValueError("pandas")) is None
    require_extra("pandas")  # installed here
    with pytest.raises(MissingExtraError, match=r"ivq-debug\[qnn\]"):
        EXTRAS["no_such_module_ivq"] = "qnn"
        try:
            require_extra("no_such_module_ivq")
        finally:
            del EXTRAS["no_such_module_ivq"]


def test_python_api_without_the_extra_names_it(tmp_path: Path) -> None:
    """``ivq.compare`` on a core install raises the project's exit-5 error naming the extra, not a bare
    ModuleNotFoundError."""
    from ivq_debug.capture.base import Selection, capture, make_runner

    model = build_mlp(tmp_path / "m.onnx")
    capture(make_runner("onnx", model, selection=Selection()), [mlp_input()], tmp_path / "a.h5", progress=None)
    script = ("import ivq_debug as ivq\nfrom ivq_debug.errors import MissingExtraError\n"
              "try:\n    ivq.compare('a.h5', 'a.h5')\nexcept MissingExtraError as e:\n"
              "    print('exit', e.exit_code, e)\n")
    r = without(("analysis",), script, cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "exit 5 ivq.compare needs pandas, which is not installed: pip install 'ivq-debug[analysis]'" in r.stdout
