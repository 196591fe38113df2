"""qnn-net-run files: inputs and ``input_list.txt`` written for the tool, ``Result_<i>`` output folders read back.

Writing inputs and reading output folders work anywhere (no SDK needed). Output folders
(``docs/qnn-formats.md``): ``<output_dir>/Result_<i>/<qnn_name>.raw`` (float32; quantized tensors dequantized on
the host) and / or ``<qnn_name>_native.raw`` (the graph's native dtype), one ``Result_<i>`` per
``input_list.txt`` line, with an extra ``<graph>/`` level when the run holds several graphs. Raw files carry no
shape: dims and encodings come from the graph JSON (:mod:`ivq_debug.qnn.netjson`, :func:`ingest_output`), or,
without one, names, dtypes and shapes come from the ONNX graph the device ran, dynamic axes resolved from the
byte sizes, and ``input_list.txt`` with its ``inputs/`` is read too (:func:`read_net_run_folder`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError, UsageError
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.onnxgraph.sites import list_sites
from ivq_debug.qnn.names import NameMap, qnn_sanitize
from ivq_debug.qnn.netjson import QnnGraph, QnnTensor, is_fixed_point, read_qnn_json
from ivq_debug.util import file_in_folder_problem, is_inside, read_input_text

_RESULT_RE = re.compile(r"^Result_(\d+)$")


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
            _atomic_bytes(path, np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes())
            row[name] = path
        files.append(row)
        lines.append(" ".join(f"{n}:={row[n]}" for n in names))
    _atomic_bytes(lst, ("\n".join(lines) + "\n").encode())
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


def _atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ============================================================================ ingest
@dataclass(frozen=True)
class IngestProblem:
    """Something wrong or notable in an output folder.

    ``kind``: ``missing_file``, ``byte_size``, ``unknown_tensor``, ``no_encoding``, ``unreadable`` (fatal: data
    is lost) or ``unmapped``, ``ambiguous``, ``duplicate``, ``mismatch`` (notes: the data is kept).
    """

    kind: str
    path: str
    message: str
    fatal: bool = True

    def one_line(self) -> str:
        """``<path>: <message>``"""
        return f"{self.path}: {self.message}"

    def error(self) -> InputError:
        """The problem as an :class:`InputError` naming the file."""
        return InputError(self.message, path=self.path)


@dataclass
class TensorData:
    """Loaded values of one ingested tensor (source layout)."""

    values: np.ndarray
    raw: np.ndarray | None
    max_mismatch: float | None = None


@dataclass
class IngestedTensor:
    """One tensor of one ``Result_<i>`` (files found and checked; data read by :meth:`read`)."""

    graph: str
    result: int
    tensor: QnnTensor
    key: str
    onnx_name: str | None
    float_file: Path | None
    native_file: Path | None
    order: int
    op_type: str | None = None
    scope: str | None = None

    @property
    def qnn_name(self) -> str:
        """The QNN tensor name."""
        return self.tensor.name

    @property
    def layout(self) -> str | None:
        """Source layout name when the graph JSON gives it."""
        return self.tensor.src_layout

    def encoding(self) -> dict[str, Any] | None:
        """The encoding in the dump's (ONNX) convention, axis in the source layout; ``None`` if not quantized."""
        t = self.tensor
        q = t.quant
        if not t.is_quantized or q is None or q.per_channel_missing:
            return None
        dt = t.dtype
        axis = q.axis
        if axis is not None and t.permute_order_to_src:
            axis = list(t.permute_order_to_src).index(axis)
        one = q.scale.size == 1 and axis is None
        scale = [float(np.float32(s)) for s in q.scale]
        zp = [int(z) for z in q.zero_point]
        return {
            "bitwidth": t.bitwidth,
            "dtype": dt.name,
            "scale": scale[0] if one else scale,
            "zero_point": zp[0] if one else zp,
            "axis": axis,
            "qmin": int(np.iinfo(dt).min),
            "qmax": int(np.iinfo(dt).max),
            "qnn_offset": [int(o) for o in q.offset] if not one else int(q.offset[0]),
            "qnn_data_type": t.data_type_name,
        }

    def read(self) -> TensorData:
        """Read the files: float values from ``.raw`` (else dequantized from ``_native.raw``), raw integers
        from ``_native.raw``, both reshaped to the QNN dims and permuted back to the source layout.
        """
        t = self.tensor
        raw_q = None
        if self.native_file is not None:
            raw_q = np.fromfile(self.native_file, dtype=t.dtype.newbyteorder("<")).astype(t.dtype)
        if self.float_file is not None:
            vals = np.fromfile(self.float_file, dtype="<f4").astype(np.float32)
        elif raw_q is not None and t.is_quantized:
            assert t.quant is not None
            vals = t.quant.dequantize(raw_q.reshape(t.dims)).reshape(-1)
        elif raw_q is not None:
            vals, raw_q = raw_q, None  # a non-quantized native tensor: the native values are the values
        else:  # pragma: no cover - never built without a file
            raise InputError("no data file", self.key)
        mismatch = None
        if raw_q is not None and self.float_file is not None and t.is_quantized and t.quant is not None \
                and not t.quant.per_channel_missing:
            deq = t.quant.dequantize(raw_q.reshape(t.dims)).reshape(-1)
            mismatch = float(np.max(np.abs(deq.astype(np.float64) - vals), initial=0.0))
        values = t.to_source(vals)
        raw = t.to_source(raw_q) if (raw_q is not None and t.is_quantized) else None
        return TensorData(values, raw, mismatch)


