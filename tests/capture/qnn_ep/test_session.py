"""QNN EP availability, registration, session configuration, partition and stdout hygiene."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ivq_debug.errors import CaptureError, ToolNotFoundError, UsageError
from tests.support.qnn_models import needs_qnn

ROOT = Path(__file__).resolve().parents[3]


def test_status_reports_absence_as_tool_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    from ivq_debug.capture.qnn_ep import session as ep

    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # import raises ImportError
    st = ep.qnn_ep_status()
    assert not st.available and "onnxruntime-qnn is not installed" in (st.reason or "")
    with pytest.raises(ToolNotFoundError) as ei:
        ep.require_qnn_ep()
    assert ei.value.exit_code == 5


def test_config_validation() -> None:
    from ivq_debug.capture.qnn_ep.session import QnnSessionConfig

    with pytest.raises(UsageError, match="profiling_level"):
        QnnSessionConfig(profiling_level="verbose").validate()
    with pytest.raises(UsageError, match="profiling_file_path"):
        QnnSessionConfig(profiling_level="basic").validate()
    with pytest.raises(UsageError, match="soc_model"):
        QnnSessionConfig(soc_model="").validate()
    with pytest.raises(UsageError, match="backend_path"):
        QnnSessionConfig(provider_options={"backend_path": "libQnnCpu.so"}).validate()
    cfg = QnnSessionConfig()
    assert cfg.session_entries()["session.disable_cpu_ep_fallback"] == "1"
    assert cfg.session_entries()["session.record_ep_graph_assignment_info"] == "1"
    assert QnnSessionConfig(allow_cpu_fallback=True).session_entries()["session.disable_cpu_ep_fallback"] == "0"


def test_native_stdout_is_captured(capfd: pytest.CaptureFixture[str]) -> None:
    from ivq_debug.capture.qnn_ep.session import capture_native_stdout

    libc = ctypes.CDLL(None)
    with capture_native_stdout() as cap:
        os.write(1, b"raw fd write\n")
        libc.printf(b"buffered C stdio %d\n", 7)  # sits in the C buffer until the block flushes it
    libc.fflush(None)
    out = capfd.readouterr().out
    assert "raw fd write" in cap.text and "buffered C stdio 7" in cap.text
    assert "raw fd write" not in out and "buffered C stdio" not in out


@pytest.mark.qnn
@needs_qnn
def test_status_and_idempotent_registration() -> None:
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    from ivq_debug.capture.qnn_ep import session as ep

    st = ep.qnn_ep_status()
    assert st.available, st.reason
    assert st.ep_version == oq.__version__ and st.qnn_sdk_version == oq.build_and_package_info.qnn_version
    assert st.emulated is (platform.machine().lower() in ("x86_64", "amd64"))
    for _ in range(3):
        ep.register_qnn_ep()
    assert "QNNExecutionProvider" in ort.get_available_providers()
    assert len(ep.qnn_ep_devices()) >= 1
    info = ep.qnn_backend_info()
    assert info["soc_model"] and info["htp_arch"] and info["cpu_fallback"] == "disabled"


@pytest.mark.qnn
@needs_qnn
def test_session_partition_and_unsupported_reasons(qnn_models: dict[str, Path]) -> None:
    from ivq_debug.capture.qnn_ep.session import QnnSessionConfig, QnnUnsupportedError, create_qnn_session

    qs = create_qnn_session(qnn_models["block.a8w8"])
    assert qs.partition.all_on_qnn and not qs.partition.cpu_nodes
    assert qs.info()["target_verified"] is True
    assert qs.provider_options["soc_model"] and qs.provider_options["htp_arch"]
    with pytest.raises(QnnUnsupportedError) as ei:
        create_qnn_session(qnn_models["erf.a8w8"])
    assert isinstance(ei.value, CaptureError)
    assert "bare_erf" in {u["name"] for u in ei.value.unsupported}
    assert "Erf" in str(ei.value)
    qs = create_qnn_session(qnn_models["erf.a8w8"], QnnSessionConfig(allow_cpu_fallback=True))
    cpu = {n.name: n for n in qs.partition.cpu_nodes}
    assert "bare_erf" in cpu and "not supported" in (cpu["bare_erf"].reason or "")


@pytest.mark.qnn
@needs_qnn
def test_artifacts_written(qnn_models: dict[str, Path], tmp_path: Path) -> None:
    from ivq_debug.capture.qnn_ep.session import QnnSessionConfig, create_qnn_session
    from tests.support import qnn_models as models

    cfg = QnnSessionConfig(profiling_level="basic", profiling_file_path=tmp_path / "p.csv",
                           op_trace_dir=tmp_path / "trace", json_graph_dir=tmp_path / "graph")
    (tmp_path / "trace").mkdir()
    (tmp_path / "graph").mkdir()
    qs = create_qnn_session(qnn_models["block.a16w8"], cfg)
    qs.session.run(None, models.block_feeds(0)[0])
    assert (tmp_path / "p.csv").read_text().startswith("Msg Timestamp,")
    trace = json.loads((tmp_path / "trace" / "qnn_op_trace.json").read_text())
    assert trace["summary"]["unsupported_nodes"] == 0
    graphs = [p for p in (tmp_path / "graph").glob("*.json") if not p.name.endswith("_tensor_log.json")]
    assert graphs and "graph" in json.loads(graphs[0].read_text())


@pytest.mark.qnn
@needs_qnn
def test_stdout_stays_clean_in_a_fresh_process(qnn_models: dict[str, Path]) -> None:
    """The native library prints a banner on fd 1 at the first HTP session of a process."""
    code = textwrap.dedent(f"""
        import json
        from ivq_debug.capture.qnn_ep.session import create_qnn_session
        qs = create_qnn_session({str(qnn_models["block.a8w8"])!r})
        print(json.dumps({{"native": qs.native_stdout}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)  # stdout holds exactly the JSON document
    assert "LIBNATIVE" in doc["native"]
