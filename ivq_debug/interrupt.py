"""SIGINT and SIGTERM as exceptions, and the partial outputs to remove when one arrives.

The CLI (``cli/common.py:run``) installs :func:`on_signal` for both signals: the signal becomes a
:class:`Signalled` exception, so every ``with`` / ``finally`` cleans up (a dump's ``.partial`` file, a quantizer's
work folder, QNN trace folders), and the command exits 128 + the signal (130, 143). Two gaps remain, both closed
here. Python ignores an exception raised while it runs a weakref callback or ``__del__`` (measured: the SIGTERM of
``tests/cli/test_thirdparty_cli.py``'s signal test was lost that way in one run of about a dozen, and the capture
finished with exit 0), so the signal is also remembered and :func:`raise_if_signalled` raises it again where work
is committed. And a signal can land between a temporary file's creation and the ``try`` that owns it (a Ctrl-C as
the dump appeared left its ``.partial``), so writers :func:`register` their temporary paths and the CLI removes
what is still registered (:func:`remove_registered`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: signals received since :func:`reset`
_SIGNALLED: list[int] = []
#: temporary files and folders of unfinished outputs
_PARTIAL: set[Path] = set()


class Signalled(KeyboardInterrupt):
    """SIGINT or SIGTERM as an exception (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def on_signal(signum: int, frame: object) -> None:
    """A ``signal.signal`` handler: remember the signal and raise :class:`Signalled`."""
    _SIGNALLED.append(signum)
    raise Signalled(signum)


def raise_if_signalled() -> None:
    """Raise :class:`Signalled` again if a signal arrived (its first exception may have been lost); called where
    work is committed: before a dump is finalized, between capture samples."""
    if _SIGNALLED:
        raise Signalled(_SIGNALLED[0])


def register(path: str | os.PathLike) -> None:
    """Record a temporary file or folder of an output being written (remove it with :func:`unregister`)."""
    _PARTIAL.add(Path(path))


def unregister(path: str | os.PathLike) -> None:
    """The temporary path was moved into place or removed by its owner."""
    _PARTIAL.discard(Path(path))


def remove_registered() -> list[Path]:
    """Remove every registered temporary path (after an interrupt); returns those that existed."""
    removed = []
    for p in sorted(_PARTIAL):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        elif p.exists():
            p.unlink(missing_ok=True)
            removed.append(p)
    _PARTIAL.clear()
    return removed


def reset() -> None:
    """Forget received signals and registered paths (the start of a CLI run)."""
    _SIGNALLED.clear()
    _PARTIAL.clear()
