""":func:`read_arrays`: ``.npz`` / ``.npy`` with every member's header checked against its byte size before
NumPy allocates anything, numeric dtypes only, never a pickle.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from ivq_debug.errors import InputError, one_line
from ivq_debug.inputfiles import open_input

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