@dataclass
class Ingest:
    """An inventory of a qnn-net-run output folder (files checked, data not yet read)."""

    output_dir: Path
    graphs: dict[str, QnnGraph]
    results: dict[str, list[int]]
    tensors: list[IngestedTensor] = field(default_factory=list)
    problems: list[IngestProblem] = field(default_factory=list)
    profiling_logs: list[Path] = field(default_factory=list)
    mapped: bool = False

    @property
    def complete(self) -> bool:
        """True when no fatal problem was found (every expected file present and readable)."""
        return not any(p.fatal for p in self.problems)

    @property
    def fatal(self) -> list[IngestProblem]:
        """Problems that lose data."""
        return [p for p in self.problems if p.fatal]

    def records(self) -> Iterator[tuple[str, int, list[IngestedTensor]]]:
        """``(graph, result, tensors in execution order)`` for every Result folder."""
        for g, idxs in self.results.items():
            for i in idxs:
                ts = [t for t in self.tensors if t.graph == g and t.result == i]
                yield g, i, sorted(ts, key=lambda t: (t.order, t.key))

    def values(self, graph: str | None = None, result: int = 0) -> dict[str, np.ndarray]:
        """Float values of one Result folder, keyed as the dump would key them."""
        g = graph or next(iter(self.results))
        return {t.key: t.read().values for t in self.tensors if t.graph == g and t.result == result}


def _graphs_arg(graphs: Any) -> dict[str, QnnGraph]:
    if isinstance(graphs, QnnGraph):
        return {graphs.name: graphs}
    if isinstance(graphs, Mapping):
        out = {}
        for k, g in graphs.items():
            g = g if isinstance(g, QnnGraph) else read_qnn_json(g)[0]
            out[str(k)] = g
        return out
    if isinstance(graphs, (str, os.PathLike)):
        return {g.name: g for g in read_qnn_json(graphs)}
    out = {}
    for g in graphs:
        for gg in ([g] if isinstance(g, QnnGraph) else read_qnn_json(g)):
            out[gg.name] = gg
    return out


def _result_dirs(d: Path) -> list[tuple[int, Path]]:
    out = []
    for c in d.iterdir():
        m = _RESULT_RE.match(c.name)
        if m and c.is_dir():
            out.append((int(m.group(1)), c))
    return sorted(out)


#: more missing ``Result_<i>`` folders than this is a stray folder name, not lost runs (an index is a number
#: from a file name: ``Result_99999999999999999999999`` must not size a loop)
MAX_RESULT_GAPS = 10_000


def _result_gaps(rds: list[tuple[int, Path]]) -> list[int]:
    """The indices missing from sorted ``(index, folder)`` pairs, counted from the folders present before any
    is listed; more than :data:`MAX_RESULT_GAPS` is an :class:`InputError` naming the highest folder."""
    missing = rds[-1][0] + 1 - len(rds)
    if missing > MAX_RESULT_GAPS:
        raise InputError(f"Result folders are numbered up to Result_{rds[-1][0]} but only {len(rds)} exist "
                         f"({missing} missing: a stray folder?)", rds[-1][1])
    gaps: list[int] = []
    prev = -1
    for i, _ in rds:
        gaps.extend(range(prev + 1, i))
        prev = i
    return gaps


