"""The comparator's tasks (runs of consecutive pairs on worker threads) give every pair the figures of one pair
computed alone, in order, in the main thread: bit for bit, on a real ORT float vs a8w8 QDQ capture (format
version 2: the test values rebuilt from their integers), with one block per pair and with many."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ivq_debug.comparator import compare
from ivq_debug.comparator.comparison import _batches, pair_metrics
from ivq_debug.dump.reader import open_dump
from ivq_debug.metrics import METRICS, one_blas_thread
from tests.support import qnn_models
from tests.support.cli import ivq_cli
from tests.support.qnn_models import needs_qnn

FIT = ("clipped_fraction", "clip_snr_db", "grid_snr_db", "enc_step")


def _bits(v: object) -> object:
    return float(v).hex() if isinstance(v, float) and not np.isnan(v) else None if isinstance(v, float) else v


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tasks")
    fm, qm, args = qnn_models.block_files(d, 3)
    assert ivq_cli("capture", "onnx", fm, *args, "-o", d / "ref.h5") == 0
    assert ivq_cli("capture", "onnx", qm, *args, "-o", d / "test.h5") == 0
    return d / "ref.h5", d / "test.h5"


@needs_qnn
@pytest.mark.parametrize("block_bytes", [4 << 20, 256])
def test_tasks_on_threads_equal_each_pair_alone(dumps: tuple[Path, Path], block_bytes: int) -> None:
    ref, test = open_dump(dumps[0]), open_dump(dumps[1])
    assert test.format_version == 2
    runs = {w: compare(ref, test, progress=False, workers=w, block_bytes=block_bytes) for w in (1, 2, 3)}
    pairs = runs[1].alignment.pairs
    tasks = _batches(pairs, block_bytes)
    assert [p for t in tasks for p in t] == pairs  # every pair once, in order
    assert len(tasks) < len(pairs) / 10 if block_bytes > 1 << 20 else len(tasks) == len(pairs)
    assert all(sum(p.ref.nbytes for p in t) <= block_bytes or len(t) == 1 for t in tasks)
    with one_blas_thread:
        alone = [pair_metrics(ref, test, p, block_bytes) for p in pairs]
    cols = [*METRICS, "status", *FIT]
    want = [[_bits(m.get(c)) for c in cols] for m in alone]
    assert sum(m["enc_step"] is not None for m in alone) > 20  # the encoding fit ran on the QDQ pairs
    for w, cmp in runs.items():
        got = [[_bits(v) for v in row] for row in cmp.table[cols].itertuples(index=False)]
        assert got == want, w
    if block_bytes == 256:  # a pair of several blocks: its sums added block by block, in order
        assert any(p.ref.nbytes > 256 for p in pairs)
