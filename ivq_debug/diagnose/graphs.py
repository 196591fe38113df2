"""Derived graphs the replay diagnostics build from a QDQ model: constant subgraphs, typed inputs, node copies,
and the temporary file a session reads them from."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.onnxgraph.fold import constant_nodes


def constant_values(model: Any) -> tuple[set[str], list[Any]]:
    """Values computed from initializers only (weights, their DequantizeLinear, shape constants), and the
    nodes that compute them, in graph order (:func:`~ivq_debug.onnxgraph.fold.constant_nodes`)."""
    nodes = list(model.graph.node)
    idx, const = constant_nodes(nodes, {i.name for i in model.graph.initializer})
    return const, [nodes[i] for i in sorted(idx)]


def unit_value(pre: str, name: str) -> str:
    """A derived graph's name for the model tensor (or node) ``name`` inside the copy whose names start with
    ``pre`` (a replay unit ``u3::``, a lift variant ``v1::``): in its own ``v:`` namespace, so a model tensor
    called ``out``, ``fq`` or ``out::logits`` cannot collide with the copy's result names (``{pre}out``,
    ``{pre}out::logits``, ...)."""
    return f"{pre}v:{name}"


def typed_inputs(m: Any, feeds: dict[str, np.ndarray]) -> None:
    """Give every graph input of ``m`` the dtype and static shape of its feed (any numpy dtype ONNX has, e.g.
    the uint8 / int8 tensors of a dynamic INT8 reference)."""
    from onnx import helper

    for vi in m.graph.input:
        a = feeds[vi.name]
        vi.CopyFrom(helper.make_tensor_value_info(vi.name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)))


def copy_node(n: Any, name: str, inputs: list[str], outputs: list[str]) -> Any:
    """A copy of node ``n`` with a new name, inputs and outputs (attributes and domain kept)."""
    import onnx

    c = onnx.NodeProto()
    c.CopyFrom(n)
    c.name = name
    c.ClearField("input")
    c.ClearField("output")
    c.input.extend(inputs)
    c.output.extend(outputs)
    return c


@contextmanager
def temp_model(m: Any, folder: str | os.PathLike, tag: str = "replay") -> Iterator[str]:
    """Save ``m`` as a hidden temporary file in ``folder`` (next to the QDQ model: its weights may be references
    into that model's file, which ONNX Runtime reads only from inside the model's folder); removed on exit."""
    import onnx

    fd, path = tempfile.mkstemp(prefix=f".ivq-{tag}-{os.getpid()}-", suffix=".onnx", dir=Path(folder))
    os.close(fd)
    try:
        onnx.save(m, path)
        yield path
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
