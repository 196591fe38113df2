"""Small shared helpers: untrusted input files, atomic writes, outputs that must not replace inputs, hashing,
JSON-safe values.

Inputs come from devices, colleagues and CI artifacts, so every reader here checks before it trusts:

* :func:`regular_file` / :func:`open_input`: an input must be a regular file. A FIFO, a socket, a device
  (``/dev/stdin`` is a pipe, ``/dev/zero`` never ends), a directory, a symlink loop or a name too long is a
  one-line :class:`~ivq_debug.errors.InputError` (exit 3), decided with ``stat`` / ``fstat`` and an open
  that cannot block (``O_NONBLOCK``), never by reading.
* :func:`read_input_text` / :func:`load_json`: UTF-8 text without NUL bytes; JSON whose nesting is bounded
  (CPython's decoder recurses) and whose failures name the file, line and column.
* :func:`read_arrays`: ``.npz`` / ``.npy`` with every member's header checked against its byte size before
  NumPy allocates anything, numeric dtypes only, never a pickle.

Outputs: :func:`atomic_write_bytes` writes through a temp file in the destination folder and a rename; when
the disk is full, the folder read-only or the file too large it removes the temp file (and folders it
created) and raises :class:`~ivq_debug.errors.UsageError` (exit 2) naming the output.
:func:`check_output` refuses an output whose real path or inode is one of the inputs, even with
``--force``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import math
import os
import stat
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np

from ivq_debug.errors import InputError, UsageError, one_line

#: errno values that can only come from writing: an output that cannot be written (exit 2)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
#: JSON nesting deeper than this is refused before decoding (real files nest < 10 levels)
MAX_JSON_DEPTH = 200

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


# ============================================================================ input files
#: why an input could not be opened, by errno (``{what}``: the input's role)
_OPEN_ERRORS = {
    errno.ENOENT: "no such {what}",
    errno.ELOOP: "{what} is a symlink loop",
    errno.ENAMETOOLONG: "{what} path is too long",
    errno.ENOTDIR: "no such {what} (a parent is not a folder)",
    errno.EACCES: "{what} is not readable (permission denied)",
    errno.ENXIO: "{what} is a socket or device, not a regular file",
}


def _stat_error(e: OSError, p: Path, what: str) -> InputError:
    msg = _OPEN_ERRORS.get(e.errno or 0)
    return InputError(msg.format(what=what) if msg else f"cannot open {what} ({e.strerror or type(e).__name__})", p)


def _kind(mode: int) -> str | None:
    """What a non-regular file is (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | os.PathLike, what: str = "input file") -> Path:
    """``path`` when it names a regular file (symlinks followed); else a one-line :class:`InputError`.

    ``what`` names the input in the message (``"overrides file"``, ``"profiling file"``, …).
    """
    p = Path(path)
    st = _stat(p, what)
    kind = _kind(st.st_mode)
    if kind:
        raise InputError(f"{what} is {kind}, not a regular file", p)
    return p


def _stat(p: Path, what: str) -> os.stat_result:
    try:
        return os.stat(p)
    except OSError as e:
        raise _stat_error(e, p, what) from None
    except ValueError:  # an embedded NUL byte
        raise InputError(f"{what} path holds a NUL byte", p) from None


def regular_folder(path: str | os.PathLike, what: str = "input folder") -> Path:
    """``path`` when it names a folder (symlinks followed); else a one-line :class:`InputError`."""
    p = Path(path)
    st = _stat(p, what)
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{what} is {_kind(st.st_mode) or 'a file'}, not a folder", p)
    return p


def is_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """True when ``path``'s real path (symlinks resolved) is ``folder``'s real path or lies under it."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def file_in_folder_problem(path: str | os.PathLike, folder: str | os.PathLike, what: str = "file",
                           allow_outside: bool = False) -> str | None:
    """Why a file found under ``folder`` may not be read, or ``None``: it cannot be ``stat``-ed (a symlink
    loop, a dangling link, permissions), is not a regular file, or is a symlink whose target leaves
    ``folder`` (unless ``allow_outside``). Decided without opening the file."""
    p = Path(path)
    try:
        st = _stat(p, what)
    except InputError as e:
        return e.message
    kind = _kind(st.st_mode)
    if kind:
        return f"{what} is {kind}, not a regular file"
    if not allow_outside and not is_inside(p, folder):
        return f"{what} is a symlink to a file outside {os.fspath(folder)!r} (--allow-outside-inputs reads it)"
    return None


def open_input(path: str | os.PathLike, what: str = "input file") -> IO[bytes]:
    """Open a regular file for binary reading without ever blocking on a FIFO or device.

    The open uses ``O_NONBLOCK`` (a FIFO with no writer opens at once instead of waiting) and the opened
    descriptor is checked with ``fstat``, so a file swapped for a FIFO after a ``stat`` is still refused.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _stat_error(e, p, what) from None
    except ValueError:
        raise InputError(f"{what} path holds a NUL byte", p) from None
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind:
            raise InputError(f"{what} is {kind}, not a regular file", p)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input_bytes(path: str | os.PathLike, what: str = "input file") -> bytes:
    """The bytes of a regular file (:func:`open_input`); read errors are one-line :class:`InputError`."""
    with open_input(path, what) as f:
        try:
            return f.read()
        except OSError as e:
            raise InputError(f"cannot read {what} ({e.strerror or type(e).__name__})", path) from None


