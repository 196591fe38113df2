"""Model intake: an ONNX file as third-party exporters write it, made into what the quantizer and the runtimes take.

What each fact of such a file does unattended, and what intake does (issue 20's paddle2onnx recognizer; reproduced
on ``tests/support/thirdparty_models.py``, tests in ``tests/onnxgraph/test_intake.py``):

* **weights as ``Constant`` nodes**: ORT's quantizer quantizes them at run time as activations ("Expected bias to
  be an initializer"; "a16w8" is really a16w16) -> :func:`constants_to_initializers`;
* **``metadata_props``**: ``qnn_preprocess_model`` raises "cannot convert dictionary update sequence element #0 to
  a sequence" -> set aside (:func:`strip_metadata`) and restored on the written model (:func:`append_metadata`);
* **dynamic dims**: QNN HTP fails with "Having zero graph inputs is not supported on this backend" -> fixed from the
  given inputs (:func:`input_shapes`, :func:`fix_input_dims`), or a one-line error naming the input and the axis;
* **opset < 13 with per-channel weights**: a per-channel DequantizeLinear needs ``axis`` (opset 13) ->
  :func:`upgrade_opset`;
* **shape arithmetic** (``Shape -> Gather -> Concat -> Reshape``, what paddle2onnx and torch's exporters write for
  a dynamic reshape): QNN HTP refuses ``Shape`` at ORT optimization level "disable" and then every node downstream
  ("Cannot get shape": 144 nodes of the PP-OCRv4 recognizer), so the QDQ model ran on HTP only at "all", where
  ORT folds the chain first -> once the dims are static, folded into initializers
  (:func:`ivq_debug.onnxgraph.fold.fold_shape_chains`: exact, weights and every other name kept);
* **standalone BatchNormalization** (no pre-processing folded it): the emulated HTP computes its quantized scale
  less exactly than CPU fake-quant -> opt-in, Mul + Add by constants (:mod:`ivq_debug.onnxgraph.batchnorm`).

Every model a command writes is checked (:func:`check_written_model`: ``onnx.checker`` and an ONNX Runtime CPU
session) before the command reports success. :func:`effective_quantization` reads back, per tensor, the
quantization a QDQ model really holds, so a preset that did not hold is visible (:func:`quantization_summary`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import CheckError, UsageError, one_line
from ivq_debug.onnxgraph.batchnorm import batchnorm_to_mul_add
from ivq_debug.onnxgraph.fold import fold_shape_chains
from ivq_debug.onnxgraph.load import load_model

#: the metadata key under which ``ivq quantize`` stores :func:`effective_quantization` in the written model
QUANT_METADATA_KEY = "ivq_debug.quantization"
#: the first opset whose DequantizeLinear takes ``axis`` (per-channel)
PER_CHANNEL_MIN_OPSET = 13
#: ops whose input 1 is a weight (what a preset's ``w`` bits are for); initializers elsewhere are ``constant``
WEIGHT_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "LSTM", "GRU", "Gather", "LayerNormalization",
              "InstanceNormalization", "BatchNormalization")
#: ops QNN quantizes per-channel (``get_qnn_qdq_config(per_channel=True)``)
PER_CHANNEL_OPS = ("Conv", "ConvTranspose", "Gemm")
_Q_OPS = ("QuantizeLinear",)
_DQ_OPS = ("DequantizeLinear",)


@dataclass
class IntakeReport:
    """What :func:`prepare` changed in a model (empty lists: nothing)."""

    constants_to_initializers: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    fixed_dims: list[str] = field(default_factory=list)
    opset_from: int | None = None
    opset_to: int | None = None
    #: the shape-arithmetic nodes folded into initializers, ``"name (op_type)"`` in graph order
    folded_shapes: list[str] = field(default_factory=list)
    #: the BatchNormalization nodes rewritten as Mul + Add (:mod:`ivq_debug.onnxgraph.batchnorm`), by name
    batchnorms_to_mul_add: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the model proto was modified."""
        return bool(self.constants_to_initializers or self.metadata or self.fixed_dims or self.opset_to
                    or self.folded_shapes or self.batchnorms_to_mul_add)

    def notes(self) -> list[str]:
        """One line per change, for a command's summary."""
        out = []
        if self.constants_to_initializers:
            n = len(self.constants_to_initializers)
            out.append(f"intake: {n} Constant node(s) turned into initializers (weights quantized as weights)")
        if self.metadata:
            out.append(f"intake: {len(self.metadata)} metadata_props entr(y/ies) set aside for the quantizer and "
                       "restored on the output")
        out += [f"intake: fixed {d}" for d in self.fixed_dims]
        if self.opset_to:
            out.append(f"intake: opset {self.opset_from} upgraded to {self.opset_to} (per-channel weights need "
                       f"opset >= {PER_CHANNEL_MIN_OPSET})")
        if self.folded_shapes:
            ops = Counter(f.rsplit(" (", 1)[-1].rstrip(")") for f in self.folded_shapes)
            out.append(f"intake: {len(self.folded_shapes)} shape node(s) folded into initializers "
                       f"({', '.join(f'{op} x{k}' for op, k in ops.most_common())}): QNN HTP runs the model at "
                       "every ORT optimization level")
        if self.batchnorms_to_mul_add:
            out.append(f"intake: {len(self.batchnorms_to_mul_add)} BatchNormalization node(s) rewritten as Mul + Add "
                       "by constants (output names kept)")
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        d = asdict(self)
        d["metadata"] = sorted(self.metadata)
        return d


