"""Dynamic INT8 quantization for ONNX Runtime CPU deployments (x86_64, ARM64 boards): ``ivq quantize --dynamic``.

A wrapper of ``onnxruntime.quantization.quantize_dynamic``, the second seed's deployment path: weights are
quantized once (``QInt8`` or ``QUInt8``, per tensor or per output channel, optionally ``reduce_range`` = 7-bit
weights), activations at run time by ``DynamicQuantizeLinear`` (u8, per tensor, from the tensor's own min / max).
A quantized ``MatMul`` becomes ``DynamicQuantizeLinear → MatMulInteger → Cast → Mul(scale)`` (a ``Conv``:
``ConvInteger``), and the ``Mul`` keeps the float op's output name, so a dump of the dynamic model aligns with the
float model's by name; at ``ORT_ENABLE_ALL`` ONNX Runtime fuses each chain into
``com.microsoft.DynamicQuantizeMatMul`` / ``MatMulIntegerToFloat``. The introduced error of each such unit is
replayed by :func:`ivq_debug.diagnose.replay.find_dynamic_units`.

``reduce_range`` matters on x86 CPUs without VNNI (AVX2 only): their u8·s8 kernel sums pairs of products into
int16 with saturation (``vpmaddubsw``); 7-bit weights keep every pair sum in range (measured bit-identical with a
VNNI host, docs/arm64.md). ARM64 (dotprod) and VNNI hosts compute the integer products exactly either way.

Needs only the core install (onnx, onnxruntime). The output appears under its final name only when complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ivq_debug.errors import InputError, IvqError, UsageError, one_line
from ivq_debug.logs import root_warnings
from ivq_debug.onnxgraph.intake import check_written_model
from ivq_debug.onnxgraph.load import has_external_data, load_model
from ivq_debug.onnxgraph.sites import is_qdq_model
from ivq_debug.outputs import publish_staged

WEIGHT_TYPES = ("QInt8", "QUInt8")
#: the ops a dynamic model computes in integers (as written by quantize_dynamic, and as fused by ONNX Runtime)
INTEGER_OPS = ("MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "DynamicQuantizeLSTM",
               "QAttention", "QGemm")
_MAX_PROTO_BYTES = 1_800_000_000  # above this, quantize with external data


@dataclass
class DynamicQuantizeResult:
    """What ``quantize_dynamic`` produced."""

    model_path: Path
    source_path: Path
    weight_type: str
    per_channel: bool
    reduce_range: bool
    integer_ops: dict[str, int]  # op type -> count in the output (MatMulInteger, ConvInteger, ...)
    dynamic_quantizers: int  # DynamicQuantizeLinear nodes (one per quantized activation)
    float_left: dict[str, int]  # MatMul / Conv / Gemm nodes left in float (activation-only matmuls, excluded nodes)
    seconds: float
    external_data: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        d = asdict(self)
        d["model_path"], d["source_path"] = str(self.model_path), str(self.source_path)
        return d


def _check_selection(proto: Any, src: Path, op_types: Sequence[str] | None, nodes_to_exclude: Sequence[str]) -> None:
    """Refuse op types ``quantize_dynamic`` cannot quantize or the model does not hold, and excluded node names
    that are not nodes of the model (a typo would otherwise quantize what the user meant to keep in float)."""
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    have_ops = {n.op_type for n in proto.graph.node}
    for op in op_types or ():
        if op not in IntegerOpsRegistry:
            raise UsageError(f"--op-types: quantize_dynamic cannot quantize {op!r} (it quantizes "
                             f"{', '.join(sorted(IntegerOpsRegistry))})")
        if op not in have_ops:
            raise UsageError(f"--op-types: the model has no {op!r} node", src)
    names = {n.name for n in proto.graph.node}
    missing = [n for n in nodes_to_exclude if n not in names]
    if missing:
        raise UsageError(f"--exclude-nodes: no node named {', '.join(repr(n) for n in missing[:5])} in the model", src)


def _constant_weights(proto: Any) -> list[str]:
    """A warning when MatMul / Conv / Gemm weights are ``Constant`` nodes: ``quantize_dynamic`` quantizes
    initializer weights only, so those ops stay float in the output (as in any run of ORT's quantizer)."""
    consts = {n.output[0] for n in proto.graph.node if n.op_type == "Constant" and n.output}
    hit = [n.name or n.output[0] for n in proto.graph.node
           if n.op_type in ("MatMul", "Conv", "Gemm") and len(n.input) > 1 and n.input[1] in consts]
    if not hit:
        return []
    return [f"{len(hit)} MatMul/Conv/Gemm weight(s) are Constant nodes, which quantize_dynamic leaves in float "
            f"(e.g. {', '.join(hit[:3])}); store them as initializers to quantize them"]


def quantize_dynamic_model(
    model_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    weight_type: str = "QInt8",
    per_channel: bool = False,
    reduce_range: bool = False,
    op_types: Sequence[str] | None = None,
    nodes_to_exclude: Sequence[str] = (),
    overwrite: bool = False,
) -> DynamicQuantizeResult:
    """Quantize a float ONNX model with ``onnxruntime.quantization.quantize_dynamic``.

    Args:
        model_path: the float ONNX model (external data supported).
        output_path: the dynamic INT8 model (atomic; replaced only with ``overwrite=True``).
        weight_type: ``"QInt8"`` (s8 weights: the u8s8 kernels, the seed's choice) or ``"QUInt8"`` (u8u8).
        per_channel: one weight scale per output channel.
        reduce_range: 7-bit weights (no u8s8 int16 saturation on AVX2-only x86).
        op_types: op types to quantize (default: every type ``quantize_dynamic`` supports).
        nodes_to_exclude: node names kept in float.
        overwrite: replace an existing output.

    Raises:
        UsageError: bad option, output exists, output would replace the input, the model is already quantized.
        InputError: the model cannot be read or the quantizer fails on it.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    t0 = time.perf_counter()
    src, out = Path(model_path), Path(output_path)
    if weight_type not in WEIGHT_TYPES:
        raise UsageError(f"unknown weight type {weight_type!r} ({', '.join(WEIGHT_TYPES)})")
    if out.exists() and not overwrite:
        raise UsageError("output exists; pass overwrite=True (CLI: --force) to replace it", out)
    if out.is_dir():
        raise InputError("output path is a directory", out)
    if src.exists() and out.resolve() == src.resolve():
        raise UsageError("output would replace the float model", out)
    proto = load_model(src)
    if is_qdq_model(proto) or any(n.op_type in (*INTEGER_OPS, "DynamicQuantizeLinear") for n in proto.graph.node):
        raise UsageError("the model is already quantized (give the float model)", src)
    _check_selection(proto, src, op_types, nodes_to_exclude)
    constant_weights = _constant_weights(proto)
    big = has_external_data(proto) or src.stat().st_size > _MAX_PROTO_BYTES
    del proto
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    staged = work / out.name
    try:
        with root_warnings() as warnings:
            try:
                quantize_dynamic(src, staged, weight_type=getattr(QuantType, weight_type), per_channel=per_channel,
                                 reduce_range=reduce_range,
                                 op_types_to_quantize=list(op_types) if op_types else None,
                                 nodes_to_exclude=list(nodes_to_exclude) or None, use_external_data_format=big)
            except IvqError:
                raise
            except Exception as e:
                raise InputError(f"quantize_dynamic failed: {type(e).__name__}: {one_line(e, 400)}", src) from None
        qproto = load_model(staged, in_place=False)
        check_written_model(staged)  # (onnx.checker + an ORT CPU load: an invalid model is never published)
        externals = sorted(p.name for p in work.iterdir() if p != staged)
        publish_staged(staged, out, externals, overwrite=overwrite)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ops = Counter(n.op_type for n in qproto.graph.node)
    return DynamicQuantizeResult(
        model_path=out, source_path=src, weight_type=weight_type, per_channel=per_channel,
        reduce_range=reduce_range, integer_ops={k: ops[k] for k in INTEGER_OPS if ops[k]},
        dynamic_quantizers=ops["DynamicQuantizeLinear"],
        float_left={k: ops[k] for k in ("MatMul", "Conv", "Gemm") if ops[k]},
        seconds=round(time.perf_counter() - t0, 3), external_data=externals,
        warnings=[*constant_weights, *warnings],
    )
