"""qnn-net-run run folders described by the ONNX graph the device ran (no QNN JSON): :func:`read_net_run_folder`.

What a device run leaves without a converter's JSON: ``input_list.txt``, ``inputs/``, ``output/Result_<i>``
(``docs/qnn-formats.md``); names, dtypes and shapes come from the ONNX graph, dynamic axes are solved from the
byte sizes, the graph and the model config (:mod:`~ivq_debug.capture.qnn_net_run.shapes`).
"""


from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.capture.qnn_net_run.outputs import result_dirs, result_gaps
from ivq_debug.capture.qnn_net_run.shapes import (
    GraphIO,
    GraphTensor,
    OpenAxis,
    SizedFile,
    UnresolvedAxes,
    config_sizes,
    solve_call,
)
from ivq_debug.errors import InputError, UsageError
from ivq_debug.inputfiles import file_in_folder_problem, is_inside, read_input_text
from ivq_debug.qnn.names import NameMap, qnn_sanitize

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
        """The values, cast to the graph's dtype (an intermediate whose float file does not fit its integer dtype,
        e.g. an int64 ``Slice`` bound written as float32, is kept as written)."""
        a = np.fromfile(self.path, dtype=self.file_dtype.newbyteorder("<")).astype(self.file_dtype)
        a = a.reshape(self.shape)
        if self.tensor.dtype is None:
            return a
        try:
            return cast_values(a, self.tensor.dtype, self.path, self.name)
        except InputError:
            if self.tensor.kind != "value":
                raise
            return a  # an intermediate is evidence, not a feed: kept as the device wrote it


@dataclass
class NetRunCall:
    """One inference of a folder: an ``input_list.txt`` line and its ``Result_<index>``."""

    index: int
    line: int | None
    result_dir: Path | None
    inputs: list[PlannedTensor]
    outputs: list[PlannedTensor]
    dims: dict[str, int]
    not_fed: list[str] = field(default_factory=list)

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
    not_fed: list[str] = field(default_factory=list)

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
    out = f / "output" if (f / "output").is_dir() and result_dirs(f / "output") else f
    if not result_dirs(out):
        nested = [p.name for p in sorted(f.iterdir()) if p.is_dir() and result_dirs(p)]
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


def _map_line(ln: InputLine, graph: GraphIO, names: NameMap, lst: Path, missing: Sequence[str] = ()
              ) -> list[tuple[GraphTensor, InputToken]]:
    """The graph inputs a line feeds. Named tokens may leave inputs out (the device did not feed them); bare
    paths go in graph-input order, the inputs named in ``missing`` skipped."""
    want = graph.inputs
    if ln.tokens[0].name is None:
        fed = [t for t in want if t.name not in set(missing)]
        if len(ln.tokens) != len(fed):
            hint = "" if missing or len(ln.tokens) > len(want) else \
                " (an input the device did not feed: --missing-input NAME, or name:=path tokens)"
            raise InputError(f"line {ln.line}: {len(ln.tokens)} token(s) for the {len(fed)} input(s) of "
                             f"{graph.name} ({', '.join(t.name for t in fed)}){hint}", lst)
        return list(zip(fed, ln.tokens, strict=True))
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
    return [out[t.name] for t in want if t.name in out]