# ------------------------------------------------------------------------------------------ graph edits
def constants_to_initializers(model: Any) -> list[str]:
    """Turn the main graph's ``Constant`` nodes into initializers of the same name (in place); returns the names.

    ORT's quantizer recognizes weights and biases only as initializers: a ``Constant``-node weight is quantized
    through a run-time QuantizeLinear with the *activation* type. Constants whose output is a graph output, and
    sparse constants, are left alone.
    """
    from onnx import helper, numpy_helper

    outputs = {o.name for o in model.graph.output}
    keep, moved = [], []
    for n in model.graph.node:
        if n.op_type != "Constant" or n.domain not in ("", "ai.onnx") or n.output[0] in outputs:
            keep.append(n)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if "value" in attrs:
            t = attrs["value"]
            t.name = n.output[0]
        elif "value_float" in attrs:
            t = numpy_helper.from_array(np.array(attrs["value_float"], np.float32), n.output[0])
        elif "value_floats" in attrs:
            t = numpy_helper.from_array(np.array(attrs["value_floats"], np.float32), n.output[0])
        elif "value_int" in attrs:
            t = numpy_helper.from_array(np.array(attrs["value_int"], np.int64), n.output[0])
        elif "value_ints" in attrs:
            t = numpy_helper.from_array(np.array(attrs["value_ints"], np.int64), n.output[0])
        else:  # sparse_value, value_string(s): not weights
            keep.append(n)
            continue
        model.graph.initializer.append(t)
        moved.append(n.output[0])
    if moved:
        del model.graph.node[:]
        model.graph.node.extend(keep)
    return moved


def load_float_model(model: Any) -> Any:
    """The float model with its ``Constant``-node weights as initializers, for every reader of float weights
    (weight spreads, lifted weights, weight overrides): a paddle2onnx-style model has no initializers at all.
    A copy: neither the file nor a proto passed in is changed."""
    m = load_model(model)
    if m is model or m is getattr(model, "proto", None):  # a proto or a loaded Model: not changed in place
        c = type(m)()
        c.CopyFrom(m)
        m = c
    constants_to_initializers(m)
    return m


def strip_metadata(model: Any) -> dict[str, str]:
    """Remove ``metadata_props`` from ``model`` (in place); returns them."""
    props = {p.key: p.value for p in model.metadata_props}
    del model.metadata_props[:]
    return props


def append_metadata(path: str | os.PathLike, props: Mapping[str, str], *, existing: Sequence[str] = ()) -> list[str]:
    """Append ``props`` to the ``metadata_props`` of the ONNX file at ``path``; returns the keys written.

    A protobuf message may be extended by appending fields (repeated fields concatenate), so the file is not
    re-serialized: a model of any size gets its metadata in O(metadata). Keys in ``existing`` (those the file
    already holds) are skipped: ONNX forbids duplicate keys.
    """
    from onnx import StringStringEntryProto

    def varint(v: int) -> bytes:
        out = bytearray()
        while True:
            b = v & 0x7F
            v >>= 7
            out.append(b | (0x80 if v else 0))
            if not v:
                return bytes(out)

    chunks, written = [], []
    for k, v in props.items():
        if k in existing:
            continue
        entry = StringStringEntryProto(key=k, value=v).SerializeToString()
        chunks.append(varint((14 << 3) | 2) + varint(len(entry)) + entry)  # ModelProto.metadata_props = 14
        written.append(k)
    if chunks:
        with open(path, "ab") as fh:
            fh.write(b"".join(chunks))
            fh.flush()
            os.fsync(fh.fileno())
    return written


