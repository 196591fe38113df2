"""QDQ quantization for QNN HTP with ONNX Runtime's QNN helpers.

``qnn_preprocess_model`` -> ``get_qnn_qdq_config`` -> ``quantize``, with presets (``a8w8``, ``a16w8``,
``a16w16``), optional per-channel weights, calibration data from a folder (``.npy`` / ``.npz`` / images),
an ``.npz`` set or in-memory feeds, and quantization overrides (ORT ``TensorQuantOverrides`` dicts or
JSON; QNN / AIMET legacy and 1.0.0 encodings through :mod:`ivq_debug.qnn.encodings` when available).

16-bit facts (measured, see ``/work/shared/notes/qnn-htp-on-x86.md`` §2): with 16-bit activations or
weights the quantizer raises the opset to 21 and writes ``com.microsoft`` QuantizeLinear /
DequantizeLinear, which ``onnx.shape_inference`` does not understand; nothing here runs shape inference
on the quantized model, and readers must not either (load graphs with ``load_external_data=False`` and
read Q/DQ domains ``""``, ``ai.onnx`` and ``com.microsoft`` alike).

The output appears under its final name only when complete (written in a temp folder beside it, then
``os.replace``); an existing output is replaced only with ``overwrite=True``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack, redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import interrupt
from ivq_debug.arrays import read_arrays
from ivq_debug.dump.contract import input_digest
from ivq_debug.errors import InputError, IvqError, UsageError, one_line
from ivq_debug.jsonio import load_json
from ivq_debug.logs import root_warnings
from ivq_debug.onnxgraph import intake
from ivq_debug.onnxgraph.inputs import InputSpec, model_inputs
from ivq_debug.onnxgraph.load import has_external_data, load_model, model_digest
from ivq_debug.onnxgraph.sites import is_qdq_model
from ivq_debug.outputs import WRITE_ERRNOS, check_output, output_error, publish_staged
from ivq_debug.qnn.encodings import parse_encodings, to_ort_overrides, validate_ort_overrides
from ivq_debug.qnn.entropy import ENTROPY_BINS, entropy_ranges
from ivq_debug.qnn.names import NameMap

#: the 16-bit weight type: signed symmetric int16, zero point 0 (``get_qnn_qdq_config`` makes signed weight types
#: symmetric). What QNN HTP computes: its 16x16 Conv / FullyConnected / MatMul take symmetric int16 weights only (the
#: QNN EP converts asymmetric uint16 ones with an inserted Convert op, microsoft/onnxruntime#24729 and #24846; a
#: Gemm at a16 x asymmetric-u16 is refused, a per-channel uint16 Conv too), and only for signed symmetric weights does
#: ORT widen a weight scale whose int32 bias would clip (``_adjust_weight_scale_for_int32_bias``). Measured on the
#: PP-OCRv4 recognizer (docs/tune.md "16-bit weights on QNN HTP").
WEIGHT16 = "QInt16"
#: preset -> (activation QuantType name, weight QuantType name)
PRESETS: dict[str, tuple[str, str]] = {
    "a8w8": ("QUInt8", "QUInt8"),
    "a16w8": ("QUInt16", "QUInt8"),
    "a16w16": ("QUInt16", WEIGHT16),
}
#: weight bits -> the storage of a ``BatchNormalization`` scale that QNN HTP computes right (symmetric). The QNN EP
#: folds mean and variance into the scale and bias and re-quantizes them; HTP (emulated, onnxruntime-qnn 2.7)
#: computes a 16-bit one right in uint16 only: one PP-OCRv4 BatchNormalization at a16w16 reads 11.5 dB against float
#: with an int16 scale, 61 dB with a uint16 one, and the whole recognizer 2 of 4 lines against 4 of 4
#: (tests/qnn/test_quantize_htp.py, docs/tune.md). 8-bit scales are left as the preset has them: uint8 against int8
#: measured no consistent winner (a16w8 + per-channel on PP-OCRv4: 4 of 4 lines with uint8, 1 of 4 with int8).
BN_SCALE_TYPES: dict[int, str] = {16: "QUInt16"}


def weight16_override() -> dict[str, Any]:
    """The ORT ``TensorQuantOverrides`` entry of one 16-bit weight, as HTP computes it (:data:`WEIGHT16`, symmetric
    whatever the preset's weight type)."""
    return {"quant_type": WEIGHT16, "symmetric": True}
CALIBRATE_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile",
                     "distribution": "Distribution"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
ARRAY_SUFFIXES = (".npy", ".npz")
#: QuantType spellings accepted in overrides JSON
_QTYPE_ALIASES = {
    "quint8": "QUInt8", "uint8": "QUInt8", "u8": "QUInt8", "qint8": "QInt8", "int8": "QInt8", "i8": "QInt8",
    "quint16": "QUInt16", "uint16": "QUInt16", "u16": "QUInt16", "qint16": "QInt16", "int16": "QInt16",
    "i16": "QInt16", "quint4": "QUInt4", "uint4": "QUInt4", "qint4": "QInt4", "int4": "QInt4",
    "qfloat8e4m3fn": "QFLOAT8E4M3FN",
}
_QTYPE_BITS = {"QUInt8": 8, "QInt8": 8, "QUInt16": 16, "QInt16": 16, "QUInt4": 4, "QInt4": 4}
_MAX_PROTO_BYTES = 1_800_000_000  # above this, preprocess / quantize with external data
#: the sidecar of an ORT overrides file listing the nodes left float (ORT overrides cannot express fp16):
#: ``<overrides>.nodes_to_exclude.json``, ``{"nodes_to_exclude": [node, ...]}``
EXCLUDE_SUFFIX = ".nodes_to_exclude.json"


@dataclass
class QuantizeResult:
    """What :func:`quantize_for_qnn` produced."""

    model_path: Path
    source_path: Path
    preset: str
    activation_type: str
    weight_type: str
    per_channel: bool
    calibrate_method: str
    calibration_samples: int
    calibration_source: str
    preprocessed: bool
    overrides: int
    overrides_unmatched: list[str]
    opset: dict[str, int]
    qdq_domains: list[str]
    quantize_nodes: int
    dequantize_nodes: int
    seconds: float
    external_data: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: what intake changed in the float model (:class:`ivq_debug.onnxgraph.intake.IntakeReport` as a dict)
    intake: dict[str, Any] = field(default_factory=dict)
    #: the quantization the written model really holds (:func:`ivq_debug.onnxgraph.intake.quantization_summary`;
    #: per tensor in the model's ``ivq_debug.quantization`` metadata)
    effective: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        d = asdict(self)
        d["model_path"], d["source_path"] = str(self.model_path), str(self.source_path)
        return d


# ---------------------------------------------------------------------------------------- inputs
def _fit(arr: np.ndarray, spec: InputSpec, where: str | Path) -> np.ndarray:
    """Add a batch axis when one is missing, cast to the input dtype, check static dims."""
    a = np.asarray(arr)
    if spec.shape and a.ndim == len(spec.shape) - 1:
        a = a[None, ...]
    if spec.shape:
        spec.check_shape(a.shape, where)
    if a.dtype != spec.dtype:
        if a.dtype.kind == "f" and spec.dtype.kind in "iu":
            raise InputError(f"input {spec.name!r}: float data for an integer input", where)
        if a.dtype.kind == "c" and spec.dtype.kind != "c":
            raise InputError(f"input {spec.name!r}: complex data for a real input", where)
        a = a.astype(spec.dtype)
    return np.ascontiguousarray(a)


#: how a calibration image is resized to the model's static size (Pillow filters; bicubic and bilinear are
#: antialiased when they shrink: their support widens with the scale, as torchvision's ``antialias=True``)
IMAGE_RESIZE = ("bicubic", "bilinear", "nearest")


def _fit_channels(a: np.ndarray, c: int | None) -> np.ndarray:
    if c is None:
        return a
    if a.shape[2] >= 3 and c == 3:
        return a[..., :3]
    if a.shape[2] == 1 and c == 3:
        return np.repeat(a, 3, axis=2)
    if a.shape[2] >= 3 and c == 1:
        return a[..., :3].mean(axis=2, keepdims=True)
    return a


def _layout(spec: InputSpec, where: Path) -> tuple[bool, int | None, tuple[int | None, int | None]]:
    """(NCHW?, channels, (height, width)) of a rank-4 image input."""
    if len(spec.shape) != 4:
        raise InputError(f"an image needs a rank-4 input, {spec.name!r} has shape {list(spec.shape)}", where)
    nchw = spec.shape[1] in (1, 3) or spec.shape[3] not in (1, 3)  # NHWC only when the last dim is C
    c = spec.shape[1] if nchw else spec.shape[3]
    hw = (spec.shape[2], spec.shape[3]) if nchw else (spec.shape[1], spec.shape[2])
    return nchw, c, hw


def _full_scale(img: Any) -> np.float32:
    """The value of full intensity in an image's mode (8 bits: 255, 16 bits: 65535, float: 1)."""
    return np.float32(65535.0 if img.mode.startswith("I") else 1.0 if img.mode == "F" else 255.0)


def resize_image(img: Any, hw: tuple[int, int], method: str = "bicubic") -> np.ndarray:
    """A Pillow image resized to ``hw`` (height, width) with ``method`` (:data:`IMAGE_RESIZE`), as HWC float32
    in [0, 1]. Each channel is resized as a float image (mode ``F``): no rounding back to 8 bits between the
    resize and the model, as a deployment's float pre-processing does."""
    from PIL import Image

    if method not in IMAGE_RESIZE:
        raise UsageError(f"unknown image resize {method!r} ({', '.join(IMAGE_RESIZE)})")
    f = getattr(Image.Resampling, method.upper())
    div = _full_scale(img)
    return np.stack([np.asarray(b.convert("F").resize((hw[1], hw[0]), f), dtype=np.float32) / div
                     for b in img.split()], axis=2)


def _image_to_input(img: Any, spec: InputSpec, where: Path, mean: Sequence[float] | None,
                    std: Sequence[float] | None, transform: Callable[[np.ndarray], np.ndarray] | None,
                    resize: str = "bicubic") -> np.ndarray:
    """A decoded Pillow image -> the model's NCHW / NHWC float input (channels fitted, resized to the static
    size with ``resize``, then ``mean`` / ``std`` / ``transform`` on the HWC float image in [0, 1])."""
    nchw, c, hw = _layout(spec, where)
    if hw[0] and hw[1] and (img.height, img.width) != hw:
        a = resize_image(img, (hw[0], hw[1]), resize)
    else:
        a = np.asarray(img, dtype=np.float32) / _full_scale(img)
    if a.ndim == 2:
        a = a[..., None]
    a = _fit_channels(a, c)
    if mean is not None:
        a = a - np.asarray(mean, np.float32)
    if std is not None:
        a = a / np.asarray(std, np.float32)
    if transform is not None:
        a = np.asarray(transform(a), np.float32)
    a = np.transpose(a, (2, 0, 1)) if nchw else a
    return _fit(a[None, ...], spec, where)


def _processor_input(img: Any, spec: InputSpec, where: Path, processor: Any) -> np.ndarray:
    """The model input the HF image processor makes of an image (its own resize, rescale and normalization)."""
    try:
        out = processor(images=img, return_tensors="np")
    except Exception as e:
        raise InputError(f"the image processor refused the image ({type(e).__name__}: {one_line(e, 200)})",
                         where) from None
    pv = np.asarray(out["pixel_values"], dtype=np.float32)
    nchw, _, _ = _layout(spec, where)
    return _fit(pv if nchw else np.transpose(pv, (0, 2, 3, 1)), spec, where)


def load_image_processor(folder: str | os.PathLike) -> Any:
    """The HF image processor of a model folder (its ``preprocessor_config.json``; local files only)."""
    p = Path(folder)
    if not (p / "preprocessor_config.json").is_file():
        raise InputError("no preprocessor_config.json in the image processor folder", p)
    try:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(p), local_files_only=True)
    except ImportError:
        raise
    except Exception as e:
        raise InputError(f"not a loadable image processor ({type(e).__name__}: {one_line(e, 200)})", p) from None


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    return read_arrays(path, "calibration file")


