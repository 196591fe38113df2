"""The deployment runner for an HF-style dynamic-cache export (:mod:`ivq_debug.vlm.export_dynamic`).

Same loop, records and positions policy as :class:`~ivq_debug.vlm.scheduler.Scheduler` (which drives the
fixed-cache export), with the dynamic cache of HF / optimum split exports:

1. vision: ``pixel_values`` → ``image_features`` (Qwen3-VL: and ``deepstack_features.{k}``); prompt embeddings
   with the image rows scattered (numpy);
2. prefill with a 2-D int64 ``attention_mask`` of ones, the prompt's ``position_ids`` and (Qwen3-VL) the
   DeepStack inputs routed by the :class:`~ivq_debug.vlm.scheduler.DeepStackPolicy`, as the fixed-cache loop;
3. decode step ``k = 1, 2, …``: the token chosen at step ``k-1``, ``attention_mask`` of ``P + 1`` ones,
   ``position_ids`` from the :class:`~ivq_debug.vlm.scheduler.PositionsPolicy` (not fed when the decode
   graph has no position input: it computes them from the cache length) and the previous ``present.*``
   as ``past_key_values.*``: the cache grows by one slot per step.

Records are keyed ``(sample, part, step)`` with the same meta as the fixed-cache scheduler
(``input_ids``, ``position_ids`` when fed, ``attention_mask``, ``cache_len``, ``token``, ``forced_token``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import InputError, UsageError
from ivq_debug.vlm.build import DEEPSTACK_OUTPUT, IMAGE_FEATURES
from ivq_debug.vlm.export_dynamic import load_dynamic_manifest
from ivq_debug.vlm.parts_dynamic import PAST_PREFIX, PRESENT_PREFIX
from ivq_debug.vlm.scheduler import DeepStackPolicy, Generation, PositionsPolicy, Scheduler, SplitSpec


def dynamic_spec(folder: str | os.PathLike, bucket: int | None = None) -> tuple[SplitSpec, dict[str, Any]]:
    """The :class:`SplitSpec` of one bucket of a dynamic-cache export folder, and its manifest."""

    folder = Path(folder)
    m = load_dynamic_manifest(folder)
    bucket = int(bucket if bucket is not None else m["buckets"][0])
    if bucket not in m["buckets"]:
        raise UsageError(f"bucket {bucket} was not exported (exported: {m['buckets']})")
    paths = {p["part"]: folder / p["path"] for p in m["parts"] if p["part"] != "vision" or p["bucket"] == bucket}
    emb_path = folder / m["embedding"]
    if not emb_path.is_file():
        raise InputError("embedding table missing", emb_path)
    spec = SplitSpec(
        family=m["family"], bucket=bucket, prompt_ids=list(m["prompt_ids"][str(bucket)]),
        prefill_positions=np.asarray(m["prefill_position_ids"][str(bucket)], dtype=np.int64),
        embedding=np.load(emb_path, allow_pickle=False), image_token_id=int(m["image_token_id"]),
        eos_token_id=int(m["eos_token_id"]), max_cache=int(m["max_positions"]),
        kv_shape=(1, int(m["kv_heads"]), int(m["max_positions"]), int(m["head_dim"])),
        num_layers=int(m["num_layers"]), mask_value=0.0,  # unused: the graphs take a 1/0 int64 mask
        deepstack=int(m.get("deepstack", 0)), mrope_layout=m.get("mrope_layout"), part_paths=paths,
    )
    return spec, m


class DynamicScheduler(Scheduler):
    """Split vision / prefill / decode runner over a dynamic (growing, whole-cache) KV cache.

    Args:
        spec: see :func:`dynamic_spec`.
        runners: ``{"vision": r, "prefill": r, "decode": r}``, objects with ``run(feeds, writer)``.
        positions: a :class:`PositionsPolicy` or its mode name (``correct`` when the decode graph has no
            position input: the graph decides).
        max_new_tokens: generation budget (default: the task's).
        decode_position_input: whether the decode graph takes ``position_ids``.
    """

    def __init__(
        self, spec: SplitSpec, runners: dict[str, Any], positions: PositionsPolicy | str = "correct",
        max_new_tokens: int | None = None, decode_position_input: bool = True, *,
        deepstack: DeepStackPolicy | str = "correct",
    ) -> None:
        super().__init__(spec, runners, positions, max_new_tokens, deepstack=deepstack)
        self.decode_position_input = decode_position_input
        if not decode_position_input and self.positions.mode != "correct":
            raise UsageError(f"positions mode {self.positions.mode!r} needs a decode graph with a position_ids "
                             "input (this one computes its positions from the cache length)")

    @classmethod
    def from_export(
        cls, folder: str | os.PathLike, bucket: int | None = None,
        runner_factory: Callable[[str, Any], Any] | None = None, positions: PositionsPolicy | str = "correct",
        max_new_tokens: int | None = None, *, deepstack: DeepStackPolicy | str = "correct",
    ) -> DynamicScheduler:
        """Scheduler over a dynamic-cache export folder; ``runner_factory(part, model_path)`` makes each runner."""
        spec, m = dynamic_spec(folder, bucket)
        return cls.from_spec(spec, folder, runner_factory, positions, max_new_tokens,  # type: ignore[return-value]
                             decode_position_input=bool(m.get("decode_position_input", True)), deepstack=deepstack)

    def generate(
        self, image: np.ndarray, *, sample: int = 0, writer: Any = None,
        forced_tokens: Sequence[int] | None = None, max_new_tokens: int | None = None,
    ) -> Generation:
        """Greedy generation for one image; with ``forced_tokens``, teacher forcing (as the base class)."""

        sp = self.spec
        budget = self._budget(forced_tokens, max_new_tokens)
        S = sp.prefill_len
        vf = self.vision_feeds(image)
        self._begin(writer, sample, "vision", 0, bucket=sp.bucket, image_shape=list(image.shape))
        self._inputs(writer, vf)
        vout = self.runners["vision"].run(vf, writer)
        feats = vout[IMAGE_FEATURES]
        pos = sp.prefill_positions
        ids = list(sp.prompt_ids)
        # the fixed-cache prefill feeds (DeepStack routed by the policy) with HF's 2-D int64 mask
        feeds = self.prefill_feeds(feats, [vout[DEEPSTACK_OUTPUT.format(k=k)] for k in range(sp.deepstack)])
        feeds["attention_mask"] = np.ones((1, S), np.int64)
        self._begin(writer, sample, "prefill", 0, input_ids=ids, position_ids=pos.reshape(-1).tolist(),
                    attention_mask=[1] * S, cache_len=0, bucket=sp.bucket)
        self._inputs(writer, {"input_ids": np.asarray([ids], np.int64), **feeds, "cache_len": np.asarray(0, np.int64)},
                     self.prefill_roles())
        out = self.runners["prefill"].run(feeds, writer)
        names = [f"{i}.{kind}" for i in range(sp.num_layers) for kind in ("key", "value")]
        cache = {f"{PAST_PREFIX}.{n}": out[f"{PRESENT_PREFIX}.{n}"] for n in names}
        tokens: list[int] = []
        fed: list[int] = []
        logits: list[np.ndarray] = []
        positions: list[list[int]] = [pos.reshape(-1).tolist()]
        cache_lens = [0]
        self._finish_step(writer, out["logits"][0, -1], tokens, fed, logits, forced_tokens, 0)
        cache_len, step = S, 1
        while step < budget and fed[-1] != sp.eos_token_id:
            feeds = {"inputs_embeds": sp.embedding[[fed[-1]]][None].astype(np.float32),
                     "attention_mask": np.ones((1, cache_len + 1), np.int64)}
            meta: dict[str, Any] = {"input_ids": [fed[-1]], "attention_mask": [1] * (cache_len + 1),
                                    "cache_len": cache_len, "bucket": sp.bucket}
            if self.decode_position_input:
                dpos = self.positions.decode_position_ids(step, S, pos, sp.mrope)
                feeds["position_ids"] = dpos
                meta["position_ids"] = dpos.reshape(-1).tolist()
                positions.append(meta["position_ids"])
            else:
                positions.append([])  # computed inside the graph
            feeds |= cache
            self._begin(writer, sample, "decode", step, **meta)
            self._inputs(writer, {"input_ids": np.asarray([[fed[-1]]], np.int64), **feeds,
                                  "cache_len": np.asarray(cache_len, np.int64)}, self.decode_roles(forced_tokens is not None))
            out = self.runners["decode"].run(feeds, writer)
            cache = {f"{PAST_PREFIX}.{n}": out[f"{PRESENT_PREFIX}.{n}"] for n in names}
            cache_lens.append(cache_len)
            self._finish_step(writer, out["logits"][0, -1], tokens, fed, logits, forced_tokens, step)
            cache_len += 1
            step += 1
        return Generation(tokens, fed, np.stack(logits), positions, cache_lens, feats,
                          forced=forced_tokens is not None)