def _layout(output_dir: Path, graphs: dict[str, QnnGraph]) -> dict[str, list[tuple[int, Path]]]:
    """graph name → its Result folders (handles the ``<graph>/Result_<i>`` level)."""
    if _RESULT_RE.match(output_dir.name):
        if len(graphs) != 1:
            raise InputError(f"a single Result folder was given but {len(graphs)} graphs", output_dir)
        return {next(iter(graphs)): [(int(output_dir.name.split("_")[1]), output_dir)]}
    direct = _result_dirs(output_dir)
    if direct:
        if len(graphs) != 1:
            raise InputError(
                f"Result folders without a <graph>/ level, but {len(graphs)} graphs were given "
                f"({', '.join(graphs)})", output_dir)
        return {next(iter(graphs)): direct}
    out: dict[str, list[tuple[int, Path]]] = {}
    unmatched = []
    for sub in sorted(p for p in output_dir.iterdir() if p.is_dir()):
        rd = _result_dirs(sub)
        if not rd:
            continue
        g = _match_graph(sub.name, graphs)
        if g is None:
            unmatched.append(sub.name)
        else:
            out[g] = rd
    if unmatched:
        raise InputError(f"graph folder(s) {unmatched} match none of the graphs {sorted(graphs)}", output_dir)
    if not out:
        raise InputError("no Result_<i> folders (is this a qnn-net-run --output_dir?)", output_dir)
    return {g: out[g] for g in graphs if g in out}  # the caller's graph order


def _match_graph(dirname: str, graphs: dict[str, QnnGraph]) -> str | None:
    if dirname in graphs:
        return dirname
    for name in graphs:
        if qnn_sanitize(name) == dirname or qnn_sanitize(name) == qnn_sanitize(dirname):
            return name
    m = re.match(r"^Graph_(\d+)$", dirname)
    if m and int(m.group(1)) < len(graphs):
        return list(graphs)[int(m.group(1))]
    return None


def _key_info(model: Any) -> tuple[NameMap | None, dict[str, Any], dict[str, tuple[int, str]]]:
    if model is None:
        return None, {}, {}
    if isinstance(model, NameMap):
        return model, {}, {}

    m = load_model(model)
    nm = NameMap.from_onnx(m)
    try:
        sites = {s.output: s for s in list_sites(m, "auto")}
    except Exception:
        sites = {}
    producers = {}
    for i, n in enumerate(m.graph.node):
        for o in n.output:
            producers[o] = (i, n.op_type)
    return nm, sites, producers


def ingest_output(
    output_dir: str | os.PathLike,
    graphs: Any,
    model: Any = None,
    strict: bool = True,
    expect_outputs: bool = True,
    allow_outside: bool = False,
) -> Ingest:
    """Inventory and check a qnn-net-run output folder.

    Args:
        output_dir: the ``--output_dir`` (or one ``Result_<i>`` folder).
        graphs: a :class:`QnnGraph`, a graph JSON path, a list of either, or ``{folder name: graph}``.
        model: the ONNX model (path, proto) or a :class:`NameMap`: maps QNN names back to ONNX names and
            keys QDQ tensors as the other captures do (a ``QuantizeLinear`` output under its float name).
            Without it tensors keep their QNN names.
        strict: raise the first fatal problem as a one-line :class:`InputError` naming the file;
            otherwise collect problems (``Ingest.complete`` is then false).
        expect_outputs: every graph output (APP_READ) must be in every Result folder.
        allow_outside: read ``.raw`` files and ``Result_<i>`` folders that are symlinks leaving ``output_dir``
            (refused by default, an ``unreadable`` problem like a symlink loop or a FIFO).

    Raises:
        InputError: unreadable folder / graph JSON; with ``strict``, any fatal problem.
    """
    out = Path(output_dir)
    if not out.exists():
        raise InputError("no such output folder", out)
    if not out.is_dir():
        raise InputError("not a folder (expected a qnn-net-run --output_dir)", out)
    gmap = _graphs_arg(graphs)
    layout = _layout(out, gmap)
    nm, sites, producers = _key_info(model)
    ing = Ingest(out, gmap, {g: [i for i, _ in rds] for g, rds in layout.items()}, mapped=nm is not None)
    ing.profiling_logs = sorted(out.glob("qnn-profiling-data*.log"))
    for gname, rds in layout.items():
        g = gmap[gname]
        index: dict[str, QnnTensor] = {}
        for t in g:
            index.setdefault(t.name, t)
        for t in g:
            index.setdefault(qnn_sanitize(t.name), t)
        order = g.order()
        prod = g.producers()
        per_result: dict[int, dict[str, dict[str, Path]]] = {}
        for j in _result_gaps(rds) if rds[0][1] != out else ():
            ing.problems.append(IngestProblem(  # one Result_<i> per input_list line: a gap is lost data
                "missing_file", str(rds[0][1].parent / f"Result_{j}"), f"missing folder Result_{j} (graph {gname!r})"))
        refused = set()
        for ri, rdir in rds:
            found: dict[str, dict[str, Path]] = {}
            per_result[ri] = found
            if not allow_outside and not is_inside(rdir, out):
                refused.add(ri)
                ing.problems.append(IngestProblem("unreadable", str(rdir), "Result folder is a symlink to a folder "
                                                  "outside the output folder (--allow-outside-inputs reads it)"))
                continue
            for f in sorted(rdir.rglob("*.raw")):
                bad = file_in_folder_problem(f, out, "raw file", allow_outside)
                if bad:
                    ing.problems.append(IngestProblem("unreadable", str(f), bad))
                    continue
                stem = f.relative_to(rdir).with_suffix("").as_posix()
                hit = _classify(stem, index)
                if hit is None:
                    ing.problems.append(IngestProblem(
                        "unknown_tensor", str(f), f"tensor {stem!r} is not in graph {gname!r} ({g.source})"))
                    continue
                t, kind = hit
                slot = found.setdefault(t.name, {})
                if kind in slot:
                    ing.problems.append(IngestProblem(
                        "duplicate", str(f), f"second {kind} file for tensor {t.name!r} (kept {slot[kind].name})",
                        fatal=False))
                    continue
                slot[kind] = f
        seen_any = set().union(*(set(v) for v in per_result.values())) if per_result else set()
        expected = set(seen_any)
        if expect_outputs:
            expected |= {t.name for t in g.outputs}
        for ri, rdir in rds:
            found = per_result[ri]
            if ri in refused:
                continue
            for name in sorted(expected - set(found), key=lambda n: order.get(n, 1 << 30)):
                others = [f"Result_{j}" for j, _ in rds if name in per_result[j]]
                why = f"present in {others[0]}" if others else "a graph output"
                ing.problems.append(IngestProblem(
                    "missing_file", str(rdir / f"{qnn_sanitize(name)}.raw"),
                    f"missing raw file for tensor {name!r} ({why})"))
            keys_seen: dict[str, IngestedTensor] = {}
            for name, files in found.items():
                t = gmap[gname].tensors[name]
                it = _make_tensor(t, gname, ri, files, order, prod, nm, sites, producers, ing)
                if it is None:
                    continue
                prev = keys_seen.get(it.key)
                if prev is not None:
                    keep, drop = (it, prev) if (it.tensor.is_quantized and not prev.tensor.is_quantized) else (prev, it)
                    ing.problems.append(IngestProblem(
                        "duplicate", str(drop.float_file or drop.native_file),
                        f"{drop.qnn_name!r} and {keep.qnn_name!r} both map to {it.key!r}; kept {keep.qnn_name!r}",
                        fatal=False))
                    if keep is it:
                        ing.tensors.remove(prev)
                        ing.tensors.append(it)
                        keys_seen[it.key] = it
                    continue
                keys_seen[it.key] = it
                ing.tensors.append(it)
    seen_notes: set[tuple[str, str]] = set()
    kept = []
    for pr in ing.problems:  # a note repeated in every Result folder is listed once
        k = (pr.kind, pr.message)
        if not pr.fatal and k in seen_notes:
            continue
        seen_notes.add(k)
        kept.append(pr)
    ing.problems = kept
    if strict and not ing.complete:
        raise ing.fatal[0].error()
    return ing


