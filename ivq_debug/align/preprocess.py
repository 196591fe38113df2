"""Model-level alignment through the quantizer's preprocessing.

ONNX Runtime's QNN flow runs ``qnn_preprocess_model`` before quantizing: ``MatMul + Add`` between 2-D reshapes
becomes ``Gemm`` (new tensors ``gemm_input_reshape_arg*`` / ``gemm_output_reshape_arg*``), the Erf GELU becomes
``Gelu``. A user's own float model does not name those tensors. When the QDQ model was made that way, running the
same preprocessing on the user's float model gives the float graph the quantizer saw: :func:`quantizer_reference`
does it in a folder and keeps it only when it is *identified* (it names every float tensor of the QDQ model); the
caller captures it on the reference dump's own inputs and :func:`check_outputs` verifies it by values against the
user's reference (its graph outputs, ``OUTPUT_RTOL``). Otherwise the dump-level strategies of
:mod:`ivq_debug.align.matcher` (``reshape``, ``fused``) and the replay's lineage apply.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.onnxgraph.load import Model, load, load_model
from ivq_debug.qnn.quantize import preprocess_float_model

#: a preprocessed float model reproduces the user's outputs within this relative max error (fusions reorder
#: float arithmetic: Gemm vs MatMul + Add, Gelu vs its Erf subgraph; measured ~1e-6 on the tests' transformer)
OUTPUT_RTOL = 1e-4


def qdq_float_names(qdq_model: Any) -> set[str]:
    """The float tensors a QDQ model quantizes (what a reference must name)."""
    return {name for name, _ in load(qdq_model).quantizers}


def graph_names(model: Any) -> set[str]:
    """Every value name of a model (inputs, node outputs)."""
    m = load_model(model) if not hasattr(model, "graph") else model
    return {i.name for i in m.graph.input} | {o for n in m.graph.node for o in n.output if o}


def quantizer_reference(float_model: str | os.PathLike | Model, qdq_model: str | os.PathLike | Model,
                        folder: str | os.PathLike) -> tuple[Path | None, str]:
    """``(path, how)``: the float model as the quantizer saw it, when that is what the QDQ model was made from.

    ``path`` is the float model itself when it already names every QDQ float tensor, ``<folder>/<name>.pre.onnx``
    when ``qnn_preprocess_model`` makes it so, and None otherwise (``how`` says why). The models: paths or loaded
    :class:`~ivq_debug.onnxgraph.load.Model` objects (the float one read from its file).
    """
    fm = load(float_model)
    want = qdq_float_names(qdq_model)
    have = graph_names(fm.proto)
    if fm.path is None:
        raise ValueError("quantizer_reference needs the float model's file (qnn_preprocess_model reads it)")
    if want <= have:
        return fm.path, "the float model names every QDQ tensor"
    out = Path(folder) / (fm.path.stem + ".pre.onnx")
    if not preprocess_float_model(fm.path, out):
        return None, f"qnn_preprocess_model changes nothing; {len(want - have)} QDQ tensors stay unnamed"
    missing = want - graph_names(out)
    if missing:
        return None, (f"not identified: after qnn_preprocess_model {len(missing)} QDQ tensors are still unnamed "
                      f"(e.g. {sorted(missing)[:3]})")
    return out, "qnn_preprocess_model (the quantizer's preprocessing) names every QDQ tensor"


def check_outputs(user_ref: Any, pre_ref: Any, outputs: list[str], rtol: float = OUTPUT_RTOL) -> dict[str, Any]:
    """The preprocessed capture's graph ``outputs`` against the user's reference, on the first common record:
    ``{"ok", "max_rel", "outputs", "rtol"}`` (``max_rel`` = max |a − b| / max |b| over the outputs)."""
    rk, pk = user_ref.record_keys(), pre_ref.record_keys()
    key = min(set(rk) & set(pk), key=lambda k: (k[0], k[2], k[1]), default=None)
    out: dict[str, Any] = {"ok": False, "max_rel": None, "outputs": list(outputs), "rtol": rtol}
    if key is None:
        return out | {"why": "no common record"}
    u = {e.name: e for e in user_ref.tensors(rk[key])}
    p = {e.name: e for e in pre_ref.tensors(pk[key])}
    names = [n for n in outputs if n in u and n in p]
    if not names:
        return out | {"why": "the graph outputs are not in both dumps"}
    worst = 0.0
    for n in names:
        a = np.asarray(pre_ref.read(p[n]), np.float64).reshape(-1)
        b = np.asarray(user_ref.read(u[n]), np.float64).reshape(-1)
        if a.size != b.size:
            return out | {"why": f"{n}: sizes differ"}
        scale = max(float(np.max(np.abs(b))), 1e-30)
        worst = max(worst, float(np.max(np.abs(a - b))) / scale)
    return out | {"ok": worst <= rtol, "max_rel": worst, "outputs": names}
