"""The tensors of an ONNX graph as headerless raw files need them, and the shapes of those files solved.

:class:`GraphIO` lists a graph's inputs, outputs and every intermediate with its dtype and dims (``value_info``
where the graph has it, else onnx shape inference); :func:`resolve_dims` solves the dynamic axes of one
inference's files jointly (see its docstring).
"""


from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.qnn.names import NameMap


@dataclass(frozen=True)
class GraphTensor:
    """A tensor as an ONNX graph declares it: what a headerless raw file needs to be read.

    ``dims`` holds ints and, for dynamic axes, their names (``dim_param``, or ``<tensor>:<axis>`` when the
    graph leaves the axis unnamed). ``order`` / ``op_type``: producer node index and op (graph inputs: -1).
    """

    name: str
    dtype: np.dtype
    dims: tuple[int | str, ...]
    kind: str  # "input" | "output" | "value"
    order: int = -1
    op_type: str | None = None

    @property
    def dynamic(self) -> tuple[str, ...]:
        """Names of the dynamic axes."""
        return tuple(d for d in self.dims if isinstance(d, str))


@dataclass
class GraphIO:
    """Names, dtypes and shapes of an ONNX graph's inputs, outputs and typed intermediates (``value_info``)."""

    path: Path | None
    name: str
    inputs: list[GraphTensor]
    outputs: list[GraphTensor]
    values: dict[str, GraphTensor] = field(default_factory=dict)

    @classmethod
    def from_model(cls, model: Any) -> GraphIO:
        """Read them from a model (path or proto); intermediates come from the graph's ``value_info``."""
        from onnx.helper import tensor_dtype_to_np_dtype

        m = load_model(model)
        g = m.graph
        inits = {i.name for i in g.initializer}
        producers = {o: (i, n.op_type) for i, n in enumerate(g.node) for o in n.output if o}

        def one(v: Any, kind: str) -> GraphTensor | None:
            tt = v.type.tensor_type
            if not v.type.HasField("tensor_type") or not tt.elem_type or not tt.HasField("shape"):
                return None
            dims: list[int | str] = []
            for j, d in enumerate(tt.shape.dim):
                if d.HasField("dim_value"):
                    dims.append(int(d.dim_value))
                else:
                    dims.append(d.dim_param or f"{v.name}:{j}")
            order, op = producers.get(v.name, (-1, None))
            return GraphTensor(v.name, np.dtype(tensor_dtype_to_np_dtype(tt.elem_type)), tuple(dims), kind, order, op)

        ins = [t for v in g.input if v.name not in inits and (t := one(v, "input")) is not None]
        outs = [t for v in g.output if (t := one(v, "output")) is not None]
        seen = {t.name for t in ins + outs}
        vals = {t.name: t for v in g.value_info if v.name not in seen and (t := one(v, "value")) is not None}
        path = Path(model) if isinstance(model, (str, os.PathLike)) else None
        return cls(path, path.name if path else (g.name or "model"), ins, outs, vals)

    def input_names(self) -> NameMap:
        """Reverse map of QNN-sanitized names to the graph input names."""
        return NameMap.from_names([t.name for t in self.inputs])

    def output_names(self) -> NameMap:
        """Reverse map of QNN-sanitized names to the graph outputs and typed intermediates."""
        return NameMap.from_names([t.name for t in self.outputs] + list(self.values))

    def tensor(self, name: str) -> GraphTensor:
        """The declared tensor of a name (inputs, outputs, intermediates)."""
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        return self.values[name]


def _fmt_dims(dims: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


@dataclass(frozen=True)
class SizedFile:
    """A raw file of one inference with the graph tensor it holds and its byte size."""

    path: Path
    tensor: GraphTensor
    itemsize: int
    nbytes: int
    file_dtype: str


def resolve_dims(files: Sequence[SizedFile], known: Mapping[str, int] | None = None,
                 optional: Sequence[SizedFile] = ()) -> tuple[dict[Path, tuple[int, ...]], dict[str, int], list[Path]]:
    """Shapes of raw files from their graph dims and byte sizes; dynamic axes shared across the files.

    A file whose only unknown axis is one dynamic name fixes it (``bytes / itemsize / static dims``); the
    value then holds for every file with that name, until nothing changes. ``optional`` files (intermediates)
    are shaped with the bindings the others gave and returned as unresolved rather than raising.

    Returns ``(shape per file, bindings, unresolved optional files)``.

    Raises:
        InputError: naming the file: a size that is not a whole number of elements, a size that contradicts
            the static dims or an axis another file fixed, or dynamic axes its size cannot separate
            (``--dim NAME=VALUE`` pins them).
    """
    bind: dict[str, int] = dict(known or {})
    origin: dict[str, str] = {k: "--dim" for k in bind}

    def attempt(f: SizedFile, strict: bool) -> bool | None:
        """True: shaped; None: needs other bindings first; raises (strict) or False on a contradiction."""
        t = f.tensor
        what = f"tensor {t.name!r} {_fmt_dims(t.dims)} x {f.file_dtype}"
        if f.nbytes % f.itemsize:
            raise InputError(f"byte size {f.nbytes} is not a whole number of {f.file_dtype} values ({what})", f.path)
        total = f.nbytes // f.itemsize
        fixed = 1
        unknown: dict[str, int] = {}
        for d in t.dims:
            if isinstance(d, int):
                fixed *= d
            elif d in bind:
                fixed *= bind[d]
            else:
                unknown[d] = unknown.get(d, 0) + 1
        if not unknown:
            if fixed != total:
                if not strict:
                    return False
                via = [f"{d}={bind[d]} (from {origin[d]})" for d in t.dynamic]
                raise InputError(f"wrong byte size {f.nbytes}, expected {fixed * f.itemsize} ({what}"
                                 + (f"; {', '.join(via)}" if via else "") + ")", f.path)
            return True
        if len(unknown) > 1:
            return None
        (sym, power), = unknown.items()
        v = round((total / fixed) ** (1.0 / power)) if fixed else 0
        if fixed == 0 or v ** power * fixed != total:
            if not strict:
                return False
            raise InputError(f"wrong byte size {f.nbytes}: not a whole number of {sym} for {what}", f.path)
        bind[sym] = int(v)
        origin[sym] = f.path.name
        return True

    pending = list(files)
    while pending:
        left = [f for f in pending if attempt(f, strict=True) is None]
        if len(left) == len(pending):
            f = left[0]
            open_axes = sorted({d for d in f.tensor.dynamic if d not in bind})
            raise InputError(
                f"cannot resolve dynamic axes {', '.join(open_axes)} of tensor {f.tensor.name!r} "
                f"{_fmt_dims(f.tensor.dims)} from its byte size {f.nbytes} alone; pin them with --dim NAME=VALUE",
                f.path)
        pending = left
    shapes = {f.path: tuple(int(d) if isinstance(d, int) else bind[d] for d in f.tensor.dims) for f in files}
    unresolved = []
    for f in optional:
        if f.nbytes % f.itemsize or attempt(f, strict=False) is not True:
            unresolved.append(f.path)
        else:
            shapes[f.path] = tuple(int(d) if isinstance(d, int) else bind[d] for d in f.tensor.dims)
    return shapes, bind, unresolved


