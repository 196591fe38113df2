"""The deployment runner: numpy embedding + image scatter, prefill, greedy decode over a static KV cache.

The scheduler does what an on-device LLM runtime does around the three graphs of
:mod:`ivq_debug.vlm.export`:

1. vision: ``pixel_values`` → ``image_features`` (one graph per resolution bucket);
2. ``inputs_embeds = E[prompt_ids]``, image rows replaced by the image features (numpy);
3. prefill with the additive causal mask and the prompt's ``position_ids`` → logits + K/V, written
   into slots ``0..S-1`` of a fixed ``max_cache``-slot cache buffer;
4. decode step ``k = 1, 2, …``: feed the token chosen at step ``k-1`` with a mask marking the valid
   slots, get logits + the new K/V, write it into slot ``cache_len``; stop at ``<eos>`` or the budget.

Positions (the :class:`PositionsPolicy`) follow the model's own rule by default: decode step ``k``
(cache position ``c = S + k - 1``) at ``c + rope_delta`` — for 1-D RoPE the delta is 0; for M-RoPE
(Qwen2-/Qwen3-VL) it is ``max(prefill positions) + 1 - S`` (HF's ``get_rope_index``), on all three rows.
Fault knobs reproduce the classic bugs: ``restart`` (decode positions restart at 0: ``k - 1``),
``mrope_text_len`` (the rope delta dropped at decode: ``c``, i.e. the text length instead of ``max(pos) + 1``)
and ``off_by_one`` (one past the correct position: the new token counted twice).

Qwen3-VL adds two more knobs, recorded in every record's meta like ``positions_policy``:

* :class:`DeepStackPolicy` (meta ``deepstack_policy``): ``correct`` scatters DeepStack feature ``k`` to the
  image-token rows of prefill input ``deepstack_embeds.{k}`` (added after LLM layer ``k``); ``dropped``
  feeds zeros (a runtime that never wires the DeepStack outputs); ``before_layer`` adds every feature one
  layer early — feature ``k`` before layer ``k`` instead of after it, feature 0 onto the input embeddings.
* ``mrope_layout`` (meta ``mrope_layout``): ``sectioned`` runs prefill graphs whose rotary embedding uses
  Qwen2-VL's contiguous t | h | w sections instead of the model's interleaved layout (exported as the
  ``mrope_sectioned`` variant); exact on text tokens, wrong on image tokens. The layout is a property
  of the graph (the rotary kernel), so the knob selects graphs; decode tokens are text, where both
  layouts agree, so decode keeps its graph.

Every part runs through a runner (``run(feeds, writer) -> outputs``) made by a
``runner_factory(part, model_path)``, so the same loop drives ONNX Runtime fp32, QDQ, QNN HTP, and
(through :mod:`ivq_debug.vlm.torch_generate`) torch. With a ``DumpWriter`` every call becomes one record
``(sample, part, step)`` holding its inputs, the runner's tensors, ``next_token_logits`` and meta
``input_ids``, ``position_ids``, ``attention_mask`` (1 = valid key slot), ``cache_len``, ``token``
and, under teacher forcing, ``forced_token``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ivq_debug.capture.base import runner_factory as runner_factory_for
from ivq_debug.errors import InputError, UsageError
from ivq_debug.vlm import task
from ivq_debug.vlm.build import (
    DEEPSTACK_INPUT,
    DEEPSTACK_OUTPUT,
    IMAGE_FEATURES,
    MASK_VALUE,
    MAX_CACHE,
    MAX_NEW_TOKENS,
    MROPE_LAYOUTS,
    deepstack_count,
    family,
    num_image_tokens,
)
from ivq_debug.vlm.inputs import prefill_positions, rope_delta, vision_feeds
from ivq_debug.vlm.manifest import load_manifest
from ivq_debug.vlm.task import caption_accuracy, caption_ids, decode_ids

POSITION_MODES: tuple[str, ...] = ("correct", "restart", "mrope_text_len", "off_by_one")
DEEPSTACK_MODES: tuple[str, ...] = ("correct", "dropped", "before_layer")
#: name of the per-step next-token logits tensor the scheduler stores in every record
NEXT_LOGITS = "next_token_logits"


@dataclass(frozen=True)
class _Knob:
    """A scheduler knob: ``correct`` or one of the fault modes of its ``MODES``."""

    mode: str = "correct"
    KIND: ClassVar[str] = ""
    MODES: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise UsageError(f"unknown {self.KIND} mode {self.mode!r}; choose from {', '.join(self.MODES)}")


@dataclass(frozen=True)
class PositionsPolicy(_Knob):
    """How decode ``position_ids`` are chosen (``correct`` or a fault knob)."""

    KIND: ClassVar[str] = "positions"
    MODES: ClassVar[tuple[str, ...]] = POSITION_MODES

    def decode_position(self, step: int, prefill_len: int, prefill_positions: np.ndarray, mrope: bool) -> int:
        """Scalar position of decode step ``step`` (>= 1), which feeds the token chosen at ``step - 1``.

        The model's rule: cache position ``S + step - 1`` plus the rope delta (0 without M-RoPE).
        """
        if step < 1:
            raise ValueError("decode steps start at 1")
        if self.mode == "restart":
            return step - 1
        cache_position = prefill_len + step - 1 + (self.mode == "off_by_one")
        if self.mode == "mrope_text_len":  # the rope delta dropped
            return cache_position
        return cache_position + (rope_delta(prefill_positions) if mrope else 0)

    def decode_position_ids(
        self, step: int, prefill_len: int, prefill_positions: np.ndarray, mrope: bool
    ) -> np.ndarray:
        """``position_ids`` feed of decode step ``step``: ``[1, 1]`` or, for M-RoPE, ``[3, 1, 1]``."""
        p = self.decode_position(step, prefill_len, prefill_positions, mrope)
        return np.full((3, 1, 1) if mrope else (1, 1), p, dtype=np.int64)


@dataclass(frozen=True)
class DeepStackPolicy(_Knob):
    """How DeepStack features reach the prefill (``correct`` or a fault knob; see the module docstring)."""

    KIND: ClassVar[str] = "deepstack"
    MODES: ClassVar[tuple[str, ...]] = DEEPSTACK_MODES

    def route(
        self, inputs_embeds: np.ndarray, features: Sequence[np.ndarray], rows: np.ndarray
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Prefill ``inputs_embeds`` and ``deepstack_embeds.{k}`` feeds for DeepStack ``features`` (``[1,N,D]``).

        ``rows`` marks the image-token rows of the prompt; each feature is scattered there (zeros elsewhere).
        """
        S, D = inputs_embeds.shape[1], inputs_embeds.shape[2]
        scattered = []
        for f in features:
            e = np.zeros((1, S, D), np.float32)
            e[0, rows] = f.reshape(-1, D)
            scattered.append(e)
        zero = np.zeros((1, S, D), np.float32)
        if self.mode == "dropped":
            slots = [zero] * len(features)
        elif self.mode == "before_layer" and scattered:
            inputs_embeds = inputs_embeds + scattered[0]  # feature 0 before layer 0
            slots = [*scattered[1:], zero]  # feature k before layer k = after layer k - 1
        else:
            slots = scattered
        return inputs_embeds, {DEEPSTACK_INPUT.format(k=k): v for k, v in enumerate(slots)}