def graph_input_dims(model: Any) -> dict[str, list[int | str | None]]:
    """Real graph inputs (initializers excluded) -> dims: an int, a ``dim_param`` name, or ``None`` (unnamed)."""
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = []
        for d in vi.type.tensor_type.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") and d.dim_value > 0
                        else (d.dim_param or None))
        out[vi.name] = dims
    return out


def input_shapes(model: Any, samples: Sequence[Mapping[str, Any]], *, required: bool = False,
                 flag: str = "--inputs", why: str = "") -> dict[str, tuple[int, ...]]:
    """The static shapes to give the dynamic inputs of ``model``, read from ``samples`` (feed dicts).

    An input with a dynamic dim gets a shape when every sample agrees on it. When they disagree (or a sample
    lacks the input) it stays dynamic; with ``required`` (e.g. QNN HTP, which takes only static shapes) that is a
    :class:`UsageError` naming the input, the axis and ``flag``.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for name, dims in graph_input_dims(model).items():
        if all(isinstance(d, int) for d in dims):
            continue
        seen = {tuple(np.shape(s[name])) for s in samples if name in s}
        bad_axes = [i for i, d in enumerate(dims) if not isinstance(d, int)]
        if len(seen) == 1 and len(next(iter(seen))) == len(dims):
            shapes[name] = next(iter(seen))
            continue
        if required:
            axis = bad_axes[0]
            label = f" ({dims[axis]!r})" if dims[axis] else ""
            if not seen:
                got = "no sample gives it"
            elif len(seen) > 1:
                got = f"the samples disagree ({', '.join(str(list(s)) for s in sorted(seen))})"
            else:
                got = f"the sample has rank {len(next(iter(seen)))}, the model {len(dims)}"
            raise UsageError(f"input {name!r} axis {axis}{label} is dynamic and {got}{why}; give {flag} samples "
                             f"of one shape (one run per size)")
    return shapes


def fix_input_dims(model: Any, shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """Make the dynamic dims of the given inputs static (in place); returns one line per fixed dim.

    A named dim (``dim_param``) gets its value everywhere it appears (inputs, outputs, value_info), so the
    outputs that share the axis become static too. A static dim that differs from the shape is a
    :class:`UsageError` (the inputs do not fit the model).
    """
    dims = graph_input_dims(model)
    params: dict[str, int] = {}
    lines = []
    by_name = {vi.name: vi for vi in model.graph.input}
    for name, shape in shapes.items():
        if name not in dims:
            continue
        want = dims[name]
        if len(shape) != len(want):
            raise UsageError(f"input {name!r}: rank {len(shape)}, the model expects {len(want)} ({want})")
        for axis, (d, have) in enumerate(zip(want, shape, strict=True)):
            if isinstance(d, int):
                if d != have:
                    raise UsageError(f"input {name!r} axis {axis} is {have}, the model expects {d} ({want})")
                continue
            if d is not None:
                if params.setdefault(d, int(have)) != int(have):
                    raise UsageError(f"dim {d!r} is {params[d]} on one input and {have} on {name!r}")
            dim = by_name[name].type.tensor_type.shape.dim[axis]
            dim.ClearField("dim_param")
            dim.dim_value = int(have)
            lines.append(f"input {name!r} axis {axis}{f' ({d!r})' if d else ''} = {int(have)} from the inputs")
    if params:
        for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
            for dim in vi.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") and dim.dim_param in params:
                    v = params[dim.dim_param]
                    dim.ClearField("dim_param")
                    dim.dim_value = v
    return lines


def opset_of(model: Any) -> int:
    """The default-domain opset of ``model``."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def upgrade_opset(model: Any, target: int, where: str | os.PathLike | None = None) -> Any:
    """``model`` converted to opset ``target`` with ``onnx.version_converter`` (a :class:`UsageError` naming the
    model when the converter cannot)."""
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, target)
    except Exception as e:
        raise UsageError(f"cannot upgrade the model from opset {opset_of(model)} to {target} for per-channel "
                         f"weights ({one_line(e, 200)}); export at opset >= {target} or drop --per-channel",
                         where) from None


