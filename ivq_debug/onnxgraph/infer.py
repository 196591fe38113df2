"""ONNX shape inference as facts about a graph: every value's element type and dims, optionally for given input dims.

Exports without shape inference (a legacy TorchScript export saved without ``value_info``, a graph an optimizer
rewrote) declare types only for their inputs and outputs, and the outputs' dynamic axes carry names made up by
the exporter (``Concatpresent.1.key_dim_0``). :func:`value_types` runs ONNX Runtime's symbolic shape inference
(``onnxruntime.tools.symbolic_shape_infer``: it evaluates the ``Shape -> Gather -> Range / Expand`` arithmetic a
legacy export builds its masks with; on the InternVL legacy prefill it leaves 0 of 359 values unshaped where
onnx's own inference with data propagation leaves 78), else onnx's, over a copy of the graph whose inputs take
the dims given and whose own ``value_info`` and output shapes are dropped, so the inference, not the
exporter's guess, decides them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: element type and dims (int, a symbolic name, or None for an unknown dim); dims None: rank unknown
ValueType = tuple[int, tuple[int | str | None, ...] | None]


def value_types(model: Any, input_dims: Mapping[str, Sequence[int | str | None]] | None = None, *,
                symbolic: bool = True) -> dict[str, ValueType]:
    """``{value name: (elem_type, dims)}`` of every graph input, node output and graph output as shape inference
    gives them; ``input_dims`` replaces the dims of the named graph inputs (ints for known values, names for
    symbolic ones). onnx's inference runs first; when it leaves a dim unknown and ``symbolic``, ONNX Runtime's
    (which imports sympy: about 1 s) decides instead. Empty when both fail (custom domains, a graph too large
    for protobuf).
    """
    import onnx

    m = _without_weights(model)
    g = m.graph
    del g.value_info[:]
    for vi in g.input:
        if input_dims and vi.name in input_dims:
            _set_dims(vi, input_dims[vi.name])
    for vi in g.output:
        if vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
    try:
        out = _types(onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True))
    except Exception:  # an op onnx cannot infer (custom domain), a protobuf limit: no inferred facts
        out = {}
    given = {d for v in (input_dims or {}).values() for d in v if isinstance(d, str)}
    complete = out and all(d is not None and all(isinstance(x, int) or x in given for x in d) for _, d in out.values())
    if symbolic and not complete:
        ort = _ort_symbolic(m)
        if ort is not None:
            out = _types(ort)
    return out


#: float initializers larger than this lose their values in the copy shape inference sees (their dims stay):
#: inference reads the values of small integer tensors only (Reshape targets, Slice bounds), and a copy of a
#: 2 GB decoder per inference would dominate the ingest
_KEEP_VALUES = 4096
_FLOATS = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


def _without_weights(model: Any) -> Any:
    """A copy of ``model`` for shape inference: large float initializers keep their dims and type, not their
    values (nothing large is copied)."""
    import onnx

    m = onnx.ModelProto()
    for f in ("ir_version", "producer_name", "domain", "model_version"):
        setattr(m, f, getattr(model, f))
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    src, g = model.graph, m.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    for t in src.initializer:
        n = 1
        for d in t.dims:
            n *= int(d)
        if t.data_type in _FLOATS and n > _KEEP_VALUES:
            e = g.initializer.add()
            e.name, e.data_type = t.name, t.data_type
            e.dims.extend(t.dims)
        else:
            g.initializer.append(t)
    return m


def _types(inferred: Any) -> dict[str, ValueType]:
    out: dict[str, ValueType] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        dims = None
        if tt.HasField("shape"):
            dims = tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        out[vi.name] = (int(tt.elem_type), dims)
    return out


def _set_dims(vi: Any, dims: Sequence[int | str | None]) -> None:
    shape = vi.type.tensor_type.shape
    shape.ClearField("dim")
    for d in dims:
        nd = shape.dim.add()
        if isinstance(d, int):
            nd.dim_value = d
        elif d:
            nd.dim_param = d


def _ort_symbolic(model: Any) -> Any:
    """ONNX Runtime's symbolic shape inference of ``model``, or None (not installed, or it gave up)."""
    import logging

    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:  # pragma: no cover - onnxruntime is a core dependency
        return None
    log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = log.level
    log.setLevel(logging.CRITICAL)
    # SymbolicShapeInference.infer_shapes, less its last step: when inference stays incomplete it saves the
    # model as ``sym_shape_infer_temp.onnx`` (+ external data) into the working directory, a user's folder
    try:
        if not model.opset_import or max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) < 7:
            return None
        ssi = SymbolicShapeInference(2**31 - 1, True, False, 0)
        done = False
        ssi._preprocess(model)
        while ssi.run_:
            done = ssi._infer_impl()
        ssi._update_output_from_vi()
        return ssi.out_mp_ if done else None
    except Exception:  # an op it does not know, an inconsistent graph: onnx's inference instead
        return None
    finally:
        log.setLevel(level)
