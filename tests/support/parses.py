"""Count what a run parses and writes: ONNX models loaded (``onnx.load`` / ``onnx.load_from_string`` / the in-place
loader), ONNX Runtime sessions created, ONNX files saved, each by source (a file name, or ``<bytes>`` for a model
serialized in memory). Used by the parse-count acceptance test and ``bench/check_diagnose_identity.py``."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _key(x: Any) -> str:
    if isinstance(x, bytes | bytearray | memoryview):
        return "<bytes>"
    if hasattr(x, "read"):
        return f"<file {getattr(x, 'name', '?')}>"
    return Path(os.fspath(x)).name


@contextlib.contextmanager
def counting() -> Iterator[dict[str, Counter]]:
    """``{"onnx_parse", "ort_session", "onnx_save"}`` counters, filled while the block runs."""
    import onnx
    import onnxruntime as ort

    from ivq_debug.onnxgraph import load as loader

    counts: dict[str, Counter] = {"onnx_parse": Counter(), "ort_session": Counter(), "onnx_save": Counter()}

    def wrap(kind: str, fn: Any) -> Any:
        def inner(first: Any, *a: Any, **k: Any) -> Any:
            counts[kind][_key(first) if kind != "onnx_save" else _key(a[0] if a else k.get("f", "?"))] += 1
            return fn(first, *a, **k)
        return inner

    saved = {n: getattr(onnx, n) for n in ("load", "load_model", "load_from_string", "load_model_from_string",
                                           "save", "save_model")}
    in_place = loader.load_in_place
    sess_init = ort.InferenceSession.__init__

    def session(self: Any, path_or_bytes: Any, *a: Any, **k: Any) -> None:
        counts["ort_session"][_key(path_or_bytes)] += 1
        sess_init(self, path_or_bytes, *a, **k)

    onnx.load = onnx.load_model = wrap("onnx_parse", saved["load"])
    onnx.load_from_string = onnx.load_model_from_string = wrap("onnx_parse", saved["load_from_string"])
    onnx.save = onnx.save_model = wrap("onnx_save", saved["save"])
    loader.load_in_place = wrap("onnx_parse", in_place)
    ort.InferenceSession.__init__ = session
    try:
        yield counts
    finally:
        for n, f in saved.items():
            setattr(onnx, n, f)
        loader.load_in_place = in_place
        ort.InferenceSession.__init__ = sess_init