def read_input_text(path: str | os.PathLike, what: str = "input file", allow_nul: bool = False) -> str:
    """A regular file's UTF-8 text; undecodable bytes or NUL bytes (a cut or corrupt file) are refused."""
    data = read_input_bytes(path, what)
    if not allow_nul and b"\x00" in data:
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise InputError(f"{what} holds NUL bytes (line {line}): a binary, cut or corrupt file", path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"{what} is not UTF-8 text (line {line}, byte offset {e.start})", path) from None


def json_depth_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``text`` opens more than ``limit`` nested arrays / objects (strings are skipped)."""
    depth = 0
    in_str = esc = False
    for c in text:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth -= 1
    return False


def parse_json(text: str, source: str | os.PathLike | None = None, what: str = "JSON") -> Any:
    """Decode JSON text; one-line :class:`InputError` (naming ``source``) for bad or too deeply nested JSON."""
    import json

    if len(text) > 2 * MAX_JSON_DEPTH and json_depth_exceeds(text):
        raise InputError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep", source)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"bad JSON at line {e.lineno} column {e.colno}: {e.msg}", source) from None
    except RecursionError:
        raise InputError(f"{what} is nested too deeply", source) from None


def load_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read a JSON input file: a regular file (:func:`open_input`), UTF-8, bounded nesting, valid JSON.

    A UTF-8 byte-order mark is skipped (some Windows editors write one).
    """
    text = read_input_text(path, what)
    return parse_json(text.removeprefix("\ufeff"), path, what)


# ============================================================================ JSON schemas
_VALIDATORS: dict[int, Any] = {}
_TYPE_WORDS = {"number": "a number", "integer": "an integer", "array": "a list", "object": "an object",
               "string": "a string", "boolean": "true or false", "null": "null"}


def _short(v: Any) -> str:
    if isinstance(v, dict):
        return f"an object ({len(v)} keys)"
    if isinstance(v, list):
        return f"a list of {len(v)}"
    return one_line(repr(v), 60)


def _where(path: Iterable[Any]) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if str(k).isidentifier() else f"[{k!r}]")
    return out.lstrip(".")


def schema_message(err: Any) -> str:
    """A short message for a ``jsonschema`` error: ``missing 'bitwidth'``, ``must be a number, got 'abc'``,
    or the schema's own ``x-message`` (a key the validator ignores) for combined rules."""
    e = err
    while e is not None:
        if isinstance(e.schema, dict) and e.schema.get("x-message"):
            return f"{e.schema['x-message']}, got {_short(e.instance)}"
        e = e.parent
    kw, value, inst = err.validator, err.validator_value, err.instance
    if kw == "required" and isinstance(inst, dict):
        return "missing " + ", ".join(repr(k) for k in value if k not in inst)
    if kw == "type":
        want = value if isinstance(value, list) else [value]
        return f"must be {' or '.join(_TYPE_WORDS.get(w, w) for w in want)}, got {_short(inst)}"
    if kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return f"{_short(inst)} is out of range ({kw} {value})"
    if kw == "minItems":
        return "must not be empty" if value == 1 else f"needs at least {value} items"
    if kw == "additionalProperties" and isinstance(inst, dict):
        allowed = set(err.schema.get("properties", {}))
        return "unknown key(s) " + ", ".join(repr(k) for k in inst if k not in allowed)
    if kw in ("const", "enum"):
        return f"must be {value!r}" if kw == "const" else f"must be one of {value!r}, got {_short(inst)}"
    return one_line(err.message, 160)


