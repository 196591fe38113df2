"""``Result_<i>`` folders described by a QNN graph JSON, read back (:func:`ingest_output`).

Output folders (``docs/qnn-formats.md``): ``<output_dir>/Result_<i>/<qnn_name>.raw`` (float32; quantized tensors
dequantized on the host) and / or ``<qnn_name>_native.raw`` (the graph's native dtype), one ``Result_<i>`` per
``input_list.txt`` line, with an extra ``<graph>/`` level when the run holds several graphs. Raw files carry no
shape: dims and encodings come from the graph JSON (:mod:`ivq_debug.qnn.netjson`).
"""


from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError
from ivq_debug.inputfiles import file_in_folder_problem, is_inside
from ivq_debug.onnxgraph.load import load_model
from ivq_debug.onnxgraph.sites import list_sites
from ivq_debug.qnn.names import NameMap, qnn_sanitize
from ivq_debug.qnn.netjson import QnnGraph, QnnTensor, is_fixed_point, read_qnn_json

_RESULT_RE = re.compile(r"^Result_(\d+)$")


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


def result_dirs(d: Path) -> list[tuple[int, Path]]:
    """``(index, folder)`` of the ``Result_<index>`` folders of ``d``, by index."""
    out = []
    for c in d.iterdir():
        m = _RESULT_RE.match(c.name)
        if m and c.is_dir():
            out.append((int(m.group(1)), c))
    return sorted(out)


def _layout(output_dir: Path, graphs: dict[str, QnnGraph]) -> dict[str, list[tuple[int, Path]]]:
    """graph name → its Result folders (handles the ``<graph>/Result_<i>`` level)."""
    if _RESULT_RE.match(output_dir.name):
        if len(graphs) != 1:
            raise InputError(f"a single Result folder was given but {len(graphs)} graphs", output_dir)
        return {next(iter(graphs)): [(int(output_dir.name.split("_")[1]), output_dir)]}
    direct = result_dirs(output_dir)
    if direct:
        if len(graphs) != 1:
            raise InputError(
                f"Result folders without a <graph>/ level, but {len(graphs)} graphs were given "
                f"({', '.join(graphs)})", output_dir)
        return {next(iter(graphs)): direct}
    out: dict[str, list[tuple[int, Path]]] = {}
    unmatched = []
    for sub in sorted(p for p in output_dir.iterdir() if p.is_dir()):
        rd = result_dirs(sub)
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
        if rds[0][1] != out:  # one Result_<i> per input_list line: a gap is lost data
            for j in result_gaps(rds):
                ing.problems.append(IngestProblem("missing_file", str(rds[0][1].parent / f"Result_{j}"),
                                                  f"missing folder Result_{j} (graph {gname!r})"))
        per_result: dict[int, dict[str, dict[str, Path]]] = {}
        for ri, rdir in rds:
            if not allow_outside and not is_inside(rdir, out):
                ing.problems.append(IngestProblem("unreadable", str(rdir), "Result folder is a symlink to a folder "
                                                  "outside the output folder (--allow-outside-inputs reads it)"))
                continue
            per_result[ri] = _scan_result(rdir, out, index, g, gname, allow_outside, ing)
        expected = set().union(*(set(v) for v in per_result.values())) if per_result else set()
        if expect_outputs:
            expected |= {t.name for t in g.outputs}
        for ri, rdir in rds:
            if ri in per_result:
                _collect(ing, g, gname, ri, rdir, per_result, expected, (nm, sites, producers))
    ing.problems = _dedupe_notes(ing.problems)
    if strict and not ing.complete:
        raise ing.fatal[0].error()
    return ing


#: more missing ``Result_<i>`` folders than this is a stray folder name, not lost runs (an index is a number
#: from a file name: ``Result_99999999999999999999999`` must not size a loop)
MAX_RESULT_GAPS = 10_000


def result_gaps(rds: Sequence[tuple[int, Path]]) -> list[int]:
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


def _scan_result(rdir: Path, out: Path, index: dict[str, QnnTensor], g: QnnGraph, gname: str, allow_outside: bool,
                 ing: Ingest) -> dict[str, dict[str, Path]]:
    """QNN name -> {"float"|"native": file} of one Result folder; unreadable, unknown and duplicate files noted."""
    found: dict[str, dict[str, Path]] = {}
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
                "duplicate", str(f), f"second {kind} file for tensor {t.name!r} (kept {slot[kind].name})", fatal=False))
            continue
        slot[kind] = f
    return found


def _collect(ing: Ingest, g: QnnGraph, gname: str, ri: int, rdir: Path, per_result: dict[int, dict[str, dict[str, Path]]],
             expected: set[str], keys: tuple[NameMap | None, dict[str, Any], dict[str, tuple[int, str]]]) -> None:
    """The tensors of one Result folder into ``ing``: missing files noted, two QNN names of one key resolved."""
    order, prod = g.order(), g.producers()
    found = per_result[ri]
    for name in sorted(expected - set(found), key=lambda n: order.get(n, 1 << 30)):
        others = [f"Result_{j}" for j in per_result if name in per_result[j]]
        why = f"present in {others[0]}" if others else "a graph output"
        ing.problems.append(IngestProblem("missing_file", str(rdir / f"{qnn_sanitize(name)}.raw"),
                                          f"missing raw file for tensor {name!r} ({why})"))
    keys_seen: dict[str, IngestedTensor] = {}
    for name, files in found.items():
        it = _make_tensor(g.tensors[name], gname, ri, files, order, prod, *keys, ing)
        if it is None:
            continue
        prev = keys_seen.get(it.key)
        if prev is None:
            keys_seen[it.key] = it
            ing.tensors.append(it)
            continue
        keep, drop = (it, prev) if (it.tensor.is_quantized and not prev.tensor.is_quantized) else (prev, it)
        ing.problems.append(IngestProblem(
            "duplicate", str(drop.float_file or drop.native_file),
            f"{drop.qnn_name!r} and {keep.qnn_name!r} both map to {it.key!r}; kept {keep.qnn_name!r}", fatal=False))
        if keep is it:
            ing.tensors.remove(prev)
            ing.tensors.append(it)
            keys_seen[it.key] = it


def _dedupe_notes(problems: list[IngestProblem]) -> list[IngestProblem]:
    """A note repeated in every Result folder listed once (fatal problems all kept)."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for pr in problems:
        k = (pr.kind, pr.message)
        if not pr.fatal and k in seen:
            continue
        seen.add(k)
        kept.append(pr)
    return kept


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


