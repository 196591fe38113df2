"""The synthetic caption task the reference VLMs are trained on.

An image holds two coloured shapes; the caption names them and their spatial relation, e.g.
``"red square left of blue circle"``. The first-named object is the one whose colour comes first in
:data:`COLOURS` (the two colours always differ), so every image has exactly one correct caption and
both the colour words and the relation word depend on the pixels. This is the deployment failure the
reference reproduces: INT8 breaks colour and spatial words first.

Everything here is numpy only (no torch): images, the prompt layout, the word-level tokenizer (saved as
a real Hugging Face ``tokenizer.json``), the seeded eval set and :func:`caption_accuracy`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: colour words and their RGB in [0, 1]; the order decides which object is named first
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.12, 0.10),
    "green": (0.10, 0.75, 0.15),
    "blue": (0.12, 0.22, 0.92),
    "yellow": (0.92, 0.85, 0.10),
}
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
#: relation of the first-named object to the second
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

#: special tokens (ids 0..7 in this order), then the caption words
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
IMG_START, IMG_END, IMAGE, VIDEO = "<img>", "</img>", "<image>", "<video>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, IMG_START, IMG_END, IMAGE, VIDEO)
PROMPT_WORD = "caption"
WORDS: tuple[str, ...] = (
    PROMPT_WORD, *COLOURS, *SHAPES, *dict.fromkeys(w for r in RELATIONS for w in r.split()),
)
VOCAB: dict[str, int] = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *WORDS))}
#: model vocabulary size (>= len(VOCAB); unused rows are never produced by a trained model)
VOCAB_SIZE = 32
#: longest caption in tokens ("c s left of c s" + eos)
MAX_CAPTION_TOKENS = 7

#: image normalisation applied before the vision tower: x -> (x - mean) / std
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5


@dataclass(frozen=True)
class Scene:
    """One image's content: two objects (colour, shape, centre in [0, 1] image coordinates)."""

    colours: tuple[str, str]
    shapes: tuple[str, str]
    relation: str
    centres: tuple[tuple[float, float], tuple[float, float]]  # (x, y) of the first- and second-named object
    size: float  # half-extent of each object, as a fraction of the image side

    @property
    def caption(self) -> str:
        """The one correct caption."""
        return f"{self.colours[0]} {self.shapes[0]} {self.relation} {self.colours[1]} {self.shapes[1]}"


@dataclass
class Sample:
    """One eval/training sample: the scene, its rendered image (HWC float32 in [0, 1]) and caption."""

    index: int
    scene: Scene
    image: np.ndarray
    caption: str
    bucket: int


def sample_scene(rng: np.random.Generator) -> Scene:
    """Draw a random scene: two different colours, any shapes, one of the four relations."""
    names = list(COLOURS)
    ci = sorted(rng.choice(len(names), size=2, replace=False).tolist())
    colours = (names[ci[0]], names[ci[1]])
    shapes = (SHAPES[int(rng.integers(len(SHAPES)))], SHAPES[int(rng.integers(len(SHAPES)))])
    relation = RELATIONS[int(rng.integers(len(RELATIONS)))]
    size = float(rng.uniform(0.16, 0.20))
    near, far = 0.25, 0.75
    a = float(rng.uniform(near - 0.04, near + 0.04))
    b = float(rng.uniform(far - 0.04, far + 0.04))
    c1, c2 = (float(v) for v in rng.uniform(0.3, 0.7, size=2))
    if relation == "left of":
        centres = ((a, c1), (b, c2))
    elif relation == "right of":
        centres = ((b, c1), (a, c2))
    elif relation == "above":
        centres = ((c1, a), (c2, b))
    else:
        centres = ((c1, b), (c2, a))
    return Scene(colours, shapes, relation, centres, size)


def _shape_mask(shape: str, h: int, w: int, cx: float, cy: float, r: float) -> np.ndarray:
    """Boolean mask of one shape; coordinates in pixels (pixel centres at +0.5)."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    dx, dy = xx - cx, yy - cy
    if shape == "square":
        return (np.abs(dx) <= r * 0.9) & (np.abs(dy) <= r * 0.9)
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "triangle":  # apex up, base at cy + r
        t = (dy + r) / (2 * r)  # 0 at apex, 1 at base
        return (t >= 0) & (t <= 1) & (np.abs(dx) <= t * r)
    raise ValueError(f"unknown shape {shape!r}")


def render(scene: Scene, size: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Rasterize a scene into an ``[size, size, 3]`` float32 image in [0, 1] (numpy only).

    With ``rng``, colours get a small jitter and the background a little noise (training
    augmentation and eval variety); without it the rendering is exact.
    """
    img = np.full((size, size, 3), 0.35, dtype=np.float32)
    if rng is not None:
        img += rng.normal(0.0, 0.02, size=img.shape).astype(np.float32)
    for colour, shape, (x, y) in zip(scene.colours, scene.shapes, scene.centres, strict=True):
        rgb = np.asarray(COLOURS[colour], dtype=np.float32)
        if rng is not None:
            rgb = rgb + rng.uniform(-0.06, 0.06, size=3).astype(np.float32)
        m = _shape_mask(shape, size, size, x * size, y * size, scene.size * size)
        img[m] = rgb
    return np.clip(img, 0.0, 1.0)


