"""``--task-metric tests/support/ppocr_metric.py:exact_match``: the share of text lines the PP-OCRv4 recognizer reads
exactly (rapidocr's greedy CTC decoding), for ``ivq tune`` on the lines of :func:`tests.support.ppocr.write_dataset`.

The labels file (``labels.json``: the decoding characters and the evaluation texts in the order of the ``--inputs``)
is named by the environment variable ``IVQ_PPOCR_LABELS``::

    IVQ_PPOCR_LABELS=data/labels.json ivq tune rec.onnx --calibration data/cal --inputs data/eval/000.npz ... \\
        --task-metric tests/support/ppocr_metric.py:exact_match

The file imports nothing from the repository (``ivq tune`` loads it by path, in any working directory).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np


def ctc_decode(probs: np.ndarray, chars: Sequence[str]) -> str:
    """rapidocr's greedy CTC decoding of one line's ``[T, classes]`` (or ``[1, T, classes]``) probabilities: argmax,
    repeats collapsed, blanks (index 0) dropped."""
    idx = np.asarray(probs).reshape(-1, np.asarray(probs).shape[-1]).argmax(-1)
    keep = np.ones(len(idx), bool)
    keep[1:] = idx[1:] != idx[:-1]
    keep &= idx != 0
    return "".join(chars[i] for i in idx[keep])


def score(outputs: Sequence[dict[str, np.ndarray]], chars: Sequence[str], labels: Sequence[str]) -> float:
    """The share of lines decoded exactly (one ``{output: probabilities}`` per line, in the labels' order)."""
    if len(outputs) != len(labels):
        raise ValueError(f"{len(outputs)} outputs for {len(labels)} labels")
    hits = sum(ctc_decode(next(iter(o.values())), chars) == t for o, t in zip(outputs, labels, strict=True))
    return hits / len(labels)


def exact_match(outputs: Sequence[dict[str, np.ndarray]]) -> float:
    """:func:`score` against the labels file ``IVQ_PPOCR_LABELS`` names (the ``ivq tune --task-metric``)."""
    path = os.environ.get("IVQ_PPOCR_LABELS")
    if not path:
        raise ValueError("IVQ_PPOCR_LABELS names no labels file")
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return score(outputs, doc["characters"], doc["labels"])
