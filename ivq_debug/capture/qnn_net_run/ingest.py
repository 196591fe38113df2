"""qnn-net-run capture: ingest an ``--output_dir`` into a golden dump (backend ``qnn-net-run``).

Each ``Result_<i>`` folder becomes one record: sample ``i`` (default) or decode step ``first_step + i``
(``as_steps=True``); with several graphs each graph is its own ``part``. Tensors are keyed by ONNX names
when the model is given (QDQ ``QuantizeLinear`` outputs under their float names, as the ORT and QNN EP
captures key them), stored as float32 values in the source layout with their raw integers and encoding.
Problems (missing files, wrong sizes, unknown names) are collected: the dump is then marked incomplete
with the reasons, or, with ``strict=True``, the first one is raised as a one-line ``InputError``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ivq_debug.capture.qnn_net_run.io import Ingest, IngestProblem, ingest_output
from ivq_debug.dump.writer import DumpWriter, check_writable
from ivq_debug.errors import UsageError
from ivq_debug.qnn.names import NameMap
from ivq_debug.qnn.profiling import join_tensors, read_profile
from ivq_debug.util import sha256_file

BACKEND = "qnn-net-run"
PARTS = ("vision", "prefill", "decode", "model")


@dataclass
class NetRunCapture:
    """What :func:`capture_net_run` wrote."""

    path: Path
    records: list[tuple[int, str, int]]
    n_tensors: int
    complete: bool
    problems: list[IngestProblem] = field(default_factory=list)
    profiling_rows: int = 0


def _part_of(graph: str, n_graphs: int, parts: Mapping[str, str] | None) -> str:
    if parts and graph in parts:
        return parts[graph]
    if n_graphs == 1:
        return "model"
    return graph


def write_ingest(
    writer: Any,
    ing: Ingest,
    as_steps: bool = False,
    first_step: int = 0,
    sample: int = 0,
    parts: Mapping[str, str] | None = None,
) -> tuple[list[tuple[int, str, int]], int]:
    """Stream an :class:`~ivq_debug.capture.qnn_net_run.io.Ingest` into an open ``DumpWriter``.

    Returns ``(records, tensor count)``. Fatal problems already in ``ing`` and float/native disagreements
    found while reading are passed to ``writer.mark_incomplete`` / recorded under ``/meta``.
    """
    records: list[tuple[int, str, int]] = []
    n = 0
    mismatches = []
    for graph, ri, tensors in ing.records():
        part = _part_of(graph, len(ing.results), parts)
        key = (sample, part, first_step + ri) if as_steps else (ri, part, 0)
        writer.begin_record(sample=key[0], part=key[1], step=key[2], qnn_graph=graph, result_dir=f"Result_{ri}")
        records.append(key)
        for t in tensors:
            d = t.read()
            if d.max_mismatch:
                mismatches.append({"graph": graph, "result": ri, "tensor": t.key, "max_abs": d.max_mismatch})
            writer.add_tensor(
                t.key, d.values, op_type=t.op_type, order=t.order, scope=t.scope, layout=t.layout,
                encoding=t.encoding(), raw=d.raw,
            )
            n += 1
    for p in ing.fatal:
        writer.mark_incomplete(p.one_line())
    notes = [{"kind": p.kind, "path": p.path, "message": p.message} for p in ing.problems]
    if notes:
        writer.set_meta("qnn_net_run_problems", notes)
    if mismatches:
        writer.set_meta("qnn_net_run_float_native_mismatch", mismatches)
    return records, n


def capture_net_run(
    output_dir: str | os.PathLike,
    dump_path: str | os.PathLike,
    graphs: Any,
    model: Any = None,
    profiling: str | os.PathLike | None = None,
    strict: bool = False,
    as_steps: bool = False,
    first_step: int = 0,
    parts: Mapping[str, str] | None = None,
    overwrite: bool = False,
    backend_info: Mapping[str, Any] | None = None,
    allow_outside: bool = False,
) -> NetRunCapture:
    """Ingest a qnn-net-run output folder into a new golden dump.

    Args:
        output_dir: qnn-net-run's ``--output_dir``.
        dump_path: the ``.h5`` to write (atomic; an existing file needs ``overwrite=True``).
        graphs: graph JSON path(s) / :class:`~ivq_debug.qnn.netjson.QnnGraph`(s) (``<model>_net.json``,
            ORT ``dump_json_qnn_graph`` output or context-binary JSON), or ``{folder: graph}``.
        model: the ONNX model, for ONNX names, execution order and op types (recommended).
        profiling: a profiling file (QNN EP CSV, qnn-profile-viewer text, Chrome trace) stored as the
            ``profiling`` table (joined to tensors when ``model`` is given).
        strict: raise the first problem instead of writing a dump marked incomplete.
        as_steps: ``Result_<i>`` are decode steps ``first_step + i`` of sample 0 (default: samples).
        parts: graph name → record part (default ``model`` for one graph, else the graph name).
        overwrite: replace an existing dump.
        backend_info: extra provenance (device, SDK version, soc_model, …).
        allow_outside: read raw files / Result folders that are symlinks leaving ``output_dir``.

    Raises:
        UsageError: the dump exists and ``overwrite`` is false.
        InputError: unreadable inputs; with ``strict``, the first missing / wrong-size / unknown file.
    """

    check_writable(dump_path, overwrite)
    if parts:
        bad = {v for v in parts.values() if v not in PARTS}
        if bad:
            raise UsageError(f"unknown part(s) {sorted(bad)} (use {', '.join(PARTS)})")
    ing = ingest_output(output_dir, graphs, model=model, strict=strict, allow_outside=allow_outside)
    prof = None
    if profiling is not None:

        prof = read_profile(profiling)
        if model is not None and not _is_namemap(model):
            prof = join_tensors(prof, model)
    info = {
        "source": "qnn-net-run output folder",
        "output_dir": str(Path(output_dir).resolve()),
        "graphs": {g: (gr.source or "") for g, gr in ing.graphs.items()},
        "emulated": None,
        "profiling_logs": [str(p) for p in ing.profiling_logs],
    }
    info.update(backend_info or {})
    model_info: dict[str, Any] = {}
    if model is not None and isinstance(model, (str, os.PathLike)):
        model_info = {"path": str(Path(model).resolve()), "sha256": sha256_file(model)}
    with DumpWriter(dump_path, backend=BACKEND, backend_info=info, model=model_info, overwrite=overwrite) as w:
        records, n = write_ingest(w, ing, as_steps=as_steps, first_step=first_step, parts=parts)
        if prof is not None:
            w.add_table("profiling", prof.astype(object).where(prof.notna(), None))
        path = w.path
    return NetRunCapture(Path(path), records, n, ing.complete, list(ing.problems),
                         0 if prof is None else len(prof))


def _is_namemap(model: Any) -> bool:

    return isinstance(model, NameMap)