@dataclass
class SplitSpec:
    """Everything the scheduler needs besides the graphs: one bucket of one exported model."""

    family: str
    bucket: int
    prompt_ids: list[int]
    prefill_positions: np.ndarray  # [1, S] or [3, 1, S]
    embedding: np.ndarray  # [V, D]
    image_token_id: int
    eos_token_id: int
    max_cache: int
    kv_shape: tuple[int, int, int, int]  # [1, H_kv, max_cache, d]
    num_layers: int
    mask_value: float
    deepstack: int = 0  # DeepStack features (vision outputs / prefill inputs)
    mrope_layout: str | None = None  # the model's own M-RoPE layout (None: 1-D RoPE)
    part_paths: dict[str, Path] = field(default_factory=dict)  # part -> graph (ONNX exports)
    variant_paths: dict[str, dict[str, Path]] = field(default_factory=dict)  # variant -> part -> graph

    @property
    def mrope(self) -> bool:
        """True for M-RoPE (Qwen2-/Qwen3-VL) position ids."""
        return self.prefill_positions.ndim == 3

    @property
    def rope_delta(self) -> int:
        """M-RoPE rope delta ``max(prefill positions) + 1 - S`` (0 for 1-D RoPE)."""
        return rope_delta(self.prefill_positions)

    @property
    def prefill_len(self) -> int:
        """Static prefill length S."""
        return len(self.prompt_ids)

    @classmethod
    def from_export(cls, folder: str | os.PathLike, bucket: int | None = None) -> SplitSpec:
        """Read an export folder written by :func:`ivq_debug.vlm.export.export_parts`."""

        folder = Path(folder)
        m = load_manifest(folder)
        bucket = int(bucket if bucket is not None else m["buckets"][0])
        if bucket not in m["buckets"]:
            raise UsageError(f"bucket {bucket} was not exported (exported: {m['buckets']})")
        paths: dict[str, Path] = {}
        variants: dict[str, dict[str, Path]] = {}
        for p in m["parts"]:
            if p["part"] == "decode" or p["bucket"] == bucket:
                if p.get("variant"):
                    variants.setdefault(p["variant"], {})[p["part"]] = folder / p["path"]
                else:
                    paths[p["part"]] = folder / p["path"]
        emb_path = folder / m["embedding"]
        if not emb_path.is_file():
            raise InputError("embedding table missing", emb_path)
        return cls(
            family=m["family"], bucket=bucket, prompt_ids=list(m["prompt_ids"][str(bucket)]),
            prefill_positions=np.asarray(m["prefill_position_ids"][str(bucket)], dtype=np.int64),
            embedding=np.load(emb_path, allow_pickle=False), image_token_id=int(m["image_token_id"]),
            eos_token_id=int(m["eos_token_id"]), max_cache=int(m["max_cache"]),
            kv_shape=tuple(m["kv_shape"]), num_layers=int(m["num_layers"]), mask_value=float(m["mask_value"]),
            deepstack=int(m.get("deepstack", 0)), mrope_layout=m.get("mrope_layout"), part_paths=paths,
            variant_paths=variants,
        )

    @classmethod
    def from_model(cls, model: Any, bucket: int, max_cache: int | None = None) -> SplitSpec:
        """The same spec computed from a torch model (for the torch reference generation)."""
        from ivq_debug.vlm.parts import kv_shape, num_layers

        fam = family(model)
        C = MAX_CACHE if max_cache is None else max_cache
        return cls(
            family=fam.name, bucket=bucket, prompt_ids=task.prompt_ids(num_image_tokens(bucket)),
            prefill_positions=prefill_positions(fam.name, model, bucket),
            embedding=model.get_input_embeddings().weight.detach().numpy().astype(np.float32),
            image_token_id=int(model.config.image_token_id), eos_token_id=task.VOCAB[task.EOS],
            max_cache=C, kv_shape=kv_shape(model, C), num_layers=num_layers(model), mask_value=MASK_VALUE,
            deepstack=deepstack_count(model), mrope_layout=fam.mrope_layout,
        )


