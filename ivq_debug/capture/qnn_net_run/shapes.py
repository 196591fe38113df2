"""The tensors of an ONNX graph as headerless raw files need them, and the shapes of one inference's files solved.

:class:`GraphIO` lists a graph's inputs, outputs and every intermediate with its dtype and dims: ``value_info``
where the graph has it, else onnx shape inference (:func:`ivq_debug.onnxgraph.infer.value_types`), so a legacy
export saved without ``value_info`` still names and shapes every ``--debug`` file.

:func:`solve_call` resolves the dynamic axes of one inference as one system (the issue-30 solve):

1. the byte size of every file: ``prod(dims) * itemsize == bytes``; a file with one unknown axis fixes it;
2. the graph: onnx shape inference run with the input dims known so far, so an output axis the exporter named
   after its producer (``Concatpresent.1.key_dim_0``, ``MatMullogits_dim_0``) takes the inferred value, and
   the inferred symbols tie axes of different tensors together;
3. sibling tensors: one axis name is one value across the inference's files;
4. the model config's sizes by tensor role, when 1-3 leave a file with several axes open: a KV-cache tensor
   ``[B, num_key_value_heads, S, head_dim]``, ``logits [..., vocab_size]`` (:func:`config_axes`).

Steps 1-3 repeat until nothing changes (a value an output fixes can open the inference of the rest). Axes still
open are returned, each with the candidate values the byte sizes allow: the caller asks for ``--dim`` pins for
all of them in one error (:class:`UnresolvedAxes`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError
from ivq_debug.onnxgraph.infer import value_types
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.qnn.names import NameMap

#: prefix of the axis symbols onnx shape inference makes up (kept apart from the graph's own names)
INFERRED = "?"
#: HF config fields whose values are axis sizes of a decoder's tensors (text config first)
CONFIG_SIZES = ("head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size", "intermediate_size",
                "vocab_size", "num_hidden_layers")


@dataclass(frozen=True)
class GraphTensor:
    """A tensor as an ONNX graph declares it (or shape inference gives it): what a headerless raw file needs.

    ``dims`` holds ints and, for dynamic axes, their names (``dim_param``; ``<tensor>:<axis>`` when the graph
    leaves the axis unnamed; ``?unk__N`` for symbols of onnx's inference); None when the rank is unknown.
    ``dtype`` None: the inference could not tell it. ``order`` / ``op_type``: producer node index and op
    (graph inputs: -1).
    """

    name: str
    dtype: np.dtype | None
    dims: tuple[int | str, ...] | None
    kind: str  # "input" | "output" | "value"
    order: int = -1
    op_type: str | None = None

    @property
    def dynamic(self) -> tuple[str, ...]:
        """Names of the dynamic axes."""
        return tuple(d for d in (self.dims or ()) if isinstance(d, str))


def _np_dtype(elem_type: int) -> np.dtype | None:
    from onnx.helper import tensor_dtype_to_np_dtype

    try:
        return np.dtype(tensor_dtype_to_np_dtype(elem_type)) if elem_type else None
    except (KeyError, TypeError, ValueError):  # STRING, complex or an unknown code
        return None


def _dims_of(name: str, dims: Sequence[int | str | None] | None, keep: set[str] | None = None,
             tag: str = "") -> tuple[int | str, ...] | None:
    """Dims as the solve names them. ``keep`` None: the graph's own dims (an unnamed axis is ``<name>:<j>``);
    else inferred dims, whose symbols are ``?<tag><symbol>`` unless they are input axis names in ``keep``."""
    if dims is None:
        return None
    out: list[int | str] = []
    for j, d in enumerate(dims):
        if isinstance(d, int):
            out.append(d)
        elif keep is None:
            out.append(d or f"{name}:{j}")
        else:
            out.append(d if d in keep else f"{INFERRED}{tag}{d or f'{name}:{j}'}")
    return tuple(out)


@dataclass
class GraphIO:
    """Names, dtypes and shapes of an ONNX graph's inputs, outputs and every intermediate (node output)."""

    path: Path | None
    name: str
    inputs: list[GraphTensor]
    outputs: list[GraphTensor]
    values: dict[str, GraphTensor] = field(default_factory=dict)
    model: Any = field(default=None, repr=False, compare=False)
    _inferred: dict[tuple, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_model(cls, model: Any) -> GraphIO:
        """Read them from a model (path or proto); intermediates from ``value_info``, else shape inference."""
        m = load_model(model)
        g = m.graph
        inits = {i.name for i in g.initializer}
        producers = {o: (i, n.op_type) for i, n in enumerate(g.node) for o in n.output if o}

        def declared(v: Any, kind: str) -> GraphTensor | None:
            tt = v.type.tensor_type
            if not v.type.HasField("tensor_type") or not tt.elem_type or not tt.HasField("shape"):
                return None
            dims = [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
            order, op = producers.get(v.name, (-1, None))
            return GraphTensor(v.name, _np_dtype(tt.elem_type), _dims_of(v.name, dims), kind, order, op)

        ins = [t for v in g.input if v.name not in inits and (t := declared(v, "input")) is not None]
        outs = [t for v in g.output if (t := declared(v, "output")) is not None]
        seen = {t.name for t in ins + outs} | inits
        vals = {t.name: t for v in g.value_info if v.name not in seen and (t := declared(v, "value")) is not None}
        keep = {d for t in ins for d in t.dynamic}
        inferred = value_types(m, symbolic=False)  # symbolic dims are hints: each inference's own run decides
        for name, (order, op) in sorted(producers.items(), key=lambda kv: kv[1][0]):
            if name in seen or name in vals:
                continue
            et, dims = inferred.get(name, (0, None))
            vals[name] = GraphTensor(name, _np_dtype(et), _dims_of(name, dims, keep, "graph:"), "value", order, op)
        path = Path(model) if isinstance(model, (str, os.PathLike)) else None
        return cls(path, path.name if path else (g.name or "model"), ins, outs, vals, m)

    def input_names(self) -> NameMap:
        """Reverse map of QNN-sanitized names to the graph input names."""
        return NameMap.from_names([t.name for t in self.inputs])

    def output_names(self) -> NameMap:
        """Reverse map of QNN-sanitized names to the graph outputs and intermediates."""
        return NameMap.from_names([t.name for t in self.outputs] + list(self.values))

    def tensor(self, name: str) -> GraphTensor:
        """The tensor of a name (inputs, outputs, intermediates)."""
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        return self.values[name]

    def infer(self, input_dims: Mapping[str, tuple[int | str, ...]]) -> dict[str, tuple[int | str, ...] | None]:
        """Dims of every value (``?``-prefixed symbols for inferred unknowns) by shape inference with the input
        dims given; cached per distinct input dims (a decode folder's calls differ by their cache length)."""
        key = tuple(sorted((k, tuple(v)) for k, v in input_dims.items()))
        if key not in self._inferred:
            keep = {d for v in input_dims.values() for d in v if isinstance(d, str)}
            types = value_types(self.model, input_dims) if self.model is not None else {}
            self._inferred[key] = {n: _dims_of(n, dims, keep) for n, (_et, dims) in types.items()}
        return self._inferred[key]


def fmt_dims(dims: Sequence[int | str] | None) -> str:
    """``[1, past_sequence_length, 16]`` (``[?]`` for an unknown rank)."""
    return "[?]" if dims is None else "[" + ", ".join(str(d) for d in dims) + "]"


def config_sizes(config: Mapping[str, Any] | None) -> dict[str, int]:
    """The axis sizes an HF config states (:data:`CONFIG_SIZES`; ``head_dim`` derived from ``hidden_size /
    num_attention_heads`` when absent), text config first."""
    if not isinstance(config, Mapping):
        return {}
    tc = config.get("text_config") or config.get("llm_config") or config
    out: dict[str, int] = {}
    for src in (tc, config):
        if not isinstance(src, Mapping):
            continue
        for k in CONFIG_SIZES:
            v = src.get(k)
            if k not in out and isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[k] = v
    if "head_dim" not in out and out.get("hidden_size") and out.get("num_attention_heads"):
        if out["hidden_size"] % out["num_attention_heads"] == 0:
            out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return out


@dataclass(frozen=True)
class SizedFile:
    """A raw file of one inference with the graph tensor it holds and its byte size."""

    path: Path
    tensor: GraphTensor
    itemsize: int
    nbytes: int
    file_dtype: str


@dataclass(frozen=True)
class OpenAxis:
    """An axis the solve left open: its name, the file that shows it, and the values its size allows."""

    name: str
    path: Path
    tensor: str
    dims: tuple[int | str, ...]
    candidates: tuple[int, ...]
    config: tuple[str, ...] = ()

    def one_line(self) -> str:
        """``seq (x.raw [batch, seq], candidates 1, 2, 3, 6)``"""
        cands = ", ".join(str(c) for c in self.candidates[:8]) + (", ..." if len(self.candidates) > 8 else "")
        conf = f"; config {', '.join(self.config)}" if self.config else ""
        return f"{self.name} ({self.path.name} {fmt_dims(self.dims)}: candidates {cands or 'none'}{conf})"


class UnresolvedAxes(InputError):
    """Dynamic axes no fact decides: every one listed, with its candidates (``--dim NAME=VALUE`` pins them)."""

    def __init__(self, axes: Sequence[OpenAxis]) -> None:
        self.axes = list(dict.fromkeys(axes))
        names = list(dict.fromkeys(a.name for a in self.axes))
        first = {n: next(a for a in self.axes if a.name == n) for n in names}
        super().__init__(
            f"{len(names)} dynamic {'axis' if len(names) == 1 else 'axes'} that the byte sizes, the graph's shape "
            f"inference and the config leave open: {'; '.join(first[n].one_line() for n in names)}; pin each with --dim NAME=VALUE",
            path=self.axes[0].path)


class _Axes:
    """Union-find over axis symbols, with a value per class and where it came from."""

    def __init__(self, pins: Mapping[str, int]) -> None:
        self.parent: dict[str, str] = {}
        self.value: dict[str, int] = {}
        self.origin: dict[str, str] = {}
        for k, v in pins.items():
            self.bind(k, int(v), "--dim")

    def find(self, s: str) -> str:
        self.parent.setdefault(s, s)
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def get(self, d: int | str) -> int | None:
        return d if isinstance(d, int) else self.value.get(self.find(d))

    def bind(self, s: str, v: int, origin: str) -> bool:
        """Give ``s`` a value; False when it had another."""
        r = self.find(s)
        if r in self.value:
            return self.value[r] == v
        self.value[r], self.origin[r] = v, origin
        return True

    def union(self, a: int | str, b: int | str, origin: str) -> bool:
        """``a == b`` (ints or symbols); False on a contradiction. Graph-named symbols stay representatives."""
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        if isinstance(a, int) or isinstance(b, int):
            s, v = (b, a) if isinstance(a, int) else (a, b)
            return self.bind(s, int(v), origin)  # type: ignore[arg-type]
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return True
        if ra.startswith(INFERRED) and not rb.startswith(INFERRED):
            ra, rb = rb, ra
        va, vb = self.value.get(ra), self.value.get(rb)
        if va is not None and vb is not None and va != vb:
            return False
        self.parent[rb] = ra
        if va is None and vb is not None:
            self.value[ra], self.origin[ra] = vb, self.origin[rb]
        return True

    def named(self) -> dict[str, int]:
        """Values of the graph's own axis names."""
        return {s: v for s in self.parent if not s.startswith(INFERRED) and (v := self.get(s)) is not None}


def _open(dims: Sequence[int | str], axes: _Axes) -> tuple[int, dict[str, int]]:
    """(product of the known dims, {open class: power})."""
    fixed, unknown = 1, {}
    for d in dims:
        v = axes.get(d)
        if v is None:
            r = axes.find(d)  # type: ignore[arg-type]
            unknown[r] = unknown.get(r, 0) + 1
        else:
            fixed *= v
    return fixed, unknown


def _unit(f: SizedFile, dims: Sequence[int | str], axes: _Axes, strict: bool) -> bool | None:
    """Fix the one open axis of a file from its size. True: shaped; None: several axes open; False (or an
    InputError when ``strict``): the size contradicts the dims."""
    what = f"tensor {f.tensor.name!r} {fmt_dims(f.tensor.dims)} x {f.file_dtype}"
    if f.nbytes % f.itemsize:
        if strict:
            raise InputError(f"byte size {f.nbytes} is not a whole number of {f.file_dtype} values ({what})", f.path)
        return False
    total = f.nbytes // f.itemsize
    fixed, unknown = _open(dims, axes)
    if not unknown:
        if fixed == total:
            return True
        if strict:
            via = [f"{d}={axes.get(d)} (from {axes.origin.get(axes.find(d), 'the graph')})"
                   for d in (f.tensor.dims or ()) if isinstance(d, str) and axes.get(d) is not None]
            raise InputError(f"wrong byte size {f.nbytes}, expected {fixed * f.itemsize} ({what}"
                             + (f"; {', '.join(via)}" if via else "") + ")", f.path)
        return False
    if len(unknown) > 1:
        return None
    (sym, power), = unknown.items()
    v = round((total / fixed) ** (1.0 / power)) if fixed else 0
    if fixed == 0 or v < 1 or v ** power * fixed != total:
        if strict:
            raise InputError(f"wrong byte size {f.nbytes}: not a whole number of {sym} for {what}", f.path)
        return False
    axes.bind(sym, int(v), f.path.name)
    return True


@dataclass
class CallShapes:
    """What :func:`solve_call` found for one inference."""

    shapes: dict[Path, tuple[int, ...]]
    dims: dict[str, int]
    open_axes: list[OpenAxis]
    skipped: dict[Path, str]


def _effective_dims(f: SizedFile, inferred: Mapping[str, Any], axes: _Axes) -> tuple[int | str, ...] | None:
    """A file's dims: declared, tied axis by axis to what shape inference gives (ints bind, symbols unify)."""
    decl, inf = f.tensor.dims, inferred.get(f.tensor.name)
    if decl is None:
        return inf
    if inf is not None and len(inf) == len(decl) and f.tensor.kind != "input":
        for d, i in zip(decl, inf, strict=True):
            if not (isinstance(d, int) and isinstance(i, int)):
                axes.union(d, i, "shape inference")
    return decl


_KV = re.compile(r"(?:^|[._/])(past|present)[^/]*[._](key|value)s?$")


def config_axes(name: str, rank: int, sizes: Mapping[str, int]) -> dict[int, tuple[int, str]]:
    """Axes an HF config fixes by the tensor's role: a KV-cache tensor ``[B, H_kv, S, head_dim]`` (``past*`` /
    ``present*`` key or value), ``logits [..., vocab_size]``. ``{axis: (value, config key)}``."""
    out: dict[int, tuple[int, str]] = {}
    if rank == 4 and _KV.search(name):
        for j, key in ((1, "num_key_value_heads"), (3, "head_dim")):
            if key in sizes:
                out[j] = (sizes[key], key)
    elif name.split("/")[-1] == "logits" and rank >= 1 and "vocab_size" in sizes:
        out[rank - 1] = (sizes["vocab_size"], "vocab_size")
    return out


def _config_fit(f: SizedFile, dims: Sequence[int | str], axes: _Axes, sizes: Mapping[str, int]) -> bool:
    """Bind the open axes the config fixes by the tensor's role (:func:`config_axes`) when the size agrees."""
    fixed, unknown = _open(dims, axes)
    if not unknown or f.nbytes % f.itemsize:
        return False
    total = f.nbytes // f.itemsize
    hits = {j: v for j, v in config_axes(f.tensor.name, len(dims), sizes).items()
            if isinstance(dims[j], str) and axes.get(dims[j]) is None}
    if not hits:
        return False
    prod = int(np.prod([v for v, _ in hits.values()]))
    if total % (fixed * prod):
        return False
    for j, (v, key) in hits.items():
        axes.bind(dims[j], v, f"config {key}")  # type: ignore[arg-type]
    return True


def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def _open_axes(files: Sequence[SizedFile], dims: Mapping[Path, Any], axes: _Axes, sizes: Mapping[str, int]
               ) -> list[OpenAxis]:
    out = []
    for f in files:
        fixed, unknown = _open(dims[f.path], axes)
        if not unknown:
            continue
        rest = (f.nbytes // f.itemsize) // fixed if fixed and f.nbytes % f.itemsize == 0 else 0
        for sym in unknown:
            cands = _divisors(rest) if rest else ()
            conf = tuple(f"{k}={v}" for k, v in sizes.items() if v in cands)
            out.append(OpenAxis(sym, f.path, f.tensor.name, tuple(f.tensor.dims or dims[f.path]), cands, conf))
    return out


def solve_call(graph: GraphIO, required: Sequence[SizedFile], optional: Sequence[SizedFile] = (),
               pins: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None) -> CallShapes:
    """Shapes of one inference's raw files, its dynamic axes solved jointly (module docstring).

    ``required``: inputs and graph outputs (a contradiction raises); ``optional``: intermediates (``--debug``
    files; one that does not fit is returned in ``skipped`` with the reason). ``pins``: ``--dim`` values;
    ``sizes``: the config's (:func:`config_sizes`).

    Raises:
        InputError: naming the file: a size that is not a whole number of elements, or that contradicts the
            static dims or an axis another file or the graph fixed.
    """
    axes = _Axes(pins or {})
    sizes = dict(sizes or {})
    files = list(required) + list(optional)
    dims: dict[Path, Any] = {f.path: f.tensor.dims for f in files}
    done_inputs: tuple | None = None
    while True:
        _propagate([f for f in required if dims[f.path] is not None], dims, axes)
        ins = {f.tensor.name: tuple(axes.get(d) or d for d in f.tensor.dims)
               for f in required if f.tensor.kind == "input" and f.tensor.dims is not None}
        sig = tuple(sorted(ins.items()))
        if sig == done_inputs:
            if not any(_config_fit(f, dims[f.path], axes, sizes) for f in required if dims[f.path] is not None):
                break
            continue
        done_inputs = sig
        inferred = graph.infer(ins)
        for f in files:
            dims[f.path] = _effective_dims(f, inferred, axes)
    shapes, skipped = {}, {}
    for f in files:
        d = dims[f.path]
        if f in optional and (d is None or _unit(f, d, axes, strict=False) is not True):
            skipped[f.path] = _why_skipped(f, d, axes)
            continue
        if d is not None and all(axes.get(x) is not None for x in d):
            shapes[f.path] = tuple(int(axes.get(x)) for x in d)  # type: ignore[arg-type]
    open_axes = _open_axes([f for f in required if f.path not in shapes and dims[f.path] is not None], dims, axes,
                           sizes)
    return CallShapes(shapes, axes.named(), open_axes, skipped)


def _propagate(files: Sequence[SizedFile], dims: Mapping[Path, Any], axes: _Axes) -> None:
    pending = list(files)
    while pending:
        left = [f for f in pending if _unit(f, dims[f.path], axes, strict=True) is None]
        if len(left) == len(pending):
            return
        pending = left


def _why_skipped(f: SizedFile, dims: Sequence[int | str] | None, axes: _Axes) -> str:
    t = f.tensor
    if dims is None:
        return f"shape: shape inference gives no rank for {t.name!r} ({f.nbytes} bytes)"
    shown = [axes.get(d) or d for d in dims]
    if f.nbytes % f.itemsize == 0:
        _fixed, unknown = _open(dims, axes)
        if unknown:
            return (f"shape: {f.nbytes // f.itemsize} {f.file_dtype} values leave axes {', '.join(unknown)} of "
                    f"{t.name!r} {fmt_dims(shown)} open")
    return f"shape: {f.nbytes} bytes is not {t.name!r} {fmt_dims(shown)} x {f.file_dtype}"