def _result_files(rdir: Path, names: NameMap, graph: GraphIO, out: Path, allow_outside: bool = False
                  ) -> tuple[dict[str, dict[str, tuple[Path, str]]], list[dict[str, str]]]:
    """ONNX name -> {"float"|"native": (file, stem)} of a Result folder, and the files no tensor claims.

    Raises:
        InputError: a ``.raw`` entry that may not be read (:func:`~ivq_debug.inputfiles.file_in_folder_problem`: a
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
                    unmatched.append({"file": str(f), "reason": f"name: matches several tensors {list(m.candidates)}"})
                    hit = ("", "")
                    break
            if hit:
                break
        if hit is None:
            unmatched.append({"file": str(f), "reason": f"name: no tensor of {graph.name} is named {stem!r} "
                                                        "(nor its QNN-sanitized form)"})
        elif hit[0]:
            slot = found.setdefault(hit[0], {})
            if hit[1] in slot:
                unmatched.append({"file": str(f), "reason": f"name: second {hit[1]} file for {hit[0]!r} "
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
    missing_inputs: Sequence[str] = (),
    config: Mapping[str, Any] | None = None,
) -> NetRunFolder:
    """Inventory a qnn-net-run run folder with names, dtypes and shapes from the ONNX graph it ran.

    Inputs: the ``input_list.txt`` (:func:`parse_input_list`) line ``i`` is ``Result_<i>``; token names are
    mapped back from their sanitized form to the graph inputs; an input no ``name:=path`` token names (or one of
    ``missing_inputs`` with bare paths) was not fed by the device and is listed in ``not_fed``; relative paths
    resolve against the input list's folder, absolute ones as given or, when they do not exist here (a device
    path), re-rooted at the folder; a path that leaves the folder is refused unless ``allow_outside_inputs``.
    Input files are float32 (qnn-net-run's default) or, with ``native_inputs``, in the graph's dtypes.
    Outputs: ``Result_<i>/<name>.raw`` (float32) or ``<name>_native.raw`` (the graph's dtype) of every graph
    output (required) and of every intermediate (``--debug`` runs; optional, shaped by shape inference when
    the graph has no ``value_info``); files no tensor claims are listed in ``unmatched`` with the reason
    (``name:``, ``dtype:`` or ``shape:``). Dynamic axes are solved per inference
    (:func:`~ivq_debug.capture.qnn_net_run.shapes.solve_call`; ``dims`` pins names, ``config`` gives sizes).

    Raises:
        UnresolvedAxes: axes no fact decides, every one of every inference listed with its candidates.
        InputError: one line naming the file: no Result folders, a missing Result index or raw file, a bad
            input-list line, a path outside the folder, a size the graph does not allow.
    """
    run, out, lst = locate_run(folder, input_list)
    graph = graph or GraphIO.from_model(model)
    results = result_dirs(out)
    gaps = result_gaps(results) if results else []
    if gaps:
        raise InputError(f"Result folders are not numbered 0..{len(results) - 1}: Result_{gaps[0]} is missing", out)
    unknown = sorted(set(missing_inputs) - {t.name for t in graph.inputs})
    if unknown:
        raise UsageError(f"--missing-input {', '.join(unknown)}: not an input of {graph.name} "
                         f"({', '.join(t.name for t in graph.inputs)})")
    lines: list[InputLine] | None = None
    if lst is not None:
        lines = parse_input_list(lst)
        if len(lines) != len(results):
            raise InputError(f"{len(lines)} inference line(s) but {len(results)} Result folder(s) in {out}", lst)
    elif require_inputs:
        raise InputError("no input_list.txt here (the device's inputs are needed)", run)
    nf = NetRunFolder(run, out, lst, graph, [])
    ctx = _Reading(run, out, lst, graph, native_inputs, allow_outside_inputs, dict(dims or {}),
                   config_sizes(config), tuple(missing_inputs))
    open_axes = []
    for i, rdir in results:
        call, axes = ctx.call(i, rdir, lines[i] if lines is not None else None, nf)
        nf.calls.append(call)
        open_axes += axes
    if open_axes:
        raise UnresolvedAxes(open_axes)
    for c in nf.calls[1:]:  # a device feeds the same inputs every call: a line leaving one out is a broken line
        if c.not_fed != nf.calls[0].not_fed:
            a, b = nf.calls[0], c
            gone = sorted(set(b.not_fed) - set(a.not_fed)) or sorted(set(a.not_fed) - set(b.not_fed))
            first, other = (b, a) if set(b.not_fed) - set(a.not_fed) else (a, b)
            assert lst is not None
            raise InputError(f"line {first.line}: no token for input(s) {', '.join(gone)}, which line {other.line} "
                             "feeds (every line of a run feeds the same inputs)", lst)
    nf.not_fed = list(nf.calls[0].not_fed) if nf.calls else []
    return nf


@dataclass
class _Reading:
    """What every inference of one folder is read with."""

    run: Path
    out: Path
    lst: Path | None
    graph: GraphIO
    native_inputs: bool
    allow_outside: bool
    pins: dict[str, int]
    sizes: dict[str, int]
    missing: tuple[str, ...]

    def _sized(self, t: GraphTensor, p: Path, dt: np.dtype) -> SizedFile:
        return SizedFile(p, t, dt.itemsize, p.stat().st_size, dt.name)

    def _inputs(self, ln: InputLine) -> tuple[list[tuple[GraphTensor, str, Path, np.dtype]], list[str]]:
        assert self.lst is not None
        planned = []
        for t, tok in _map_line(ln, self.graph, self.graph.input_names(), self.lst, self.missing):
            p = _input_path(tok, self.run, self.lst, ln.line, self.allow_outside)
            dt = t.dtype if self.native_inputs and t.dtype is not None else np.dtype(np.float32)
            planned.append((t, tok.name or qnn_sanitize(t.name), p, dt))
        fed = {t.name for t, *_ in planned}
        return planned, [t.name for t in self.graph.inputs if t.name not in fed]

    def _outputs(self, i: int, rdir: Path, nf: NetRunFolder
                 ) -> tuple[list[tuple[GraphTensor, str, Path, np.dtype]], list[tuple[GraphTensor, str, Path, np.dtype]]]:
        """(graph outputs, intermediates) of a Result folder: (tensor, stem, file, file dtype)."""
        found, unmatched = _result_files(rdir, self.graph.output_names(), self.graph, self.out, self.allow_outside)
        nf.unmatched += unmatched
        outs, values = [], []
        for t in self.graph.outputs:
            files = found.get(t.name)
            if not files:
                raise InputError(f"missing raw file for graph output {t.name!r} (Result_{i})",
                                 rdir / f"{qnn_sanitize(t.name)}.raw")
            outs.append(self._pick(t, files))
        for name, files in found.items():
            if name in self.graph.values:
                t = self.graph.values[name]
                if "float" not in files and t.dtype is None:
                    nf.unmatched.append({"file": str(files["native"][0]), "reason": f"dtype: the graph gives no "
                                         f"element type for {name!r}, so its native file cannot be read"})
                    continue
                values.append(self._pick(t, files))
            elif name not in {t.name for t in self.graph.outputs}:  # a graph input written back as an output file
                nf.unmatched.append({"file": str(files[next(iter(files))][0]), "reason": f"name: {name!r} is a "
                                     "graph input"})
        return outs, values

    @staticmethod
    def _pick(t: GraphTensor, files: dict[str, tuple[Path, str]]) -> tuple[GraphTensor, str, Path, np.dtype]:
        kind = "float" if "float" in files else "native"
        p, stem = files[kind]
        dt = np.dtype(np.float32) if kind == "float" or t.dtype is None else t.dtype
        return t, stem, p, dt

    def call(self, i: int, rdir: Path, ln: InputLine | None, nf: NetRunFolder) -> tuple[NetRunCall, list[OpenAxis]]:
        """One inference planned (files shaped), and the axes its solve left open."""
        if not self.allow_outside and not is_inside(rdir, self.out):
            raise InputError(f"Result folder is a symlink leaving {str(self.out)!r} (--allow-outside-inputs reads it)",
                             rdir)
        planned_in, not_fed = self._inputs(ln) if ln is not None else ([], [])
        outs, values = self._outputs(i, rdir, nf)
        required = [self._sized(t, p, dt) for t, _q, p, dt in planned_in + outs]
        optional = [self._sized(t, p, dt) for t, _q, p, dt in values]
        sol = solve_call(self.graph, required, optional, self.pins, self.sizes)
        for p, why in sol.skipped.items():
            nf.unmatched.append({"file": str(p), "reason": why})
        shape = sol.shapes.get
        ins = [PlannedTensor(t.name, q, p, dt, shape(p, ()), t) for t, q, p, dt in planned_in]
        planned = [PlannedTensor(t.name, q, p, dt, shape(p, ()), t) for t, q, p, dt in outs + values
                   if p in sol.shapes or t.kind == "output"]
        planned.sort(key=lambda pt: (pt.tensor.kind == "output", pt.tensor.order))
        return NetRunCall(i, ln.line if ln is not None else None, rdir, ins, planned, sol.dims, not_fed), sol.open_axes