def make_samples(n: int, bucket: int, seed: int, start: int = 0) -> list[Sample]:
    """``n`` seeded samples rendered at ``bucket`` pixels (same seed → same samples, any machine)."""
    rng = np.random.default_rng([seed, bucket])
    out = []
    for i in range(n):
        scene = sample_scene(rng)
        out.append(Sample(start + i, scene, render(scene, bucket, rng), scene.caption, bucket))
    return out


#: seed of the fixed eval set
EVAL_SEED = 1234
#: samples per bucket in the fixed eval set
EVAL_SIZE = 64


def eval_set(bucket: int, n: int = EVAL_SIZE, seed: int = EVAL_SEED) -> list[Sample]:
    """The fixed, seeded eval set for one resolution bucket (disjoint seed from training)."""
    return make_samples(n, bucket, seed)


# ------------------------------------------------------------------------------------------- prompt
def prompt_tokens(num_image_tokens: int) -> list[str]:
    """The prompt: ``<bos> <img> <image>×N </img> caption``; the model continues with the caption."""
    return [BOS, IMG_START, *([IMAGE] * num_image_tokens), IMG_END, PROMPT_WORD]


def prompt_ids(num_image_tokens: int) -> list[int]:
    """Token ids of :func:`prompt_tokens`."""
    return [VOCAB[t] for t in prompt_tokens(num_image_tokens)]


def caption_ids(caption: str) -> list[int]:
    """Token ids of a caption followed by ``<eos>``."""
    return [VOCAB.get(w, VOCAB[UNK]) for w in caption.split()] + [VOCAB[EOS]]


def decode_ids(ids: Sequence[int]) -> str:
    """Caption text of generated ids (stops at ``<eos>``; special tokens dropped)."""
    inv = {i: t for t, i in VOCAB.items()}
    words = []
    for i in ids:
        if int(i) == VOCAB[EOS]:
            break
        t = inv.get(int(i), UNK)
        if t not in SPECIAL_TOKENS:
            words.append(t)
    return " ".join(words)


def normalize(image: np.ndarray) -> np.ndarray:
    """HWC [0, 1] image → CHW float32 normalised with :data:`PIXEL_MEAN` / :data:`PIXEL_STD`."""
    return ((np.asarray(image, np.float32).transpose(2, 0, 1) - PIXEL_MEAN) / PIXEL_STD).astype(np.float32)


# ------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer() -> Any:
    """The word-level tokenizer as a ``transformers`` fast tokenizer (``tokenizers`` WordLevel model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(dict(VOCAB), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[IMG_START, IMG_END, IMAGE, VIDEO],
    )


def save_tokenizer(folder: str | os.PathLike) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` into ``folder`` (loadable by ``AutoTokenizer``)."""
    folder = Path(folder)
    build_tokenizer().save_pretrained(folder)
    return folder / "tokenizer.json"


# ------------------------------------------------------------------------------------------- accuracy
@dataclass
class CaptionAccuracy:
    """Caption accuracy of predictions against references.

    ``exact_match`` is the fraction of captions equal word for word. The slot accuracies parse each
    caption as ``colour shape relation colour shape`` and score: ``colour`` over both colour slots,
    ``shape`` over both shape slots, ``position`` over the relation slot. A prediction that does not
    parse scores 0 in every slot.
    """

    n: int
    exact_match: float
    colour: float
    shape: float
    position: float
    failures: list[tuple[int, str, str]] = field(default_factory=list)  # (index, predicted, reference)

    def as_dict(self) -> dict[str, float]:
        """The numbers (without the failure list)."""
        return {
            "n": self.n, "exact_match": self.exact_match, "colour": self.colour, "shape": self.shape,
            "position": self.position,
        }


def parse_caption(caption: str) -> tuple[str, str, str, str, str] | None:
    """Split a caption into ``(colour1, shape1, relation, colour2, shape2)``; None when it does not parse."""
    w = caption.split()
    if len(w) < 5:
        return None
    rel = " ".join(w[2:-2])
    return (w[0], w[1], rel, w[-2], w[-1])


def caption_accuracy(predictions: Sequence[str], references: Sequence[str]) -> CaptionAccuracy:
    """Exact-match and per-word-slot accuracy of predicted captions (any backend's decoded text)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    n = len(references)
    exact = colour = shape = position = 0
    failures = []
    for i, (p, r) in enumerate(zip(predictions, references, strict=True)):
        p, r = " ".join(p.split()), " ".join(r.split())
        if p == r:
            exact += 1
        else:
            failures.append((i, p, r))
        pp, rr = parse_caption(p), parse_caption(r)
        if pp is None or rr is None:
            continue
        colour += (pp[0] == rr[0]) + (pp[3] == rr[3])
        shape += (pp[1] == rr[1]) + (pp[4] == rr[4])
        position += pp[2] == rr[2]
    d = max(n, 1)
    return CaptionAccuracy(n, exact / d, colour / (2 * d), shape / (2 * d), position / d, failures)
