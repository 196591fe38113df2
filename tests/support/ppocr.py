"""The PP-OCRv4 text recognizer of issue 29, a real third-party model, and text lines to read with it.

The model is ``ch_PP-OCRv4_rec_infer.onnx`` from the ``rapidocr-onnxruntime==1.4.4`` wheel (Apache-2.0), fetched
at test set-up with ``pip download --no-deps`` (:func:`fetch`; nothing is vendored). Its input is
``x: [N, 3, 48, W]`` (dynamic batch and width), its output the per-step character probabilities
``[N, W/8, 6625]``; the character list is the model's ``character`` metadata (one per line), to which rapidocr's
``CTCLabelDecode`` adds ``blank`` in front and a space at the end.

Text lines are rendered here with Pillow's built-in font (``ImageFont.load_default(size=...)``, no system fonts),
seeded, from ASCII letters and digits of the model's own character list, and preprocessed exactly as rapidocr's
``TextRecognizer.resize_norm_img`` does for one line: height 48, the width its aspect ratio gives, ``/255``,
``-0.5``, ``/0.5``, zero-padded to :data:`WIDTH`. ``ppocr_metric.ctc_decode`` is rapidocr's greedy decoding. The
task metric ``--task-metric tests/support/ppocr_metric.py:exact_match``
reads the labels :func:`write_dataset` writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: the wheel the recognizer comes from
WHEEL = "rapidocr-onnxruntime==1.4.4"
#: the recognizer's path inside the wheel
MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"
#: rapidocr's ``rec_img_shape`` (config.yaml): 3 x 48 x 320
HEIGHT, WIDTH = 48, 320
#: the font size of the rendered lines (Pillow's built-in Aileron): cap height ~ half the line height
FONT_SIZE = 28
#: set to 1 (CI) so that a failed download fails the test instead of skipping it
REQUIRE_ENV = "IVQ_REQUIRE_PPOCR"
#: where the labels file is named for the task metric
LABELS_ENV = "IVQ_PPOCR_LABELS"

_WORDS = ("total", "invoice", "date", "order", "price", "amount", "station", "river", "green", "north", "market",
          "paper", "window", "signal", "number", "street", "coffee", "ticket", "garden", "office", "model", "value",
          "check", "route", "level", "table", "light", "sound", "water", "house", "black", "white", "small", "large")


#: letters a sans-serif font draws alike (I / l, O / o / 0, the case of c k o s v w x z): not in random letter strings
AMBIGUOUS = "IlOoCcKkSsVvWwXxZz"


class Unavailable(RuntimeError):
    """The wheel could not be fetched (no registry here): the caller skips, or fails under :data:`REQUIRE_ENV`."""


def fetch(folder: Path, *, timeout: float = 300.0) -> Path:
    """``folder/rec.onnx``: the recognizer unzipped from the wheel ``pip download`` fetches into ``folder``
    (reused when it is already there).

    Raises:
        Unavailable: ``pip download`` failed (its last line) or the wheel lacks the model.
    """
    folder = Path(folder)
    out = folder / "rec.onnx"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob("rapidocr_onnxruntime-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
               "-q", "-d", str(folder), WHEEL]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"pip download {WHEEL}: {e}") from None
        wheels = sorted(folder.glob("rapidocr_onnxruntime-*.whl"))
        if r.returncode or not wheels:
            tail = (r.stderr or r.stdout).strip().splitlines()
            raise Unavailable(f"pip download {WHEEL} failed (exit {r.returncode}): {tail[-1] if tail else ''}")
    with zipfile.ZipFile(wheels[-1]) as z:
        try:
            data = z.read(MEMBER)
        except KeyError:
            raise Unavailable(f"{wheels[-1].name} has no {MEMBER}") from None
    tmp = out.with_suffix(".partial")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out


def fetch_or_skip(folder: Path) -> Path:
    """:func:`fetch` for a test: skip when the wheel cannot be fetched (fail under :data:`REQUIRE_ENV` ``=1``), and
    when onnxruntime-qnn is absent (the recognizer's tests run on the emulated HTP)."""
    import pytest

    pytest.importorskip("onnxruntime_qnn")
    try:
        return fetch(folder)
    except Unavailable as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1: {e}", pytrace=False)
        pytest.skip(f"the PP-OCRv4 recognizer could not be fetched: {e}")


def characters(model: Path) -> list[str]:
    """The decoding table: ``blank``, the model's ``character`` metadata lines, a space (rapidocr's
    ``CTCLabelDecode``)."""
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(model), load_external_data=False).metadata_props}
    return ["blank", *meta["character"].splitlines(), " "]


