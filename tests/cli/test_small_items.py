"""Issue 32, the smaller CLI items: each backend's capture help lists its own flags only, ``ivq demo --help`` names
every shipped reference, an output in a missing folder is a usage error (exit 2) that creates nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ivq_debug.cli.common import run
from ivq_debug.cli.main import _main as ivq_main
from tests.support.dynamic_models import build_mlp, mlp_input


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        ivq_main(list(argv))
    assert e.value.code == 0
    return capsys.readouterr().out


def test_capture_help_is_per_backend(capsys) -> None:
    onnx_help = _help(capsys, "capture", "onnx", "--help")
    qnn_help = _help(capsys, "capture", "qnn", "--help")
    assert "--session-option" in onnx_help and "--whole-model-runs" in onnx_help and "--inputs" in onnx_help
    assert not any(f in onnx_help for f in ("--soc-model", "--htp-arch", "--qnn-cache", "--profiling"))
    assert "--soc-model" in qnn_help and "--qnn-cache" in qnn_help and "--inputs" in qnn_help
    assert "--session-option" not in qnn_help and "--whole-model-runs" not in qnn_help


def test_a_qnn_flag_on_the_onnx_backend_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert run("ivq", ivq_main, ["capture", "onnx", "m.onnx", "--inputs", "x.npz", "-o", str(tmp_path / "d.h5"),
                                 "--soc-model", "60"]) == 2
    assert "--soc-model" in capsys.readouterr().err


def test_demo_help_lists_every_shipped_reference(capsys) -> None:
    from ivq_debug.vlm.load import REFERENCE_DIR

    text = " ".join(_help(capsys, "demo", "--help").split())
    shipped = sorted(d.name for d in REFERENCE_DIR.iterdir() if (d / "ivq_reference.json").is_file())
    assert "qwen3vl-tiny" in shipped and all(name in text for name in shipped)


def test_output_in_a_missing_folder_is_exit_2(tmp_path: Path, capsys) -> None:
    model = build_mlp(tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", **mlp_input())
    out = tmp_path / "missing" / "d.h5"
    assert run("ivq", ivq_main, ["capture", "onnx", str(model), "--inputs", str(tmp_path / "x.npz"), "-o",
                                 str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "output folder" in err[0] and "does not exist" in err[0], err
    assert not (tmp_path / "missing").exists()
    (tmp_path / "missing").mkdir()
    assert run("ivq", ivq_main, ["capture", "onnx", str(model), "--inputs", str(tmp_path / "x.npz"), "-o",
                                 str(out)]) == 0 and out.is_file()



@pytest.mark.parametrize(("entry", "argv"), [("ivq_debug.cli.main", ["ls", "missing.h5"]),
                                             ("ivq_debug.cli.diff", ["missing.h5", "other.h5"])])
@pytest.mark.parametrize("console", [True, False])
def test_a_console_script_freezes_what_its_command_left(entry: str, argv: list[str], console: bool,
                                                        tmp_path: Path) -> None:
    """``exit_with``: run as the process's own command (no argv: the console script, ``python -m ivq_debug``) the
    objects left are frozen before the interpreter's teardown (``gc.freeze``: its collections walk none of them),
    and the process exits with the command's code; called with an argv (tests, notebooks) nothing is frozen."""
    import subprocess
    import sys

    script = ("import atexit, gc, sys\n"
              "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n"
              f"from {entry} import main\n"
              f"sys.argv = ['ivq', *{argv!r}]\n"
              f"main({None if console else argv!r})\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 3 and "missing.h5" in p.stderr, p.stderr  # the command's own exit code (no such file)
    count = int(p.stderr.split("frozen ")[1].split()[0])
    assert (count > 1000) == console, count
