"""The reference VLM families (one table) and fresh (untrained) builds, from transformers' own classes.

* ``internvl-tiny``: ``InternVLForConditionalGeneration`` = InternViT-style vision tower +
  ``multi_modal_projector`` (InternVL's ``mlp1``) + a Qwen2 text model, eager attention.
* ``qwen2vl-tiny``: ``Qwen2VLForConditionalGeneration`` = Qwen2-VL vision transformer with its patch
  merger + a Qwen2-VL text model with sectioned M-RoPE (``mrope_section=[2, 3, 3]``), eager attention.
* ``qwen3vl-tiny``: ``Qwen3VLForConditionalGeneration`` = Qwen3-VL vision transformer (learned position
  table, bilinearly resampled per grid) whose blocks 0 and 1 also feed **DeepStack** mergers, + a Qwen3-VL
  text model (q/k RMSNorm) with **interleaved** M-RoPE (``mrope_section=[3, 3, 2]``); DeepStack feature
  ``k`` is added to the hidden states at the image-token positions after LLM layer ``k``.

Everything that differs between the families is a field of :class:`Family` in :data:`FAMILIES`;
the rest of :mod:`ivq_debug.vlm` reads those fields instead of testing family names.

All use the word-level vocabulary of :mod:`ivq_debug.vlm.task` and ``initializer_range=0.1`` (the
notes measured argmax gaps >= 8e-3 with it, against ~1e-6 ORT error). Resolution buckets are square
image sizes; each gives ``(size / 28) ** 2`` image tokens (14-pixel patches, 2x2 merge / pixel shuffle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ivq_debug.vlm import task

#: resolution buckets (square image side in pixels); one vision and one prefill graph per bucket
BUCKETS: tuple[int, ...] = (56, 84, 112)
#: default bucket
DEFAULT_BUCKET = 112
PATCH = 14
MERGE = 2
#: generation budget (longest caption + eos)
MAX_NEW_TOKENS = task.MAX_CAPTION_TOKENS + 1
#: fixed KV-cache length of the decode graph (>= longest prefill + MAX_NEW_TOKENS)
MAX_CACHE = 32
#: additive attention-mask value for masked positions (finite: the deployment convention)
MASK_VALUE = -1.0e4
#: M-RoPE layouts: how the t/h/w position rows map onto the rotary frequencies
MROPE_LAYOUTS: tuple[str, ...] = ("sectioned", "interleaved")
#: vision output holding the merged image features ``[1, N, D]``
IMAGE_FEATURES = "image_features"
#: vision output of DeepStack feature ``k`` ``[1, N, D]`` (one row per image token)
DEEPSTACK_OUTPUT = "deepstack_features.{k}"
#: prefill input of DeepStack feature ``k`` ``[1, S, D]``: scattered to the image-token rows, zeros elsewhere
DEEPSTACK_INPUT = "deepstack_embeds.{k}"

_TEXT = dict(
    vocab_size=task.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
    tie_word_embeddings=False, bos_token_id=task.VOCAB[task.BOS], eos_token_id=task.VOCAB[task.EOS],
    pad_token_id=task.VOCAB[task.PAD],
)


def num_image_tokens(bucket: int) -> int:
    """LLM image tokens produced for one ``bucket``-pixel square image."""
    if bucket % (PATCH * MERGE):
        raise ValueError(f"bucket {bucket} is not a multiple of {PATCH * MERGE}")
    return (bucket // (PATCH * MERGE)) ** 2


def prefill_len(bucket: int) -> int:
    """Static prefill length of a bucket (the prompt: bos, <img>, N image tokens, </img>, caption)."""
    return len(task.prompt_ids(num_image_tokens(bucket)))


def internvl_config() -> Any:
    """Config of ``internvl-tiny``."""
    from transformers import InternVLConfig

    cfg = InternVLConfig(
        vision_config=dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            image_size=max(BUCKETS), patch_size=PATCH, use_mean_pooling=False, initializer_range=0.1,
            hidden_act="gelu",
        ),
        text_config=dict(model_type="qwen2", **_TEXT),
        image_token_id=task.VOCAB[task.IMAGE], image_seq_length=num_image_tokens(DEFAULT_BUCKET),
        downsample_ratio=1 / MERGE, projector_hidden_act="gelu", tie_word_embeddings=False,
        vision_feature_layer=-1, vision_feature_select_strategy="default",
        bos_token_id=task.VOCAB[task.BOS], eos_token_id=task.VOCAB[task.EOS], pad_token_id=task.VOCAB[task.PAD],
    )
    return cfg


_QWEN_TOKENS = dict(
    image_token_id=task.VOCAB[task.IMAGE], video_token_id=task.VOCAB[task.VIDEO],
    vision_start_token_id=task.VOCAB[task.IMG_START], vision_end_token_id=task.VOCAB[task.IMG_END],
    tie_word_embeddings=False,
)


def qwen2vl_config() -> Any:
    """Config of ``qwen2vl-tiny``."""
    from transformers import Qwen2VLConfig

    cfg = Qwen2VLConfig(
        vision_config=dict(
            depth=2, embed_dim=64, hidden_size=_TEXT["hidden_size"], num_heads=4, mlp_ratio=2,
            patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, initializer_range=0.1,
        ),
        text_config=dict(
            **_TEXT, rope_parameters=dict(rope_type="default", rope_theta=1.0e4, mrope_section=[2, 3, 3]),
        ),
        **_QWEN_TOKENS,
        bos_token_id=task.VOCAB[task.BOS], eos_token_id=task.VOCAB[task.EOS], pad_token_id=task.VOCAB[task.PAD],
    )
    return cfg


#: vision blocks of ``qwen3vl-tiny`` whose outputs feed the DeepStack mergers (inside its depth of 3)
QWEN3VL_DEEPSTACK_INDEXES: tuple[int, ...] = (0, 1)


def qwen3vl_config() -> Any:
    """Config of ``qwen3vl-tiny``.

    The vision tower is 3 blocks deep with ``deepstack_visual_indexes=[0, 1]``: both DeepStack taps lie
    inside the tower (a tiny config that kept the full-size ``[8, 16, 24]`` would build the mergers and
    never run them). Three text layers, so both DeepStack adds (after layers 0 and 1) land before the last
    one. ``head_dim=16`` gives 8 rotary frequencies, split ``mrope_section=[3, 3, 2]`` (t, h, w) and laid
    out interleaved (``t h w t h w t h``), the small-scale image of the full model's ``[24, 20, 20]`` over 64.
    transformers 5.24's ``Qwen3VLTextRotaryEmbedding`` always interleaves; ``mrope_interleaved=True`` is
    stored as the released checkpoints store it. Vision width 32 keeps the three mergers (4·32 → 4·32 → 64
    each) and the model at ~255k parameters, the range of the other two references.
    """
    from transformers import Qwen3VLConfig

    text = dict(_TEXT, num_hidden_layers=3)
    cfg = Qwen3VLConfig(
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
            spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=_TEXT["hidden_size"],
            num_position_embeddings=(max(BUCKETS) // PATCH) ** 2,
            deepstack_visual_indexes=list(QWEN3VL_DEEPSTACK_INDEXES), initializer_range=0.1,
        ),
        text_config=dict(
            **text, head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=1.0e4, mrope_section=[3, 3, 2],
                                 mrope_interleaved=True),
        ),
        **_QWEN_TOKENS,
    )
    return cfg


def _redraw_internvl_position_table(model: Any) -> None:
    """HF leaves InternVL's position table and cls token at zero; draw them as the notes did."""
    import torch

    emb = model.model.vision_tower.embeddings
    with torch.no_grad():
        emb.position_embeddings.normal_(0.0, 0.02)
        emb.cls_token.normal_(0.0, 0.02)