def alphabet(chars: Sequence[str]) -> str:
    """The ASCII letters and digits of the model's character list (what the rendered lines use)."""
    return "".join(sorted(c for c in set(chars) if len(c) == 1 and c.isascii() and c.isalnum()))


def texts(n: int, seed: int, chars: Sequence[str]) -> list[str]:
    """``n`` seeded text lines: one or two words (a dictionary word, capitalized or not, a random letter string,
    a number), only characters of ``chars``."""
    rng = np.random.default_rng(seed)
    ok = set(alphabet(chars))
    letters = "".join(c for c in alphabet(chars) if c.isalpha() and c not in AMBIGUOUS)
    out = []
    while len(out) < n:
        words = []
        for _ in range(int(rng.integers(1, 3))):
            kind = int(rng.integers(0, 4))
            if kind == 0:
                w = str(rng.choice(_WORDS))
            elif kind == 1:
                w = str(rng.choice(_WORDS)).capitalize()
            elif kind == 2:
                w = "".join(rng.choice(list(letters), int(rng.integers(3, 7))))
            else:
                w = str(int(rng.integers(10, 100000)))
            words.append(w)
        line = " ".join(words)
        if set(line) - {" "} <= ok and line not in out:
            out.append(line)
    return out


def render(text: str, *, size: int = FONT_SIZE) -> np.ndarray:
    """``text`` in black on white, Pillow's built-in font, as an ``H x W x 3`` uint8 image of height
    :data:`HEIGHT` (4 pixels of margin left and right)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=size)
    x0, _, x1, _ = font.getbbox(text)
    asc, desc = font.getmetrics()
    img = Image.new("RGB", (x1 - x0 + 8, HEIGHT), "white")
    ImageDraw.Draw(img).text((4 - x0, (HEIGHT - asc - desc) // 2), text, fill="black", font=font)
    return np.asarray(img)


def preprocess(img: np.ndarray) -> np.ndarray:
    """rapidocr's ``resize_norm_img`` for one line (``max_wh_ratio`` = 320 / 48): resized to height 48 keeping its
    aspect ratio (at most :data:`WIDTH` wide), ``/255 - 0.5) / 0.5``, zero-padded on the right: ``[1, 3, 48, 320]``."""
    from PIL import Image

    h, w = img.shape[:2]
    rw = min(WIDTH, int(np.ceil(HEIGHT * w / h)))
    if (h, w) != (HEIGHT, rw):  # cv2.resize's default is bilinear
        img = np.asarray(Image.fromarray(img).resize((rw, HEIGHT), Image.BILINEAR))
    x = (img.astype(np.float32).transpose(2, 0, 1) / 255 - 0.5) / 0.5
    out = np.zeros((1, 3, HEIGHT, WIDTH), np.float32)
    out[0, :, :, :rw] = x
    return out


def write_dataset(folder: Path, model: Path, *, calibration: int = 16, evaluation: int = 12, held_out: int = 48,
                  seed: int = 29) -> dict[str, Any]:
    """The files a user of ``ivq tune`` keeps, every line distinct: ``folder/cal/NNN.npz`` (calibration lines),
    ``folder/eval/NNN.npz`` (the tune's evaluation lines, ``folder/eval.json`` their labels) and
    ``folder/held/NNN.npz`` (lines neither calibrated on nor tuned on, ``folder/held.json``). A labels file holds
    ``characters`` and ``labels`` (the texts in file order): what ``ppocr_metric.exact_match`` reads. Returns the
    paths (``cal``, ``eval``, ``held``: lists of files, ``eval_labels``, ``held_labels``) and the texts."""
    chars = characters(model)
    lines = texts(calibration + evaluation + held_out, seed, chars)
    parts = {"cal": lines[:calibration], "eval": lines[calibration:calibration + evaluation],
             "held": lines[calibration + evaluation:]}
    folder = Path(folder)
    out: dict[str, Any] = {"cal": folder / "cal", "texts": parts}
    for name, ts in parts.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        files = []
        for i, t in enumerate(ts):
            files.append(folder / name / f"{i:03d}.npz")
            np.savez(files[-1], x=preprocess(render(t)))
        if name != "cal":
            out[name] = files
            out[f"{name}_labels"] = write_labels(folder / f"{name}.json", chars, ts)
    return out


def write_labels(path: Path, chars: Sequence[str], labels: Sequence[str]) -> Path:
    """A labels file for ``ppocr_metric.exact_match`` (``IVQ_PPOCR_LABELS``)."""
    Path(path).write_text(json.dumps({"characters": list(chars), "labels": list(labels)}))
    return Path(path)