@dataclass
class Generation:
    """One scheduled generation.

    Step 0 is the prefill (its ``token`` is the argmax of the last prompt position); step ``k >= 1`` is
    decode call ``k``. ``tokens`` are the argmax of every step; ``fed`` the tokens actually fed forward
    (equal to ``tokens`` unless teacher forcing). ``logits[k]`` are step ``k``'s next-token logits.
    """

    tokens: list[int]
    fed: list[int]
    logits: np.ndarray  # [steps, V]
    position_ids: list[list[int]]  # per step, flattened position_ids feed
    cache_len: list[int]  # per step, valid KV slots before the call
    image_features: np.ndarray
    forced: bool = False
    deepstack_features: list[np.ndarray] = field(default_factory=list)  # per DeepStack feature, [1, N, D]

    @property
    def text(self) -> str:
        """The caption from the argmax tokens (up to ``<eos>``)."""

        return decode_ids(self.tokens)


#: contract roles of the inputs the scheduler stores (``ivq_debug.dump.contract``): prompt and teacher-forced tokens
#: are external (both sides of a comparison must be fed the same); positions, masks, cache lengths and token
#: embeddings are the scheduler's own rules (derived: the position diagnostics judge them); prompt embeddings hold
#: this backend's vision output, as do the Qwen3-VL DeepStack inputs (``deepstack_embeds.{k}``), and a free-running
#: step's token is this backend's choice (carried); the KV cache is carried by name
#: (``defaults.CONTRACT_CARRIED_INPUTS``)
PREFILL_ROLES = {"input_ids": "external", "inputs_embeds": "carried", "attention_mask": "derived",
                 "position_ids": "derived", "cache_len": "derived"}