#: the keywords of :func:`load_calibration` that :func:`quantize_for_qnn` (and the tuner) pass through
CALIBRATION_OPTIONS = ("fixed_feeds", "max_samples", "image_mean", "image_std", "transform", "image_resize",
                       "image_processor")


def load_calibration(
    source: str | os.PathLike | Iterable[Mapping[str, Any]] | Mapping[str, Any],
    model: str | os.PathLike | Any,
    *,
    fixed_feeds: Mapping[str, Any] | None = None,
    max_samples: int | None = None,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
    image_resize: str = "bicubic",
    image_processor: str | os.PathLike | Any | None = None,
) -> tuple[list[dict[str, np.ndarray]], str]:
    """Calibration feeds for ``model`` and a description of where they came from.

    ``source`` is one of:

    * a folder: each file (sorted by name) is one sample. ``.npz``: keys are input names; ``.npy``: the
      single free input; ``.png`` / ``.jpg`` / ``.bmp`` (decoded with Pillow): an image for the single rank-4
      input. With ``image_processor`` (a model folder holding ``preprocessor_config.json``, or a loaded HF image
      processor) the processor makes the input, as the deployment's pre-processing does; otherwise the image
      is resized to the static size with ``image_resize`` (``bicubic`` by default, ``bilinear``: both
      antialiased; ``nearest``), scaled to [0, 1], channels fitted, then ``image_mean`` / ``image_std`` /
      ``transform`` on the HWC float image, then NCHW or NHWC as the model wants. The description returned
      says which;
    * an ``.npz`` file: keys are input names, the leading axis indexes samples;
    * a ``.npy`` file: the single free input, leading axis = samples;
    * a list of feed dicts, or a dict of stacked arrays (leading axis = samples).

    ``fixed_feeds`` are added to every sample (e.g. position ids); a missing batch axis is added; dtypes
    are cast to the model's. Raises :class:`InputError` naming the file on any mismatch.
    """
    proto = model if hasattr(model, "graph") else load_model(Path(model))
    specs = {s.name: s for s in model_inputs(proto)}
    fixed = {k: np.asarray(v) for k, v in (fixed_feeds or {}).items()}
    unknown = [k for k in fixed if k not in specs]
    if unknown:
        raise UsageError(f"fixed feeds {unknown} are not model inputs ({list(specs)})")
    free = [n for n in specs if n not in fixed]

    def single(where: str | Path) -> InputSpec:
        if len(free) != 1:
            raise InputError(f"a bare array or image needs exactly one free model input, the model has "
                             f"{free} (give .npz samples or fixed_feeds)", where)
        return specs[free[0]]

    samples: list[dict[str, np.ndarray]] = []
    if image_resize not in IMAGE_RESIZE:
        raise UsageError(f"unknown image resize {image_resize!r} ({', '.join(IMAGE_RESIZE)})")
    processor = load_image_processor(image_processor) if isinstance(image_processor, str | os.PathLike) \
        else image_processor
    images = 0

    def image(f: Path) -> np.ndarray:
        nonlocal images
        spec = single(f)
        images += 1
        img = _read_image(f)
        if processor is not None:
            return _processor_input(img, spec, f, processor)
        return _image_to_input(img, spec, f, image_mean, image_std, transform, image_resize)

    def add(sample: Mapping[str, Any], where: str | Path) -> None:
        missing = [n for n in free if n not in sample]
        if missing:
            raise InputError(f"sample lacks inputs {missing}", where)
        extra = sorted(k for k in sample if k not in specs)
        if extra:
            raise InputError(f"sample has arrays for names that are not model inputs: {extra[:5]} "
                             f"(inputs: {free})", where)
        feed = {n: _fit(sample[n], specs[n], where) for n in free}
        feed.update({n: _fit(v, specs[n], "fixed_feeds") for n, v in fixed.items()})
        samples.append(feed)

    def stacked(arrays: Mapping[str, Any], where: str | Path) -> None:
        extra = sorted(k for k in arrays if k not in specs)
        if extra:
            raise InputError(f"arrays for names that are not model inputs: {extra[:5]} (inputs: {free})",
                             where)
        arrays = {k: np.asarray(v) for k, v in arrays.items() if k in free}
        if len(arrays) != len(free):
            raise InputError(f"needs arrays for inputs {free}, got {sorted(arrays)}", where)
        counts = {k: v.shape[0] if v.ndim else 0 for k, v in arrays.items()}
        if len(set(counts.values())) != 1 or 0 in counts.values():
            raise InputError(f"the leading (sample) axis differs between inputs: {counts}", where)
        for i in range(next(iter(counts.values()))):
            add({k: v[i] for k, v in arrays.items()}, where)

    if isinstance(source, str | os.PathLike):
        p = Path(source)
        if not p.exists():
            raise InputError("no such calibration data", p)
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix.lower() in ARRAY_SUFFIXES + IMAGE_SUFFIXES)
            if not files:
                raise InputError(f"no calibration files ({', '.join(ARRAY_SUFFIXES + IMAGE_SUFFIXES)})", p)
            for f in files:
                if max_samples is not None and len(samples) >= max_samples:
                    break
                suf = f.suffix.lower()
                if suf == ".npz":
                    add(_read_npz(f), f)
                elif suf == ".npy":
                    add({single(f).name: _read_npy(f)}, f)
                else:
                    add({single(f).name: image(f)}, f)
            desc = f"folder {p} ({len(files)} files)"
            if images:
                how = (f"the image processor {type(processor).__name__}" if processor is not None
                       else f"Pillow, {image_resize} resize" + (" (antialiased)" if image_resize != "nearest" else ""))
                desc += f"; {images} image(s) through {how}"
        elif p.suffix.lower() == ".npz":
            stacked(_read_npz(p), p)
            desc = f"npz {p}"
        elif p.suffix.lower() == ".npy":
            stacked({single(p).name: _read_npy(p)}, p)
            desc = f"npy {p}"
        else:
            raise InputError("calibration data must be a folder, an .npz or an .npy", p)
    elif isinstance(source, Mapping):
        stacked(source, "calibration arrays")
        desc = "in-memory arrays"
    else:
        for i, s in enumerate(source):
            add(s, f"calibration sample {i}")
        desc = "in-memory feeds"
    if max_samples is not None:
        samples = samples[:max_samples]
    if not samples:
        raise InputError("calibration data holds no samples", str(source) if isinstance(source, str | os.PathLike)
                         else None)
    return samples, desc


