"""Loading reference VLMs: the shipped names or any local folder saved with ``save_pretrained``.

Both go through the same code path (``from_pretrained`` of the family's transformers class, eager
attention). ``trust_remote_code`` is passed on only when asked for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ivq_debug.errors import InputError, one_line
from ivq_debug.vlm.build import BUCKETS, FAMILIES, MODEL_NAMES, MODEL_TYPES, set_eager
from ivq_debug.vlm.train import REFERENCE_JSON

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference"


@dataclass
class LoadedVLM:
    """A loaded VLM and what was found beside it."""

    name: str
    path: Path
    family: str  # a family name of ivq_debug.vlm.build.FAMILIES ("internvl", "qwen2vl", "qwen3vl")
    model: Any
    tokenizer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)  # ivq_reference.json, when present

    @property
    def buckets(self) -> list[int]:
        """Resolution buckets from the metadata (default: the reference buckets)."""

        return [int(b) for b in self.meta.get("buckets", BUCKETS)]


def reference_path(name: str) -> Path:
    """Folder of a shipped reference model (``internvl-tiny`` / ``qwen2vl-tiny`` / ``qwen3vl-tiny``)."""

    if name not in MODEL_NAMES:
        raise InputError(f"unknown reference model {name!r}; shipped: {', '.join(MODEL_NAMES)}")
    return REFERENCE_DIR / name


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A shipped name → its folder; anything else is taken as a folder path."""

    s = os.fspath(name_or_path)
    if s in MODEL_NAMES:
        return reference_path(s)
    return Path(s).expanduser()


def load_vlm(name_or_path: str | os.PathLike, trust_remote_code: bool = False) -> LoadedVLM:
    """Load a VLM checkpoint folder (or a shipped reference name) for the split pipeline.

    Raises:
        InputError: the folder is missing, has no ``config.json``, is not a checkpoint of a supported
            family (InternVL, Qwen2-VL, Qwen3-VL), or its weights cannot be loaded (the message names the folder).
    """

    path = resolve(name_or_path)
    if not path.exists():
        raise InputError("model folder does not exist", path)
    if not path.is_dir():
        raise InputError("not a model folder (expected a directory saved with save_pretrained)", path)
    if not (path / "config.json").is_file():
        raise InputError("not a Hugging Face checkpoint (no config.json)", path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"unreadable config.json: {e}", path) from e
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in MODEL_TYPES:
        raise InputError(
            f"not a supported VLM checkpoint (model_type={model_type!r}; supported: {', '.join(sorted(MODEL_TYPES))})",
            path,
        )
    family = MODEL_TYPES[model_type]
    import transformers

    cls = getattr(transformers, FAMILIES[family].model_class)
    kw: dict[str, Any] = {"attn_implementation": "eager"}
    if trust_remote_code:
        kw["trust_remote_code"] = True
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a per-load "Loading weights" bar is noise in CLI and notebook output
        model = cls.from_pretrained(str(path), **kw)
    except Exception as e:  # safetensors / config / shape errors all mean: this folder does not load
        raise InputError(f"cannot load the checkpoint: {one_line(e, 300)}", path) from e

    set_eager(model.config)
    model.eval()
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    meta: dict[str, Any] = {}

    if (path / REFERENCE_JSON).is_file():
        try:
            meta = json.loads((path / REFERENCE_JSON).read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"bad JSON: {e}", path / REFERENCE_JSON) from e
    return LoadedVLM(os.fspath(name_or_path), path, family, model, tokenizer, meta)