DECODE_ROLES_FORCED = {"input_ids": "external", "inputs_embeds": "derived", "attention_mask": "derived",
                       "position_ids": "derived", "cache_len": "derived"}
DECODE_ROLES_FREE = dict(DECODE_ROLES_FORCED, input_ids="carried", inputs_embeds="carried")

#: runner facts a capture through a scheduler records per part (QNN target, emulation, exposure check, partition)
PART_INFO_KEYS = ("soc_model", "htp_arch", "emulated", "qnn_sdk_version", "onnxruntime_qnn", "exposure_check",
                  "partition")


class Scheduler:
    """Split vision / prefill / decode runner with a KV cache, a positions policy and teacher forcing.

    Args:
        spec: the model/bucket description (see :meth:`SplitSpec.from_export`).
        runners: ``{"vision": r, "prefill": r, "decode": r}``, objects with ``run(feeds, writer)``.
        positions: a :class:`PositionsPolicy` or its mode name.
        max_new_tokens: generation budget (default: the task's).
        deepstack: a :class:`DeepStackPolicy` or its mode name (DeepStack models only, unless ``correct``).
        mrope_layout: the M-RoPE layout the prefill runner computes (None: the model's own); recorded
            in the meta. :meth:`from_export` picks the matching graphs.
    """

    def __init__(
        self, spec: SplitSpec, runners: dict[str, Any], positions: PositionsPolicy | str = "correct",
        max_new_tokens: int | None = None, *, deepstack: DeepStackPolicy | str = "correct",
        mrope_layout: str | None = None,
    ) -> None:

        self.spec = spec
        self.runners = runners
        self.positions = positions if isinstance(positions, PositionsPolicy) else PositionsPolicy(positions)
        if self.positions.mode == "mrope_text_len" and not spec.mrope:
            raise UsageError("positions mode 'mrope_text_len' applies to M-RoPE models (Qwen2-/Qwen3-VL) only")
        self.deepstack = deepstack if isinstance(deepstack, DeepStackPolicy) else DeepStackPolicy(deepstack)
        if self.deepstack.mode != "correct" and not spec.deepstack:
            raise UsageError(f"deepstack mode {self.deepstack.mode!r} applies to DeepStack models (Qwen3-VL) only")
        self.mrope_layout = _check_layout(spec, mrope_layout)
        self.max_new_tokens = MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        if spec.prefill_len + self.max_new_tokens - 1 > spec.max_cache:
            raise UsageError(
                f"max_cache {spec.max_cache} < prefill {spec.prefill_len} + {self.max_new_tokens - 1} decode steps"
            )

    @classmethod
    def from_export(
        cls, folder: str | os.PathLike, bucket: int | None = None,
        runner_factory: Callable[[str, Any], Any] | None = None, positions: PositionsPolicy | str = "correct",
        max_new_tokens: int | None = None, *, deepstack: DeepStackPolicy | str = "correct",
        mrope_layout: str | None = None,
    ) -> Scheduler:
        """Scheduler over an export folder; ``runner_factory(part, model_path)`` makes each runner.

        ``mrope_layout="sectioned"`` on an interleaved model runs the export's ``mrope_sectioned`` prefill
        variant (``export_parts(..., variants=("mrope_sectioned",))``).
        """
        return cls.from_spec(SplitSpec.from_export(folder, bucket), folder, runner_factory, positions,
                             max_new_tokens, deepstack=deepstack, mrope_layout=mrope_layout)

    @classmethod
    def from_spec(
        cls, spec: SplitSpec, folder: str | os.PathLike, runner_factory: Callable[[str, Any], Any] | None = None,
        positions: PositionsPolicy | str = "correct", max_new_tokens: int | None = None, **kwargs: Any,
    ) -> Scheduler:
        """Scheduler over the graphs of ``spec`` (read from ``folder``); ``kwargs`` go to the constructor."""
        factory = runner_factory or runner_factory_for("onnx")
        missing = {"vision", "prefill", "decode"} - set(spec.part_paths)
        if missing:
            raise InputError(f"export lacks parts {sorted(missing)} for bucket {spec.bucket}", folder)
        paths = dict(spec.part_paths)
        mrope_layout = kwargs.get("mrope_layout")
        if _check_layout(spec, mrope_layout) != spec.mrope_layout:
            variant = f"mrope_{mrope_layout}"
            if variant not in spec.variant_paths:
                raise UsageError(
                    f"the export has no {variant!r} graphs for bucket {spec.bucket}; export with "
                    f"variants=('{variant}',)"
                )
            paths.update(spec.variant_paths[variant])
        runners = {part: factory(part, path) for part, path in paths.items()}
        return cls(spec, runners, positions, max_new_tokens, **kwargs)

    @property
    def backend(self) -> str:
        """Backend name of the decode runner."""
        return str(getattr(self.runners["decode"], "backend", "unknown"))

    @property
    def info(self) -> dict[str, Any]:
        """The backend info of a capture through this scheduler: the decode runner's, plus each part's target
        facts (:data:`PART_INFO_KEYS`) under the part's name."""
        info = dict(getattr(self.runners["decode"], "info", {}))
        for part, r in self.runners.items():
            if hasattr(r, "info"):
                info[part] = {k: v for k, v in r.info.items() if k in PART_INFO_KEYS}
        return info

    # ---------------------------------------------------------------- pieces
    def vision_feeds(self, image: np.ndarray) -> dict[str, np.ndarray]:
        """Vision graph feeds for one HWC image in [0, 1] of the bucket's size."""

        if image.shape[:2] != (self.spec.bucket, self.spec.bucket):
            raise UsageError(f"image is {image.shape[:2]}, bucket needs {self.spec.bucket}x{self.spec.bucket}")
        return vision_feeds(self.spec.family, image)

    def image_rows(self) -> np.ndarray:
        """Boolean mask of the image-token rows of the prompt ``[S]``."""
        return np.asarray(self.spec.prompt_ids) == self.spec.image_token_id

    def prompt_embeddings(self, image_features: np.ndarray) -> np.ndarray:
        """``E[prompt_ids]`` with the image-token rows replaced by the image features → ``[1, S, D]``."""
        ids = np.asarray(self.spec.prompt_ids)
        emb = self.spec.embedding[ids].astype(np.float32)
        feats = image_features.reshape(-1, emb.shape[-1])
        rows = self.image_rows()
        if rows.sum() != feats.shape[0]:
            raise UsageError(f"{int(rows.sum())} image tokens in the prompt, {feats.shape[0]} image features")
        emb[rows] = feats
        return emb[None]

    def prefill_feeds(self, image_features: np.ndarray, deepstack_features: Sequence[np.ndarray] = ()) -> dict[str, np.ndarray]:
        """Feeds of the prefill graph: embeddings, mask, positions, then the DeepStack inputs (graph order)."""
        from ivq_debug.vlm.parts import prefill_mask

        emb = self.prompt_embeddings(image_features)
        ds: dict[str, np.ndarray] = {}
        if self.spec.deepstack:
            if len(deepstack_features) != self.spec.deepstack:
                raise UsageError(f"{len(deepstack_features)} DeepStack features, the model has {self.spec.deepstack}")
            emb, ds = self.deepstack.route(emb, deepstack_features, self.image_rows())
        return {"inputs_embeds": emb, "attention_mask": prefill_mask(self.spec.prefill_len),
                "position_ids": self.spec.prefill_positions, **ds}

    # ---------------------------------------------------------------- generation
    def _budget(self, forced_tokens: Sequence[int] | None, max_new_tokens: int | None) -> int:
        """The decode steps of one generation: ``max_new_tokens`` (default the scheduler's), or under teacher
        forcing the forced tokens that fit the cache."""
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if forced_tokens is not None:
            if len(forced_tokens) == 0:
                raise UsageError("forced_tokens is empty")
            budget = min(len(forced_tokens), self.spec.max_cache - self.spec.prefill_len + 1)
        return budget

    def generate(
        self, image: np.ndarray, *, sample: int = 0, writer: Any = None,
        forced_tokens: Sequence[int] | None = None, max_new_tokens: int | None = None,
    ) -> Generation:
        """Greedy generation for one image; with ``forced_tokens``, teacher forcing.

        Under teacher forcing, step ``k`` still records the argmax as ``token`` but feeds
        ``forced_tokens[k]`` to step ``k+1`` (meta ``forced_token``); it runs ``len(forced_tokens)``
        steps (or stops after a forced ``<eos>``).
        """
        from ivq_debug.vlm.parts import decode_mask

        sp = self.spec
        budget = self._budget(forced_tokens, max_new_tokens)
        S, C = sp.prefill_len, sp.max_cache
        # -- vision
        vf = self.vision_feeds(image)
        self._begin(writer, sample, "vision", 0, bucket=sp.bucket, image_shape=list(image.shape),
                    preprocess=self.preprocess_identity(image))
        self._inputs(writer, vf)
        vout = self.runners["vision"].run(vf, writer)
        feats = vout[IMAGE_FEATURES]
        deep = [vout[DEEPSTACK_OUTPUT.format(k=k)] for k in range(sp.deepstack)]
        # -- prefill
        pos = sp.prefill_positions
        feeds = self.prefill_feeds(feats, deep)
        ids = list(sp.prompt_ids)
        self._begin(writer, sample, "prefill", 0, input_ids=ids, position_ids=pos.reshape(-1).tolist(),
                    attention_mask=[1] * S, cache_len=0, bucket=sp.bucket)
        self._inputs(writer, {"input_ids": np.asarray([ids], np.int64), **feeds,
                              "cache_len": np.asarray(0, np.int64)}, self.prefill_roles())
        out = self.runners["prefill"].run(feeds, writer)
        cache = {}
        for i in range(sp.num_layers):
            for kind in ("key", "value"):
                buf = np.zeros(sp.kv_shape, np.float32)
                buf[:, :, :S] = out[f"present.{i}.{kind}"]
                cache[f"past.{i}.{kind}"] = buf
        tokens: list[int] = []
        fed: list[int] = []
        logits: list[np.ndarray] = []
        positions: list[list[int]] = [pos.reshape(-1).tolist()]
        cache_lens = [0]
        step_logits = out["logits"][0, -1]
        self._finish_step(writer, step_logits, tokens, fed, logits, forced_tokens, 0)
        cache_len = S
        step = 1
        while step < budget and fed[-1] != sp.eos_token_id:
            dpos = self.positions.decode_position_ids(step, S, pos, sp.mrope)
            mask = decode_mask(cache_len, C)
            feeds = {"inputs_embeds": sp.embedding[[fed[-1]]][None].astype(np.float32),
                     "attention_mask": mask, "position_ids": dpos, **cache}
            valid = [int(v == 0.0) for v in mask.reshape(-1)]
            self._begin(writer, sample, "decode", step, input_ids=[fed[-1]], position_ids=dpos.reshape(-1).tolist(),
                        attention_mask=valid, cache_len=cache_len, bucket=sp.bucket)
            self._inputs(writer, {"input_ids": np.asarray([[fed[-1]]], np.int64), **feeds,
                                  "cache_len": np.asarray(cache_len, np.int64)},
                         self.decode_roles(forced_tokens is not None))
            out = self.runners["decode"].run(feeds, writer)
            for i in range(sp.num_layers):
                for kind in ("key", "value"):
                    cache[f"past.{i}.{kind}"][:, :, cache_len] = out[f"present.{i}.{kind}"][:, :, 0]
            positions.append(dpos.reshape(-1).tolist())
            cache_lens.append(cache_len)
            self._finish_step(writer, out["logits"][0, -1], tokens, fed, logits, forced_tokens, step)
            cache_len += 1
            step += 1
        return Generation(tokens, fed, np.stack(logits), positions, cache_lens, feats,
                          forced=forced_tokens is not None, deepstack_features=deep)

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _finish_step(
        writer: Any, step_logits: np.ndarray, tokens: list[int], fed: list[int], logits: list[np.ndarray],
        forced: Sequence[int] | None, step: int,
    ) -> None:
        tok = int(np.argmax(step_logits))
        tokens.append(tok)
        logits.append(np.asarray(step_logits, np.float32))
        nxt = int(forced[step]) if forced is not None else tok
        fed.append(nxt)
        if writer is not None:
            writer.add_tensor(NEXT_LOGITS, np.asarray(step_logits, np.float32), op_type="next_token_logits")
            meta: dict[str, Any] = {"token": tok}
            if forced is not None:
                meta["forced_token"] = nxt
            writer.update_record_meta(**meta)

    def knobs(self) -> dict[str, str]:
        """The scheduler's knob settings as recorded in every record's meta (those the model has)."""
        out = {"positions_policy": self.positions.mode}
        if self.spec.deepstack:
            out["deepstack_policy"] = self.deepstack.mode
        if self.spec.mrope_layout == "interleaved":
            out["mrope_layout"] = str(self.mrope_layout)
        return out

    def prefill_roles(self) -> dict[str, str]:
        """Contract roles of the prefill inputs (:data:`PREFILL_ROLES`; DeepStack inputs carried)."""
        return PREFILL_ROLES | {DEEPSTACK_INPUT.format(k=k): "carried" for k in range(self.spec.deepstack)}

    @staticmethod
    def decode_roles(forced: bool) -> dict[str, str]:
        """Contract roles of the decode inputs, teacher-forced or free-running."""
        return DECODE_ROLES_FORCED if forced else DECODE_ROLES_FREE

    def _begin(self, writer: Any, sample: int, part: str, step: int, **meta: Any) -> None:
        if writer is not None:
            writer.begin_record(sample=sample, part=part, step=step, **self.knobs(), **meta)

    def preprocess_identity(self, image: np.ndarray) -> dict[str, Any]:
        """The preprocessing a vision record's ``pixel_values`` went through (contract: ``meta["preprocess"]``)."""
        return {"function": "ivq_debug.vlm.inputs.vision_feeds", "family": self.spec.family,
                "bucket": self.spec.bucket, "resize": "none (the image is the bucket's size)",
                "normalize": f"(x - {task.PIXEL_MEAN}) / {task.PIXEL_STD}", "image_shape": list(image.shape)}

    @staticmethod
    def _inputs(writer: Any, feeds: dict[str, np.ndarray], roles: dict[str, str] | None = None) -> None:
        if writer is not None:
            for name, value in feeds.items():
                writer.add_input(name, value, role=(roles or {}).get(name))