def _read_npy(path: Path) -> np.ndarray:
    return next(iter(read_arrays(path, "calibration file").values()))


def _read_image(path: Path) -> Any:
    """The decoded image (Pillow), as ``RGB`` / ``L`` (alpha and palettes dropped; 16-bit and float greyscale
    kept as ``I`` / ``F``)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("RGBA", "LA", "P", "CMYK", "YCbCr", "1", "PA", "RGBX"):
                return im.convert("RGB" if im.mode not in ("LA", "1") else "L")
            return im.copy()
    except Exception as e:
        raise InputError(f"not a readable image ({type(e).__name__}: {one_line(e, 200)})", path) from None


def _reader(samples: list[dict[str, np.ndarray]]) -> Any:
    """An ORT ``CalibrationDataReader`` over in-memory feeds that counts what it served."""
    from onnxruntime.quantization import CalibrationDataReader

    class _FeedsReader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = samples
            self.pos = 0
            self.served = 0

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self.pos >= len(self.samples):
                return None
            s = self.samples[self.pos]
            self.pos += 1
            self.served = max(self.served, self.pos)
            return s

        def rewind(self) -> None:
            self.pos = 0

        def __len__(self) -> int:
            return len(self.samples)

    return _FeedsReader()


# ---------------------------------------------------------------------------------------- overrides
def _qtype(name: Any) -> Any:
    from onnxruntime.quantization import QuantType

    if isinstance(name, QuantType):
        return name
    key = str(name).strip()
    key = _QTYPE_ALIASES.get(key.lower(), key)
    try:
        return QuantType[key]
    except KeyError:
        raise UsageError(f"unknown quant_type {name!r} (e.g. QUInt8, QUInt16, QInt8)") from None


def _known_qtype(name: str) -> bool:
    """True when ``name`` is a QuantType name or one of the spellings :func:`_qtype` accepts."""
    from onnxruntime.quantization import QuantType

    key = str(name).strip()
    return _QTYPE_ALIASES.get(key.lower(), key) in QuantType.__members__


def _is_qnn_encodings(data: Mapping[str, Any]) -> bool:
    return "activation_encodings" in data or "param_encodings" in data


def float_producers(tensors: Iterable[str], model: Any) -> list[str]:
    """The nodes that produce ``tensors``, in graph order: what a float request on an activation (a QNN encoding
    of ``dtype`` float, the tuner's ``fp16``) leaves unquantized (ORT's ``nodes_to_exclude``). A graph input or
    an initializer has no producer and is left out."""
    want = set(tensors)
    return [n.name for n in model.graph.node if n.name and want.intersection(n.output)]


def read_exclude_sidecar(overrides: str | os.PathLike) -> list[str]:
    """The nodes ``<overrides>.nodes_to_exclude.json`` (:data:`EXCLUDE_SUFFIX`) leaves float; [] without one.

    Raises:
        InputError: the sidecar is not ``{"nodes_to_exclude": [node, ...]}`` (exit 3, naming it).
    """
    p = Path(overrides)
    side = p.with_name(p.name + EXCLUDE_SUFFIX)
    if not side.exists():
        return []
    doc = load_json(side, "nodes_to_exclude file")
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes_to_exclude", []), list):
        raise InputError("expected {\"nodes_to_exclude\": [node, ...]}", side)
    return [str(n) for n in doc.get("nodes_to_exclude", [])]


def _from_qnn_encodings(data: Mapping[str, Any], where: str, model: Any, notes: list[str],
                        exclude: list[str]) -> dict[str, list[dict[str, Any]]]:
    """QNN / AIMET legacy, 1.0.0 or 2.x encodings -> ORT TensorQuantOverrides (via ivq_debug.qnn.encodings).

    Per-channel axes missing from the file are inferred from the model's initializers; QNN-sanitized
    names that resolve uniquely to an ONNX tensor are renamed to it (the quantizer matches ONNX names). A float
    activation encoding leaves its producer unquantized (appended to ``exclude``, :func:`float_producers`).
    """
    encs = parse_encodings(dict(data), None if where == "overrides" else where)
    encs = encs.infer_axes(model)
    encs.validate(model, allow_sanitized=True)
    nm = NameMap.from_onnx(model)
    floats = {n: float_producers([nm.lookup(n) or n], model) for n, e in encs.activations.items() if e.is_float}
    for name, nodes in floats.items():
        if nodes:
            exclude.extend(nodes)
            notes.append(f"overrides: {name}: float: its producer {', '.join(nodes)} left unquantized")
    skipped: list[tuple[str, str]] = []
    ort = to_ort_overrides(encs, skip_unsupported=True, skipped=skipped)
    notes.extend(f"overrides: {name}: {why} (not applied)" for name, why in [*encs.dropped, *skipped]
                 if not floats.get(name))
    known = set(nm.tensors)
    out: dict[str, list[dict[str, Any]]] = {}
    for name, entries in ort.items():
        onnx_name = name if name in known else (nm.lookup(name) or name)
        if onnx_name != name:
            notes.append(f"overrides: QNN name {name!r} applied to ONNX tensor {onnx_name!r}")
        out[onnx_name] = entries
    return out


def load_overrides(
    overrides: str | os.PathLike | Mapping[str, Any] | None,
    model: Any,
    *,
    activation_type: str = "QUInt8",
    weight_type: str = "QUInt8",
    notes: list[str] | None = None,
    exclude: list[str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Normalize quantization overrides into an ORT ``init_overrides`` dict.

    Accepts an ORT ``TensorQuantOverrides`` dict (``{tensor: [ {quant_type, scale, zero_point,
    symmetric, rmin, rmax, axis, convert, ...} ]}``; one dict per tensor, or one per channel), a JSON file
    of the same (``quant_type`` as a string such as ``"QUInt16"``), or a QNN / AIMET encodings JSON
    (legacy, 1.0.0 or AIMET 2.x, via :mod:`ivq_debug.qnn.encodings`; entries it cannot express, and
    QNN-sanitized names mapped back to ONNX names, are reported in ``notes``). ``scale`` becomes
    float32 and ``zero_point`` the integer type of the tensor's quant type (ORT would otherwise keep a
    float64 scale). ``model`` is an ``onnx.ModelProto``. The nodes the overrides leave float — the producers of
    float activation encodings, and an ORT file's ``<file>.nodes_to_exclude.json`` (:data:`EXCLUDE_SUFFIX`), what
    ``ivq tune`` delivers for ``fp16`` — are appended to ``exclude``.
    """
    notes = notes if notes is not None else []
    exclude = exclude if exclude is not None else []
    if overrides is None:
        return {}
    where = "overrides"
    data: Any = overrides
    if isinstance(overrides, str | os.PathLike):
        p = Path(overrides)
        where = str(p)
        data = load_json(p, "overrides file")
        exclude.extend(read_exclude_sidecar(p))
    if not isinstance(data, Mapping):
        raise InputError("overrides must be a JSON object", where if where != "overrides" else None)
    if _is_qnn_encodings(data):
        data = _from_qnn_encodings(data, where, model, notes, exclude)
    elif where != "overrides":  # an ORT TensorQuantOverrides file: checked before ORT sees it
        validate_ort_overrides(data, where, known_quant_type=_known_qtype)
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, list[dict[str, Any]]] = {}
    for name, entries in data.items():
        items = [entries] if isinstance(entries, Mapping) else list(entries)
        if not items or not all(isinstance(e, Mapping) for e in items):
            raise UsageError(f"{where}: overrides for {name!r} must be a dict or a list of dicts")
        default = weight_type if name in inits else activation_type
        norm = []
        for e in items:
            d = dict(e)
            qt = _qtype(d["quant_type"]) if "quant_type" in d else _qtype(default)
            if "quant_type" in d:
                d["quant_type"] = qt
            if "scale" in d:
                d["scale"] = np.asarray(d["scale"], dtype=np.float32)
            if "zero_point" in d:
                d["zero_point"] = np.asarray(d["zero_point"], dtype=_np_int_type(qt))
            for k in ("rmin", "rmax"):
                if k in d:
                    d[k] = np.asarray(d[k], dtype=np.float32)
            if isinstance(d.get("convert"), Mapping):
                c = dict(d["convert"])
                if "quant_type" in c:
                    c["quant_type"] = _qtype(c["quant_type"])
                    if "scale" in c:
                        c["scale"] = np.asarray(c["scale"], dtype=np.float32)
                    if "zero_point" in c:
                        c["zero_point"] = np.asarray(c["zero_point"], dtype=_np_int_type(c["quant_type"]))
                d["convert"] = c
            norm.append(d)
        out[str(name)] = norm
    return out


