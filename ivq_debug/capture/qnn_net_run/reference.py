"""The reference of a device session: the same ONNX parts replayed on ONNX Runtime CPU with the device's inputs.

A device session dump (:func:`~ivq_debug.capture.qnn_net_run.ingest.capture_session`) holds what the device
fed each part and what it got back. Its reference runs the parts (fp32, or the float model the user names)
sample by sample through the one capture loop (:func:`ivq_debug.capture.base.capture`), fed:

* **vision**: the device's own inputs (``pixel_values``);
* **prefill**: the device's inputs, with the image rows of ``inputs_embeds`` (the rows equal to the device's
  vision output) replaced by the reference's own vision output, and ``position_ids`` recomputed by the
  model's rule: 1-D RoPE ``cumsum(attention_mask) − 1`` (``0..S−1`` without padding); M-RoPE (Qwen2-VL:
  ``position_ids [3, B, S]``) transformers' own ``get_rope_index`` over the image rows and grid
  (:func:`ivq_debug.vlm.inputs.rope_index`);
* **decode step k**: the device's inputs (its ``inputs_embeds`` / ``input_ids``: teacher forcing on the
  device's tokens, and its ``attention_mask``), ``position_ids = max(prefill positions) + k`` (1-D RoPE:
  ``S + k − 1``), and the reference's own cache: a growing cache takes the previous call's ``present`` as its
  ``past``; a fixed buffer whose graph returns only the new slot gets it written at slot ``S + k − 1``.

Each record keeps the device's key ``(sample, part, step)``; meta: ``position_ids``, ``cache_len``,
``token`` (the reference's argmax of ``logits``), ``forced_token`` (the device's token, fed next) and, for the
prefill, ``image_rows`` and ``rope_delta``. The model config is stored in the dump's model attributes.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.capture.base import Selection, capture, make_runner, model_facts
from ivq_debug.capture.qnn_net_run.ingest import LOGITS, find_part_model, load_config, token_of
from ivq_debug.capture.qnn_net_run.shapes import GraphIO
from ivq_debug.dump import check_writable, open_dump
from ivq_debug.dump.contract import INPUTS_META
from ivq_debug.errors import InputError, UsageError
from ivq_debug.inputfiles import sha256_file
from ivq_debug.vlm.config import check_hf_config
from ivq_debug.vlm.inputs import rope_index

PARTS = ("vision", "prefill", "decode")
POSITIONS = "position_ids"
_KV = re.compile(r"(\d+)[._](key|value)$")
_PAST = re.compile(r"^past")
_PRESENT = re.compile(r"^present")


@dataclass
class ReferenceRun:
    """What :func:`build_reference` wrote.

    ``positions[sample]``: the rule and the positions it gave (``prefill`` flattened, ``decode`` per step,
    ``rope_delta``); ``image_rows[sample]``: the prefill rows given the reference's image features (None: not
    found, the device's rows kept).
    """

    path: Path
    records: list[tuple[int, str, int]]
    parts: dict[str, Path]
    config_source: str | None
    positions: dict[int, dict[str, Any]] = field(default_factory=dict)
    image_rows: dict[int, list[int] | None] = field(default_factory=dict)


def locate_rows(embeds: np.ndarray, feats: np.ndarray) -> np.ndarray | None:
    """Indices of the rows of ``embeds [1, S, D]`` that hold ``feats`` (the vision output, ``N x D`` values)
    as one contiguous block, or None. A runtime copies its vision output into the prompt embeddings, so the
    rows agree to float32 rounding."""
    d = embeds.shape[-1]
    if feats.size == 0 or feats.size % d:
        return None
    e = embeds.reshape(-1, d).astype(np.float64)
    f = feats.reshape(-1, d).astype(np.float64)
    n = f.shape[0]
    tol = 1e-5 * max(1.0, float(np.abs(f).max()))
    for i in np.flatnonzero(np.all(np.abs(e - f[0]) <= tol, axis=1)):
        if i + n <= e.shape[0] and np.all(np.abs(e[i : i + n] - f) <= tol):
            return np.arange(i, i + n)
    return None


def text_positions(mask: np.ndarray | None, length: int) -> np.ndarray:
    """1-D RoPE prompt positions ``[1, S]``: HF's ``cumsum(attention_mask) − 1`` (padded slots at 1) for a
    2-D 1/0 mask, else ``0..S−1``."""
    if mask is not None and mask.ndim == 2 and mask.dtype.kind in "iub" and mask.shape[-1] == length:
        m = mask.astype(np.int64)
        pos = np.cumsum(m, axis=-1) - 1
        return np.where(m == 0, 1, pos)
    return np.arange(length, dtype=np.int64)[None]


def _grid(config: Mapping[str, Any], vision_feeds: Mapping[str, np.ndarray] | None, n_tokens: int,
          grid_thw: tuple[int, int, int] | None) -> np.ndarray:
    """The image's patch grid ``[[t, h, w]]`` for ``get_rope_index``."""
    if grid_thw is not None:
        return np.asarray([grid_thw], dtype=np.int64)
    for name in ("image_grid_thw", "grid_thw"):
        if vision_feeds and name in vision_feeds:
            return np.asarray(vision_feeds[name], dtype=np.int64).reshape(-1, 3)
    merge = int((config.get("vision_config") or {}).get("spatial_merge_size") or 2)
    pv = (vision_feeds or {}).get("pixel_values")
    if pv is not None and pv.ndim == 2:  # flattened patches [t*h*w, C*T*P*P]
        side = math.isqrt(pv.shape[0])
        if side * side == pv.shape[0] and (side // merge) ** 2 == n_tokens:
            return np.asarray([[1, side, side]], dtype=np.int64)
    raise UsageError(f"cannot tell the image grid of the {n_tokens} image rows (not a square image of flattened "
                     "patches): pass --grid-thw T,H,W")


def _pairs(names: list[str]) -> dict[tuple[int, str], str]:
    out = {}
    for n in names:
        m = _KV.search(n)
        if m:
            out[(int(m.group(1)), m.group(2))] = n
    return out


class SessionReplay:
    """Replays the device session in ``session`` with one runner per part (driven by ``capture()``).

    Args:
        session: the opened device session dump.
        runners: ``{part: runner}`` (``make_runner("onnx", part_model)``).
        graphs: ``{part: GraphIO}`` of the same models.
        config: the HF config dict (needed for M-RoPE).
        grid_thw: the image grid for M-RoPE when it cannot be told from the vision inputs.
    """

    def __init__(self, session: Any, runners: dict[str, Any], graphs: dict[str, GraphIO],
                 config: Mapping[str, Any] | None, grid_thw: tuple[int, int, int] | None = None) -> None:
        self.session = session
        self.runners = runners
        self.graphs = graphs
        self.config = config
        self.grid_thw = grid_thw
        self.backend = str(getattr(runners["prefill"], "backend", "onnxruntime-cpu"))
        self.info: dict[str, Any] = dict(getattr(runners["prefill"], "info", {}))
        self.info["source"] = "device session replayed on ORT CPU (ivq reference)"
        self.positions: dict[int, dict[str, Any]] = {}
        self.image_rows: dict[int, list[int] | None] = {}
        self.records: list[tuple[int, str, int]] = []
        dec = graphs["decode"]
        self.mrope = any(t.name == POSITIONS and len(t.dims) == 3 for t in graphs["prefill"].inputs)
        past = {t.name: t for t in dec.inputs if _PAST.match(t.name)}
        present = {t.name: t for t in dec.outputs if _PRESENT.match(t.name)}
        self.past = _pairs(list(past))
        self.present = _pairs(list(present))
        if not self.past or set(self.past) != set(self.present):
            raise InputError(f"the decode graph {dec.name} has no past/present cache pairs the replay can chain "
                             f"(inputs {[t.name for t in dec.inputs]}): not a decode part", dec.path)
        one = next(iter(self.past))
        pd, qd = past[self.past[one]].dims, present[self.present[one]].dims
        self.new_slot = isinstance(pd[-2], int) and qd[-2] == 1 and pd[-2] != 1
        self.buffer = {k: (tuple(int(d) for d in past[n].dims), past[n].dtype) for k, n in self.past.items()} \
            if self.new_slot else {}

    # ------------------------------------------------------------------ pieces
    def _device(self, rid: str, kind: str) -> dict[str, np.ndarray]:
        return {e.name: self.session.read(e) for e in self.session.tensors(rid, kind=kind)}

    def _feeds(self, part: str, device: Mapping[str, np.ndarray], skip: set[str], key: tuple[int, str, int]
               ) -> dict[str, np.ndarray]:
        feeds = {}
        for t in self.graphs[part].inputs:
            if t.name in skip:
                continue
            if t.name not in device:
                rid = self.session.record_keys().get(key)
                unfed = t.name in ((self.session.record_meta(rid).get("not_fed") or []) if rid is not None else [])
                raise InputError(f"record {key} has no input {t.name!r}"
                                 + (" (the device did not feed it)" if unfed else "")
                                 + f", which the reference {part} graph {self.graphs[part].name} takes; the reference "
                                 f"recomputes only {POSITIONS} and the cache", self.session.path)
            feeds[t.name] = device[t.name].astype(t.dtype, copy=False)
        return feeds

    def _run(self, writer: Any, key: tuple[int, str, int], feeds: dict[str, np.ndarray],
             recomputed: Mapping[str, str] | None = None, **meta: Any) -> dict[str, np.ndarray]:
        writer.begin_record(sample=key[0], part=key[1], step=key[2], **meta)
        self._store_inputs(writer, key, feeds, recomputed or {})
        out = self.runners[key[1]].run(feeds, writer)
        self.records.append(key)
        return out

    def _store_inputs(self, writer: Any, key: tuple[int, str, int], feeds: Mapping[str, np.ndarray],
                      recomputed: Mapping[str, str]) -> None:
        """The record's inputs with their contract roles: ``recomputed`` (name -> why) for what the replay
        recomputes on purpose, ``carried`` for its own cache, the device's role for what it passes through."""
        rid = self.session.record_keys().get(key)
        dev = (self.session.record_meta(rid).get(INPUTS_META) or {}) if rid is not None else {}
        past = set(self.past.values())
        for name, value in feeds.items():
            if name in recomputed:
                writer.add_input(name, value, role="recomputed", reason=recomputed[name])
            elif name in past:
                writer.add_input(name, value, role="carried")
            else:
                writer.add_input(name, value, role=(dev.get(name) or {}).get("role"))

    def _token_meta(self, writer: Any, out: Mapping[str, np.ndarray], device_meta: Mapping[str, Any]) -> None:
        meta = {}
        if LOGITS in out:
            meta["token"] = token_of(out[LOGITS])
        if device_meta.get("token") is not None:
            meta["forced_token"] = int(device_meta["token"])
        if meta:
            writer.update_record_meta(**meta)

    def _prefill_positions(self, feeds: Mapping[str, np.ndarray], rows: np.ndarray | None,
                           vision_feeds: Mapping[str, np.ndarray] | None) -> np.ndarray:
        t = next(t for t in self.graphs["prefill"].inputs if t.name == POSITIONS)
        emb = feeds.get("inputs_embeds")
        mask = feeds.get("attention_mask")
        ref = emb if emb is not None else next(iter(feeds.values()))
        length = int(ref.shape[1]) if ref.ndim >= 2 else int(ref.shape[-1])
        if not self.mrope:
            return text_positions(mask, length).astype(t.dtype)
        if ref.shape[0] != 1:
            raise UsageError(f"M-RoPE prefill positions are computed for batch 1 (the device fed batch {ref.shape[0]})")
        if rows is None and vision_feeds is None:
            raise UsageError("M-RoPE positions need the image rows: ingest the session with its vision folder "
                             "(--vision DIR)")
        if self.config is None:
            raise UsageError("the prefill graph takes M-RoPE position_ids [3, B, S]: the reference needs the "
                             "model's HF config.json (--config) for get_rope_index")
        types = np.zeros((1, length), np.int32)
        if rows is None:
            return np.repeat(text_positions(mask, length)[None], 3, axis=0).astype(t.dtype)
        types[0, rows] = 1
        grid = _grid(self.config, vision_feeds, len(rows), self.grid_thw)
        am = mask if (mask is not None and mask.ndim == 2 and mask.dtype.kind in "iub") else None
        pos, _ = rope_index(dict(self.config), types, grid, am)
        return pos.astype(t.dtype)

    # ------------------------------------------------------------------ one sample
    def record(self, writer: Any, index: int, sample: int) -> None:
        """Replay sample ``sample`` of the session into ``writer`` (the ``record`` hook of ``capture()``)."""
        keys = self.session.record_keys()
        pre = keys.get((sample, "prefill", 0))
        if pre is None:
            raise InputError(f"sample {sample} has no prefill record (step 0)", self.session.path)
        steps = sorted(k[2] for k in keys if k[0] == sample and k[1] == "decode")
        if steps != list(range(1, len(steps) + 1)):
            gap = next(k for k in range(1, len(steps) + 2) if k not in steps)
            raise InputError(f"sample {sample} has decode steps {steps}: step {gap} is missing (decode call k is "
                             "step k >= 1)", self.session.path)
        feats = vision_feeds = dev_feats = None
        vis = keys.get((sample, "vision", 0))
        if vis is not None:
            dev_out = self._device(vis, "tensor")
            name = "image_features" if "image_features" in dev_out else (
                self.graphs["vision"].outputs[0].name if "vision" in self.graphs else next(iter(dev_out), ""))
            dev_feats = dev_out.get(name)
            vision_feeds = self._device(vis, "input")
            if "vision" in self.runners:
                vision_feeds = self._feeds("vision", vision_feeds, set(), (sample, "vision", 0))
                feats = self._run(writer, (sample, "vision", 0), vision_feeds)[name]
        # ---- prefill
        dev_in = self._device(pre, "input")
        has_pos = any(t.name == POSITIONS for t in self.graphs["prefill"].inputs)
        feeds = self._feeds("prefill", dev_in, {POSITIONS}, (sample, "prefill", 0))
        rows = None
        if "input_ids" in feeds and self.config and self.config.get("image_token_id") is not None:
            rows = np.flatnonzero(feeds["input_ids"].reshape(-1) == int(self.config["image_token_id"])) if \
                feeds["input_ids"].shape[0] == 1 else None
            rows = rows if rows is not None and rows.size else None
        elif "inputs_embeds" in feeds and dev_feats is not None:
            rows = locate_rows(feeds["inputs_embeds"], dev_feats)
            if rows is None and self.mrope:
                raise InputError(f"sample {sample}: the device's vision output is not among the prefill "
                                 "inputs_embeds rows, so the image tokens (which M-RoPE positions need) cannot be "
                                 "told", self.session.path)
            if rows is not None and feats is not None:
                emb = feeds["inputs_embeds"].copy()
                flat = emb.reshape(-1, emb.shape[-1])
                flat[rows] = feats.reshape(-1, emb.shape[-1])
                feeds["inputs_embeds"] = flat.reshape(emb.shape)
        self.image_rows[sample] = None if rows is None else [int(rows[0]), int(rows[-1]) + 1]
        pos = self._prefill_positions(feeds, rows, vision_feeds) if has_pos else None
        if pos is not None:
            feeds[POSITIONS] = pos
        S = int(pos.shape[-1]) if pos is not None else int(feeds["inputs_embeds"].shape[1])
        top = int(pos.max()) if pos is not None else S - 1
        info = {"rule": "M-RoPE (get_rope_index)" if self.mrope else "1-D RoPE",
                "prefill": None if pos is None else pos.reshape(-1).tolist(), "rope_delta": top + 1 - S,
                "decode": {}}
        self.positions[sample] = info
        why = {}
        if pos is not None:
            why[POSITIONS] = f"ivq reference: the model's positions ({info['rule']})"
        if rows is not None and feats is not None and "inputs_embeds" in feeds and "input_ids" not in feeds:
            why["inputs_embeds"] = "ivq reference: image rows replaced by the reference's own vision output"
        out = self._run(writer, (sample, "prefill", 0), feeds, why, cache_len=0,
                        position_ids=info["prefill"], rope_delta=top + 1 - S, image_rows=self.image_rows[sample])
        self._token_meta(writer, out, self.session.record_meta(pre))
        pnames = _pairs([n for n in out if _PRESENT.match(n)])
        if set(pnames) != set(self.past):
            raise UsageError(f"the prefill graph's present outputs {sorted(pnames)} do not match the decode "
                             f"graph's past inputs {sorted(self.past)}")
        cache: dict[tuple[int, str], np.ndarray] = {}
        for k, n in pnames.items():
            v = out[n]
            if self.new_slot:
                shape, dt = self.buffer[k]
                buf = np.zeros(shape, dt)
                buf[..., : v.shape[-2], :] = v
                v = buf
            cache[k] = v
        prefill_len = int(out[next(iter(pnames.values()))].shape[-2])
        self._decode(writer, sample, steps, top, prefill_len, cache, info)

    def _decode(self, writer: Any, sample: int, steps: list[int], top: int, prefill_len: int,
                cache: dict[tuple[int, str], np.ndarray], info: dict[str, Any]) -> None:
        """Decode steps ``k`` at ``top + k`` (``top`` = max prefill position), each on the reference's own cache."""
        keys = self.session.record_keys()
        dec = self.graphs["decode"]
        dpos = next((t for t in dec.inputs if t.name == POSITIONS), None)
        if dpos is None:
            raise UsageError(f"the decode graph {dec.name} has no position_ids input: the reference cannot use "
                             "the model's positions (it would repeat the device's rule); pass parts exported "
                             "with a position input")
        for k in steps:
            rid = keys[(sample, "decode", k)]
            feeds = self._feeds("decode", self._device(rid, "input"), {POSITIONS, *self.past.values()},
                                (sample, "decode", k))
            p = top + k
            shape = tuple(1 if isinstance(d, str) else int(d) for d in dpos.dims)
            feeds[POSITIONS] = np.full(shape, p, dtype=dpos.dtype)
            cache_len = prefill_len + k - 1
            for kk, n in self.past.items():
                feeds[n] = cache[kk]
            mask = feeds.get("attention_mask")
            if not self.new_slot and mask is not None and mask.ndim == 2 and mask.shape[-1] != cache_len + 1:
                raise InputError(f"decode step {k} of sample {sample}: the device's attention_mask has "
                                 f"{mask.shape[-1]} slots, the reference's cache {cache_len} + 1", self.session.path)
            info["decode"][k] = feeds[POSITIONS].reshape(-1).tolist()
            out = self._run(writer, (sample, "decode", k), feeds,
                            {POSITIONS: "ivq reference: the model's decode position max(prefill positions) + k"},
                            cache_len=cache_len, position_ids=info["decode"][k])
            self._token_meta(writer, out, self.session.record_meta(rid))
            for kk, n in self.present.items():
                v = out[n]
                if self.new_slot:
                    buf = cache[kk].copy()
                    buf[..., cache_len, :] = v[..., 0, :]
                    v = buf
                cache[kk] = v


def _selection(session: Any, part: str, graph: GraphIO) -> Selection | None:
    """Capture the intermediates the device dump holds for this part (its ``--debug`` tensors), else none."""
    outs = {t.name for t in graph.outputs}
    names = sorted({e.name for e in session.tensors() if e.part == part} - outs)
    return Selection(include=[glob.escape(n) for n in names]) if names else None


def _fits(session: Any, part: str) -> Any:
    """A check of a candidate part model against the device's inputs of that part (names and static dims)."""
    ent = next((e for e in session.tensors(kind="input") if e.part == part), None)
    shapes = {e.name: e.shape for e in session.tensors(ent.rid, kind="input")} if ent else {}

    def check(model: Path) -> str | None:
        g = GraphIO.from_model(model)
        for t in g.inputs:
            if t.name == POSITIONS or _PAST.match(t.name):
                continue
            if t.name not in shapes:
                return f"the device fed no {t.name!r}"
            sh = shapes[t.name]
            if len(sh) != len(t.dims) or any(isinstance(d, int) and d != s for d, s in zip(t.dims, sh, strict=True)):
                return f"{t.name!r} is {list(sh)} on the device, {list(t.dims)} in {model.name}"
        return None

    return check


def build_reference(
    session: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model_dir: str | os.PathLike | None = None,
    models: Mapping[str, str | os.PathLike] | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    grid_thw: tuple[int, int, int] | None = None,
    overwrite: bool = False,
    threads: int | None = None,
) -> ReferenceRun:
    """Replay a device session dump on ORT CPU (see the module docstring) into the dump ``out``.

    Args:
        session: the device session dump (``ivq ingest session``).
        out: the reference dump to write (atomic; ``overwrite`` to replace).
        model_dir: folder of the ONNX parts to replay (fp32, or the float model), chosen per part as the
            ingest chooses them; ``models`` names files per part.
        config: the HF ``config.json`` (default: ``model_dir/config.json``, else the session dump's).
        grid_thw: the image's patch grid for M-RoPE when the vision inputs do not tell it.
        threads: intra-op threads of the ORT sessions.

    Raises:
        UsageError: the output exists, parts missing or ambiguous, an M-RoPE graph without a config, a decode
            graph without a position input.
        InputError: an unreadable session dump, or records the parts cannot be fed (missing inputs or steps).
    """
    check_writable(out, overwrite)
    models = dict(models or {})
    with open_dump(session) as dev:
        have = {k[1] for k in dev.record_keys()}
        if "prefill" not in have or "decode" not in have:
            raise InputError(f"not a device session dump: it has records of {sorted(have)}, a session needs "
                             "prefill and decode records (ivq ingest session)", dev.path)
        cfg, cfg_src = load_config(config, model_dir)
        if cfg is None and dev.model.get("config") is not None:  # a list there is refused, not read as "none"
            cfg_src = str(dev.model.get("config_source") or f"{dev.path.name} model attributes")
            cfg = check_hf_config(dev.model["config"], f"{dev.path}: model attribute config")
        parts = {p: find_part_model(p, model_dir, models.get(p), _fits(dev, p)) for p in PARTS
                 if p in have and (p != "vision" or model_dir is not None or "vision" in models)}
        graphs = {p: GraphIO.from_model(m) for p, m in parts.items()}
        runners = {p: make_runner("onnx", m, selection=_selection(dev, p, graphs[p]), threads=threads)
                   for p, m in parts.items()}
        replay = SessionReplay(dev, runners, graphs, cfg, grid_thw)
        samples = sorted({k[0] for k in dev.record_keys()})
        attrs = {"config": cfg, "config_source": cfg_src, "parts": {p: model_facts(m, p) for p, m in parts.items()},
                 "reference_of": {"path": str(dev.path.resolve()), "sha256": sha256_file(dev.path)},
                 "positions_rule": "M-RoPE (get_rope_index)" if replay.mrope else "1-D RoPE"}
        try:
            path = capture(replay, samples, out, model=attrs, overwrite=overwrite, progress="replaying",
                           record=lambda w, i, s: replay.record(w, i, s))
        finally:
            for r in runners.values():
                if hasattr(r, "close"):
                    r.close()
    return ReferenceRun(Path(path), replay.records, parts, cfg_src, replay.positions, replay.image_rows)