def _check_layout(spec: SplitSpec, layout: str | None) -> str | None:
    """The M-RoPE layout a scheduler runs (None: the model's own); only interleaved → sectioned is a knob."""
    if layout is None or layout == spec.mrope_layout:
        return spec.mrope_layout
    if spec.mrope_layout != "interleaved" or layout not in MROPE_LAYOUTS:
        raise UsageError(f"M-RoPE layout {layout!r} does not apply to this model (its own: {spec.mrope_layout})")
    return layout


def evaluate(scheduler: Scheduler, samples: Sequence[Any], writer: Any = None) -> Any:
    """Caption accuracy of ``scheduler`` on task samples (greedy); returns a ``CaptionAccuracy``."""

    preds = [scheduler.generate(s.image, sample=k, writer=writer).text for k, s in enumerate(samples)]
    return caption_accuracy(preds, [s.caption for s in samples])


class _FeedRecorder:
    """Runner wrapper that keeps a copy of every feed it runs (for quantization calibration)."""

    def __init__(self, inner: Any, sink: list[dict[str, np.ndarray]]) -> None:
        self.inner = inner
        self.sink = sink
        self.backend = getattr(inner, "backend", "unknown")
        self.info = getattr(inner, "info", {})

    def run(self, feeds: dict[str, np.ndarray], writer: Any = None) -> dict[str, np.ndarray]:
        self.sink.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return self.inner.run(feeds, writer)


def collect_feeds(
    scheduler: Scheduler, samples: Sequence[Any], forced: bool = False
) -> dict[str, list[dict[str, np.ndarray]]]:
    """The feeds every part received while generating for ``samples`` (e.g. QDQ calibration data).

    Returns ``{"vision": [...], "prefill": [...], "decode": [...]}``: realistic inputs, including
    image-feature-filled prompt embeddings and real KV caches. With ``forced=True`` the reference
    captions are teacher-forced, so decode feeds follow the correct caption.
    """
    out: dict[str, list[dict[str, np.ndarray]]] = {p: [] for p in scheduler.runners}
    saved = dict(scheduler.runners)
    scheduler.runners = {p: _FeedRecorder(r, out[p]) for p, r in saved.items()}
    try:
        for s in samples:
            scheduler.generate(s.image, forced_tokens=caption_ids(s.caption) if forced else None)
    finally:
        scheduler.runners = saved
    return out