def _validator_class() -> Any:
    """Draft 2020-12 with the project's number keywords (JSON Schema has none for them):

    * ``"x-finite": true``: a number that is not NaN nor ±inf (Python's ``json`` reads ``NaN`` and ``Infinity``);
      ``"x-finite": "not-nan"``: ±inf allowed (an empty accumulator's min / max), NaN not.
    * ``"x-ordered": [[a, b], ...]``: on an object, the number ``a`` is at most the number ``b`` (``min`` ≤ ``max``).
    """
    global _VALIDATOR_CLS
    if _VALIDATOR_CLS is None:
        from jsonschema import Draft202012Validator, ValidationError, validators

        def finite(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
            if isinstance(instance, float) and value and (
                    math.isnan(instance) if value == "not-nan" else not math.isfinite(instance)):
                yield ValidationError(f"must be {'a number, not NaN' if value == 'not-nan' else 'a finite number'}, "
                                      f"got {instance!r}")

        def ordered(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
            if not isinstance(instance, dict):
                return
            for a, b in value:
                x, y = instance.get(a), instance.get(b)
                if (isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool)
                        and not isinstance(y, bool) and x > y):
                    yield ValidationError(f"{a} {x!r} is above {b} {y!r}")

        _VALIDATOR_CLS = validators.extend(Draft202012Validator, {"x-finite": finite, "x-ordered": ordered})
    return _VALIDATOR_CLS


_VALIDATOR_CLS: Any = None


def check_schema(doc: Any, schema: dict[str, Any], source: str | os.PathLike | None = None,
                 what: str = "") -> None:
    """Validate a loaded document against a JSON Schema (Draft 2020-12, ``jsonschema``).

    Raises:
        InputError: the most relevant violation on one line, naming ``source`` and the field:
            ``ov.json: activation_encodings['x'][0].scale: must be a number, got 'abc'`` (``what`` is
            prefixed when given, e.g. ``tensor 't'``).
    """
    err = schema_error(doc, schema)
    if err is not None:
        head = ": ".join(x for x in (what, _where(err[0])) if x) or "document"
        raise InputError(f"{head}: {err[1]}", source)


def schema_error(doc: Any, schema: dict[str, Any]) -> tuple[list[Any], str] | None:
    """The most relevant violation of ``schema`` (Draft 2020-12, ``jsonschema``) by ``doc``: the path to the
    field (keys and list indices) and a short message (:func:`schema_message`); None when ``doc`` is valid.

    Validators are cached by the schema's ``id``: pass module-level schemas only."""
    v = _VALIDATORS.get(id(schema))
    if v is None:
        v = _VALIDATORS[id(schema)] = _validator_class()(schema)
    from jsonschema.exceptions import best_match

    err = best_match(v.iter_errors(doc))
    return None if err is None else (list(err.absolute_path), schema_message(err))


# ============================================================================ outputs
def output_error(e: OSError, path: str | os.PathLike) -> UsageError:
    """The one-line error (exit 2) for an output that could not be written."""
    reason = e.strerror or one_line(e, 200)
    return UsageError(f"cannot write output ({reason})", path)


def _stat_or_none(p: Path) -> os.stat_result | None:
    try:
        return os.stat(p)
    except OSError:
        return None


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = (),
                 overwrite: bool = False) -> Path:
    """Fail before any work when an output would replace an input or a file the user did not allow.

    An output is refused (:class:`UsageError`, exit 2) when its real path (symlinks resolved) or, when it
    exists, its inode (hard links) is one of ``inputs`` or a file inside an input folder (a hard link into
    the folder is found by walking it, only when the output has several links), **even with**
    ``overwrite``; when it exists and ``overwrite`` is false; when it is a folder. Returns the output path.
    """
    out = Path(output)
    real = Path(os.path.realpath(out))
    ost = _stat_or_none(out)
    for item in inputs:
        if item is None:
            continue
        ip = Path(item)
        ireal = Path(os.path.realpath(ip))
        ist = _stat_or_none(ip)
        if real == ireal or (ost is not None and ist is not None and _same_file(ost, ist)):
            raise UsageError(f"output would replace the input {os.fspath(ip)!r} (even --force does not allow that)",
                             out)
        if ist is not None and stat.S_ISDIR(ist.st_mode) and ost is not None and (
                real.is_relative_to(ireal) or (ost.st_nlink > 1 and _holds_inode(ip, ost))):
            raise UsageError(f"output would replace a file of the input folder {os.fspath(ip)!r}", out)
    if ost is not None:
        if stat.S_ISDIR(ost.st_mode):
            raise UsageError("output is a folder", out)
        if not overwrite:
            raise UsageError("output exists; pass --force (overwrite=True) to replace it", out)
    return out