@dataclass(frozen=True)
class Family:
    """What the split pipeline needs to know about one VLM family (one row of :data:`FAMILIES`).

    Attributes:
        name: family name stored in manifests and dumps (``"qwen3vl"``).
        model_type: ``config.model_type`` of its checkpoints.
        model_class: the transformers class (``from_pretrained`` / config builds).
        reference: name of the shipped tiny reference.
        config: builder of the reference config.
        patches: the vision tower takes flattened patches ``[h·w, 3·2·14·14]`` + a grid (Qwen-VL);
            otherwise ``[1, 3, H, W]`` pixels (InternVL).
        mrope_layout: ``None`` for 1-D RoPE; ``"sectioned"`` (Qwen2-VL: contiguous t | h | w frequency
            sections) or ``"interleaved"`` (Qwen3-VL: t h w t h w …) for 3-D M-RoPE positions.
        deepstack: the vision tower also returns DeepStack features that the LLM adds at the image-token
            positions after its first layers.
        post_build: fix-up of a freshly initialised reference (seeded), or None.
    """

    name: str
    model_type: str
    model_class: str
    reference: str
    config: Callable[[], Any]
    patches: bool = False
    mrope_layout: str | None = None
    deepstack: bool = False
    post_build: Callable[[Any], None] | None = None

    @property
    def mrope(self) -> bool:
        """3-D M-RoPE positions (``[3, 1, S]``) with a rope delta."""
        return self.mrope_layout is not None


