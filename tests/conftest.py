"""Shared pytest setup: no progress bars, deterministic threads, an artifacts folder for humans."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from ivq_debug.dump.format import unescape_name
from ivq_debug.onnxgraph.sites import list_sites
from ivq_debug.qnn.quantize import quantize_for_qnn
from tests.support import qnn_models as models
from tests.support.qnn_fixtures import FIX, MODEL, SINGLE
from tests.support.qnn_models import CAL_SEED, HAVE_QNN

os.environ.setdefault("IVQ_NO_PROGRESS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
#: ivq's width off a terminal (console.py), also in pytest-xdist workers, which run with COLUMNS=80: the tests read
#: whole lines of what the commands print, the same under `pytest -q` and `make test` (tests of narrow output set it)
os.environ["COLUMNS"] = "160"
#: no QNN compiled-context cache in ~/.cache: every test compiles unless it names its own cache folder
os.environ.setdefault("IVQ_QNN_CACHE", "off")

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Folder where tests leave files for people to look at (screenshots, reports); git-ignored."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


# ---------------------------------------------------------------- QNN fixtures (committed files)
@pytest.fixture(scope="session")
def ref() -> dict[tuple[str, int, str], np.ndarray]:
    """The direct QNN EP capture: ``(group, sample, onnx name) → array``."""
    out = {}
    with np.load(FIX / "reference.npz", allow_pickle=False) as z:
        for k in z.files:
            group, sample, name = k.split("|", 2)
            out[(group, int(sample), unescape_name(name))] = z[k]
    return out


@pytest.fixture(scope="session")
def sites() -> dict:
    """ONNX output name → capture site (key, encoding) of the QDQ model, as the ORT capture lists them."""
    return {s.output: s for s in list_sites(onnx.load(MODEL), "qdq")}


@pytest.fixture()
def single_copy(tmp_path: Path) -> Path:
    """A writable copy of the single-graph net-run fixture (``<copy>/output``, ``<copy>/model_net.json``)."""
    dst = tmp_path / "single"
    shutil.copytree(SINGLE, dst)
    return dst



# ---------------------------------------------------------------- QNN EP models (built per session)
@pytest.fixture(scope="session")
def qnn_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Float models and their QDQ versions: ``block``, ``block.a8w8``, ``block.a16w8``, ``erf.a8w8``."""
    if not HAVE_QNN:
        pytest.skip("onnxruntime-qnn is not installed")
    d = tmp_path_factory.mktemp("qnn-models")
    out: dict[str, Path] = {}
    for name, model in (("block", models.build_block(0)), ("erf", models.build_erf(0))):
        p = d / f"{name}.onnx"
        onnx.save(model, str(p))
        out[name] = p
    cal = models.block_feeds(CAL_SEED, 8)
    for preset in ("a8w8", "a16w8"):
        out[f"block.{preset}"] = quantize_for_qnn(out["block"], d / f"block.{preset}.onnx", cal,
                                                  preset=preset).model_path
    erf_cal = [{"x": f["x"]} for f in cal]
    out["erf.a8w8"] = quantize_for_qnn(out["erf"], d / "erf.a8w8.onnx", erf_cal).model_path
    return out


@pytest.fixture(scope="session")
def session_parts(tmp_path_factory: pytest.TempPathFactory):
    """``get(model, cache, fault) -> ExportResult``: the split exports device sessions run, built on first use
    (``tests/support/device_sessions.py``; dynamic-cache exports verified against torch)."""
    from ivq_debug.vlm.load import load_vlm
    from tests.support.device_sessions import parts_exporter

    models: dict = {}

    def load(name: str):
        if name not in models:
            models[name] = load_vlm(name).model
        return models[name]

    return parts_exporter(tmp_path_factory.mktemp("session-parts"), load)


@pytest.fixture(scope="session")
def device_sessions(session_parts, tmp_path_factory: pytest.TempPathFactory):
    """name -> DeviceSession: every fixture of ``tests/fixtures/device_sessions.SESSIONS``, written into tmp."""
    from tests.support.device_sessions import build_sessions

    return build_sessions(tmp_path_factory.mktemp("device-sessions"), session_parts)


# ---------------------------------------------------------------- pytest-xdist: one worker per shared fixture
#: test files (or folders) that share an expensive session fixture, by group: under ``make test`` (``-n 2``) each
#: group runs on one worker, so its fixture is built once per run, not once per worker; any other file is its own
#: group (its module-scoped fixtures: one ViT, one sweep, one capture per module). First match wins.
XDIST_GROUPS: tuple[tuple[str, str], ...] = (
    # session_parts / device_sessions (the split exports and the device-session folders, ~40 s)
    ("tests/cli/test_debug_sessions_cli.py", "sessions"), ("tests/cli/test_device_sessions_cli.py", "sessions"),
    ("tests/capture/qnn_net_run/test_onnx_folders.py", "sessions"),
    ("tests/capture/qnn_net_run/test_device_sessions.py", "sessions"), ("tests/comparator/test_contract.py", "sessions"),
    ("tests/diagnose/test_positions_sessions.py", "sessions"), ("tests/vlm/test_export_dynamic.py", "sessions"),
    ("tests/acceptance/", "demo"),  # the demo (ivq demo into tmp)
    ("tests/hostile/", "hostile"),  # the case server and the corpus
    ("tests/vlm/", "vlm"),  # the shipped checkpoints and their exports
    ("tests/report/", "report"),  # the report pipeline's dumps
)


def group_of(nodeid: str) -> str:
    """The xdist work unit of a test id: its :data:`XDIST_GROUPS` group, else its file."""
    path = nodeid.split("::", 1)[0]
    return next((g for prefix, g in XDIST_GROUPS if path.startswith(prefix)), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N``: xdist's load-scope scheduling with :func:`group_of` as the scope (whole groups go to one worker,
    the groups with the most tests first). pytest-xdist's ``--dist loadgroup`` does not group under pytest 9."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return SharedFixtureScheduling(config, log)
