"""Hostile cases that still fail, grouped by the module that has to change (``xfail(strict=True)``).

Each entry: module → (what it must do, the failing case ids). Fixing a module flips its cases to XPASS,
which strict xfail reports as a failure: remove them here then.
"""

from __future__ import annotations

#: module → (what it must do, case ids)
KNOWN: dict[str, tuple[str, tuple[str, ...]]] = {
}
