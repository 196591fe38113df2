"""A QNN refusal anywhere is exit 7 with the whole reason on one line (issue 29): ``capture qnn`` and ``diagnose
--backend qnn`` on a model with ten quantized ``Erf`` nodes HTP does not take (``tune``:
``tests/tune/test_tune_qnn_options.py``); the line names each distinct reason once with its node count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from ivq_debug.capture.qnn_ep.session import refusal_reasons
from ivq_debug.errors import EXIT_RUN
from ivq_debug.qnn.quantize import quantize_for_qnn
from tests.support import qnn_models
from tests.support.cli import ivq_cli
from tests.support.qnn_models import needs_qnn


def test_each_distinct_reason_once_with_its_count_and_first_nodes() -> None:
    refused = [{"name": "p2o.Shape.2", "op_type": "Shape", "reason": "Failed to add node."},
               *({"name": f"r{i}", "op_type": "Reshape", "reason": "Cannot get shape"} for i in range(143)),
               {"name": "erf_a", "op_type": "Erf", "reason": "Erf node `erf_a` will not be assigned to QNN EP."},
               {"name": "erf_b", "op_type": "Erf", "reason": "Erf node `erf_b` will not be assigned to QNN EP."}]
    assert refusal_reasons(refused) == (
        "Failed to add node [1: p2o.Shape.2 (Shape)]; Cannot get shape [143: r0 (Reshape), r1 (Reshape), "
        "r2 (Reshape) +140 more]; Erf node `…` will not be assigned to QNN EP [2: erf_a (Erf), erf_b (Erf)]")
    assert "\n" not in refusal_reasons([{"name": "x", "op_type": "Y", "reason": "two\nlines"}])


@pytest.mark.qnn
@pytest.mark.slow  # ~20 s on 2 loaded cores: four QNN compiles (each refusal is checked at "all" too)
@needs_qnn
def test_capture_and_diagnose_refusals_are_exit_7_on_one_line(tmp_path: Path, capfd) -> None:
    model = tmp_path / "erf10.onnx"
    onnx.save(qnn_models.build_erf(0, erfs=10), str(model))
    rng = np.random.default_rng(0)
    cal = [{"x": rng.standard_normal((1, qnn_models.S, qnn_models.D)).astype(np.float32)} for _ in range(4)]
    np.savez(tmp_path / "in.npz", x=rng.standard_normal((1, qnn_models.S, qnn_models.D)).astype(np.float32))
    q = quantize_for_qnn(model, tmp_path / "q.onnx", cal).model_path
    feeds = ["--inputs", tmp_path / "in.npz"]
    assert ivq_cli("capture", "onnx", model, *feeds, "-o", tmp_path / "f.h5") == 0
    assert ivq_cli("capture", "onnx", q, *feeds, "-o", tmp_path / "q.h5") == 0
    for args in (("capture", "qnn", q, *feeds, "-o", tmp_path / "h.h5"),
                 ("diagnose", tmp_path / "f.h5", tmp_path / "q.h5", "--model", q, "--backend", "qnn", "--no-lift")):
        capfd.readouterr()
        assert ivq_cli(*args) == EXIT_RUN, args[0]
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ivq: error: 10 node(s) not supported by QNN HTP"), err
        assert "Operators of type `Erf` are not supported by QNN EP" in err[0] and "[10: " in err[0]
        assert err[0].endswith("--optimization all does not fix it either (checked)")  # the whole reason
    assert not (tmp_path / "h.h5").exists()
