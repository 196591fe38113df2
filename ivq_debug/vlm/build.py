"""Configs and fresh (untrained) builds of the two reference VLMs, from transformers' own classes.

* ``internvl-tiny``: ``InternVLForConditionalGeneration`` = InternViT-style vision tower +
  ``multi_modal_projector`` (InternVL's ``mlp1``) + a Qwen2 text model, eager attention.
* ``qwen2vl-tiny``: ``Qwen2VLForConditionalGeneration`` = Qwen2-VL vision transformer with its patch
  merger + a Qwen2-VL text model with M-RoPE (``mrope_section=[2, 3, 3]``), eager attention.

Both use the word-level vocabulary of :mod:`ivq_debug.vlm.task` and ``initializer_range=0.1`` (the
notes measured argmax gaps >= 8e-3 with it, against ~1e-6 ORT error). Resolution buckets are square
image sizes; each gives ``(size / 28) ** 2`` image tokens (14-pixel patches, 2x2 merge / pixel shuffle).
"""

from __future__ import annotations

from typing import Any

from ivq_debug.vlm import task

#: the shipped reference models
MODEL_NAMES: tuple[str, ...] = ("internvl-tiny", "qwen2vl-tiny")
#: model families (``model_type`` of the top-level config → family)
FAMILIES: dict[str, str] = {"internvl": "internvl", "qwen2_vl": "qwen2vl"}
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
        image_token_id=task.VOCAB[task.IMAGE], video_token_id=task.VOCAB[task.VIDEO],
        vision_start_token_id=task.VOCAB[task.IMG_START], vision_end_token_id=task.VOCAB[task.IMG_END],
        tie_word_embeddings=False,
        bos_token_id=task.VOCAB[task.BOS], eos_token_id=task.VOCAB[task.EOS], pad_token_id=task.VOCAB[task.PAD],
    )
    return cfg


def build_model(name: str, seed: int = 0) -> Any:
    """A freshly initialised (untrained) reference model in eval mode with eager attention."""
    import torch

    if name not in MODEL_NAMES:
        raise ValueError(f"unknown reference model {name!r}; choose from {MODEL_NAMES}")
    torch.manual_seed(seed)
    if name == "internvl-tiny":
        from transformers import InternVLForConditionalGeneration

        cfg = internvl_config()
        set_eager(cfg)
        model = InternVLForConditionalGeneration(cfg)
        emb = model.model.vision_tower.embeddings
        with torch.no_grad():  # HF leaves these at zero; draw them as the notes did
            emb.position_embeddings.normal_(0.0, 0.02)
            emb.cls_token.normal_(0.0, 0.02)
    else:
        from transformers import Qwen2VLForConditionalGeneration

        cfg = qwen2vl_config()
        set_eager(cfg)
        model = Qwen2VLForConditionalGeneration(cfg)
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
    """``"internvl"`` or ``"qwen2vl"`` for a model or config; ValueError for anything else."""
    cfg = getattr(model_or_config, "config", model_or_config)
    mt = getattr(cfg, "model_type", None)
    if mt not in FAMILIES:
        raise ValueError(f"not a supported VLM (model_type={mt!r}; supported: {sorted(FAMILIES)})")
    return FAMILIES[mt]


def param_count(model: Any) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters())