def _holds_inode(folder: Path, st: os.stat_result) -> bool:
    """Whether a file under ``folder`` is ``st``'s inode (a hard link of it; only asked when it has several)."""
    for dirpath, _, files in os.walk(folder):
        for n in files:
            try:
                if _same_file(os.stat(os.path.join(dirpath, n), follow_symlinks=False), st):
                    return True
            except OSError:
                continue
    return False


def _make_parents(p: Path) -> list[Path]:
    """Create the missing parent folders of ``p``; returns those created (innermost last)."""
    missing = []
    d = p.parent
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    created = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            _remove_dirs(created)
            raise output_error(e, p) from None
        created.append(d)
    return created


def _remove_dirs(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            pass


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename.

    Raises :class:`UsageError` when ``path`` exists and ``overwrite`` is False, and when the write fails
    for want of space, a writable folder or a file size limit; then neither the final file nor the temp
    file (nor folders created for it) remain.
    """
    return atomic_write_with(path, lambda f: f.write(data), overwrite=overwrite)


def atomic_write_json(path: str | os.PathLike, doc: Any, *, overwrite: bool = False, indent: int | None = 1) -> Path:
    """:func:`atomic_write_with` of a JSON document, encoded as it is written (``json.dump``'s chunks): no
    string of the whole document, nor its UTF-8 copy, is ever in memory (``ivq-diff --json`` of a large
    comparison under a 384 MiB address-space cap). NaN / inf are refused (``ValueError``: nothing is left)."""
    import json

    def fill(f: IO[bytes]) -> None:
        text = io.TextIOWrapper(f, encoding="utf-8", errors="backslashreplace", newline="\n", write_through=False)
        json.dump(doc, text, indent=indent, allow_nan=False)
        text.write("\n")
        text.flush()
        text.detach()

    return atomic_write_with(path, fill, overwrite=overwrite)


def atomic_write_with(path: str | os.PathLike, fill: Any, *, overwrite: bool = False) -> Path:
    """The atomic write of :func:`atomic_write_bytes`, the content written by ``fill(binary_file)``."""
    p = Path(path)
    try:
        exists = os.path.lexists(p)
    except (OSError, ValueError) as e:
        raise UsageError(f"bad output path ({one_line(e, 100)})", p) from None
    if exists and not overwrite:
        raise UsageError("output exists; pass --force to replace it", p)
    created = _make_parents(p)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, p)
    except BaseException as e:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
        _remove_dirs(created)
        if isinstance(e, OSError) and (e.errno in WRITE_ERRNOS or e.errno in (errno.EACCES, errno.EPERM)):
            raise output_error(e, p) from None
        raise
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """:func:`atomic_write_bytes` for UTF-8 text. Characters UTF-8 cannot encode (lone surrogates of
    undecodable file names) are written as ``\\udcxx`` escapes rather than failing the write."""
    return atomic_write_bytes(path, text.encode("utf-8", "backslashreplace"), overwrite=overwrite)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a regular file, read in chunks (a FIFO or device is an :class:`InputError`)."""
    h = hashlib.sha256()
    with open_input(path) as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def as_float(v: object) -> float | None:
    """``float(v)``, or None for None, NaN and values that are not numbers (table cells, JSON fields)."""
    if v is None:
        return None
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


# ============================================================================ arrays
#: dtype kinds a model input can hold: bool, signed / unsigned integers, floats, complex
ARRAY_KINDS = "biufc"


def _npy_header(f: IO[bytes], where: str, p: Path) -> tuple[Any, tuple[int, ...], int]:
    """``(dtype, shape, header bytes)`` of the ``.npy`` stream at ``f``, checked; :class:`InputError` else."""
    from numpy.lib import format as npf

    start = f.tell()
    try:
        version = npf.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npf.read_array_header_1_0(f, max_header_size=10000)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = npf.read_array_header_2_0(f, max_header_size=10000)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, SyntaxError, TypeError, EOFError, OverflowError, MemoryError, RecursionError) as e:
        raise InputError(f"{where}: not a readable .npy header ({one_line(e, 120)})", p) from None
    except Exception as e:  # NumPy's header parser raises tokenizer errors too
        raise InputError(f"{where}: not a readable .npy header ({type(e).__name__})", p) from None
    if dtype.hasobject:
        raise InputError(f"{where}: object arrays (pickles are never loaded)", p)
    if dtype.fields is not None or dtype.kind not in ARRAY_KINDS:
        raise InputError(f"{where}: dtype {dtype.str!r} is not a number or bool array", p)
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InputError(f"{where}: bad shape {shape!r}", p)
    del fortran
    return dtype, tuple(shape), f.tell() - start


def _check_npy_size(dtype: Any, shape: tuple[int, ...], data_bytes: int, where: str, p: Path) -> None:
    import math

    want = math.prod(shape) * dtype.itemsize
    if want != data_bytes:
        raise InputError(f"{where}: header says shape {list(shape)} {dtype.name} ({want} bytes) but holds "
                         f"{data_bytes} bytes", p)


def read_arrays(path: str | os.PathLike, what: str = "inputs file") -> dict:
    """Named arrays of an ``.npz`` (or one ``.npy``, named after the file), never unpickling anything.

    Checked before NumPy loads anything: the file is a regular file; each member is an ``.npy`` whose
    header parses, whose dtype is numeric or bool (no objects, strings or records) and whose shape times
    itemsize is exactly its byte count (a header cannot ask for terabytes). Raises
    :class:`~ivq_debug.errors.InputError` with a one-line message naming the file otherwise.
    """
    p = Path(path)
    with open_input(p, what) as f:
        magic = f.read(6)
        f.seek(0)
        try:
            if magic == b"\x93NUMPY":
                size = os.fstat(f.fileno()).st_size
                dtype, shape, hlen = _npy_header(f, p.name, p)
                _check_npy_size(dtype, shape, size - hlen, p.name, p)
                f.seek(0)
                return {p.stem: np.load(f, allow_pickle=False)}
            if not zipfile.is_zipfile(f):
                raise InputError("not an .npz archive (a NumPy zip of named arrays) or an .npy array", p)
            f.seek(0)
            out = {}
            with zipfile.ZipFile(f) as z:
                for info in z.infolist():
                    name = info.filename
                    if info.is_dir():
                        continue
                    if not name.endswith(".npy"):
                        raise InputError(f"member {name!r} is not an .npy array", p)
                    with z.open(info) as m:
                        head = m.read(1 << 16)
                    dtype, shape, hlen = _npy_header(io.BytesIO(head), f"member {name!r}", p)
                    _check_npy_size(dtype, shape, info.file_size - hlen, f"member {name!r}", p)
                    with z.open(info) as m:
                        out[name[: -len(".npy")]] = np.lib.format.read_array(m, allow_pickle=False)
            return out
        except InputError:
            raise
        except (ValueError, OSError, zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError) as e:
            kind = "object arrays (pickles are never loaded)" if "pickle" in str(e) else one_line(e, 160)
            raise InputError(f"not a readable NumPy file: {kind}", p) from None


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """A JSON document from a file (:func:`load_json`: a regular file, UTF-8 without NUL bytes, bounded
    nesting); one-line :class:`~ivq_debug.errors.InputError` naming it when it is missing, unreadable or not
    JSON (``what`` names the kind of file in the message)."""
    return load_json(path, what)


def json_safe(obj: Any) -> Any:
    """Replace non-finite floats by the strings ``"inf"``, ``"-inf"``, ``"nan"`` (strict JSON)."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, (np.floating,)):
        return json_safe(float(obj))
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


class _Warnings(logging.Handler):
    """WARNING and above, one line each, without repeats."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = " ".join(record.getMessage().split())
        if msg not in self.messages:
            self.messages.append(msg)


@contextmanager
def root_warnings() -> Iterator[list[str]]:
    """Keep the root logger off the console for the block (ONNX Runtime's quantizers log through it) and yield
    the list its warnings are collected in (one line each, without repeats)."""
    cap = _Warnings()
    root = logging.getLogger()
    others = list(root.handlers)
    for h in others:
        root.removeHandler(h)
    root.addHandler(cap)
    try:
        yield cap.messages
    finally:
        root.removeHandler(cap)
        for h in others:
            root.addHandler(h)


def publish_staged(staged: Path, out: Path, externals: Iterable[str], *, overwrite: bool = False) -> None:
    """Move a model written into a staging folder beside ``out`` into place: its external data files (names
    relative to the staging folder) first, the model last, so that it appears only when complete. Refuses to
    replace an existing file without ``overwrite``."""
    for name in externals:
        dst = out.parent / name
        if dst.exists() and not overwrite:
            raise UsageError("external data file exists; pass overwrite=True", dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged.parent / name, dst)
    if out.exists() and not overwrite:
        raise UsageError("output appeared while quantizing; not overwritten", out)
    os.replace(staged, out)