def _np_int_type(qt: Any) -> Any:
    from onnxruntime.quantization.quant_utils import ONNX_TYPE_TO_NP_TYPE, QuantType

    try:
        return ONNX_TYPE_TO_NP_TYPE[qt.tensor_type]
    except (KeyError, AttributeError):
        return {QuantType.QUInt8: np.uint8, QuantType.QInt8: np.int8, QuantType.QUInt16: np.uint16,
                QuantType.QInt16: np.int16}.get(qt, np.int32)


def _tensor_names(model: Any) -> set[str]:
    names = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
    names |= {i.name for i in model.graph.initializer}
    for n in model.graph.node:
        names.update(x for x in n.input if x)
        names.update(x for x in n.output if x)
    return names


# ---------------------------------------------------------------------------------------- quantize
def _write_or_input_error(e: OSError, out: Path, src: Path, what: str) -> IvqError:
    """A full disk / read-only folder while writing ``out`` (exit 2), else a problem with the model (exit 3)."""
    if e.errno in WRITE_ERRNOS:
        return output_error(e, out)
    return InputError(f"{what}: {type(e).__name__}: {one_line(e, 400)}", src)


def quantize_for_qnn(
    model_path: str | os.PathLike,
    output_path: str | os.PathLike,
    calibration: str | os.PathLike | Iterable[Mapping[str, Any]] | Mapping[str, Any],
    *,
    preset: str = "a8w8",
    per_channel: bool = False,
    overrides: str | os.PathLike | Mapping[str, Any] | None = None,
    strict_overrides: bool = True,
    calibrate_method: str = "minmax",
    preprocess: bool = True,
    activation_symmetric: bool = False,
    weight_symmetric: bool | None = None,
    op_types_to_quantize: Sequence[str] | None = None,
    nodes_to_exclude: Sequence[str] | None = None,
    constants_to_initializers: bool = True,
    fold_shapes: bool = True,
    unfuse_batchnorm: bool = False,
    overwrite: bool = False,
    calibration_cache: str | os.PathLike | None = None,
    **calibration_options: Any,
) -> QuantizeResult:
    """Quantize a float ONNX model to a QDQ model for QNN HTP.

    Args:
        model_path: the float ONNX model.
        output_path: where the QDQ model goes (atomic; replaced only with ``overwrite=True``).
        calibration: see :func:`load_calibration` (folder, ``.npz``, ``.npy``, feeds list, stacked dict).
        preset: ``"a8w8"``, ``"a16w8"`` or ``"a16w16"`` (activation / weight bits; :data:`PRESETS`: unsigned,
            but 16-bit weights signed symmetric, :data:`WEIGHT16`, and 16-bit BatchNormalization scales
            :data:`BN_SCALE_TYPES`).
        per_channel: per-channel weights for the op types QNN supports per-channel.
        overrides: see :func:`load_overrides`.
        strict_overrides: raise :class:`UsageError` when overrides name tensors the model lacks
            (otherwise they are listed in ``overrides_unmatched``).
        calibrate_method: ``"minmax"`` (default), ``"entropy"``, ``"percentile"``, ``"distribution"``. Entropy
            is ORT's KL-divergence threshold search with :data:`~ivq_debug.qnn.entropy.ENTROPY_BINS` (2048
            histogram bins, 128 quantized bins) at 8-bit activations, its search vectorized
            (:func:`~ivq_debug.qnn.entropy.entropy_ranges`: ORT's ranges, handed to ``quantize_static`` as a
            calibration cache file; ``quantize_static`` alone runs it with 128 / 128 bins: MinMax's ranges), and
            MinMax at 16-bit activations (the preset's, said in the warnings; a 16-bit override of an 8-bit preset
            keeps the 8-bit entropy range).
        preprocess: run ``qnn_preprocess_model`` first (graph fusions QNN wants).
        calibration_options: keywords of :func:`load_calibration` (:data:`CALIBRATION_OPTIONS`: ``fixed_feeds``,
            ``max_samples``, ``image_mean``, ``image_std``, ``transform``, ``image_resize``, ``image_processor``;
            ``calibration_source`` of the result says how images were made inputs).
        activation_symmetric, weight_symmetric, op_types_to_quantize, nodes_to_exclude: passed to
            ``get_qnn_qdq_config``.
        constants_to_initializers: turn ``Constant``-node weights into initializers first (model intake,
            :mod:`ivq_debug.onnxgraph.intake`; metadata, dims and the per-channel opset are always taken care of).
        fold_shapes: fold the shape arithmetic the static dims make constant (``Shape -> Gather -> Concat ->
            Reshape``) into initializers, so that QNN HTP runs the QDQ model at every ORT optimization level
            (``result.intake["folded_shapes"]`` lists the nodes; False writes them as they are).
        unfuse_batchnorm: rewrite each BatchNormalization as Mul + Add by constants before quantizing
            (:mod:`ivq_debug.onnxgraph.batchnorm`; ``result.intake["batchnorms_to_mul_add"]``). Off by default:
            on PP-OCRv4 it gains on HTP at a16w16 and loses a little at a16w8 (docs/tune.md).
        overwrite: replace an existing output.
        calibration_cache: a folder of calibration results (:func:`calibration_cache_key`): a quantization whose
            calibration inputs (model, samples, method, types, options) were calibrated before loads the tensor
            ranges instead of running the calibration again (ORT's ``calibration_cache_path``); overrides and
            excluded nodes do not enter calibration, so the trials of ``ivq tune`` calibrate once. The written
            model is the same bytes as without the cache (``tests/qnn/test_quantize.py``).

    The written model holds its metadata, plus the effective quantization per tensor under
    ``ivq_debug.quantization`` (``result.effective`` is its summary; ``mismatches`` says where the preset did
    not hold), and is checked (``onnx.checker`` + an ORT CPU load) before it appears under ``output_path``.

    Raises:
        CheckError: the written model failed its check (exit 7; nothing is left under ``output_path``).
    """
    from onnxruntime.quantization import CalibrationMethod, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    t0 = time.perf_counter()
    src = Path(model_path)
    out = Path(output_path)
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r} ({', '.join(PRESETS)})")
    if calibrate_method.lower() not in CALIBRATE_METHODS:
        raise UsageError(f"unknown calibrate_method {calibrate_method!r} ({', '.join(CALIBRATE_METHODS)})")
    files = [x for x in (calibration, overrides) if isinstance(x, str | os.PathLike)]
    check_output(out, [src, *files], overwrite)  # never replaces an input, even with overwrite
    proto = load_model(src)

    if is_qdq_model(proto):
        raise UsageError("the model already holds QuantizeLinear nodes (give the float model)", src)
    act_name, w_name = PRESETS[preset]
    act, wt = _qtype(act_name), _qtype(w_name)
    unknown = sorted(set(calibration_options) - set(CALIBRATION_OPTIONS))
    if unknown:
        raise TypeError(f"quantize_for_qnn() got unexpected keyword argument(s) {unknown}")
    samples, cal_desc = load_calibration(calibration, proto, **calibration_options)
    method = calibrate_method.lower()
    notes: list[str] = []
    if method == "entropy" and _QTYPE_BITS[act_name] == 16:
        method = "minmax"
        notes.append("entropy calibration at 16-bit activations is MinMax: a 65536-level grid is finer than the "
                     "histogram, the search keeps the full range")
    # per-channel weights need opset >= 13; the upgrade comes after qnn_preprocess_model (below), so that the
    # graph is the same whether the preprocessing runs here or ran before (the tuner's source): at opset 13 the
    # preprocessing fuses what it leaves apart at 12 (PP-OCRv4: 9 MatMul + Add -> Gemm)
    big = has_external_data(proto) or src.stat().st_size > _MAX_PROTO_BYTES
    late = preprocess and not big
    proto, intake_rep = intake.prepare(proto, samples=samples, per_channel=per_channel and not late, where=src,
                                       constants=constants_to_initializers, fold_shapes=fold_shapes,
                                       batchnorm=unfuse_batchnorm)
    floats: list[str] = []  # nodes the overrides leave float
    init_overrides = load_overrides(overrides, proto, activation_type=act_name, weight_type=w_name, notes=notes,
                                    exclude=floats)
    nodes_to_exclude = list(dict.fromkeys([*(nodes_to_exclude or []), *floats]))
    # a per-channel weight override (the tuner's per-channel lever on one weight) needs what --per-channel needs:
    # ORT writes its bias's DequantizeLinear per channel too (`axis`; PP-OCRv4 is opset 12)
    upgrade = (per_channel or any("axis" in e for es in init_overrides.values() for e in es)) \
        and intake.opset_of(proto) < intake.PER_CHANNEL_MIN_OPSET
    if upgrade:
        intake_rep.opset_from, intake_rep.opset_to = intake.opset_of(proto), intake.PER_CHANNEL_MIN_OPSET
        if not late:
            proto = intake.upgrade_opset(proto, intake.PER_CHANNEL_MIN_OPSET, src)
    known = _tensor_names(proto)
    unmatched = sorted(k for k in init_overrides if k not in known)
    if unmatched and strict_overrides:
        src = overrides if isinstance(overrides, str | os.PathLike) else None  # a file's content: exit 3
        raise (InputError if src else UsageError)(
            f"overrides name {len(unmatched)} tensor(s) the model lacks: {unmatched[:8]}"
            f"{' …' if len(unmatched) > 8 else ''} (ONNX names, unsanitized; strict_overrides=False to ignore)", src)
    for k in unmatched:
        init_overrides.pop(k)

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    interrupt.register(work)
    logs_off = ExitStack()
    logs = logs_off.enter_context(root_warnings())  # the quantizer logs through the root logger
    intake_file: Path | None = None
    try:
        source = src
        # the graph of ``source`` once loaded (the opset upgrade, the BatchNormalization storage and the calibration
        # key read it): ``proto`` is the source file's graph unless the preprocessing wrote another file
        source_proto: Any = proto
        if intake_rep.changed:  # the model as the quantizer takes it; its external data stays beside the source
            source = intake_file = _write_intake(proto, src, work)
        preprocessed = False
        if preprocess:
            pre = work / "preprocessed" / src.name
            pre.parent.mkdir()
            try:
                preprocessed = bool(qnn_preprocess_model(source, pre, save_as_external_data=big,
                                                         all_tensors_to_one_file=True))
            except OSError as e:
                raise _write_or_input_error(e, out, src, "qnn_preprocess_model failed") from None
            except Exception as e:
                raise InputError(f"qnn_preprocess_model failed: {one_line(e, 300)}", src) from None
            if preprocessed:
                source, source_proto = pre, None
        if upgrade and late:
            import onnx

            up = work / "upgraded" / src.name
            up.parent.mkdir()
            source_proto = intake.upgrade_opset(load_model(source), intake.PER_CHANNEL_MIN_OPSET, src)
            onnx.save(source_proto, str(up))
            source = up
        entropy = method == "entropy"  # ranges computed here (entropy_ranges), handed over as a cache file
        if source_proto is None and (calibration_cache is not None or entropy or _stores_scales(w_name)):
            source_proto = load_model(source)  # once: the storage below and the calibration key read it
        storage = htp_storage_overrides(source if source_proto is None else source_proto, w_name, init_overrides)
        if storage:
            notes.append(f"{len(storage)} BatchNormalization scale(s) stored as "
                         f"{BN_SCALE_TYPES[_QTYPE_BITS[w_name]]} symmetric: what QNN HTP computes right")
        reader = _reader(samples)
        # ORT's entropy / percentile calibration prints its progress on stdout, which carries a command's results
        # (tables, TSV, JSON): it goes to stderr with the other progress
        try:
            with redirect_stdout(sys.stderr):
                cfg = get_qnn_qdq_config(
                    source, reader,
                    calibrate_method=getattr(CalibrationMethod, CALIBRATE_METHODS[method]),
                    activation_type=act, weight_type=wt, per_channel=per_channel,
                    init_overrides={**storage, **init_overrides} or None, activation_symmetric=activation_symmetric,
                    weight_symmetric=weight_symmetric,
                    op_types_to_quantize=list(op_types_to_quantize) if op_types_to_quantize else None,
                    nodes_to_exclude=list(nodes_to_exclude) if nodes_to_exclude else None,
                )
                if big:
                    cfg.use_external_data_format = True
                staged = work / out.name
                if calibration_cache is None and not entropy:
                    quantize(source, staged, cfg)
                else:
                    _quantize_cached(source, staged, cfg, work / "calibration" if calibration_cache is None
                                     else Path(calibration_cache), samples, source_proto)
        except IvqError:
            raise
        except OSError as e:
            raise _write_or_input_error(e, out, src, "quantization failed") from None
        except Exception as e:
            raise InputError(f"quantization failed: {type(e).__name__}: {one_line(e, 400)}",
                             src) from None
        served = reader.served
        qproto = load_model(staged)  # no shape inference: com.microsoft Q/DQ at 16 bits
        tensors = intake.effective_quantization(qproto)
        effective = intake.quantization_summary(tensors, activation=_np_name(act), weight=_np_name(wt),
                                                per_channel=per_channel,
                                                expected={k: _np_name(v[0]["quant_type"]) for k, v in storage.items()})
        meta = {**intake_rep.metadata, intake.QUANT_METADATA_KEY: intake.quantization_metadata(tensors, effective)}
        intake.append_metadata(staged, meta, existing=[p.key for p in qproto.metadata_props])
        intake.check_written_model(staged)
        externals = sorted({e.value for t in qproto.graph.initializer for e in t.external_data
                            if e.key == "location"})
        publish_staged(staged, out, externals, overwrite=overwrite)
    finally:
        logs_off.close()
        shutil.rmtree(work, ignore_errors=True)
        interrupt.unregister(work)
        if intake_file is not None and work not in intake_file.parents:
            intake_file.unlink(missing_ok=True)
    qnodes = [n for n in qproto.graph.node if n.op_type == "QuantizeLinear"]
    dqnodes = [n for n in qproto.graph.node if n.op_type == "DequantizeLinear"]
    domains = sorted({n.domain or "ai.onnx" for n in qnodes + dqnodes})
    return QuantizeResult(
        model_path=out,
        source_path=src,
        preset=preset,
        activation_type=act.name,
        weight_type=wt.name,
        per_channel=per_channel,
        calibrate_method=calibrate_method.lower(),
        calibration_samples=served,
        calibration_source=cal_desc,
        preprocessed=preprocessed,
        overrides=len(init_overrides),
        overrides_unmatched=unmatched,
        opset={o.domain or "ai.onnx": o.version for o in qproto.opset_import},
        qdq_domains=domains,
        quantize_nodes=len(qnodes),
        dequantize_nodes=len(dqnodes),
        seconds=round(time.perf_counter() - t0, 3),
        external_data=externals,
        warnings=intake_rep.notes() + notes + [m for m in logs if not _noise(m)],
        intake=intake_rep.to_dict(),
        effective=effective,
    )