def _classify(stem: str, index: dict[str, QnnTensor]) -> tuple[QnnTensor, str] | None:
    for cand in dict.fromkeys((stem, qnn_sanitize(stem), qnn_sanitize("/" + stem))):
        if cand in index:
            return index[cand], "float"
        if cand.endswith("_native") and cand[: -len("_native")] in index:
            return index[cand[: -len("_native")]], "native"
    return None


def _make_tensor(
    t: QnnTensor,
    gname: str,
    ri: int,
    files: dict[str, Path],
    order: dict[str, int],
    prod: dict[str, Any],
    nm: NameMap | None,
    sites: dict[str, Any],
    producers: dict[str, tuple[int, str]],
    ing: Ingest,
) -> IngestedTensor | None:
    ok = True
    ff, nf = files.get("float"), files.get("native")
    if t.dtype.name == "object":  # STRING tensors have no fixed-size elements
        ing.problems.append(IngestProblem("unreadable", str(ff or nf), f"tensor {t.name!r} is a QNN STRING tensor: "
                                          "its raw file cannot be read as numbers"))
        return None
    for kind, f in (("float", ff), ("native", nf)):
        if f is None:
            continue
        itemsize = 4 if kind == "float" else t.dtype.itemsize
        want = t.size * itemsize
        got = f.stat().st_size
        if got != want:
            dt = "float32" if kind == "float" else t.dtype.name
            ing.problems.append(IngestProblem(
                "byte_size", str(f),
                f"wrong byte size {got}, expected {want} ({list(t.dims)} x {dt}) for tensor {t.name!r}"))
            ok = False
    if ff is None and nf is not None and is_fixed_point(t.data_type) and (
            t.quant is None or t.quant.per_channel_missing or t.quant.scale.size == 0):
        why = "no per-channel parameters" if (t.quant is not None and t.quant.per_channel) else "no encoding"
        ing.problems.append(IngestProblem(
            "no_encoding", str(nf), f"cannot dequantize {t.name!r}: the graph JSON has {why} for it"))
        ok = False
    if not ok:
        return None
    key, onnx_name, op_type, scope = t.name, None, None, None
    pos = order.get(t.name, 1 << 20)
    node = prod.get(t.name)
    op_type = node.type if node is not None else ("GraphInput" if t.type == "APP_WRITE" else None)
    if nm is not None:
        m = nm.resolve(t.name, kinds=("tensor",))
        if m.onnx_name is not None:
            onnx_name = m.onnx_name
            site = sites.get(onnx_name)
            if site is not None:
                key, pos, op_type, scope = site.name, site.order, site.op_type, site.scope
            else:
                key = onnx_name
                if onnx_name in producers:
                    pos, op_type = producers[onnx_name]
        else:
            where = str(ff or nf)
            if m.ambiguous:
                ing.problems.append(IngestProblem(
                    "ambiguous", where, f"QNN name {t.name!r} matches several ONNX tensors {list(m.candidates)}; "
                    "kept under its QNN name", fatal=False))
            else:
                ing.problems.append(IngestProblem(
                    "unmapped", where, f"QNN tensor {t.name!r} has no ONNX counterpart; kept under its QNN name",
                    fatal=False))
    return IngestedTensor(gname, ri, t, key, onnx_name, ff, nf, pos, op_type, scope)


