"""qnn-net-run capture: ingest run folders into a golden dump (backend ``qnn-net-run``).

Steps follow the dump's one convention (``docs/architecture.md``): step 0 is a single forward or a prefill,
decode call ``k`` is step ``k >= 1``; a decode record at step 0 is refused.

With a QNN graph JSON (:func:`capture_net_run`): each ``Result_<i>`` folder becomes one record: sample ``i``
(default) or decode step ``first_step + i`` (``as_steps=True``, ``first_step`` 1 by default); with several
graphs each graph is its own ``part``. Tensors are keyed by ONNX names when the model is given (QDQ
``QuantizeLinear`` outputs under their float names, as the ORT and QNN EP captures key them), stored as
float32 values in the source layout with their raw integers and encoding. Problems (missing files, wrong
sizes, unknown names) are collected: the dump is then marked incomplete with the reasons, or, with
``strict=True``, the first one is raised as a one-line ``InputError``.

With only the ONNX graph (:func:`capture_net_run_model`, :func:`capture_session`): names, dtypes and shapes
come from the graph (:func:`~ivq_debug.capture.qnn_net_run.folders.read_net_run_folder`), the inputs of
``input_list.txt`` become the record inputs, and every problem is a one-line ``InputError`` (nothing is
written). A *session* puts a device's vision, prefill and decode folders of one or more samples into one dump.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.capture.base import model_facts
from ivq_debug.capture.qnn_net_run.folders import NetRunCall, NetRunFolder, read_net_run_folder
from ivq_debug.capture.qnn_net_run.outputs import Ingest, IngestProblem, ingest_output
from ivq_debug.capture.qnn_net_run.shapes import GraphIO, UnresolvedAxes
from ivq_debug.dump.writer import DumpWriter, check_writable
from ivq_debug.errors import InputError, UsageError
from ivq_debug.inputfiles import file_in_folder_problem, is_inside, sha256_file
from ivq_debug.jsonio import load_json, read_json
from ivq_debug.qnn.names import NameMap
from ivq_debug.qnn.profiling import join_tensors, read_profile
from ivq_debug.schema import check_schema
from ivq_debug.vlm.config import check_hf_config

BACKEND = "qnn-net-run"
PARTS = ("vision", "prefill", "decode", "model")


@dataclass
class NetRunCapture:
    """What an ingest wrote.

    ``mapping``: every file read, with the ONNX tensor, its QNN name and the record it went to;
    ``unmatched``: files no tensor claimed (``{"file", "reason"}``); ``parts``: the ONNX graph of each part.
    """

    path: Path
    records: list[tuple[int, str, int]]
    n_tensors: int
    complete: bool
    problems: list[IngestProblem] = field(default_factory=list)
    profiling_rows: int = 0
    mapping: list[dict[str, Any]] = field(default_factory=list)
    unmatched: list[dict[str, str]] = field(default_factory=list)
    parts: dict[str, Path] = field(default_factory=dict)
    config_source: str | None = None
    llm: bool = False
    not_fed: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``ivq-ingest/1`` document of ``ivq ingest --json``."""
        return {"schema": INGEST_SCHEMA, "dump": str(self.path), "complete": self.complete,
                "records": [{"sample": s, "part": p, "step": k} for s, p, k in self.records],
                "parts": {k: str(v) for k, v in self.parts.items()}, "config": self.config_source,
                "tensors": self.mapping, "unmatched": self.unmatched, "not_fed": self.not_fed,
                "problems": [{"kind": p.kind, "file": p.path, "message": p.message, "fatal": p.fatal}
                             for p in self.problems]}


INGEST_SCHEMA = "ivq-ingest/1"


