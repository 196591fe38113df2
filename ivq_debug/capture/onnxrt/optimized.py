"""The graph ONNX Runtime runs, and the kernels behind each captured tensor.

Above ``ORT_DISABLE_ALL`` ONNX Runtime rewrites the graph before it runs it (fusions such as
``DynamicQuantizeLinear + MatMulInteger + Cast + Mul`` → ``com.microsoft.DynamicQuantizeMatMul``, LayerNorm and
GELU fusions, QDQ → QLinear ops). A tensor that a fusion swallowed no longer exists, and asking for it as a graph
output stops the fusion: every kernel after it changes. Measured on ARM64 (cortex-a76, docs/arm64.md): exposing
every node output at ``ORT_ENABLE_ALL`` moved a dynamic-INT8 model's outputs by up to 1.9e-6, while exposing only
the tensors of the optimized graph left all 15 tested graphs bit-identical. :func:`optimized_model` asks ONNX
Runtime for the graph it runs (``SessionOptions.optimized_model_filepath``) under the capture's own options;
:class:`OrtRunner` then exposes only the tensors that graph still has.

:func:`graph_kernels` records, for every tensor, the op that computes it *as run* (``com.microsoft.
MatMulIntegerToFloat`` rather than the file's ``Mul``), the tensors it reads and its accumulation length (the
reduction size of a MatMul / Conv / Gemm): the facts a platform comparison needs to tell a kernel that differs
from a difference it merely inherited (:mod:`ivq_debug.diagnose.platform`). They go into the dump as
``/meta/kernels``.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

from ivq_debug.onnxgraph.fold import constant_nodes
from ivq_debug.onnxgraph.load import load_model

#: op -> (index of the weight input, layout of the reduction in it): ``"rows"`` (MatMul B [.., K, N]),
#: ``"gemm"`` (K is dim 0, or dim 1 with ``transB``), ``"conv"`` (W [M, C/group, kh, kw]: K = C/group·kh·kw)
ACCUMULATING_OPS: dict[str, tuple[int, str]] = {
    "MatMul": (1, "rows"), "MatMulInteger": (1, "rows"), "QLinearMatMul": (3, "rows"),
    "com.microsoft.DynamicQuantizeMatMul": (1, "rows"), "com.microsoft.MatMulIntegerToFloat": (1, "rows"),
    "com.microsoft.FusedMatMul": (1, "gemm"), "Gemm": (1, "gemm"), "com.microsoft.QGemm": (3, "gemm"),
    "Conv": (1, "conv"), "ConvInteger": (1, "conv"), "QLinearConv": (3, "conv"),
    "com.microsoft.FusedConv": (1, "conv"), "com.microsoft.NhwcConv": (1, "conv"),
}

#: the ``optimized_model_filepath`` copy keeps initializers from this size in a side file (a small graph to read)
EXTERNAL_MIN_BYTES = 1024


def op_name(node: Any) -> str:
    """``domain.op`` (``op`` for the default ONNX domain): how a kernel is named in dumps and findings."""
    return f"{node.domain}.{node.op_type}" if node.domain and node.domain != "ai.onnx" else node.op_type


def _accumulation(node: Any, op: str, dims: dict[str, list[int]]) -> int | None:
    spec = ACCUMULATING_OPS.get(op)
    if spec is None or len(node.input) <= spec[0]:
        return None
    w = dims.get(node.input[spec[0]])
    if not w:
        return None
    if spec[1] == "rows":
        return int(w[-2]) if len(w) >= 2 else int(w[0])
    if spec[1] == "gemm":
        trans = any(a.name in ("transB", "transBatchB") and a.i for a in node.attribute)
        return int(w[1] if trans and len(w) > 1 else w[0])
    return int(math.prod(w[1:])) if len(w) > 1 else None


def graph_kernels(model: Any, level: str) -> dict[str, Any]:
    """The ``/meta/kernels`` document of a graph: per tensor, its producer op (as run), the computed tensors it
    reads (initializers, constants and graph inputs left out) and its accumulation length ``k`` when known."""
    nodes = list(model.graph.node)
    inits = {i.name for i in model.graph.initializer}
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    _, const = constant_nodes(nodes, inits)
    computed = {o for n in nodes for o in n.output if o} - const  # (graph inputs are the capture's feeds)
    tensors: dict[str, Any] = {}
    for n in nodes:
        if all((not o) or o in const for o in n.output):
            continue
        op = op_name(n)
        entry: dict[str, Any] = {"op": op, "inputs": [x for x in n.input if x in computed]}
        k = _accumulation(n, op, dims)
        if k is not None:
            entry["k"] = k
        for o in n.output:
            if o:
                tensors[o] = entry
    return {"level": level, "nodes": len(nodes), "tensors": tensors}


def optimized_model(create: Callable[[Callable[[], Any]], Any], options: Callable[[], Any]) -> Any:
    """The graph ONNX Runtime runs: ``create(options)`` makes one session whose options (``options()``, the
    capture's own: level, threads, config entries) also save the optimized graph; returns it as a ModelProto.

    The graph is written to a temporary folder with its initializers from :data:`EXTERNAL_MIN_BYTES` in a side
    file (a transient copy of the weights) and read back without them.
    """
    with tempfile.TemporaryDirectory(prefix="ivq-optimized-") as td:
        path = os.path.join(td, "optimized.onnx")

        def saving() -> Any:
            so = options()
            so.optimized_model_filepath = path
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                        str(EXTERNAL_MIN_BYTES))
            return so

        create(saving)
        return load_model(path, in_place=False)