def _stores_scales(weight_type: str) -> bool:
    """Whether :func:`htp_storage_overrides` stores the BatchNormalization scales of this weight type otherwise."""
    qt = BN_SCALE_TYPES.get(_QTYPE_BITS.get(weight_type, 8))
    return qt is not None and qt != weight_type


def htp_storage_overrides(model: str | os.PathLike | Any, weight_type: str,
                          overrides: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The ORT overrides that store what QNN HTP computes right and the preset would store otherwise: the scale of
    each ``BatchNormalization`` (an initializer no entry of ``overrides`` names) in :data:`BN_SCALE_TYPES` of the
    weight type's bits, symmetric. ``model`` is the graph the quantizer takes (a path: loaded only when the weight
    type has such a storage, not for every 8-bit quantization)."""
    if not _stores_scales(weight_type):
        return {}
    qt = BN_SCALE_TYPES[_QTYPE_BITS.get(weight_type, 8)]
    if not hasattr(model, "graph"):
        model = load_model(model)
    inits = {t.name for t in model.graph.initializer}
    return {n.input[1]: [{"quant_type": _qtype(qt), "symmetric": True}] for n in model.graph.node
            if n.op_type == "BatchNormalization" and len(n.input) > 1 and n.input[1] in inits
            and n.input[1] not in overrides}


#: ORT's 16-bit integer quantization types (``QuantType`` names): a quantization that uses one anywhere calibrates
#: the model raised to opset 21 (:func:`calibrated_opset`)
_Q16 = frozenset({"QInt16", "QUInt16"})


def _qt_name(qt: Any) -> str:
    """A ``QuantType`` (or its name) as its name: ``QuantType.QUInt16`` -> ``"QUInt16"``."""
    return getattr(qt, "name", str(qt).rsplit(".", 1)[-1])


def calibrated_opset(opset: int, cfg: Any) -> int:
    """The opset of the model ORT's ``quantize_static`` *calibrates* for a config on a model of ``opset``: what the
    types of ``cfg`` change in the calibration, and nothing else. ``quantize_static`` calls
    ``quant_utils.update_opset_version`` before it calibrates and calibrates the converted model when that bumps
    the opset (``onnx.version_converter`` to 21 for a 16-bit type anywhere — the activation or weight type, an
    override's ``quant_type`` or its ``convert.quant_type`` — or a block size, 19 for float-8 weights, 11 below
    opset 10); the branches here are that function's (onnxruntime 1.32, ``quantization/quant_utils.py``)."""
    ex = dict(cfg.extra_options or {})
    over = [e for v in (ex.get("TensorQuantOverrides") or {}).values() for e in v if isinstance(e, Mapping)]
    types = {_qt_name(cfg.activation_type), _qt_name(cfg.weight_type)}
    types |= {_qt_name(e["quant_type"]) for e in over if e.get("quant_type") is not None}
    types |= {_qt_name((e.get("convert") or {})["quant_type"]) for e in over
              if (e.get("convert") or {}).get("quant_type") is not None}
    if opset < 21 and int(ex.get("BlockSize", 0) or 0) > 0:
        return 21
    if opset < 19 and _qt_name(cfg.weight_type) == "QFLOAT8E4M3FN":
        return 19
    if opset < 21 and types & _Q16:
        return 21
    return 11 if opset < 10 else opset