# ============================================================================ ONNX-described folders
# What a device run leaves without a QNN converter's JSON: ``input_list.txt``, ``inputs/``, ``output/Result_<i>``,
# described by the ONNX graph the device ran (names, dtypes and shapes; dynamic axes resolved from byte sizes).
_NATIVE = "_native"
_HEADER = "#"
_SKIP = "%"


@dataclass(frozen=True)
class InputToken:
    """One token of an ``input_list.txt`` line: ``name:=path`` (``name`` set) or a bare path."""

    name: str | None
    path: str


@dataclass(frozen=True)
class InputLine:
    """One inference of an ``input_list.txt``: its 1-based line number and its tokens."""

    line: int
    tokens: tuple[InputToken, ...]


def parse_input_list(path: str | os.PathLike) -> list[InputLine]:
    """The inferences of a qnn-net-run ``input_list.txt``, with qnn-net-run's rules (SDK ``readInputList``).

    Empty lines are skipped; a first line starting with ``#`` is a header (SNPE-style output names) and
    skipped; lines starting with ``%`` are skipped anywhere. Every other line is one inference: tokens
    separated by spaces, each ``name:=path`` or a bare path (a line uses one form: names map tokens to
    graph inputs, bare paths go in graph-input order).

    Raises:
        InputError: the file is missing or not text, holds no inference, a ``#`` line after the first line
            (qnn-net-run would read it as an inference), a token without a name or path, or a line mixing
            both token forms; the message names the file and the line.
    """
    p = Path(path)
    text = read_input_text(p, "input list")  # a regular file of UTF-8 text without NUL bytes
    out: list[InputLine] = []
    first = True
    for no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith(_HEADER):
            if first:
                first = False
                continue
            raise InputError(f"line {no}: a '#' line after the first line (qnn-net-run skips only a first-line "
                             "header and would read this as an inference)", p)
        first = False
        if line.startswith(_SKIP):
            continue
        tokens = []
        for tok in line.split():
            if ":=" in tok:
                name, _, tp = tok.partition(":=")
                if not name or not tp:
                    raise InputError(f"line {no}: token {tok!r} needs a tensor name and a path (name:=path)", p)
                tokens.append(InputToken(name, tp))
            else:
                tokens.append(InputToken(None, tok))
        if len({t.name is None for t in tokens}) > 1:
            raise InputError(f"line {no}: mixes name:=path tokens and bare paths", p)
        out.append(InputLine(no, tuple(tokens)))
    if not out:
        raise InputError("input list holds no inference line", p)
    return out


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
class _SizedFile:
    path: Path
    tensor: GraphTensor
    itemsize: int
    nbytes: int
    file_dtype: str


def resolve_dims(files: Sequence[_SizedFile], known: Mapping[str, int] | None = None,
                 optional: Sequence[_SizedFile] = ()) -> tuple[dict[Path, tuple[int, ...]], dict[str, int], list[Path]]:
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

    def attempt(f: _SizedFile, strict: bool) -> bool | None:
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


