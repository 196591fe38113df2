"""Outputs: :func:`atomic_write_bytes` writes through a temp file in the destination folder, ``fsync`` and a
rename; when the disk is full, the folder read-only or the file too large it removes the temp file (and
folders it created) and raises :class:`~ivq_debug.errors.UsageError` (exit 2) naming the output.
:func:`check_output` refuses an output whose real path or inode is one of the inputs, even with
``--force``; :func:`publish_staged` moves a staged model and its external data into place.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from ivq_debug.errors import UsageError, one_line

#: errno values that can only come from writing: an output that cannot be written (exit 2)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


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


def check_outputs(outputs: Iterable[str | os.PathLike | None], inputs: Iterable[str | os.PathLike | None],
                  overwrite: bool = False, *, folders_exist: bool = True) -> None:
    """:func:`~ivq_debug.outputs.check_output` for every output (``None`` and ``"-"``, stdout, are skipped),
    then refuse two outputs that are one file (same real path, or the same inode when both exist).

    With ``folders_exist`` (the default: outputs a user named, ``-o missing/x.h5``), an output whose folder does not
    exist is refused too, rather than the folder made silently; a command that owns a folder it creates (``ivq
    tune``'s workdir) passes False.

    Raises:
        UsageError: an output would replace an input or another output, exists without ``overwrite``, or its folder
            does not exist.
    """
    ins = [i for i in inputs if i is not None]
    seen: list[tuple[str, tuple[int, int] | None, str | os.PathLike]] = []
    for out in outputs:
        if out is None or os.fspath(out) == "-":
            continue
        check_output(out, ins, overwrite)
        parent = os.path.dirname(os.fspath(out)) or "."
        if folders_exist and not os.path.isdir(parent):
            raise UsageError(f"the output folder {parent!r} does not exist (create it first)", out)
        real = os.path.realpath(out)
        try:
            st = os.stat(out)
            ino: tuple[int, int] | None = (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None
        except OSError:
            ino = None
        for other_real, other_ino, other in seen:
            if real == other_real or (ino is not None and ino == other_ino):
                raise UsageError(f"two outputs name the same file ({os.fspath(other)!r})", out)
        seen.append((real, ino, out))


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


def partial_files(path: str | os.PathLike) -> list[Path]:
    """The temporary files an atomic write of ``path`` left (its writer killed before the rename):
    ``.NAME.*.partial`` beside it, as :func:`atomic_write_with` names them."""
    import glob

    p = Path(path)
    return sorted(p.parent.glob(f"{glob.escape(_temp_prefix(p))}*{PARTIAL_SUFFIX}"))


#: the suffix of an atomic write's temporary file
PARTIAL_SUFFIX = ".partial"


def _temp_prefix(p: Path) -> str:
    """The prefix of the temporary file an atomic write of ``p`` makes beside it (hidden: a dot first)."""
    return f".{p.name}."


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
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(p), suffix=PARTIAL_SUFFIX, dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, p)
    except BaseException as e:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
        _remove_dirs(created)
        if isinstance(e, OSError) and (e.errno in WRITE_ERRNOS or e.errno in (errno.EACCES, errno.EPERM)):
            raise output_error(e, p) from None
        raise
    return p


def current_umask() -> int:
    """The process umask (read without changing it: set and restored at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """:func:`atomic_write_bytes` for UTF-8 text. Characters UTF-8 cannot encode (lone surrogates of
    undecodable file names) are written as ``\\udcxx`` escapes rather than failing the write."""
    return atomic_write_bytes(path, text.encode("utf-8", "backslashreplace"), overwrite=overwrite)


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