#: the supported families, by name
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("internvl", "internvl", "InternVLForConditionalGeneration", "internvl-tiny", internvl_config,
               post_build=_redraw_internvl_position_table),
        Family("qwen2vl", "qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2vl-tiny", qwen2vl_config,
               patches=True, mrope_layout="sectioned"),
        Family("qwen3vl", "qwen3_vl", "Qwen3VLForConditionalGeneration", "qwen3vl-tiny", qwen3vl_config,
               patches=True, mrope_layout="interleaved", deepstack=True),
    )
}
#: ``config.model_type`` → family name
MODEL_TYPES: dict[str, str] = {f.model_type: f.name for f in FAMILIES.values()}
#: the shipped reference models
MODEL_NAMES: tuple[str, ...] = tuple(f.reference for f in FAMILIES.values())


def family_of_reference(name: str) -> Family:
    """The family of a shipped reference name; ValueError for an unknown name."""
    for f in FAMILIES.values():
        if f.reference == name:
            return f
    raise ValueError(f"unknown reference model {name!r}; choose from {MODEL_NAMES}")


def build_model(name: str, seed: int = 0) -> Any:
    """A freshly initialised (untrained) reference model in eval mode with eager attention."""
    import torch
    import transformers

    fam = family_of_reference(name)
    torch.manual_seed(seed)
    cfg = fam.config()
    set_eager(cfg)
    model = getattr(transformers, fam.model_class)(cfg)
    if fam.post_build is not None:
        fam.post_build(model)
    configure_generation(model)
    return model.eval()


def set_eager(cfg: Any) -> None:
    """Select eager attention in a config and its sub-configs (plain MatMul/Softmax in exported graphs)."""
    cfg._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        sc = getattr(cfg, sub, None)
        if sc is not None:
            sc._attn_implementation = "eager"


def configure_generation(model: Any) -> None:
    """Greedy generation defaults matching the task (eos/pad ids, caption budget)."""
    gc = model.generation_config
    gc.eos_token_id = task.VOCAB[task.EOS]
    gc.pad_token_id = task.VOCAB[task.PAD]
    gc.bos_token_id = task.VOCAB[task.BOS]
    gc.do_sample = False
    gc.max_new_tokens = MAX_NEW_TOKENS


def family_of(model_or_config: Any) -> str:
    """The family name (``"internvl"``, ``"qwen2vl"``, ``"qwen3vl"``) of a model or config; ValueError otherwise."""
    cfg = getattr(model_or_config, "config", model_or_config)
    mt = getattr(cfg, "model_type", None)
    if mt not in MODEL_TYPES:
        raise ValueError(f"not a supported VLM (model_type={mt!r}; supported: {sorted(MODEL_TYPES)})")
    return MODEL_TYPES[mt]


def family(model_or_name: Any) -> Family:
    """The :class:`Family` row of a model, a config or a family name."""
    return FAMILIES[model_or_name if isinstance(model_or_name, str) else family_of(model_or_name)]


def deepstack_count(model: Any) -> int:
    """Number of DeepStack features the vision tower returns (0 for families without DeepStack)."""
    if not family(model).deepstack:
        return 0
    return len(model.config.vision_config.deepstack_visual_indexes)


def param_count(model: Any) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters())