def calibration_cache_key(source: str | os.PathLike, samples: Sequence[Mapping[str, Any]], cfg: Any,
                          proto: Any = None) -> str:
    """The key of one calibration: SHA-256 over what ORT's calibration reads, and only that (two quantizations that
    calibrate the same share one calibration).

    ``quantize_static`` (onnxruntime 1.32, ``quantization/quantize.py`` and ``calibrate.py``) calibrates with
    ``create_calibrator(model, op_types_to_quantize, calibrate_method, providers=calibration_providers,
    extra_options=<the Calib* options>)`` then ``collect_data(reader)`` (strided by ``CalibStridedMinMax``),
    after ``SmoothQuant`` when asked; the calibrator picks the float tensors of the nodes of those op types. So the
    key holds: the model file handed to the quantizer (its bytes and its external-data files'; ``proto``: that file
    already loaded, not read again), the calibration samples (their input digests), the method, the op types, the
    ``Calib*`` and ``SmoothQuant*`` options, for entropy the bins of :func:`~ivq_debug.qnn.entropy.entropy_ranges` (not
    there for another method: its keys are those of earlier versions), the calibration providers, the opset of the model calibrated
    (:func:`calibrated_opset`: the only thing the activation / weight types and the overrides' 16-bit types change
    there) and the onnxruntime version. Not in the key, as not read by the calibration: the types themselves
    (a16w8, a16w16 and a8w8 with 16-bit overrides calibrate the same opset-21 model), ``per_channel`` (the
    calibrator is not given it; the per-channel opset upgrade is in the model file), the overrides' ranges, the
    excluded nodes (beyond the op types they leave) and ``use_external_data_format`` (how the augmented model is
    saved). ``tests/qnn/test_quantize.py`` shows a16w8 and a16w16 sharing one calibration and giving the bytes of
    uncached runs."""
    import hashlib
    import json

    import onnxruntime

    proto = proto if proto is not None else load_model(source)
    ex = dict(cfg.extra_options or {})
    material = {
        "model": model_digest(source, proto),  # its bytes and its external-data files' (not loaded)
        "samples": [{k: input_digest(v) for k, v in sorted(s.items())} for s in samples],
        "method": str(cfg.calibrate_method), "op_types": sorted(cfg.op_types_to_quantize or []),
        "options": {k: str(v) for k, v in sorted(ex.items()) if k.startswith(("Calib", "SmoothQuant"))},
        "providers": [str(p) for p in cfg.calibration_providers or []],
        "opset": calibrated_opset(intake.opset_of(proto), cfg), "onnxruntime": onnxruntime.__version__,
    }
    if _is_entropy(cfg):  # the bins entropy_ranges gives ORT (the ranges cached before them were MinMax's)
        material["entropy_bins"] = list(ENTROPY_BINS)
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def _quantize_cached(source: Path, staged: Path, cfg: Any, folder: Path, samples: Sequence[Mapping[str, Any]],
                     proto: Any = None) -> None:
    """ORT's ``quantize`` of a static config with its calibration kept in ``folder`` under
    :func:`calibration_cache_key` (ORT writes the cache atomically; a file another process wrote half is never
    seen under the key). ``proto``: ``source`` already loaded. Entropy's ranges are :func:`entropy_ranges`, saved
    under the key before ``quantize_static`` reads them (a miss there would calibrate with ORT's 128 / 128 bins)."""
    from onnxruntime.quantization import quantize_static
    from onnxruntime.quantization.calibrate import save_tensors_data

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{calibration_cache_key(source, samples, cfg, proto)}.json"
    if _is_entropy(cfg) and not path.is_file():
        save_tensors_data(entropy_ranges(source, cfg), path)  # atomic (ORT's temp file + os.replace)
    quantize_static(source, staged, cfg.calibration_data_reader, calibrate_method=cfg.calibrate_method,
                    quant_format=cfg.quant_format, activation_type=cfg.activation_type, weight_type=cfg.weight_type,
                    op_types_to_quantize=cfg.op_types_to_quantize, nodes_to_quantize=cfg.nodes_to_quantize,
                    nodes_to_exclude=cfg.nodes_to_exclude, per_channel=cfg.per_channel, reduce_range=cfg.reduce_range,
                    use_external_data_format=cfg.use_external_data_format,
                    calibration_providers=cfg.calibration_providers, extra_options=cfg.extra_options,
                    calibration_cache_path=path)


