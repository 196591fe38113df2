"""Derived graphs the replay diagnostics build from a QDQ model: value names, typed inputs, node copies (the
constant subgraph is :attr:`ivq_debug.onnxgraph.load.Model.constants`).
Derived models go to their runner in memory (:meth:`ivq_debug.onnxgraph.load.Model.derive`), never a file."""

from __future__ import annotations

from typing import Any

import numpy as np


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
