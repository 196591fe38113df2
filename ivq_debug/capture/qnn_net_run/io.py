"""Inputs written for ``qnn-net-run``: raw files and the ``input_list.txt`` naming them (:func:`write_inputs`).

Reading a run back is elsewhere in this package: ``Result_<i>`` folders described by a QNN graph JSON in
:mod:`~ivq_debug.capture.qnn_net_run.outputs`, run folders described by the ONNX graph the device ran in
:mod:`~ivq_debug.capture.qnn_net_run.folders` (shapes solved by :mod:`~ivq_debug.capture.qnn_net_run.shapes`).
"""


from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import UsageError
from ivq_debug.outputs import atomic_write_bytes
from ivq_debug.qnn.names import NameMap, qnn_sanitize
from ivq_debug.qnn.netjson import QnnGraph, QnnTensor


# ============================================================================ inputs
@dataclass
class InputList:
    """What :func:`write_inputs` wrote."""

    path: Path
    files: list[dict[str, Path]]
    names: list[str]
    native: bool

    @property
    def lines(self) -> list[str]:
        """The ``input_list.txt`` lines."""
        return self.path.read_text().splitlines()


def quantize_like_sdk(x: np.ndarray, scale: float, offset: int, bitwidth: int) -> np.ndarray:
    """``floatToTfN`` of the SDK sample app: float → unsigned fixed point with a QNN offset."""
    qmax = float((1 << bitwidth) - 1)
    enc_min = offset * float(np.float32(scale))
    enc_max = (qmax + offset) * float(np.float32(scale))
    v = qmax * (x.astype(np.float64) - enc_min) / (enc_max - enc_min)
    v = np.where(v >= 0, np.floor(v + 0.5), np.ceil(v - 0.5))  # std::round: half away from zero
    dt = np.uint8 if bitwidth <= 8 else (np.uint16 if bitwidth <= 16 else np.uint32)
    return np.clip(v, 0, qmax).astype(dt)


def _native_bytes(t: QnnTensor, arr: np.ndarray) -> np.ndarray:
    if t.is_quantized:
        q = t.quant
        assert q is not None
        if np.issubdtype(arr.dtype, np.integer):
            return arr.astype(t.dtype)
        if q.per_channel or q.scale.size != 1:
            raise UsageError(f"input {t.name!r}: per-channel native inputs are not supported; write float inputs")
        return quantize_like_sdk(arr, float(q.scale[0]), int(q.offset[0]), t.bitwidth).astype(t.dtype)
    return arr.astype(t.dtype)


def write_inputs(
    samples: Sequence[Mapping[str, np.ndarray]],
    out_dir: str | os.PathLike,
    graph: QnnGraph | None = None,
    native: bool = False,
    overwrite: bool = False,
    input_list_name: str = "input_list.txt",
) -> InputList:
    """Write raw input files and ``input_list.txt`` (one line per sample, ``name:=abs_path`` tokens).

    Args:
        samples: one dict per inference, keyed by ONNX input name (or QNN name).
        out_dir: folder for ``input_list.txt`` and ``inputs/<i>/<name>.raw``.
        graph: the QNN graph: gives the input order, QNN names, layouts (arrays in the source layout are
            transposed into the graph's layout, e.g. NCHW → NHWC) and native dtypes. Without it, names
            are kept and arrays are written as float32 as given.
        native: write the graph's native dtype (quantized with the SDK's arithmetic) for
            ``--use_native_input_files``; default float32 (qnn-net-run quantizes on the host).
        overwrite: replace an existing ``input_list.txt`` / input files.

    Raises:
        UsageError: missing or extra inputs, a shape that does not match the graph, existing files.
    """
    if not samples:
        raise UsageError("no samples to write")
    if native and graph is None:
        raise UsageError("native inputs need the graph (dtypes and encodings)")
    out = Path(out_dir)
    lst = out / input_list_name
    if lst.exists() and not overwrite:
        raise UsageError("output exists; pass overwrite=True (CLI: --force) to replace it", lst)
    out.mkdir(parents=True, exist_ok=True)
    if graph is not None:
        names = [t.name for t in graph.inputs]
        if not names:
            raise UsageError(f"graph {graph.name!r} declares no inputs (APP_WRITE tensors)")
    else:
        names = list(samples[0])
    files: list[dict[str, Path]] = []
    lines: list[str] = []
    for i, sample in enumerate(samples):
        key_of = _match_inputs(sample, names, i)
        sdir = out / "inputs" / str(i)
        sdir.mkdir(parents=True, exist_ok=True)
        row: dict[str, Path] = {}
        for name in names:
            arr = np.asarray(sample[key_of[name]])
            if graph is not None:
                t = graph.tensors[name]
                if tuple(arr.shape) != t.src_shape:
                    raise UsageError(
                        f"sample {i}: input {key_of[name]!r} has shape {list(arr.shape)}, the graph wants "
                        f"{list(t.src_shape)} (source layout of QNN dims {list(t.dims)})")
                arr = t.from_source(arr)
                data = _native_bytes(t, arr) if native else arr.astype(np.float32)
            else:
                data = arr.astype(np.float32)
            path = (sdir / f"{qnn_sanitize(name)}.raw").resolve()
            if path.exists() and not overwrite:
                raise UsageError("output exists; pass overwrite=True (CLI: --force) to replace it", path)
            atomic_write_bytes(path, np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes(),
                               overwrite=True)
            row[name] = path
        files.append(row)
        lines.append(" ".join(f"{n}:={row[n]}" for n in names))
    atomic_write_bytes(lst, ("\n".join(lines) + "\n").encode(), overwrite=True)
    return InputList(lst.resolve(), files, names, native)


def _match_inputs(sample: Mapping[str, Any], names: list[str], i: int) -> dict[str, str]:
    nm = NameMap.from_names(sample.keys())
    out: dict[str, str] = {}
    for n in names:
        if n in sample:
            out[n] = n
            continue
        hit = next((k for k in sample if qnn_sanitize(k) == n or qnn_sanitize(k, legacy=True) == n), None)
        hit = hit or nm.lookup(n)
        if hit is None:
            raise UsageError(f"sample {i} has no value for graph input {n!r} (got {sorted(sample)})")
        out[n] = hit
    extra = set(sample) - set(out.values())
    if extra:
        raise UsageError(f"sample {i} has values for tensors that are not graph inputs: {sorted(extra)}")
    return out



