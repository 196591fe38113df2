"""A model's graph inputs (:class:`InputSpec`) and the check of user feeds against them (:func:`check_feeds`:
``ivq capture --inputs``, ``ivq tune --inputs``; the quantizer's calibration samples are fitted to the same specs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivq_debug.errors import InputError
from ivq_debug.onnxgraph.load import load_model

PathLike = str | os.PathLike


@dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype and shape (``None`` for a symbolic dimension)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]

    def check_shape(self, shape: Sequence[int], source: PathLike | str | None) -> None:
        """:class:`InputError` (naming ``source``) when an array of ``shape`` has another rank than the input or
        differs from one of its static dimensions."""
        shape = tuple(shape)
        if len(self.shape) != len(shape):
            raise InputError(f"input {self.name!r} has rank {len(shape)} (shape {list(shape)}), the model expects "
                             f"rank {len(self.shape)} {_dims(self.shape)}", source)
        for i, (have, want) in enumerate(zip(shape, self.shape, strict=True)):
            if want is not None and want > 0 and have != want:
                raise InputError(f"input {self.name!r}: dimension {i} is {have}, the model expects {want} "
                                 f"{_dims(self.shape)}", source)


def model_inputs(model: Any) -> list[InputSpec]:
    """The real graph inputs of an ``onnx.ModelProto`` (initializers listed as inputs excluded)."""
    from onnx import helper

    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else np.dtype(np.float32)
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
        out.append(InputSpec(vi.name, dtype, shape))
    return out


def check_feeds(samples: Sequence[Mapping[str, np.ndarray]], model: Any, sources: Sequence[PathLike]) -> None:
    """Every sample holds exactly the model's graph inputs, each with the input's dtype, rank and static
    dimensions (what ONNX Runtime would refuse mid-run, said up front and naming the file).

    Args:
        samples: one ``name -> array`` mapping per ``--inputs`` file.
        model: the ``onnx.ModelProto`` (or a path) the samples feed.
        sources: the file each sample came from (named in the error).

    Raises:
        InputError: a missing or extra array, another dtype, rank or static dimension (exit 3).
    """
    m = load_model(model)
    want = {s.name: s for s in model_inputs(m)}
    # what the graph declares: a tensor element type (0: not a tensor / unknown) and a shape (absent: any rank)
    declared = {vi.name: (vi.type.tensor_type.elem_type, vi.type.tensor_type.HasField("shape")) for vi in m.graph.input}
    for feeds, src in zip(samples, sources, strict=True):
        missing = [n for n in want if n not in feeds]
        if missing:
            raise InputError(f"missing model input(s) {missing} (the model's inputs: {list(want)})", src)
        extra = [n for n in feeds if n not in want]
        if extra:
            raise InputError(f"array(s) {extra} are not inputs of the model (its inputs: {list(want)})", src)
        for name, arr in feeds.items():
            elem, ranked = declared.get(name, (0, False))
            _check_feed(name, np.asarray(arr), want[name], src, typed=elem != 0, ranked=ranked)


def _check_feed(name: str, a: np.ndarray, spec: InputSpec, src: PathLike, *, typed: bool, ranked: bool) -> None:
    if typed and a.dtype != spec.dtype:
        raise InputError(f"input {name!r} is {a.dtype}, the model expects {spec.dtype}", src)
    if not ranked:
        return
    spec.check_shape(a.shape, src)


def _dims(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None or d <= 0 else str(d) for d in shape) + "]"
