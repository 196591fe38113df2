"""What a dump records so that a comparison can check both sides were fed the same inputs (the contract).

Per record, :class:`~ivq_debug.dump.DumpWriter` stores one *input fact* for every input it is given
(``meta["inputs"][name]``): the SHA-256 of its canonical bytes (:func:`input_digest`), dtype, shape and the
input's **role** (:data:`ROLES`), which says whether two dumps of the same inputs must agree on it:

=========== ==========================================================================================
external    fed from outside the system under test: pixel values, prompt token ids, teacher-forced decode
            tokens, a user's ``.npz``. Two dumps compared must agree (``ivq-diff`` exit 6 otherwise).
derived     computed by the runtime under test from the external inputs by its own rules: positions,
            attention masks, cache lengths, token embeddings. A difference is reported (it is what the
            position diagnostics look at), never a contract failure.
carried     an earlier part's or step's output on the same backend: the KV cache, prompt embeddings that
            hold the vision output, a free-running decode step's token. Differs whenever the backend does.
recomputed  recomputed on purpose by a reference (``ivq reference``: the model's own positions and its own
            vision rows); ``reason`` says why. Never compared.
=========== ==========================================================================================

A capture also stores the *identity* of what ran under ``/meta/contract`` (:data:`CONTRACT_META`): the model
files per part (path, SHA-256, precision), the platform, and the preprocessing when the producer knows it
(``meta["preprocess"]`` of a vision record). Dumps written before these facts existed have none: their
comparisons report the contract as unknown.
"""

from __future__ import annotations

import fnmatch
import hashlib
import platform
from typing import Any

import numpy as np

from ivq_debug import defaults

#: record meta key of the per-input facts, dump ``/meta`` key of the identity, record meta key of preprocessing
INPUTS_META = "inputs"
CONTRACT_META = "contract"
PREPROCESS_META = "preprocess"

ROLES = ("external", "derived", "carried", "recomputed")


def canonical(arr: np.ndarray, dtype_name: str | None = None) -> tuple[str, np.ndarray]:
    """``(dtype tag, contiguous little-endian array)`` an input is hashed as.

    Integers and booleans are hashed as int64 (token ids fed as int32 on one side and int64 on the other are
    the same tokens); floating values in their own dtype (a float16 image is not the float32 one); dtypes numpy
    lacks (bfloat16, float8) as their stored integer view, tagged with their name.
    """
    a = np.asarray(arr)
    if a.dtype.kind in "iub":
        return "int", np.ascontiguousarray(a, dtype="<i8")
    tag = dtype_name or a.dtype.name
    return tag, np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


def input_digest(arr: np.ndarray, dtype_name: str | None = None) -> str:
    """SHA-256 (hex) of an input: its canonical dtype tag, shape and bytes (:func:`canonical`)."""
    tag, c = canonical(arr, dtype_name)
    h = hashlib.sha256()
    h.update(f"{tag}|{','.join(map(str, c.shape))}|".encode())
    h.update(memoryview(c.reshape(-1)).cast("B"))
    return h.hexdigest()


def default_role(name: str) -> str:
    """The role of an input nobody declared: ``carried`` for KV-cache names (``defaults.CONTRACT_CARRIED_INPUTS``),
    else ``external``."""
    return "carried" if any(fnmatch.fnmatchcase(name, p) for p in defaults.CONTRACT_CARRIED_INPUTS) else "external"


def input_fact(name: str, arr: np.ndarray, dtype_name: str | None = None, role: str | None = None,
               reason: str | None = None) -> dict[str, Any]:
    """The fact a dump stores for one input of one record (see the module docstring)."""
    role = role or default_role(name)
    if role not in ROLES:
        raise ValueError(f"unknown input role {role!r} (known: {', '.join(ROLES)})")
    fact: dict[str, Any] = {"sha256": input_digest(arr, dtype_name), "dtype": dtype_name or np.asarray(arr).dtype.name,
                            "shape": list(np.shape(arr)), "role": role}
    if reason:
        fact["reason"] = reason
    return fact


def host_platform() -> dict[str, str]:
    """Where a capture ran: OS, machine architecture, Python."""
    return {"system": platform.system(), "machine": platform.machine(), "python": platform.python_version()}


def model_precision(model: Any) -> str:
    """``float`` or ``a<bits>w<bits>`` of an ONNX model proto: the most common activation and weight bitwidths of
    its QuantizeLinear outputs / initializer DequantizeLinear inputs (from their zero-point dtypes)."""
    from collections import Counter

    bits = {2: 8, 3: 8, 4: 16, 5: 16, 21: 4, 22: 4, 6: 32, 12: 32}  # onnx TensorProto int types -> bits
    inits = {i.name: i for i in model.graph.initializer}
    act: Counter = Counter()
    wts: Counter = Counter()
    for n in model.graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(n.input) < 3:
            continue
        zp = inits.get(n.input[2])
        if zp is None:
            continue
        b = bits.get(zp.data_type)
        if b is None:
            continue
        if n.op_type == "DequantizeLinear" and n.input[0] in inits:
            wts[b] += 1
        elif n.op_type == "QuantizeLinear":
            act[b] += 1
    if not act and not wts:
        return "float"
    a = act.most_common(1)[0][0] if act else None
    w = wts.most_common(1)[0][0] if wts else None
    return f"a{a if a else '?'}w{w if w else '?'}"
