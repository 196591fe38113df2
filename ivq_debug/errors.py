"""Errors with documented exit codes.

Every failure the user can cause (bad arguments, unreadable files, alignment that leaves too much
unmatched, a missing external tool) is raised as an :class:`IvqError` subclass. The CLIs catch them and
print ``<prog>: error: <message>`` on one line to stderr, then exit with ``exit_code``; no traceback.

Exit codes (contract, see ``docs/cli.md``):

==== =====================================================================
0    pass
1    a threshold, budget or regression check failed
2    usage error (bad arguments, bad option values)
3    an input is unreadable or corrupt (missing file, not HDF5, truncated, wrong byte size, bad JSON)
4    alignment left more unmatched tensors than allowed
5    a required external tool, backend or optional extra is absent (QAIRT SDK, adb, QNN EP, pandas, torch)
6    contract: the dumps compared were not fed the same inputs (``ivq-diff --allow-input-mismatch``)
7    a run failed: a capture, session or quantization could not run as asked, or a written model failed its check
==== =====================================================================

The core install (``pip install ivq-debug``: numpy, onnx, onnxruntime, h5py, rich) captures with ONNX Runtime and
reads dumps; the rest needs an extra (:data:`EXTRAS`). A command that reaches a missing extra's module exits 5
with one line naming the extra (:func:`missing_extra`, used by ``cli/common.py:run``).
"""

from __future__ import annotations

import importlib.util
import os
import re

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_UNMATCHED = 4
EXIT_TOOL = 5
EXIT_CONTRACT = 6
EXIT_RUN = 7


#: what must never reach a terminal raw: C0 controls (tab and newline included: a message is one line),
#: DEL, C1 controls (``\x9b`` is a CSI on some terminals), lone surrogates (undecodable bytes of a file
#: name), and the bidirectional overrides that reorder what a reader sees (``abc\u202egnp.exe``)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")
#: the same, tab and newline allowed (multi-line text: an HTML ``<pre>`` block)
_UNSAFE_MULTILINE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


def printable(text: object, multiline: bool = False) -> str:
    """``text`` with every control, surrogate or bidi-override character written as a visible escape
    (``\x1b``, ``\udc80``, ``\u202e``): names come from files and must not drive the terminal.
    ``multiline`` keeps tabs and newlines."""
    s = text if isinstance(text, str) else str(text)
    return (_UNSAFE_MULTILINE if multiline else _UNSAFE).sub(_escape_char, s)


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def one_line(e: BaseException | str, limit: int | None = None) -> str:
    """An exception's (or a text's) message folded onto one line (runs of whitespace become one space),
    with control characters escaped (:func:`printable`), at most ``limit`` characters: a longer text is cut at
    the last space that fits and ends with ``…`` (a single word longer than the limit is cut inside it)."""
    text = printable(" ".join(str(e).split()))
    if limit is None or len(text) <= limit:
        return text
    if limit <= 1:
        return text[:limit]
    head = text[: limit - 1]
    space = head.rfind(" ")
    if space >= limit // 2:  # a word boundary not too far back
        head = head[:space]
    return head.rstrip(" ;,:") + "…"


class IvqError(Exception):
    """Base class: a user-facing error with a one-line message and an exit code."""

    exit_code = EXIT_FAIL

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        self.path = os.fspath(path) if path is not None else None
        self.message = message
        super().__init__(f"{self.path}: {message}" if self.path else message)

    def one_line(self) -> str:
        """The message folded onto a single line."""
        return one_line(self)


class UsageError(IvqError):
    """Bad arguments or option values (exit 2)."""

    exit_code = EXIT_USAGE


class InputError(IvqError):
    """An input file is missing, unreadable, corrupt or malformed (exit 3)."""

    exit_code = EXIT_INPUT


class AlignmentError(IvqError):
    """More tensors were left unmatched than allowed (exit 4)."""

    exit_code = EXIT_UNMATCHED


class ToolNotFoundError(IvqError):
    """A required external tool or backend is absent (exit 5)."""

    exit_code = EXIT_TOOL


class ContractError(IvqError):
    """The dumps compared were not fed the same inputs (exit 6); see :mod:`ivq_debug.comparator.contract`."""

    exit_code = EXIT_CONTRACT

    def one_line(self) -> str:
        """``contract: <the first differing input and record>``."""
        return f"contract: {super().one_line()}"


class RunError(IvqError):
    """A run failed (exit 7): distinct from a check that ran and failed (exit 1), so CI can tell a broken
    capture from a missed budget."""

    exit_code = EXIT_RUN


class CaptureError(RunError):
    """A capture could not run as requested (e.g. nodes fell back to the CPU with fallback disabled; exit 7)."""


class CheckError(RunError):
    """A model a command wrote failed its check (``onnx.checker`` or an ONNX Runtime load; exit 7)."""


#: third-party modules of the optional extras (``pyproject.toml``): top-level module -> extra
EXTRAS: dict[str, str] = {
    "pandas": "analysis", "PIL": "analysis",
    "torch": "torch", "transformers": "torch", "tokenizers": "torch", "safetensors": "torch", "onnxscript": "torch",
    "onnxruntime_qnn": "qnn", "ray": "ray",
}


class MissingExtraError(ToolNotFoundError):
    """A module of an optional extra is not installed (exit 5); the message names the extra to install."""

    def __init__(self, module: str, extra: str, what: str | None = None) -> None:
        self.module, self.extra = module, extra
        super().__init__(f"{what or 'this'} needs {module}, which is not installed: "
                         f"pip install 'ivq-debug[{extra}]'")


def missing_extra(e: BaseException, what: str | None = None) -> MissingExtraError | None:
    """The :class:`MissingExtraError` for an ``ImportError`` of an extra's module (``None`` for anything else)."""
    name = getattr(e, "name", None)
    if not isinstance(e, ImportError) or not name:
        return None
    top = name.split(".")[0]
    return MissingExtraError(top, EXTRAS[top], what) if top in EXTRAS else None


def require_extra(module: str, what: str | None = None) -> None:
    """Raise :class:`MissingExtraError` unless ``module`` (one of :data:`EXTRAS`) is importable; imports nothing."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(module, EXTRAS[module], what)
