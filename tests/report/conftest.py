"""Fixtures for the report tests: a real tiny pipeline (float / CPU-QDQ / emulated HTP dumps with a real QNN
profile), its comparisons and replay, and a synthetic pair of dumps full of edge cases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.report.pipeline import build_pipeline

#: every budget of the main comparison (the tiny a8w8 model sits between 20 and 40 dB)
MIN_SQNR = 30.0
EDGE_NAMES = {
    "ctrl": "ctrl\x01\x1b[31mname</script><!--",
    "quote": "quote\"'&amp;<b>bold</b>",
    "uni": "ünï/çødé\u2028line",
}


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Paths of the tiny models and their dumps (``htp`` only with onnxruntime-qnn)."""
    return build_pipeline(tmp_path_factory.mktemp("report-pipeline"))


def need_htp(pipeline: dict[str, Path]) -> Path:
    """The HTP dump, or skip (QNN HTP emulation needs onnxruntime-qnn on Linux x86_64)."""
    if "htp" not in pipeline:
        pytest.skip("onnxruntime-qnn is not installed: no emulated QNN HTP dump and no QNN profile")
    return pipeline["htp"]


@pytest.fixture(scope="session")
def comparisons(pipeline: dict[str, Path]) -> dict[str, Any]:
    """``main`` (float → HTP, or float → CPU-QDQ without QNN), ``quant`` (float → CPU-QDQ), ``backend``
    (CPU-QDQ → HTP) and the replay of the QDQ units on the float reference."""
    from ivq_debug.api import compare
    from ivq_debug.comparator import Budgets
    from ivq_debug.diagnose.replay import replay

    b = Budgets.from_args(min_sqnr=MIN_SQNR)
    test = pipeline.get("htp", pipeline["cpu"])
    out: dict[str, Any] = {"main": compare(pipeline["float"], test, budgets=b, progress=False)}
    out["quant"] = compare(pipeline["float"], pipeline["cpu"], budgets=b, progress=False)
    extras = {"quantization (float → CPU-QDQ)": out["quant"]}
    if "htp" in pipeline:
        out["backend"] = compare(pipeline["cpu"], pipeline["htp"], budgets=b, progress=False)
        extras["backend (CPU-QDQ → HTP)"] = out["backend"]
    out["extras"] = extras
    out["replay"] = replay(pipeline["qdq"], out["main"].ref, cumulative=out["main"], progress=False)
    return out


@pytest.fixture(scope="session")
def edge_dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two synthetic dumps (prefill + 2 decode steps) whose tensors are identical, non-finite, zero-norm,
    mismatched in size, fine, logits, or named with control characters, quotes and ``</script>``."""
    from ivq_debug.dump import DumpWriter

    d = tmp_path_factory.mktemp("report-edge")
    rng = np.random.default_rng(0)
    base = {k: rng.standard_normal((4, 16)).astype(np.float32) for k in ("same", "nan", "fine", "logits", *EDGE_NAMES)}
    paths = []
    for side in ("ref", "test"):
        p = d / f"{side}.h5"
        info = {"emulated": side == "test" or None, "label": "synthetic" if side == "test" else None}
        with DumpWriter(p, backend="synthetic-" + side, backend_info=info, command="pytest edge") as w:
            for step in range(3):
                w.begin_record(sample=0, part="prefill" if step == 0 else "decode", step=step)
                for k, v in base.items():
                    name = EDGE_NAMES.get(k, k)
                    x = v * (1 + step)
                    if side == "test" and k != "same":
                        x = x + 0.05 * (1 + step) * rng.standard_normal(x.shape).astype(np.float32)
                    if side == "test" and k == "nan":
                        x = x.copy()
                        x[0, 0] = np.nan
                    w.add_tensor(name, x, op_type="MatMul")
                w.add_tensor("zero", np.zeros(8, np.float32) if side == "ref" else np.ones(8, np.float32), op_type="Add")
                w.add_tensor("shape", np.ones(8 if side == "ref" else 9, np.float32), op_type="Reshape")
                w.add_tensor(f"only_{side}", np.ones(4, np.float32))
        paths.append(p)
    return paths[0], paths[1]


@pytest.fixture(scope="session")
def edge_cmp(edge_dumps: tuple[Path, Path]):
    """The comparison of the edge-case dumps, with an SQNR budget every undefined metric breaks."""
    from ivq_debug.api import compare
    from ivq_debug.comparator import Budgets

    return compare(edge_dumps[0], edge_dumps[1], budgets=Budgets.from_args(min_sqnr=20), progress=False)
