"""Standalone ``BatchNormalization`` (inference form) rewritten as ``Mul`` then ``Add`` by constants, before quantizing.

ORT's quantizer leaves a BatchNormalization that no pre-processing folded as a QNN BatchNorm op whose scale input
is quantized like a weight; the QNN EP folds mean and variance into that scale and re-quantizes it, and the emulated
HTP computes the result less exactly than CPU fake-quant (docs/tune.md, "16-bit weights on QNN HTP"). The rewrite
``y = x * k + c`` with ``k = scale / sqrt(var + eps)`` and ``c = bias - mean * k`` (computed in float64, stored in
the scale's dtype) is exact in float; the quantizer then sees two elementwise ops with constant operands.

Measured on the PP-OCRv4 recognizer (6 standalone BatchNormalizations after Conv, 6 lines, emulated HTP v73,
``--optimization all``): at a16w16 the HTP output SQNR goes 46.3 -> 58.9 dB (worst line 28.9 -> 48.9 dB), CPU-QDQ
unchanged (62.4 / 62.2 dB); at a16w8 + per-channel it goes 14.7 -> 13.3 dB (5/6 -> 4/6 lines exact), CPU-QDQ
unchanged. Hence opt-in (``intake.prepare(batchnorm=True)``, ``quantize_for_qnn(unfuse_batchnorm=True)``).

Names: the ``Add`` takes the BatchNormalization's node name and output name (alignment still pairs that tensor);
the ``Mul``, its output and the two constants get new names derived from the node's, unique in the graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ivq_debug.onnxgraph.fold import _subgraph_reads, static_shapes


def _unique(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def _ranks(model: Any) -> dict[str, int]:
    """``{value name: rank}`` of every value whose rank the model declares or ONNX shape inference gives."""
    import onnx

    out = {k: len(v) for k, v in static_shapes(model).items()}
    try:
        g = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # e.g. custom-domain ops: the declared ranks only
        g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out.setdefault(vi.name, len(t.shape.dim))
    return out


def batchnorm_to_mul_add(model: Any) -> list[str]:
    """Rewrite every inference-form ``BatchNormalization`` of ``model``'s main graph (in place) as ``Mul`` + ``Add``.

    A node is rewritten when it has one output (no training outputs, ``training_mode`` 0), its scale, bias, mean
    and variance are initializers, and its input's rank is known (>= 2); others stay as they are. The float
    outputs are those of the original model to float rounding (``tests/onnxgraph/test_batchnorm.py``).
    Returns the names of the rewritten nodes in graph order.
    """
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    candidates = [n for n in g.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")
                  and len([o for o in n.output if o]) == 1 and len(n.input) == 5
                  and all(x in inits for x in n.input[1:])
                  and not any(a.name == "training_mode" and a.i for a in n.attribute)]
    if not candidates:
        return []
    ranks = _ranks(model)
    taken = {t.name for t in g.initializer} | {n.name for n in g.node} | {x for n in g.node for x in n.output} \
        | {v.name for v in g.input}
    done: list[str] = []
    nodes: list[Any] = []
    rewrite = {id(n) for n in candidates if ranks.get(n.input[0], 0) >= 2}
    for n in g.node:
        if id(n) not in rewrite:
            nodes.append(n)
            continue
        eps = next((a.f for a in n.attribute if a.name == "epsilon"), 1e-5)
        scale, bias, mean, var = (numpy_helper.to_array(inits[x]) for x in n.input[1:])
        k = scale.astype(np.float64) / np.sqrt(var.astype(np.float64) + eps)
        c = bias.astype(np.float64) - mean.astype(np.float64) * k
        shape = [-1] + [1] * (ranks[n.input[0]] - 2)
        base = n.name or n.output[0]
        kn, cn = _unique(f"{base}.mul_scale", taken), _unique(f"{base}.add_shift", taken)
        g.initializer.extend([numpy_helper.from_array(k.reshape(shape).astype(scale.dtype), kn),
                              numpy_helper.from_array(c.reshape(shape).astype(scale.dtype), cn)])
        mid = _unique(f"{n.output[0]}.scaled", taken)
        nodes.append(helper.make_node("Mul", [n.input[0], kn], [mid], name=_unique(f"{base}.mul", taken)))
        nodes.append(helper.make_node("Add", [mid, cn], [n.output[0]], name=n.name))
        done.append(n.name)
    if not done:
        return []
    del g.node[:]
    g.node.extend(nodes)
    read = {x for n in g.node for x in n.input} | {o.name for o in g.output} | _subgraph_reads(g.node)
    dropped = [t for t in g.initializer if t.name not in read]
    if dropped:  # the BatchNormalizations' own parameters, when nothing else reads them
        keep = [t for t in g.initializer if t.name in read]
        del g.initializer[:]
        g.initializer.extend(keep)
        gone = {t.name for t in dropped}
        kept_inputs = [v for v in g.input if v.name not in gone]
        if len(kept_inputs) != len(g.input):  # IR < 4: initializers also listed as graph inputs
            del g.input[:]
            g.input.extend(kept_inputs)
    return done
