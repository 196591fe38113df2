"""qnn-net-run run folders described by the ONNX graph the device ran (no QNN JSON): :func:`read_net_run_folder`.

What a device run leaves without a converter's JSON: ``input_list.txt``, ``inputs/``, ``output/Result_<i>``
(``docs/qnn-formats.md``); names, dtypes and shapes come from the ONNX graph, dynamic axes are solved from the
byte sizes, the graph and the model config (:mod:`~ivq_debug.capture.qnn_net_run.shapes`).
"""


from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.capture.qnn_net_run.outputs import result_dirs
from ivq_debug.capture.qnn_net_run.shapes import GraphIO, GraphTensor, SizedFile, resolve_dims
from ivq_debug.errors import InputError
from ivq_debug.qnn.names import NameMap, qnn_sanitize
from ivq_debug.util import file_in_folder_problem, is_inside, read_input_text

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
    results = result_dirs(out)
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
        sized: list[SizedFile] = []
        planned_in: list[tuple[GraphTensor, str, Path, np.dtype]] = []
        if lines is not None:
            assert lst is not None
            ln = lines[i]
            for t, tok in _map_line(ln, graph, in_names, lst):
                p = _input_path(tok, run, lst, ln.line, allow_outside_inputs)
                dt = in_dtype(t)
                planned_in.append((t, tok.name or qnn_sanitize(t.name), p, dt))
                sized.append(SizedFile(p, t, dt.itemsize, p.stat().st_size, dt.name))
        found, unmatched = _result_files(rdir, out_names, graph, out, allow_outside_inputs)
        nf.unmatched += unmatched
        planned_out: list[tuple[GraphTensor, str, Path, np.dtype]] = []
        optional: list[SizedFile] = []
        for t in graph.outputs:
            files = found.get(t.name)
            if not files:
                raise InputError(f"missing raw file for graph output {t.name!r} (Result_{i})",
                                 rdir / f"{qnn_sanitize(t.name)}.raw")
            kind = "float" if "float" in files else "native"
            p, stem = files[kind]
            dt = np.dtype(np.float32) if kind == "float" else t.dtype
            planned_out.append((t, stem, p, dt))
            sized.append(SizedFile(p, t, dt.itemsize, p.stat().st_size, dt.name))
        for name, files in found.items():
            if name in graph.values:
                t = graph.values[name]
                kind = "float" if "float" in files else "native"
                p, stem = files[kind]
                dt = np.dtype(np.float32) if kind == "float" else t.dtype
                planned_out.append((t, stem, p, dt))
                optional.append(SizedFile(p, t, dt.itemsize, p.stat().st_size, dt.name))
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
