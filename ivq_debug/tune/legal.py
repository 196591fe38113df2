"""Which precision pairs each backend runs: one table per backend, checked before a trial (on the suggestions) and
after it (on the QDQ model the trial wrote), so the tuner never recommends a set the backend refuses.

A *pair* is what a weight op (``Conv``, ``ConvTranspose``, ``Gemm``, ``MatMul`` with a constant operand) reads:
its activation input's bits and its weight's bits; its bias is a separate entry. Sources (docs/tune.md cites them):

* QNN HTP: activations and weights are 8 × 8, 16 × 8 or 16 × 16 bits; **8-bit activations × 16-bit weights is not
  a configuration HTP has** (the QNN HTA/HTP 16-bit notes: "16-bit activations while keeping weights at 8 bits",
  ``--act_bw 16 --weight_bw 8``; the HTP op revision history lists a16w8 and a16w16 configurations per op, never
  a8w16; ONNX Runtime's QNN EP "Mixed precision support"); measured here: the QNN EP's session creation refuses a
  Conv at a8w16 (``tests/tune/test_legal.py``). A bias is ``int32``. **A 16-bit weight is symmetric** (zero
  point at the middle of its storage: int16 0, uint16 32768): QNN's 16x16 Conv / FullyConnected / MatMul take
  symmetric int16 weights only, and the QNN EP converts an asymmetric uint16 weight with an inserted Convert op
  (microsoft/onnxruntime#24729, #24846); measured here, PP-OCRv4 at a16w16 with asymmetric uint16 weights reads 1
  of 4 lines on HTP (4 of 4 on CPU-QDQ), symmetric ones 4 of 4 (docs/tune.md).
* ORT CPU-QDQ: every pair the quantizer writes runs (the CPU kernels dequantize), bias ``int32``.

fp16 (a node left unquantized) reads float weights: it is no pair and always legal where the backend has fp16
(HTP v73+: ``enable_htp_fp16_precision``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import numpy_helper

from ivq_debug.onnxgraph.load import load_model

#: ops that read a weight (input 1) and, for ``Conv`` / ``ConvTranspose`` / ``Gemm``, a bias (input 2)
WEIGHT_PAIR_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_BIAS_OPS = ("Conv", "ConvTranspose", "Gemm")
_BITS = {"uint8": 8, "int8": 8, "uint16": 16, "int16": 16, "int32": 32, "uint4": 4, "int4": 4}
_ONNX_INT = {2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 21: "uint4", 22: "int4"}


@dataclass(frozen=True)
class PrecisionTable:
    """The precision pairs one backend runs."""

    backend: str
    #: legal ``(activation bits, weight bits)`` of a weight op
    pairs: frozenset[tuple[int, int]]
    #: legal bias storage types
    bias: frozenset[str]
    #: where the table comes from (cited in docs/tune.md)
    source: str
    #: a 16-bit weight must be symmetric (its zero point the middle of its storage)
    symmetric16: bool = False

    def allows(self, activation_bits: int, weight_bits: int) -> bool:
        """True when the backend runs a weight op at these bits."""
        return (activation_bits, weight_bits) in self.pairs

    def forbidden(self) -> list[tuple[int, int]]:
        """The pairs of 8 / 16 bits the backend does not run (one test each)."""
        return [p for p in ((8, 8), (8, 16), (16, 8), (16, 16)) if p not in self.pairs]


TABLES: dict[str, PrecisionTable] = {
    "qnn": PrecisionTable("qnn", frozenset({(8, 8), (16, 8), (16, 16)}), frozenset({"int32"}),
                          "QNN HTP: a8w8, a16w8, a16w16; no 8-bit activation x 16-bit weight; int32 bias; "
                          "16-bit weights symmetric", symmetric16=True),
    "cpu": PrecisionTable("cpu", frozenset({(8, 8), (16, 8), (16, 16), (8, 16)}), frozenset({"int32"}),
                          "ORT CPU-QDQ: every pair the quantizer writes; int32 bias"),
}


def table(backend: str) -> PrecisionTable:
    """The table of ``backend`` (``qnn`` or ``cpu``)."""
    return TABLES[backend]


@dataclass(frozen=True)
class Violation:
    """One weight op of a QDQ model at a pair its backend does not run."""

    node: str
    op_type: str
    what: str  # "pair", "asymmetric16"
    detail: str

    def __str__(self) -> str:
        return f"{self.node} ({self.op_type}): {self.detail}"


def _dq_types(model: Any) -> dict[str, str]:
    """DequantizeLinear output -> the integer type it dequantizes (from its input or zero point)."""
    g = model.graph
    inits = {t.name: t.data_type for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output if o}
    out: dict[str, str] = {}
    for n in g.node:
        if n.op_type != "DequantizeLinear":
            continue
        x = n.input[0]
        zp = n.input[2] if len(n.input) > 2 and n.input[2] else None
        dt = inits.get(x)
        if dt is None and zp in inits:
            dt = inits[zp]
        if dt is None:
            q = producers.get(x)
            qzp = q.input[2] if q is not None and len(q.input) > 2 and q.input[2] else None
            dt = inits.get(qzp) if qzp else 2  # a QuantizeLinear without zero point writes uint8
        out[n.output[0]] = _ONNX_INT.get(dt or 2, str(dt))
    return out


def violations(qdq_model: str | os.PathLike | Any, backend: str = "qnn") -> list[Violation]:
    """Every weight op of a written QDQ model whose (activation, weight) bits or bias type ``backend`` refuses:
    the ground truth a trial checks after quantizing (type conflicts the quantizer resolved included)."""
    tab = table(backend)
    m = qdq_model if hasattr(qdq_model, "graph") else load_model(qdq_model)
    inits_by_name = {t.name: t for t in m.graph.initializer}
    inits = set(inits_by_name)
    producers = {o: n for n in m.graph.node for o in n.output if o}
    types = _dq_types(m)
    out: list[Violation] = []
    for n in m.graph.node:
        if n.op_type not in WEIGHT_PAIR_OPS or len(n.input) < 2:
            continue
        a, w = types.get(n.input[0]), types.get(n.input[1])
        wdq = producers.get(n.input[1])
        if a is None or w is None or wdq is None or wdq.input[0] not in inits:
            continue  # not a quantized activation x constant weight (an activation x activation MatMul)
        ab, wb = _BITS.get(a, 0), _BITS.get(w, 0)
        if not tab.allows(ab, wb):
            out.append(Violation(n.name, n.op_type, "pair", f"{ab}-bit activation x {wb}-bit weight is not run by "
                                 f"{tab.backend.upper()} ({tab.source})"))
        elif wb == 16 and tab.symmetric16 and not _symmetric_zero_point(wdq, inits_by_name, w):
            out.append(Violation(n.name, n.op_type, "asymmetric16", f"16-bit weight {wdq.input[0]!r} is asymmetric "
                                 f"(its zero point is off the middle of {w}): {tab.backend.upper()} computes 16-bit "
                                 "weights symmetric only (the QNN EP converts it; docs/tune.md)"))
    return out


def _symmetric_zero_point(dq: Any, inits: dict[str, Any], dtype: str) -> bool:
    """True when a weight's DequantizeLinear has the symmetric zero point of its storage on every channel."""
    zp = inits.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    mid = 0 if dtype.startswith("int") else 1 << (_BITS.get(dtype, 8) - 1)
    if zp is None:
        return mid == 0
    return bool(np.all(numpy_helper.to_array(zp).astype(np.int64) == mid))