def cast_values(values: np.ndarray, dtype: np.dtype, path: Path, name: str) -> np.ndarray:
    """Float file values cast to a graph dtype; integer / bool types must receive whole numbers in range.

    qnn-net-run reads and writes float32 unless told otherwise, so an int64 ``attention_mask`` arrives as
    float32 values. A float file holding non-integers for an integer input is a native file read as float
    (``--native-inputs``) or corrupt: an :class:`InputError` naming the file.
    """
    if values.dtype == dtype:
        return values
    if dtype.kind in "iub" and values.dtype.kind == "f":
        v = values.astype(np.float64)
        bad = ~np.isfinite(v) | (v != np.round(v))
        if bad.any():
            first = float(v.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]])
            raise InputError(f"tensor {name!r} is {dtype.name} in the graph but the float32 file holds a "
                             f"non-integer value ({first!r}); is it in the graph's own dtype (--native-inputs)?",
                             path)
        lo, hi = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        if v.size and (v.min() < lo or v.max() > hi):
            raise InputError(f"tensor {name!r}: values [{v.min():g}, {v.max():g}] do not fit {dtype.name}", path)
        return v.astype(dtype)
    return values.astype(dtype)


@dataclass(frozen=True)
class PlannedTensor:
    """One raw file of one inference: checked, shaped, not yet read (:meth:`load`)."""

    name: str  # the ONNX name
    qnn_name: str  # the name the folder uses (input-list token name or file stem)
    path: Path
    file_dtype: np.dtype
    shape: tuple[int, ...]
    tensor: GraphTensor

    def load(self) -> np.ndarray:
        """The values, cast to the graph's dtype."""
        a = np.fromfile(self.path, dtype=self.file_dtype.newbyteorder("<")).astype(self.file_dtype)
        return cast_values(a.reshape(self.shape), self.tensor.dtype, self.path, self.name)


@dataclass
class NetRunCall:
    """One inference of a folder: an ``input_list.txt`` line and its ``Result_<index>``."""

    index: int
    line: int | None
    result_dir: Path | None
    inputs: list[PlannedTensor]
    outputs: list[PlannedTensor]
    dims: dict[str, int]

    def input(self, name: str) -> PlannedTensor | None:
        """The planned input of that ONNX name."""
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> PlannedTensor | None:
        """The planned output of that ONNX name."""
        return next((t for t in self.outputs if t.name == name), None)


@dataclass
class NetRunFolder:
    """A qnn-net-run run folder described by an ONNX graph: every inference's files, checked and shaped."""

    folder: Path
    output_dir: Path
    input_list: Path | None
    graph: GraphIO
    calls: list[NetRunCall]
    unmatched: list[dict[str, str]] = field(default_factory=list)

    def mapping(self) -> list[dict[str, Any]]:
        """Every file with the ONNX tensor it was read as (JSON-ready)."""
        rows = []
        for c in self.calls:
            for kind, ts in (("input", c.inputs), ("tensor", c.outputs)):
                rows += [{"result": c.index, "line": c.line, "kind": kind, "name": t.name, "qnn_name": t.qnn_name,
                          "file": str(t.path), "shape": list(t.shape), "file_dtype": t.file_dtype.name}
                         for t in ts]
        return rows


def locate_run(folder: str | os.PathLike, input_list: str | os.PathLike | None = None) -> tuple[Path, Path, Path | None]:
    """``(run folder, output dir, input list)`` of a qnn-net-run run.

    ``folder`` is the run folder (``input_list.txt`` + ``output/Result_<i>``) or the ``--output_dir`` itself
    (its ``input_list.txt``, else its parent's). Without an input list the third item is None.
    """
    f = Path(folder)
    if not f.exists():
        raise InputError("no such folder", f)
    if not f.is_dir():
        raise InputError("not a folder (expected a qnn-net-run run folder or --output_dir)", f)
    out = f / "output" if (f / "output").is_dir() and _result_dirs(f / "output") else f
    if not _result_dirs(out):
        nested = [p.name for p in sorted(f.iterdir()) if p.is_dir() and _result_dirs(p)]
        hint = f" (graph folders {nested}: name one)" if nested else ""
        raise InputError(f"no Result_<i> folders (is this a qnn-net-run run folder or --output_dir?){hint}", f)
    if input_list is not None:
        lst: Path | None = Path(input_list)
    else:
        cands = [f / "input_list.txt"] + ([f.parent / "input_list.txt"] if out == f else [])
        lst = next((c for c in cands if os.path.lexists(c)), None)  # a FIFO or loop there is refused, not skipped
    return (lst.parent if lst is not None else f), out, lst


def _rebase(token: str, base: Path) -> Path | None:
    """An absolute device path (``/data/local/tmp/run/inputs/0/x.raw``) re-rooted at the session folder: the
    longest tail of it that exists under ``base``."""
    parts = Path(token).parts[1:]
    for i in range(len(parts)):
        cand = base.joinpath(*parts[i:])
        if cand.is_file():
            return cand
    return None