def check_step(part: str, step: int, where: str = "") -> None:
    """The one step convention: decode calls are steps ``k >= 1`` (step 0 is the prefill)."""
    if part == "decode" and step < 1:
        raise UsageError(f"a decode record at step {step}{where}: decode call k is step k >= 1 "
                         "(step 0 is the prefill); pass --as-steps / as_steps=True")


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
    first_step: int = 1,
    sample: int = 0,
    parts: Mapping[str, str] | None = None,
) -> tuple[list[tuple[int, str, int]], int]:
    """Stream an :class:`~ivq_debug.capture.qnn_net_run.outputs.Ingest` into an open ``DumpWriter``.

    Returns ``(records, tensor count)``. Fatal problems already in ``ing`` and float/native disagreements
    found while reading are passed to ``writer.mark_incomplete`` / recorded under ``/meta``.
    """
    records: list[tuple[int, str, int]] = []
    n = 0
    mismatches = []
    for graph, ri, tensors in ing.records():
        part = _part_of(graph, len(ing.results), parts)
        key = (sample, part, first_step + ri) if as_steps else (ri, part, 0)
        check_step(part, key[2], f" (graph {graph!r}, Result_{ri})")
        writer.begin_record(sample=key[0], part=key[1], step=key[2], qnn_graph=graph, result_dir=f"Result_{ri}")
        records.append(key)
        for t in tensors:
            d = t.read()
            if d.max_mismatch:
                mismatches.append({"graph": graph, "result": ri, "tensor": t.key, "max_abs": d.max_mismatch})
            writer.add_tensor(
                t.key, d.values, op_type=t.op_type, order=t.order, scope=t.scope, layout=t.layout,
                encoding=t.encoding(), raw=d.raw, qnn_name=t.qnn_name, source_file=str(t.float_file or t.native_file),
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
    first_step: int = 1,
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
        as_steps: ``Result_<i>`` are decode steps ``first_step + i`` of sample 0 (default: samples);
            ``first_step`` is 1 (decode call 1 follows the prefill, step 0), as on the CLI.
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
    if as_steps and first_step < 1:
        raise UsageError(f"first_step {first_step}: decode steps start at 1 (step 0 is the prefill)")
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
    mapping = [{"record": {"sample": key[0], "part": key[1], "step": key[2]}, "graph": graph, "result": ri,
                "kind": "tensor", "name": t.key, "qnn_name": t.qnn_name, "file": str(t.float_file or t.native_file)}
               for key, (graph, ri, tensors) in zip(records, ing.records(), strict=True) for t in tensors]
    unmatched = [{"file": p.path, "reason": p.message} for p in ing.problems if p.kind in ("unknown_tensor", "unmapped")]
    return NetRunCapture(Path(path), records, n, ing.complete, list(ing.problems),
                         0 if prof is None else len(prof), mapping, unmatched)


def _is_namemap(model: Any) -> bool:

    return isinstance(model, NameMap)


# ==================================================================================== ONNX-described ingests
SESSION_PARTS = ("vision", "prefill", "decode")
SESSION_SCHEMA = "ivq-session/1"
#: name of the output whose last row's argmax is a record's ``token`` (HF exports)
LOGITS = "logits"
_PAST = re.compile(r"^past(?:_key_values)?[._](\d+)[._](key|value)$")


def token_of(values: np.ndarray) -> int:
    """The greedy token of a ``logits`` output: argmax of its last position."""
    v = np.asarray(values)
    return int(np.argmax(v.reshape(-1, v.shape[-1])[-1]))


def decode_cache_len(call: NetRunCall) -> int | None:
    """Valid cache slots before a decode call: the ``past`` input's length when the graph's cache grows, else
    the attended slots of ``attention_mask`` (1/0 mask: ones; additive mask: zeros) minus the new token."""
    past = [t for t in call.inputs if _PAST.match(t.name)]
    if past and len(past[0].shape) >= 2 and isinstance(past[0].tensor.dims[-2], str):
        return int(past[0].shape[-2])
    mask = call.input("attention_mask")
    if mask is None:
        return None
    m = mask.load()
    last = m.reshape(-1, m.shape[-1])[-1] if m.ndim else m.reshape(1)
    attended = int(np.count_nonzero(last)) if m.dtype.kind in "iub" else int(np.count_nonzero(last == 0))
    return attended - 1


#: inputs a device runtime computes by its own rules (contract role ``derived``, :mod:`ivq_debug.dump.contract`)
DERIVED_INPUTS = ("position_ids", "attention_mask", "cache_position")


def session_role(part: str, name: str) -> str | None:
    """The contract role of a device session's input: positions and masks are the device runtime's (``derived``),
    prefill ``inputs_embeds`` hold the device's own vision output (``carried``); the rest take the default role
    (``past*`` carried, token embeddings and pixels external: a teacher-forced reference must be fed the same)."""
    if name in DERIVED_INPUTS:
        return "derived"
    if part == "prefill" and name == "inputs_embeds":
        return "carried"
    return None


def _record_rows(writer: Any, call: NetRunCall, key: tuple[int, str, int],
                 meta: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Write one inference as one record (inputs, then outputs); returns its mapping rows and tensor count."""
    s, part, step = key
    check_step(part, step, f" ({call.result_dir})")
    writer.begin_record(sample=s, part=part, step=step, result_dir=call.result_dir.name if call.result_dir else None,
                        input_list_line=call.line, **meta, **({"not_fed": call.not_fed} if call.not_fed else {}))
    rows = []
    for t in call.inputs:
        writer.add_input(t.name, t.load(), qnn_name=t.qnn_name, source_file=str(t.path), role=session_role(part, t.name))
    token = None
    for t in call.outputs:
        v = t.load()
        writer.add_tensor(t.name, v, op_type=t.tensor.op_type or ("GraphOutput" if t.tensor.kind == "output" else None),
                          order=t.tensor.order if t.tensor.order >= 0 else None, qnn_name=t.qnn_name,
                          source_file=str(t.path))
        if t.name == LOGITS and v.ndim >= 1 and v.size:
            token = token_of(v)
    if token is not None:
        writer.update_record_meta(token=token)
    rec = {"sample": s, "part": part, "step": step}
    for kind, ts in (("input", call.inputs), ("tensor", call.outputs)):
        rows += [{"record": rec, "kind": kind, "name": t.name, "qnn_name": t.qnn_name, "file": str(t.path),
                  "shape": list(t.shape)} for t in ts]
    return rows, len(call.inputs) + len(call.outputs)


def load_config(config: str | os.PathLike | Mapping[str, Any] | None,
                model_dir: str | os.PathLike | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """The HF ``config.json`` of a model as a dict and where it came from: ``config`` (a file, a folder
    holding one, or a dict), else ``model_dir/config.json`` when it exists, else ``(None, None)``.

    Raises:
        InputError: a named config that is missing or not a JSON object.
    """
    if isinstance(config, Mapping):
        return dict(config), "argument"
    path = Path(config) if config is not None else None
    if path is None and model_dir is not None and (Path(model_dir) / "config.json").is_file():
        path = Path(model_dir) / "config.json"
    if path is None:
        return None, None
    if path.is_dir():
        path = path / "config.json"
    doc = check_hf_config(read_json(path, "config.json"), path)
    return doc, str(path.resolve())


#: the ``parts`` list of an ivq export's ``export.json`` as far as the part lookup reads it
EXPORT_PARTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"parts": {"type": "array", "items": {
        "type": "object", "required": ["path"],
        "properties": {"part": {"type": "string"}, "path": {"type": "string", "minLength": 1}}}}},
}


def part_candidates(model_dir: str | os.PathLike, part: str) -> list[Path]:
    """The ONNX files of ``part`` in a parts folder: those its ``export.json`` lists (ivq exports), else
    ``<part>*.onnx`` (``vision_b112.onnx``, ``prefill.onnx``, ``decode.onnx``, ...).

    Raises:
        InputError: the folder is missing; ``export.json`` is not a regular JSON file of the export schema
            (:data:`EXPORT_PARTS_SCHEMA`), or it lists a path that leaves the folder or is missing; a
            candidate that is not a regular file or a symlink leaving the folder.
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise InputError("no such model folder" if not d.exists() else "not a folder", d)
    manifest = d / "export.json"
    if os.path.lexists(manifest):
        doc = load_json(manifest, "export manifest")
        check_schema(doc, EXPORT_PARTS_SCHEMA, manifest)
        listed = [d / p["path"] for p in doc.get("parts", []) if p.get("part") == part]
        for p in listed:
            if not os.path.normpath(p).startswith(os.path.normpath(d) + os.sep):
                raise InputError(f"lists {part} part {os.path.relpath(p, d)!r}, which is not a file of the folder", manifest)
            if not os.path.lexists(p):
                raise InputError(f"the {part} part that {manifest.name} lists is missing", p)
        if listed:
            cands = listed
        else:
            cands = sorted(p for p in d.iterdir() if p.suffix == ".onnx" and p.name.lower().startswith(part))
    else:
        cands = sorted(p for p in d.iterdir() if p.suffix == ".onnx" and p.name.lower().startswith(part))
    for p in cands:
        bad = file_in_folder_problem(p, d, "ONNX part")
        if bad:
            raise InputError(bad, p)
    return cands


def find_part_model(part: str, model_dir: str | os.PathLike | None, explicit: str | os.PathLike | None,
                    fits: Callable[[Path], str | None]) -> Path:
    """The ONNX graph of one part: ``explicit``, else the one candidate of ``model_dir`` that ``fits`` (a check
    returning why a graph does not fit the data, or None).

    Raises:
        UsageError: no model folder nor explicit file, no candidate, or several that fit.
        InputError: the only candidates do not fit the data (the first reason, naming the file).
    """
    if explicit is not None:
        p = Path(explicit)
        if not p.is_file():
            raise InputError("no such ONNX model", p)
        return p
    if model_dir is None:
        raise UsageError(f"no ONNX graph for the {part} part: pass --model-dir PARTS/ or --{part}-model FILE")
    cands = part_candidates(model_dir, part)
    if not cands:
        raise UsageError(f"no {part} model in {model_dir} (looked for export.json parts and {part}*.onnx); "
                         f"name it with --{part}-model FILE")
    if len(cands) == 1:
        return cands[0]
    reasons = {c: fits(c) for c in cands}
    ok = [c for c, r in reasons.items() if r is None]
    if len(ok) == 1:
        return ok[0]
    if not ok:
        c, r = next(iter(reasons.items()))
        raise InputError(f"none of the {part} models {[p.name for p in cands]} fits the data ({r})", c)
    raise UsageError(f"several {part} models fit the data ({', '.join(p.name for p in ok)}); "
                     f"name one with --{part}-model FILE")


@dataclass
class SessionSpec:
    """What ``ivq ingest session`` reads: per part the folders (one per sample, or one holding every sample's
    calls in order), the ONNX parts and the model config.

    Attributes:
        folders: ``{"vision": [...], "prefill": [...], "decode": [...]}`` (vision and decode optional).
        model_dir: folder of the ONNX parts (:func:`part_candidates`); ``models`` names files per part.
        config: the HF ``config.json`` (default ``model_dir/config.json`` when present).
        native_inputs: input files are in the graph's dtypes (``--use_native_input_files``); default float32.
        allow_outside_inputs: read input paths that leave their session folder.
        dims: dynamic axis values to pin (``{"batch_size": 1}``).
        missing_inputs: inputs the device did not feed (``NAME``: every part whose graph takes it;
            ``PART:NAME``: that part), for positional input lists; ``name:=path`` lists just leave them out.
    """

    folders: dict[str, list[Path]]
    model_dir: Path | None = None
    models: dict[str, Path] = field(default_factory=dict)
    config: Path | None = None
    native_inputs: bool = False
    allow_outside_inputs: bool = False
    dims: dict[str, int] = field(default_factory=dict)
    missing_inputs: list[str] = field(default_factory=list)

    def missing_for(self, part: str, graph: GraphIO) -> list[str]:
        """The ``missing_inputs`` of one part: ``PART:NAME`` entries of that part, plain names its graph takes."""
        names = {t.name for t in graph.inputs}
        out = []
        for m in self.missing_inputs:
            p, sep, n = m.partition(":")
            if sep and p in SESSION_PARTS:
                out += [n] if p == part else []
            elif m in names:
                out.append(m)
        return out

    @classmethod
    def from_json(cls, path: str | os.PathLike, allow_outside: bool = False) -> SessionSpec:
        """A spec file (schema ``ivq-session/1``, ``docs/device-sessions.md``); paths relative to the file.

        A path that leaves the spec's folder (absolute elsewhere, ``../``, or a symlink out) is refused unless
        ``allow_outside`` (the command line's ``--allow-outside-inputs``: the spec's own field cannot grant it).

        Raises:
            InputError: not JSON, another schema, an unknown field or a field of the wrong type (named), a path
                outside the spec's folder.
        """
        p = Path(path)
        doc = read_json(p, "JSON session spec")
        _validate_spec(doc, p)
        base = p.parent

        def path_of(v: str) -> Path:
            q = Path(v)
            q = q if q.is_absolute() else base / q
            if not allow_outside and not is_inside(q, base):
                raise InputError(f"path {v!r} leaves the spec's folder {str(base) or '.'!r} "
                                 "(pass --allow-outside-inputs to read it)", p)
            return q

        folders = {}
        for part in SESSION_PARTS:
            v = doc.get(part)
            if v is not None:
                folders[part] = [path_of(x) for x in ([v] if isinstance(v, str) else v)]
        return cls(folders, path_of(doc["model_dir"]) if doc.get("model_dir") else None,
                   {k: path_of(v) for k, v in (doc.get("models") or {}).items()},
                   path_of(doc["config"]) if doc.get("config") else None, bool(doc.get("native_inputs", False)),
                   bool(doc.get("allow_outside_inputs", False)), {k: int(v) for k, v in (doc.get("dims") or {}).items()},
                   list(doc.get("missing_inputs") or []))


#: field -> (JSON types, what it is) of an ``ivq-session/1`` spec
SPEC_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "schema": ((str,), f"the string {SESSION_SCHEMA!r}"),
    "model_dir": ((str,), "a folder path"),
    "models": ((dict,), "an object {part: ONNX path}"),
    "config": ((str,), "a config.json path"),
    "vision": ((str, list), "a folder path or a list of them"),
    "prefill": ((str, list), "a folder path or a list of them"),
    "decode": ((str, list), "a folder path or a list of them"),
    "native_inputs": ((bool,), "true or false"),
    "allow_outside_inputs": ((bool,), "true or false"),
    "dims": ((dict,), "an object {axis name: integer 1 .. 2^31-1}"),
    "missing_inputs": ((list,), "a list of input names (NAME or PART:NAME) the device did not feed"),
}


def _validate_spec(doc: Any, path: Path) -> None:
    if not isinstance(doc, dict):
        raise InputError("a session spec is a JSON object", path)
    if doc.get("schema") != SESSION_SCHEMA:
        raise InputError(f"field 'schema' must be {SESSION_SCHEMA!r} (got {doc.get('schema')!r})", path)
    for k, v in doc.items():
        if k not in SPEC_FIELDS:
            raise InputError(f"unknown field {k!r} (known: {', '.join(SPEC_FIELDS)})", path)
        types, what = SPEC_FIELDS[k]
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if ok and isinstance(v, list):
            ok = bool(v) and all(isinstance(x, str) for x in v)
        if ok and k == "models":
            ok = all(part in SESSION_PARTS and isinstance(x, str) for part, x in v.items())
        if ok and k == "dims":
            ok = all(isinstance(x, int) and not isinstance(x, bool) and 0 < x < 2**31 for x in v.values())
        if not ok:
            raise InputError(f"field {k!r} must be {what}", path)
    if "prefill" not in doc:
        raise InputError("field 'prefill' is required (the prefill folder(s))", path)


def _read_part(part: str, folders: Sequence[Path], model: Path, spec: SessionSpec, cfg: Mapping[str, Any] | None,
               graph: GraphIO) -> list[NetRunFolder]:
    return [read_net_run_folder(f, model, native_inputs=spec.native_inputs,
                                allow_outside_inputs=spec.allow_outside_inputs, dims=spec.dims,
                                require_inputs=True, graph=graph, missing_inputs=spec.missing_for(part, graph),
                                config=cfg) for f in folders]


def is_llm(graph: GraphIO) -> bool:
    """A decoder part: it takes or returns a KV cache, or returns ``logits`` (the RoPE hints apply)."""
    names = [t.name for t in graph.inputs + graph.outputs]
    return any(_PAST.match(n) or n.startswith("present") or n == LOGITS for n in names)


def _fits(part: str, folder: Path, spec: SessionSpec) -> Callable[[Path], str | None]:
    def check(model: Path) -> str | None:
        try:
            graph = GraphIO.from_model(model)
            read_net_run_folder(folder, model, native_inputs=spec.native_inputs, graph=graph,
                                allow_outside_inputs=spec.allow_outside_inputs, dims=spec.dims,
                                missing_inputs=spec.missing_for(part, graph))
        except InputError as e:
            return e.one_line()
        return None

    return check


def split_sessions(calls: list[tuple[NetRunFolder, NetRunCall]], n: int, folder: Path
                   ) -> list[list[tuple[NetRunFolder, NetRunCall]]]:
    """The decode calls of ``n`` samples run one after the other in one folder, split where the cache restarts
    (its length, :func:`decode_cache_len`, does not grow by one).

    Raises:
        InputError: the cache length cannot be told, or the folder does not split into ``n`` sessions.
    """
    lens = [decode_cache_len(c) for _, c in calls]
    if any(v is None for v in lens):
        raise InputError(f"one decode folder for {n} samples, but the cache length of its calls cannot be told; "
                         "give one decode folder per sample", folder)
    out: list[list[tuple[NetRunFolder, NetRunCall]]] = []
    for i, c in enumerate(calls):
        if i == 0 or lens[i] != lens[i - 1] + 1:  # type: ignore[operator]
            out.append([])
        out[-1].append(c)
    if len(out) != n:
        raise InputError(f"the decode calls split into {len(out)} session(s) where the cache restarts, "
                         f"but there are {n} prefill call(s); give one decode folder per sample", folder)
    return out


def _read_parts(spec: SessionSpec, cfg: Mapping[str, Any] | None
                ) -> tuple[dict[str, Path], dict[str, list[NetRunFolder]]]:
    """Each part's graph and folders read; the axes no part could resolve raised together."""
    models = {part: find_part_model(part, spec.model_dir, spec.models.get(part), _fits(part, fs[0], spec))
              for part in SESSION_PARTS if (fs := spec.folders.get(part))}
    named = {m.partition(":")[2] if m.partition(":")[0] in SESSION_PARTS else m for m in spec.missing_inputs}
    graphs = {part: GraphIO.from_model(m) for part, m in models.items()}
    takes = {t.name for g in graphs.values() for t in g.inputs}
    if named - takes:
        raise UsageError(f"--missing-input {', '.join(sorted(named - takes))}: no part's graph takes it")
    read: dict[str, list[NetRunFolder]] = {}
    open_axes = []
    for part, model in models.items():
        try:
            read[part] = _read_part(part, spec.folders[part], model, spec, cfg, graphs[part])
        except UnresolvedAxes as e:
            open_axes += e.axes
    if open_axes:
        raise UnresolvedAxes(open_axes)
    return models, read


def capture_session(spec: SessionSpec, dump_path: str | os.PathLike, *, overwrite: bool = False,
                    backend_info: Mapping[str, Any] | None = None) -> NetRunCapture:
    """Ingest a device session (vision, prefill, decode folders) into one dump.

    Sample ``i`` is prefill call ``i`` (the ``i``-th line of the prefill folders, in order) with vision call
    ``i`` and its decode calls: decode folder ``i`` when there is one per sample, else the calls of the one
    decode folder split where the cache restarts (:func:`split_sessions`). Records: ``(i, "vision", 0)``,
    ``(i, "prefill", 0)`` and ``(i, "decode", k)`` for decode call ``k = 1, 2, ...``. Each record holds the
    device's inputs (cast to the graph's types) and outputs, with their QNN names and files; meta ``token``
    (argmax of ``logits``), ``cache_len`` (decode), ``result_dir`` and ``input_list_line``. The HF config is
    stored in the model attributes (``config``), where the position checks read ``rope_theta``.

    Raises:
        UsageError: the dump exists (``overwrite``), no prefill folder, ambiguous or missing parts.
        InputError: any problem in the folders (one line naming the file); nothing is written.
    """
    check_writable(dump_path, overwrite)
    unknown = set(spec.folders) - set(SESSION_PARTS)
    if unknown:
        raise UsageError(f"unknown part(s) {sorted(unknown)} (use {', '.join(SESSION_PARTS)})")
    if not spec.folders.get("prefill"):
        raise UsageError("a session needs its prefill folder(s) (--prefill DIR)")
    cfg, cfg_src = load_config(spec.config, spec.model_dir)
    models, read = _read_parts(spec, cfg)
    calls = {p: [(f, c) for f in fs for c in f.calls] for p, fs in read.items()}
    n = len(calls["prefill"])
    if "vision" in calls and len(calls["vision"]) != n:
        raise InputError(f"{len(calls['vision'])} vision call(s) for {n} prefill call(s) (one per sample)",
                         spec.folders["vision"][0])
    decode: list[list[tuple[NetRunFolder, NetRunCall]]] = [[] for _ in range(n)]
    if "decode" in read:
        if len(read["decode"]) == n:
            decode = [[(f, c) for c in f.calls] for f in read["decode"]]
        elif len(read["decode"]) == 1:
            decode = split_sessions(calls["decode"], n, spec.folders["decode"][0]) if n > 1 else [calls["decode"]]
        else:
            raise UsageError(f"{len(read['decode'])} decode folders for {n} samples: give one per sample, or one "
                             "holding every sample's calls")
    info = {"source": "qnn-net-run session folders", "emulated": None,
            "folders": {p: [str(f.resolve()) for f in fs] for p, fs in spec.folders.items()},
            "native_inputs": spec.native_inputs}
    info.update(backend_info or {})
    model_attrs = {"parts": {p: model_facts(m, p) for p, m in models.items()}, "config": cfg,
                   "config_source": cfg_src}
    records: list[tuple[int, str, int]] = []
    mapping: list[dict[str, Any]] = []
    n_tensors = 0
    with DumpWriter(dump_path, backend=BACKEND, backend_info=info, model=model_attrs, overwrite=overwrite) as w:
        for s in range(n):
            plan: list[tuple[tuple[int, str, int], NetRunFolder, NetRunCall]] = []
            if "vision" in calls:
                plan.append(((s, "vision", 0), *calls["vision"][s]))
            plan.append(((s, "prefill", 0), *calls["prefill"][s]))
            plan += [((s, "decode", k), f, c) for k, (f, c) in enumerate(decode[s], start=1)]
            for key, f, c in plan:
                meta: dict[str, Any] = {"folder": str(f.folder)}
                if key[1] == "decode":
                    cl = decode_cache_len(c)
                    if cl is not None:
                        meta["cache_len"] = cl
                rows, k = _record_rows(w, c, key, meta)
                mapping += rows
                n_tensors += k
                records.append(key)
        unmatched = [u for fs in read.values() for f in fs for u in f.unmatched]
        w.set_meta("ingest_unmatched", unmatched)
        path = w.path
    return NetRunCapture(Path(path), records, n_tensors, True, [], 0, mapping, unmatched, models, cfg_src,
                         any(is_llm(fs[0].graph) for fs in read.values()),
                         {p: fs[0].not_fed for p, fs in read.items() if fs[0].not_fed})


def capture_net_run_model(
    output_dir: str | os.PathLike,
    dump_path: str | os.PathLike,
    model: str | os.PathLike,
    *,
    part: str = "model",
    as_steps: bool = False,
    first_step: int = 1,
    input_list: str | os.PathLike | None = None,
    native_inputs: bool = False,
    allow_outside_inputs: bool = False,
    dims: Mapping[str, int] | None = None,
    config: str | os.PathLike | None = None,
    missing_inputs: Sequence[str] = (),
    overwrite: bool = False,
    backend_info: Mapping[str, Any] | None = None,
) -> NetRunCapture:
    """Ingest one qnn-net-run run folder described by the ONNX graph it ran (no QNN JSON).

    ``Result_<i>`` (with line ``i`` of ``input_list.txt`` as its inputs, when the folder has one) becomes
    record ``(i, part, 0)``, or ``(0, part, first_step + i)`` with ``as_steps`` (decode calls; ``first_step``
    >= 1). See :func:`~ivq_debug.capture.qnn_net_run.folders.read_net_run_folder` for what is read and checked.

    Raises:
        UsageError: the dump exists, an unknown part, a decode record at step 0.
        InputError: any problem in the folder (one line naming the file); nothing is written.
    """
    check_writable(dump_path, overwrite)
    if part not in PARTS:
        raise UsageError(f"unknown part {part!r} (use {', '.join(PARTS)})")
    if as_steps and first_step < 1:
        raise UsageError(f"first_step {first_step}: decode steps start at 1 (step 0 is the prefill)")
    check_step(part, first_step if as_steps else 0)
    cfg, cfg_src = load_config(config, Path(model).parent)
    folder = read_net_run_folder(output_dir, model, input_list=input_list, native_inputs=native_inputs,
                                 allow_outside_inputs=allow_outside_inputs, dims=dims, missing_inputs=missing_inputs,
                                 config=cfg)
    info = {"source": "qnn-net-run output folder", "output_dir": str(folder.output_dir.resolve()),
            "input_list": str(folder.input_list.resolve()) if folder.input_list else None, "emulated": None,
            "native_inputs": native_inputs}
    info.update(backend_info or {})
    attrs = model_facts(model, part) | {"config": cfg, "config_source": cfg_src}
    records, mapping, n = [], [], 0
    with DumpWriter(dump_path, backend=BACKEND, backend_info=info, model=attrs, overwrite=overwrite) as w:
        for c in folder.calls:
            key = (0, part, first_step + c.index) if as_steps else (c.index, part, 0)
            rows, k = _record_rows(w, c, key, {})
            mapping += rows
            n += k
            records.append(key)
        w.set_meta("ingest_unmatched", folder.unmatched)
        path = w.path
    return NetRunCapture(Path(path), records, n, True, [], 0, mapping, folder.unmatched, {part: Path(model)}, cfg_src,
                         is_llm(folder.graph), {part: folder.not_fed} if folder.not_fed else {})