def prepare(model: Any, *, samples: Sequence[Mapping[str, Any]] | None = None, per_channel: bool = False,
            where: str | os.PathLike | None = None, constants: bool = True,
            fold_shapes: bool = True, batchnorm: bool = False) -> tuple[Any, IntakeReport]:
    """The quantizer's intake of ``model`` (a proto, modified in place unless the opset is upgraded).

    Constants become initializers, metadata is set aside (``report.metadata``: restore it with
    :func:`append_metadata`), dims every sample agrees on are fixed, with ``per_channel`` an opset below 13 is
    upgraded, and the shape arithmetic the static dims make constant is folded
    (:func:`~ivq_debug.onnxgraph.fold.fold_shape_chains`; ``fold_shapes=False`` keeps it, ``constants=False``
    keeps ``Constant`` nodes); with ``batchnorm`` every inference-form BatchNormalization becomes Mul + Add
    (:func:`~ivq_debug.onnxgraph.batchnorm.batchnorm_to_mul_add`). Returns the model to quantize and what changed.
    """
    rep = IntakeReport()
    if constants:
        rep.constants_to_initializers = constants_to_initializers(model)
    rep.metadata = strip_metadata(model)
    if samples:
        rep.fixed_dims = fix_input_dims(model, input_shapes(model, samples))
    if per_channel and opset_of(model) < PER_CHANNEL_MIN_OPSET:
        rep.opset_from, rep.opset_to = opset_of(model), PER_CHANNEL_MIN_OPSET
        model = upgrade_opset(model, PER_CHANNEL_MIN_OPSET, where)
    if fold_shapes:
        model, folded = fold_shape_chains(model)
        rep.folded_shapes = [f"{name} ({op})" for name, op in folded]
    if batchnorm:
        rep.batchnorms_to_mul_add = batchnorm_to_mul_add(model)
    return model, rep