def forbidden(suggestions: Iterable[Any], float_model: str | os.PathLike | Any, preset: str,
              backend: str = "qnn") -> list[str]:
    """Why a set of suggestions cannot run on ``backend`` (empty: it may), before any trial: a 16-bit weight
    whose op reads an activation left at 8 bits (by the preset and the set), or an override on a bias."""
    tab = table(backend)
    sug = list(suggestions)
    m = float_model if hasattr(float_model, "graph") else load_model(float_model)
    act16 = {s.tensor for s in sug if not s.is_weight and s.bitwidth == 16 and s.action != "fp16"}
    act8 = {s.tensor for s in sug if not s.is_weight and s.action == "a8"}
    floats = {s.node for s in sug if s.action == "fp16" and s.node}
    default_bits = 16 if preset.startswith("a16") else 8
    weights = {s.tensor: s for s in sug if s.is_weight}
    out: list[str] = []
    for n in m.graph.node:
        if n.op_type not in WEIGHT_PAIR_OPS or n.name in floats:
            continue
        for i, x in enumerate(n.input):
            s = weights.get(x)
            if s is None:
                continue
            if i == 2 and n.op_type in _BIAS_OPS:
                out.append(f"{x}: a {s.action} override on the bias of {n.name} ({n.op_type}); a bias stays "
                           f"{'/'.join(sorted(tab.bias))}, derived from its input and weight scales")
                continue
            if i != 1:
                continue
            wb = _weight_bits(s, preset)
            a = n.input[0]
            ab = 16 if a in act16 else 8 if a in act8 else default_bits
            if not tab.allows(ab, wb):
                out.append(f"{x}: {wb}-bit weight of {n.name} ({n.op_type}) under its {ab}-bit activation {a!r}: "
                           f"{tab.source}")
            elif wb == 16 and tab.symmetric16 and s.encoding is not None and not s.encoding.symmetric:
                out.append(f"{x}: an asymmetric 16-bit weight encoding for {n.name} ({n.op_type}): {tab.source}")
    return out


def refusal(why: Sequence[str], backend: str = "qnn") -> str:
    """One line for the reasons :func:`forbidden` gives: each weight once, the backend's rule once at the end (not
    repeated after every one of PP-OCRv4's 38 weights)."""
    rule = table(backend).source
    items = [w.removesuffix(f": {rule}") for w in why]
    tail = f" ({rule})" if any(i != w for i, w in zip(items, why, strict=True)) else ""
    return f"not run by {backend.upper()}: " + "; ".join(items) + tail


def _weight_bits(s: Any, preset: str) -> int:
    if s.encoding is not None and getattr(s.encoding, "bitwidth", None):
        return int(s.encoding.bitwidth)
    if s.action == "w16":
        return 16
    return 16 if preset.endswith("w16") else 8


def split_legal(sets: Sequence[tuple[str, list[Any]]], float_model: Any, preset: str,
                backend: str = "qnn") -> tuple[list[tuple[str, list[Any]]], list[dict[str, Any]]]:
    """Candidate sets split into those ``backend`` can run and the refused ones (with every reason)."""
    ok, refused = [], []
    for name, ss in sets:
        why = forbidden(ss, float_model, preset, backend)
        if why:
            refused.append({"candidate": name, "label": None, "overrides": [s.tensor for s in ss],
                            "reason": f"not run by {backend.upper()}: " + "; ".join(why)})
        else:
            ok.append((name, ss))
    return ok, refused
