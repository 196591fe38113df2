"""Backend-only faults for the three-way tests: a QDQ model the backend runs with one encoding corrupted."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import numpy_helper as nh


def corrupt_encoding(qdq: Path, tensor: str, factor: float, out: Path) -> Path:
    """A copy of the QDQ model ``qdq`` whose activation ``tensor`` is quantized with its scale times ``factor``
    (the QuantizeLinear of ``tensor`` and the DequantizeLinear it feeds get a new scale initializer): what a wrong
    encoding on the device side does, while the CPU-QDQ run keeps the original model."""
    m = onnx.load(str(qdq))
    inits = {i.name: i for i in m.graph.initializer}
    q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    old = inits[q.input[1]]
    new = nh.from_array((nh.to_array(old) * factor).astype(nh.to_array(old).dtype), f"{old.name}_corrupted")
    m.graph.initializer.append(new)
    q.input[1] = new.name
    for n in m.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]:
            n.input[1] = new.name
    onnx.save(m, str(out))
    return out