def _is_entropy(cfg: Any) -> bool:
    return str(cfg.calibrate_method).rsplit(".", 1)[-1] == "Entropy"


#: quantizer log lines that say nothing about this run (advice to run the preprocessing ``quantize_for_qnn`` ran)
_NOISE = ("consider to run pre-processing", "consider pre-processing")


def _noise(message: str) -> bool:
    return any(s in message for s in _NOISE)


def _np_name(qt: Any) -> str:
    return np.dtype(_np_int_type(qt)).name


def preprocess_float_model(float_model: str | os.PathLike, out: str | os.PathLike,
                           samples: Sequence[Mapping[str, Any]] | None = None) -> bool:
    """Write ``out``: ``float_model`` as :func:`quantize_for_qnn` takes it — the intake (``Constant`` weights as
    initializers, metadata set aside, with ``samples`` — the calibration samples — the dims they agree on fixed and
    the shape arithmetic that makes constant folded) then ORT's ``qnn_preprocess_model`` (the fusions the QNN flow
    makes before quantizing). The one place besides :func:`quantize_for_qnn` that runs the preprocessing (the
    tuner's source, the aligner's quantizer reference). Returns False, writing nothing, when neither step changes
    the graph.

    Without ``samples`` a dynamic axis stays dynamic, its ``Shape -> Reshape`` chains stay, and
    ``qnn_preprocess_model`` fuses less than :func:`quantize_for_qnn` does (PP-OCRv4's recognizer: its 9
    ``MatMul + Add`` pairs stay apart, the QDQ model names other tensors than ``ivq quantize`` writes).

    Raises:
        InputError: the preprocessing fails on the model (exit 3).
    """
    from onnxruntime.quantization.execution_providers.qnn import qnn_preprocess_model

    src, out = Path(float_model), Path(out)
    proto, rep = intake.prepare(load_model(src), samples=samples, where=src)  # a copy: its metadata stays off
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    intake_file = None
    try:
        if rep.changed:
            intake_file = _write_intake(proto, src, work)
        source = intake_file or src
        tmp = work / out.name
        try:
            changed = bool(qnn_preprocess_model(source, tmp))
        except Exception as e:
            raise InputError(f"qnn_preprocess_model failed: {one_line(e, 300)}", src) from None
        if changed:
            os.replace(tmp, out)
            return True
        if intake_file is not None and intake_file.parent != src.parent:
            os.replace(intake_file, out)
            return True
        return False
    finally:
        if intake_file is not None and intake_file.parent == src.parent:  # the hidden copy beside the source
            intake_file.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def _write_intake(proto: Any, src: Path, work: Path) -> Path:
    """Save the intake model for the quantizer: in ``work``, or, when its weights are external data (referenced
    relative to the source's folder), under a hidden temporary name in the source's folder (the caller removes
    it)."""
    import onnx

    if not has_external_data(proto):
        path = work / "intake" / src.name
        path.parent.mkdir()
        onnx.save(proto, str(path))
        return path
    path = src.parent / f".{src.stem}.intake-{os.getpid()}.onnx"
    try:
        onnx.save(proto, str(path), save_as_external_data=False)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise InputError(f"cannot write the intake model beside the model (its external data must stay in its "
                         f"folder): {one_line(e, 200)}", src.parent) from None
    return path