def _input_path(tok: InputToken, base: Path, lst: Path, line: int, allow_outside: bool) -> Path:
    p = Path(tok.path)
    if not p.is_absolute():
        cand: Path | None = base / p
    elif p.exists():
        cand = p
    else:
        cand = _rebase(tok.path, base) or p
    assert cand is not None
    try:
        inside = cand.resolve().is_relative_to(base.resolve())
    except OSError:  # pragma: no cover - unresolvable path
        inside = False
    if not inside and not allow_outside:
        raise InputError(f"line {line}: input path {tok.path!r} leaves the session folder {base} "
                         "(pass --allow-outside-inputs to read it)", lst)
    if not cand.is_file():
        what = f"tensor {tok.name!r}, " if tok.name else ""
        raise InputError(f"missing raw input file ({what}{lst.name} line {line})", cand)
    return cand


def _map_line(ln: InputLine, graph: GraphIO, names: NameMap, lst: Path) -> list[tuple[GraphTensor, InputToken]]:
    want = graph.inputs
    if len(ln.tokens) != len(want):
        raise InputError(f"line {ln.line}: {len(ln.tokens)} token(s) for the {len(want)} input(s) of "
                         f"{graph.name} ({', '.join(t.name for t in want)})", lst)
    if ln.tokens[0].name is None:
        return list(zip(want, ln.tokens, strict=True))
    by_name = {t.name: t for t in want}
    out: dict[str, tuple[GraphTensor, InputToken]] = {}
    for tok in ln.tokens:
        assert tok.name is not None
        m = names.resolve(tok.name, kinds=("tensor",))
        if m.onnx_name is None:
            why = f"matches several inputs {list(m.candidates)}" if m.ambiguous else \
                f"is not an input of {graph.name} ({', '.join(by_name)})"
            raise InputError(f"line {ln.line}: tensor {tok.name!r} {why}", lst)
        if m.onnx_name in out:
            raise InputError(f"line {ln.line}: two tokens for input {m.onnx_name!r}", lst)
        out[m.onnx_name] = (by_name[m.onnx_name], tok)
    return [out[t.name] for t in want]


def _result_files(rdir: Path, names: NameMap, graph: GraphIO, out: Path, allow_outside: bool = False
                  ) -> tuple[dict[str, dict[str, tuple[Path, str]]], list[dict[str, str]]]:
    """ONNX name -> {"float"|"native": (file, stem)} of a Result folder, and the files no tensor claims.

    Raises:
        InputError: a ``.raw`` entry that may not be read (:func:`~ivq_debug.util.file_in_folder_problem`: a
            symlink loop, a FIFO or folder, a symlink leaving ``out`` unless ``allow_outside``).
    """
    found: dict[str, dict[str, tuple[Path, str]]] = {}
    unmatched = []
    for f in sorted(rdir.rglob("*.raw")):
        bad = file_in_folder_problem(f, out, "raw file", allow_outside)
        if bad:
            raise InputError(bad, f)
        stem = f.relative_to(rdir).with_suffix("").as_posix()
        hit = None
        forms = [(stem, "float")] + ([(stem[: -len(_NATIVE)], "native")] if stem.endswith(_NATIVE) else [])
        for cand, kind in forms:
            for form in dict.fromkeys((cand, qnn_sanitize(cand))):
                m = names.resolve(form, kinds=("tensor",))
                if m.onnx_name is not None:
                    hit = (m.onnx_name, kind)
                    break
                if m.ambiguous:
                    unmatched.append({"file": str(f), "reason": f"matches several tensors {list(m.candidates)}"})
                    hit = ("", "")
                    break
            if hit:
                break
        if hit is None:
            unmatched.append({"file": str(f), "reason": f"no tensor of {graph.name} is named {stem!r}"})
        elif hit[0]:
            slot = found.setdefault(hit[0], {})
            if hit[1] in slot:
                unmatched.append({"file": str(f), "reason": f"second {hit[1]} file for {hit[0]!r} "
                                                            f"(kept {slot[hit[1]][0].name})"})
            else:
                slot[hit[1]] = (f, stem[: -len(_NATIVE)] if hit[1] == "native" else stem)
    return found, unmatched


