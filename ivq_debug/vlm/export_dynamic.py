"""HF-style split export with a dynamic KV cache (the layout of optimum / phone split exports), verified.

One call writes, into one folder:

* ``vision_b{bucket}.onnx`` per resolution bucket: vision tower + projector (as :mod:`ivq_debug.vlm.export`
  writes it, grid fixed in the graph);
* ``prefill.onnx``: the LLM over the prompt, dynamic ``sequence_length``, HF's 2-D int64 ``attention_mask``
  (Qwen3-VL: plus the DeepStack inputs ``deepstack_embeds.{k}``, as in the fixed-cache prefill);
* ``decode.onnx``: one step whose cache is a graph input (``past_key_values.{i}.key/value``, dynamic
  ``past_sequence_length``) and whose ``present.{i}.key/value`` outputs hold the whole cache (``P + 1``
  slots); with ``decode_position_input=False`` it has no ``position_ids`` input and computes positions from
  the cache length (:class:`~ivq_debug.vlm.parts_dynamic.HFDecodePart`);
* ``embed_tokens.npy`` (embedding and image scatter happen in numpy), ``config.json`` (the HF model
  config: ``rope_theta``, ``head_dim``, ``mrope_section`` for the KV-cache checks) and ``export.json``
  (schema :data:`SCHEMA`).

Unlike the fixed-cache export, no ``MaskAdd`` / ``DeepStackAdd`` node is marked (transformers builds the causal mask from the
2-D mask inside the graph) and the graphs keep dynamic axes, as such exports do (QNN needs static shapes:
a device runs them through its own runtime). Verification: ORT (CPU, fp32) vs the torch wrapper on real
samples of every bucket, a padded prompt, and two decode steps (cache lengths ``S`` and ``S + 1``),
``max_abs <= 1e-5`` per output.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.errors import UsageError
from ivq_debug.onnxgraph.fold import fold_constants
from ivq_debug.outputs import atomic_write_text
from ivq_debug.vlm import task
from ivq_debug.vlm.build import DEEPSTACK_INPUT, DEFAULT_BUCKET, family_of
from ivq_debug.vlm.export import (
    DEFAULT_EXPORTER,
    DEFAULT_OPSET,
    EXPORTERS,
    ExportedPart,
    ExportResult,
    _export_one,
    _shapes,
    example_inputs,
    export_parts,
    verify_part,
)
from ivq_debug.vlm.manifest import CONFIG_FILE, MANIFEST, load_manifest
from ivq_debug.vlm.parts_dynamic import PAST_PREFIX, PRESENT_PREFIX, HFDecodePart, HFPrefillPart

SCHEMA = "ivq-vlm-export-dynamic/1"
PREFILL_FILE = "prefill.onnx"
DECODE_FILE = "decode.onnx"
CACHE_STYLE = "dynamic"
#: name prefix of the prefill's DeepStack inputs (``deepstack_embeds.{k}``, Qwen3-VL)
DEEPSTACK_PREFIX = DEEPSTACK_INPUT.split("{")[0]


def hf_feeds(example: dict[str, dict[str, np.ndarray]], position_input: bool = True) -> dict[str, dict[str, np.ndarray]]:
    """The prefill / first-decode feeds of :func:`ivq_debug.vlm.export.example_inputs` in the HF layout.

    The additive masks become 2-D int64 1/0 masks and the fixed ``C``-slot past buffers their ``S`` valid
    slots (``past_key_values.*``); ``position_input=False`` drops the decode ``position_ids``.
    """

    pf, dec = example["prefill"], example["decode"]
    S = pf["inputs_embeds"].shape[1]
    prefill = {"inputs_embeds": pf["inputs_embeds"], "attention_mask": np.ones((1, S), np.int64),
               "position_ids": pf["position_ids"]}
    prefill |= {n: v for n, v in pf.items() if n.startswith(DEEPSTACK_PREFIX)}  # Qwen3-VL, in graph order
    decode: dict[str, np.ndarray] = {"inputs_embeds": dec["inputs_embeds"], "attention_mask": np.ones((1, S + 1), np.int64)}
    if position_input:
        decode["position_ids"] = dec["position_ids"]
    for name, buf in dec.items():
        if name.startswith("past."):
            decode[PAST_PREFIX + name[len("past"):]] = np.ascontiguousarray(buf[:, :, :S])
    return {"vision": example["vision"], "prefill": prefill, "decode": decode}


def next_decode_feeds(module: Any, feeds: dict[str, np.ndarray], token_embedding: np.ndarray) -> dict[str, np.ndarray]:
    """The feeds of the following decode step: run ``module`` (torch) once and chain its whole-cache outputs."""
    import torch


    with torch.no_grad():
        outs = module(*[torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values()])
    nxt: dict[str, np.ndarray] = {"inputs_embeds": token_embedding.reshape(1, 1, -1).astype(np.float32),
                                  "attention_mask": np.ones((1, feeds["attention_mask"].shape[1] + 1), np.int64)}
    if "position_ids" in feeds:
        nxt["position_ids"] = feeds["position_ids"] + 1
    past = [k for k in feeds if k.startswith(PAST_PREFIX)]
    for k, t in zip(past, outs[1:], strict=True):  # present.{i}.{kind} come in the order of the past inputs
        nxt[k] = t.numpy()
    return nxt


def _dynamic_spec(part: str, feeds: dict[str, np.ndarray], kv_out: list[str], exporter: str, max_positions: int) -> Any:
    """``dynamic_axes`` (legacy) or ``dynamic_shapes`` (dynamo) for one LLM part."""
    if exporter == "legacy":
        present = [n for n in kv_out if n != "logits"]
        if part == "prefill":
            axes = {"inputs_embeds": {1: "sequence_length"}, "attention_mask": {1: "sequence_length"},
                    "position_ids": {feeds["position_ids"].ndim - 1: "sequence_length"},
                    "logits": {1: "sequence_length"}}
            axes |= {n: {1: "sequence_length"} for n in feeds if n.startswith(DEEPSTACK_PREFIX)}
            return axes | {n: {2: "sequence_length"} for n in present}
        axes = {"attention_mask": {1: "total_sequence_length"}}
        axes |= {n: {2: "past_sequence_length"} for n in feeds if n.startswith("past_key_values")}
        return axes | {n: {2: "total_sequence_length"} for n in present}
    from torch.export import Dim

    if part == "prefill":
        seq = Dim("sequence_length", min=2, max=max_positions)
        deepstack = tuple({1: seq} for n in feeds if n.startswith(DEEPSTACK_PREFIX))  # *deepstack_embeds
        # torch.export counts the varargs as one input only when they are given
        return ({1: seq}, {1: seq}, {feeds["position_ids"].ndim - 1: seq}, *([deepstack] if deepstack else []))
    past = Dim("past_sequence_length", min=1, max=max_positions - 1)
    rest = [{} if n == "position_ids" else {2: past} for n in list(feeds)[2:]]  # *rest is one entry
    return ({}, {1: past + 1}, tuple(rest))


def _pin_output_dims(proto: Any, shapes: list[tuple[int, ...]], axes: dict[str, dict[int, str]]) -> None:
    """Graph output dims: the named dynamic axes symbolic, every other dim its example value.

    The legacy exporter's shape inference leaves made-up symbolic names on static dims
    (``Concatpresent.1.key_dim_0``) and misplaces the named ones, which a reader resolving the dynamic axes
    from byte sizes cannot tell apart from real dynamic axes.
    """
    for out, shape in zip(proto.graph.output, shapes, strict=True):
        named = axes.get(out.name, {})
        dims = out.type.tensor_type.shape.dim
        del dims[:]
        for j, n in enumerate(shape):
            d = dims.add()
            if j in named:
                d.dim_param = named[j]
            else:
                d.dim_value = int(n)


def export_dynamic_parts(
    model: Any,
    folder: str | os.PathLike,
    buckets: Sequence[int] | None = None,
    exporter: str = DEFAULT_EXPORTER,
    opset: int = DEFAULT_OPSET,
    verify: bool = True,
    overwrite: bool = False,
    model_id: str | None = None,
    verify_samples: int = 1,
    decode_position_input: bool = True,
    decode_position_offset: int = 0,
    pin_output_dims: bool = True,
) -> ExportResult:
    """Export vision (per bucket), prefill and decode of ``model`` with a dynamic KV cache into ``folder``.

    Args:
        model: a reference VLM (``InternVLForConditionalGeneration`` / ``Qwen2VLForConditionalGeneration``,
            eager attention, eval mode), e.g. from :func:`ivq_debug.vlm.load.load_vlm`.
        folder: output folder (created).
        buckets: resolution buckets of the vision graphs (the prefill serves them all); default: the model's.
        exporter: ``"legacy"`` (TorchScript ``dynamic_axes``, default) or ``"dynamo"`` (``dynamic_shapes``).
        opset: ONNX opset (>= 17; default 20).
        verify: run ORT vs torch and store ``max_abs`` per output.
        overwrite: replace an existing export in ``folder``.
        model_id: the model's name or path, recorded in the manifest.
        verify_samples: eval samples per bucket the verification runs (worst kept).
        decode_position_input: the decode graph takes ``position_ids``; ``False`` exports the variant that
            computes them from the cache length (``P + decode_position_offset``).
        decode_position_offset: see ``decode_position_input``.
        pin_output_dims: legacy exporter: give the outputs' static dims their values (:func:`_pin_output_dims`);
            ``False`` keeps the exporter's producer-named axes (``Concatpresent.1.key_dim_0``), as third-party
            legacy exports ship them.
    """
    import onnx
    import torch

    from ivq_debug.vlm.parts import kv_names, kv_shape, num_layers

    if exporter not in EXPORTERS:
        raise UsageError(f"unknown exporter {exporter!r}; choose from {', '.join(EXPORTERS)}")
    folder = Path(folder)
    if (folder / MANIFEST).exists() and not overwrite:
        raise UsageError("an export already exists here; pass overwrite=True", folder / MANIFEST)
    buckets = list(buckets) if buckets else [DEFAULT_BUCKET]
    # the vision graphs and the embedding table exactly as the fixed-cache export writes them
    res = export_parts(model, folder, buckets=buckets, exporter=exporter, opset=opset, parts=("vision",),
                       verify=verify, overwrite=True, model_id=model_id, verify_samples=verify_samples)
    L = num_layers(model)
    tc = model.config.text_config
    max_positions = int(tc.max_position_embeddings)
    kv_out = ["logits", *kv_names(PRESENT_PREFIX, L)]
    table = model.get_input_embeddings().weight.detach().numpy()
    prefill_mod = HFPrefillPart(model)
    decode_mod = HFDecodePart(model, decode_position_input, decode_position_offset)
    feeds: dict[str, list[dict[str, np.ndarray]]] = {"prefill": [], "decode": []}
    for b in buckets:
        for s in task.eval_set(b, max(1, verify_samples)):
            ex = hf_feeds(example_inputs(model, b, s), decode_position_input)
            feeds["prefill"].append(ex["prefill"])
            feeds["decode"] += [ex["decode"], next_decode_feeds(decode_mod, ex["decode"], table[task.VOCAB["red"]])]
    # a padded prompt and a masked cache slot: the graphs must not have baked HF's all-ones shortcuts
    for part in ("prefill", "decode"):
        padded = dict(feeds[part][0])
        padded["attention_mask"] = padded["attention_mask"].copy()
        padded["attention_mask"][:, 0] = 0
        feeds[part].append(padded)

    for part, module, name in (("prefill", prefill_mod, PREFILL_FILE), ("decode", decode_mod, DECODE_FILE)):
        path = folder / name
        tmp = path.with_name(f".{path.name}.tmp")
        t0 = time.perf_counter()
        spec = _dynamic_spec(part, feeds[part][0], kv_out, exporter, max_positions)
        _export_one(module, feeds[part][0], kv_out, tmp, exporter, opset,
                    dynamic_axes=spec if exporter == "legacy" else None,
                    dynamic_shapes=spec if exporter == "dynamo" else None)
        proto = onnx.load(str(tmp))
        if exporter == "legacy" and pin_output_dims:
            with torch.no_grad():
                example = module(*[torch.from_numpy(v) for v in feeds[part][0].values()])
            _pin_output_dims(proto, [tuple(t.shape) for t in example], spec)
        fold_constants(proto)
        proto.doc_string = f"ivq-debug {family_of(model)} {part} cache={CACHE_STYLE} exporter={exporter}"
        onnx.save(proto, str(tmp))
        os.replace(tmp, path)
        ep = ExportedPart(part, None, str(path), _shapes(proto.graph.input), _shapes(proto.graph.output),
                          len(proto.graph.node), time.perf_counter() - t0)
        if verify:
            with torch.no_grad():
                ep.check = verify_part(module, feeds[part], path, part, None, exporter)
        res.parts.append(ep)

    atomic_write_text(folder / CONFIG_FILE, model.config.to_json_string(), overwrite=True)
    m = dict(res.manifest)
    for fixed_only in ("max_cache", "mask_value", "mask_add_node", "kv_shape"):
        m.pop(fixed_only, None)
    H, d = kv_shape(model, 0)[1], kv_shape(model, 0)[3]
    m.update({
        "schema": SCHEMA, "cache": CACHE_STYLE, "config": CONFIG_FILE, "max_positions": max_positions,
        "kv_heads": H, "head_dim": d, "past_prefix": "past_key_values", "present_prefix": PRESENT_PREFIX,
        "attention_mask": "int64, 1 = attend, [1, total_sequence_length]",
        "decode_position_input": decode_position_input,
        "decode_position_offset": 0 if decode_position_input else int(decode_position_offset),
        "parts": [{k: v for k, v in asdict(p).items() if k != "check"} | {"path": Path(p.path).name} for p in res.parts],
        "checks": [asdict(c) | {"ok": c.ok} for c in res.checks],
    })
    atomic_write_text(folder / MANIFEST, json.dumps(m, indent=1), overwrite=True)
    res.manifest = m
    return res


def load_dynamic_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """Read ``export.json`` of a dynamic-cache export folder (InputError when missing or of another kind)."""
    return load_manifest(folder, schema=SCHEMA)