# ------------------------------------------------------------------------------------------ checks
def check_written_model(path: str | os.PathLike) -> None:
    """Check a model a command wrote: ``onnx.checker`` (by path: external data and > 2 GB work) and an ONNX
    Runtime CPU session load (no graph optimization). Raises :class:`CheckError` naming the file."""
    import onnx
    import onnxruntime as ort

    p = Path(path)
    try:
        onnx.checker.check_model(str(p))
    except Exception as e:
        raise CheckError(f"the written model is invalid (onnx.checker: {one_line(e, 300)})", p) from None
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        ort.InferenceSession(str(p), sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise CheckError(f"the written model does not load in ONNX Runtime ({one_line(e, 300)})", p) from None


# ------------------------------------------------------------------------------------------ what was quantized
_INT_NAMES = {2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 21: "uint4", 22: "int4",
              17: "float8e4m3fn"}


@dataclass
class TensorQuant:
    """The quantization one tensor really has in a QDQ model."""

    tensor: str
    role: str          # activation | weight (input 1 of WEIGHT_OPS) | bias (int32) | constant (other initializers)
    dtype: str         # uint8, uint16, int32, ...
    per_channel: bool
    axis: int | None = None
    runtime_quantized: bool = False  # a constant quantized by a run-time QuantizeLinear (as an activation)
    consumer: str | None = None      # the op type reading it (for weights: the op the weight belongs to)


def effective_quantization(model: Any) -> list[TensorQuant]:
    """Per quantized tensor of a QDQ model: role, integer type, per-channel or not.

    A DequantizeLinear whose input is an initializer dequantizes a constant: a ``weight`` when it feeds input 1 of
    a :data:`WEIGHT_OPS` node, a ``bias`` when ``int32``, else a ``constant`` (an elementwise operand, which QNN's
    config quantizes with the activation type). One fed by a QuantizeLinear dequantizes an ``activation``, unless
    that QuantizeLinear's input is a constant (an initializer or a ``Constant`` node): then it is quantized at run
    time as an activation (``runtime_quantized``), what ORT's quantizer does with ``Constant``-node weights.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output if o}
    const_outputs = {n.output[0] for n in g.node if n.op_type == "Constant"}
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in g.node:
        for i, x in enumerate(node.input):
            readers.setdefault(x, []).append((node.op_type, i))

    def constant_role(dq_out: str, dtype: str) -> tuple[str, str | None]:
        rs = readers.get(dq_out, [])
        w = next((op for op, i in rs if op in WEIGHT_OPS and i == 1), None)
        if dtype == "int32":
            return "bias", next((op for op, i in rs), None)
        return ("weight", w) if w else ("constant", next((op for op, i in rs), None))
    out: list[TensorQuant] = []
    seen: set[str] = set()

    def dtype_of(name: str, zp: str | None) -> str:
        if name in inits:
            return _INT_NAMES.get(inits[name].data_type, str(inits[name].data_type))
        if zp and zp in inits:
            return _INT_NAMES.get(inits[zp].data_type, str(inits[zp].data_type))
        return "uint8"  # QuantizeLinear without zero point: uint8

    def per_channel(scale: str) -> bool:
        t = inits.get(scale)
        return t is not None and len(t.dims) > 0 and int(np.prod(t.dims)) > 1

    for n in g.node:
        if n.op_type not in _DQ_OPS:
            continue
        x = n.input[0]
        zp = n.input[2] if len(n.input) > 2 and n.input[2] else None
        per = per_channel(n.input[1])
        axis = next((a.i for a in n.attribute if a.name == "axis"), None) if per else None
        if x in inits:
            dtype = dtype_of(x, zp)
            role, consumer = constant_role(n.output[0], dtype)
            name = x[: -len("_quantized")] if x.endswith("_quantized") else x
            rt = False
        else:
            q = producers.get(x)
            if q is None or q.op_type not in _Q_OPS:
                continue
            name = q.input[0]
            qzp = q.input[2] if len(q.input) > 2 and q.input[2] else None
            dtype = dtype_of(x, qzp or zp)
            rt = name in inits or name in const_outputs
            if rt:
                role, consumer = constant_role(n.output[0], "")
            else:
                role, consumer = "activation", None
        if name in seen:
            continue
        seen.add(name)
        out.append(TensorQuant(name, role, dtype, per, axis, rt, consumer))
    return out


def quantization_summary(tensors: Sequence[TensorQuant], *, activation: str, weight: str,
                         per_channel: bool, expected: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Counts by role and dtype, and ``mismatches``: lines saying where the requested types did not hold.

    ``activation`` / ``weight`` are the requested numpy dtype names (``uint8``, ``uint16``); ``expected`` the dtype
    of tensors the quantizer stores otherwise on purpose (a 16-bit BatchNormalization scale: ``uint16``).
    """
    exp = expected or {}
    counts: dict[str, dict[str, int]] = {}
    for t in tensors:
        counts.setdefault(t.role, Counter())[t.dtype] += 1
    mism = []
    acts = [t for t in tensors if t.role == "activation" and t.dtype != activation]
    if acts:
        mism.append(f"{len(acts)} activation(s) are not {activation}: {_names(acts)}")
    ws = [t for t in tensors if t.role == "weight" and t.dtype != exp.get(t.tensor, weight)]
    if ws:
        mism.append(f"{len(ws)} weight(s) are {'/'.join(sorted({t.dtype for t in ws}))}, not {weight}: {_names(ws)}")
    rt = [t for t in tensors if t.runtime_quantized]
    if rt:
        mism.append(f"{len(rt)} constant(s) are quantized at run time as activations (Constant nodes): "
                    f"{_names(rt)}")
    if per_channel:
        pt = [t for t in tensors if t.role == "weight" and t.consumer in PER_CHANNEL_OPS and not t.per_channel]
        if pt:
            mism.append(f"{len(pt)} {'/'.join(PER_CHANNEL_OPS)} weight(s) stayed per-tensor: {_names(pt)}")
    return {
        "requested": {"activation": activation, "weight": weight, "per_channel": per_channel},
        "counts": {k: dict(v) for k, v in counts.items()},
        "per_channel_weights": sum(1 for t in tensors if t.role == "weight" and t.per_channel),
        "mismatches": mism,
    }


def _names(ts: Sequence[TensorQuant], n: int = 4) -> str:
    shown = ", ".join(t.tensor for t in ts[:n])
    return shown + (f" (+{len(ts) - n} more)" if len(ts) > n else "")


def quantization_metadata(tensors: Sequence[TensorQuant], summary: Mapping[str, Any]) -> str:
    """The JSON stored under :data:`QUANT_METADATA_KEY`: the summary and one entry per tensor."""
    return json.dumps({"schema": "ivq-quantization/1", **summary, "tensors": [asdict(t) for t in tensors]},
                      separators=(",", ":"))


def read_quantization_metadata(model: Any) -> dict[str, Any] | None:
    """What ``ivq quantize`` stored in a model (``None`` when absent or unreadable)."""
    for p in model.metadata_props:
        if p.key == QUANT_METADATA_KEY:
            try:
                doc = json.loads(p.value)
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None