def read_net_run_folder(
    folder: str | os.PathLike,
    model: Any,
    *,
    input_list: str | os.PathLike | None = None,
    native_inputs: bool = False,
    allow_outside_inputs: bool = False,
    dims: Mapping[str, int] | None = None,
    require_inputs: bool = False,
    graph: GraphIO | None = None,
) -> NetRunFolder:
    """Inventory a qnn-net-run run folder with names, dtypes and shapes from the ONNX graph it ran.

    Inputs: the ``input_list.txt`` (:func:`parse_input_list`) line ``i`` is ``Result_<i>``; token names are
    mapped back from their sanitized form to the graph inputs; relative paths resolve against the input
    list's folder, absolute ones as given or, when they do not exist here (a device path), re-rooted at the
    folder; a path that leaves the folder is refused unless ``allow_outside_inputs``. Input files are
    float32 (qnn-net-run's default) or, with ``native_inputs``, in the graph's dtypes.
    Outputs: ``Result_<i>/<name>.raw`` (float32) or ``<name>_native.raw`` (the graph's dtype) of every graph
    output (required) and of typed intermediates (``--debug`` runs; optional); files no tensor claims are
    listed in ``unmatched``. Dynamic axes are resolved per inference from the byte sizes (:func:`resolve_dims`,
    ``dims`` pins names).

    Raises:
        InputError: one line naming the file: no Result folders, a missing Result index or raw file, a bad
            input-list line, a path outside the folder, a size the graph does not allow.
    """
    run, out, lst = locate_run(folder, input_list)
    graph = graph or GraphIO.from_model(model)
    results = _result_dirs(out)
    idx = [i for i, _ in results]
    if idx != list(range(len(idx))):
        gap = next(i for i in range(len(idx) + 1) if i not in idx)
        raise InputError(f"Result folders are not numbered 0..{len(idx) - 1}: Result_{gap} is missing", out)
    lines: list[InputLine] | None = None
    if lst is not None:
        lines = parse_input_list(lst)
        if len(lines) != len(results):
            raise InputError(f"{len(lines)} inference line(s) but {len(results)} Result folder(s) in {out}", lst)
    elif require_inputs:
        raise InputError("no input_list.txt here (the device's inputs are needed)", run)
    in_names, out_names = graph.input_names(), graph.output_names()
    nf = NetRunFolder(run, out, lst, graph, [])
    in_dtype = (lambda t: t.dtype) if native_inputs else (lambda t: np.dtype(np.float32))
    for i, rdir in results:
        if not allow_outside_inputs and not is_inside(rdir, out):
            raise InputError(f"Result folder is a symlink leaving {str(out)!r} (--allow-outside-inputs reads it)", rdir)
        sized: list[_SizedFile] = []
        planned_in: list[tuple[GraphTensor, str, Path, np.dtype]] = []
        if lines is not None:
            assert lst is not None
            ln = lines[i]
            for t, tok in _map_line(ln, graph, in_names, lst):
                p = _input_path(tok, run, lst, ln.line, allow_outside_inputs)
                dt = in_dtype(t)
                planned_in.append((t, tok.name or qnn_sanitize(t.name), p, dt))
                sized.append(_SizedFile(p, t, dt.itemsize, p.stat().st_size, dt.name))
        found, unmatched = _result_files(rdir, out_names, graph, out, allow_outside_inputs)
        nf.unmatched += unmatched
        planned_out: list[tuple[GraphTensor, str, Path, np.dtype]] = []
        optional: list[_SizedFile] = []
        for t in graph.outputs:
            files = found.get(t.name)
            if not files:
                raise InputError(f"missing raw file for graph output {t.name!r} (Result_{i})",
                                 rdir / f"{qnn_sanitize(t.name)}.raw")
            kind = "float" if "float" in files else "native"
            p, stem = files[kind]
            dt = np.dtype(np.float32) if kind == "float" else t.dtype
            planned_out.append((t, stem, p, dt))
            sized.append(_SizedFile(p, t, dt.itemsize, p.stat().st_size, dt.name))
        for name, files in found.items():
            if name in graph.values:
                t = graph.values[name]
                kind = "float" if "float" in files else "native"
                p, stem = files[kind]
                dt = np.dtype(np.float32) if kind == "float" else t.dtype
                planned_out.append((t, stem, p, dt))
                optional.append(_SizedFile(p, t, dt.itemsize, p.stat().st_size, dt.name))
            elif name not in {t.name for t in graph.outputs}:  # a graph input written back as an output file
                nf.unmatched.append({"file": str(files[next(iter(files))][0]), "reason": f"{name!r} is a graph input"})
        shapes, bind, unresolved = resolve_dims(sized, dims, optional)
        for p in unresolved:
            nf.unmatched.append({"file": str(p), "reason": "its shape cannot be told from the graph and its size"})
        ins = [PlannedTensor(t.name, q, p, dt, shapes[p], t) for t, q, p, dt in planned_in]
        outs = [PlannedTensor(t.name, q, p, dt, shapes[p], t) for t, q, p, dt in planned_out if p in shapes]
        outs.sort(key=lambda pt: (pt.tensor.kind == "output", pt.tensor.order))
        nf.calls.append(NetRunCall(i, lines[i].line if lines is not None else None, rdir, ins, outs, bind))
    return nf
