"""One digest of a dump's content: what the replay's and the sweep's shard keys name a dump by.

SHA-256 over the entries sorted by ``(sample, part, step, kind, name)``, each fed as
``"<record>|<kind>|<name>|"`` then the :func:`~ivq_debug.dump.contract.input_digest` of its values as the
reader returns them (bfloat16 as float32; a summary-only tensor: its stored sample). Two captures of the same
data agree; their files do not (provenance, creation time, HDF5 layout), so a re-capture of identical data
keeps its shards.

The writer computes it as entries arrive and stores it in the root attribute :data:`ATTR` when it closes the
dump; a dump written before that (or by another writer) gets it computed on read, one pass over every tensor
(:meth:`~ivq_debug.dump.reader.Dump.content_digest`). Its cost at write is one SHA-256 pass over the bytes
kept: 256 MiB of float32 in 64 tensors took 1.5-1.7 s to write without it and 2.2-2.7 s with it on the
shared 2-core build box (SHA-256 there ran at 0.34 GB/s; hashing in a thread beside the HDF5 write alone was
slower). Since then the writer hashes the tensors a runner hands over (``add_tensor(..., owned=True)``) in its own
thread, beside the HDF5 writes *and the next forward* (ONNX Runtime releases the GIL), with their statistics; the
entries are sorted here, so the order their digests arrive in does not change the digest (docs/scale.md,
"Capture ×2 + diff against the machine's limit").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from ivq_debug.dump.contract import input_digest

#: the root attribute holding the digest (64 lowercase hex digits)
ATTR = "content_sha256"


class ContentDigest:
    """The digest built entry by entry, in any order (sorted when finished)."""

    def __init__(self) -> None:
        self._parts: list[tuple[tuple[Any, ...], str, str]] = []

    def add(self, record: tuple[int, str, int], kind: str, name: str, values: np.ndarray,
            dtype_name: str | None = None) -> None:
        """One entry: its record ``(sample, part, step)``, kind, name and values (as the reader returns them)."""
        self.add_digest(record, kind, name, input_digest(values, dtype_name))

    def add_digest(self, record: tuple[int, str, int], kind: str, name: str, values_digest: str) -> None:
        """One entry whose values' :func:`~ivq_debug.dump.contract.input_digest` is already made (in another
        thread: the order entries arrive in does not matter)."""
        self._parts.append(((*record, kind, name), f"{record}|{kind}|{name}|", values_digest))

    def hexdigest(self) -> str:
        """The digest of the entries added so far."""
        h = hashlib.sha256()
        for _, head, d in sorted(self._parts, key=lambda p: p[0]):
            h.update(head.encode())
            h.update(d.encode())
        return h.hexdigest()


def compute(entries: Iterable[Any], read: Any) -> str:
    """The digest of a dump's entries (``Entry`` objects) whose values ``read(entry)`` returns."""
    cd = ContentDigest()
    for e in entries:
        cd.add((e.sample, e.part, e.step), e.kind, e.name, read(e), e.dtype)
    return cd.hexdigest()
