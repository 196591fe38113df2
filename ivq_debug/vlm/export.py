"""Split ONNX export of a reference VLM, as deployments do it, with static shapes and verification.

One call writes, into one folder:

* ``vision_b{bucket}.onnx`` per resolution bucket: vision tower + projector (grid fixed),
* ``prefill_b{bucket}.onnx`` per bucket: the LLM over the whole prompt (``S`` fixed per bucket),
* ``decode.onnx``: one LLM step over a fixed ``max_cache``-slot KV cache (shared by all buckets),
* ``embed_tokens.npy``: the token-embedding table (embedding and image scatter happen in numpy),
* ``export.json``: the manifest (shapes, names, token ids, prompts, prefill ``position_ids``, checks).

Graph conventions (see ``docs/reference-models.md``):

* the attention mask is an additive float32 input with a finite −1e4 (``build.MASK_VALUE``);
* the mask + scores addition of every decoder layer is an explicit ``Add`` node named
  ``/language_model/layers.{i}/self_attn/MaskAdd`` with output ``…/MaskAdd_output_0`` and node metadata
  ``ivq.role = attention_mask_add`` (both exporters);
* ``position_ids`` are inputs; GELU is the ``Gelu`` op (opset >= 20), not an ``Erf`` chain;
* constant subgraphs (the exporter's ``Shape``/``ConstantOfShape``/``Where`` shape arithmetic) are folded
  into initializers (:func:`ivq_debug.onnxgraph.fold.fold_constants`: exact, every other name kept), since QNN HTP
  accepts no ``Shape``/``ConstantOfShape`` node;
* legacy exporter scopes are left untouched, so node names map to HF module paths by suffix.

Verification runs each graph in ONNX Runtime (CPU, fp32) on a real sample and compares every output
with the torch wrapper: ``max_abs <= 1e-5`` (the ``export`` preset).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug.defaults import EXPORT_OUTPUT_MAX_ABS
from ivq_debug.errors import InputError, UsageError
from ivq_debug.onnxgraph.fold import fold_constants
from ivq_debug.vlm import task
from ivq_debug.vlm.build import DEFAULT_BUCKET, MASK_VALUE, MAX_CACHE, family_of, num_image_tokens
from ivq_debug.vlm.inputs import prefill_positions, vision_feeds

EXPORTERS: tuple[str, ...] = ("legacy", "dynamo")
DEFAULT_EXPORTER = "legacy"
#: opset 20 for the ``Gelu`` op (QNN HTP runs it; the Erf chain falls back to the CPU when quantized)
DEFAULT_OPSET = 20
MANIFEST = "export.json"
EMBEDDING_FILE = "embed_tokens.npy"
MASK_ADD_NODE = "/language_model/layers.{layer}/self_attn/MaskAdd"
MASK_ADD_OUTPUT = MASK_ADD_NODE + "_output_0"
MASK_ADD_ROLE = "attention_mask_add"
PARTS: tuple[str, ...] = ("vision", "prefill", "decode")


@dataclass
class PartCheck:
    """Export verification of one part: ONNX Runtime fp32 vs the torch wrapper, per output."""

    part: str
    bucket: int | None
    exporter: str
    max_abs: dict[str, float]
    tolerance: float

    @property
    def worst(self) -> float:
        """Largest max_abs over the outputs."""
        return max(self.max_abs.values()) if self.max_abs else 0.0

    @property
    def ok(self) -> bool:
        """Every output within tolerance."""
        return self.worst <= self.tolerance


@dataclass
class ExportedPart:
    """One exported graph."""

    part: str
    bucket: int | None
    path: str
    inputs: dict[str, list[int | str]]  # a dynamic dimension by its name
    outputs: dict[str, list[int | str]]
    nodes: int
    seconds: float
    check: PartCheck | None = None


@dataclass
class ExportResult:
    """What :func:`export_parts` wrote."""

    folder: Path
    family: str
    exporter: str
    opset: int
    parts: list[ExportedPart] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def checks(self) -> list[PartCheck]:
        """Verification results of all parts (when verified)."""
        return [p.check for p in self.parts if p.check is not None]

    @property
    def ok(self) -> bool:
        """All verified parts within tolerance."""
        return all(c.ok for c in self.checks)

    def checks_frame(self) -> Any:
        """The checks as a pandas DataFrame (one row per part × output)."""
        import pandas as pd

        rows = [
            {"part": c.part, "bucket": c.bucket, "exporter": c.exporter, "output": o, "max_abs": v,
             "tolerance": c.tolerance, "ok": v <= c.tolerance}
            for c in self.checks for o, v in c.max_abs.items()
        ]
        return pd.DataFrame(rows)

    def path(self, part: str, bucket: int | None = None) -> Path:
        """Path of one part's graph (``bucket`` ignored for ``decode``)."""
        for p in self.parts:
            if p.part == part and (part == "decode" or p.bucket == bucket):
                return Path(p.path)
        raise KeyError(f"no exported {part} for bucket {bucket}")


# ------------------------------------------------------------------------------------- example data
def example_inputs(model: Any, bucket: int, sample: Any = None) -> dict[str, dict[str, np.ndarray]]:
    """Realistic feeds of every part for one eval sample: vision, prefill, and the first decode step."""
    import torch

    from ivq_debug.vlm.parts import PrefillPart, VisionPart, decode_mask, prefill_mask

    family = family_of(model)
    sample = sample if sample is not None else task.eval_set(bucket, 1)[0]
    vf = vision_feeds(family, sample.image)
    with torch.no_grad():
        feats = VisionPart(model, bucket)(torch.from_numpy(vf["pixel_values"])).numpy()
    ids = np.array(task.prompt_ids(num_image_tokens(bucket)), dtype=np.int64)
    table = model.get_input_embeddings().weight.detach().numpy()
    emb = table[ids].copy()
    emb[ids == model.config.image_token_id] = feats.reshape(-1, feats.shape[-1])
    S = len(ids)
    pos = prefill_positions(family, model, bucket)
    pf = {"inputs_embeds": emb[None].astype(np.float32), "attention_mask": prefill_mask(S), "position_ids": pos}
    with torch.no_grad():
        outs = PrefillPart(model)(*[torch.from_numpy(v) for v in pf.values()])
    tok = int(outs[0][0, -1].argmax())
    dpos = np.array([[S]], dtype=np.int64) if family == "internvl" else np.full((3, 1, 1), pos.max() + 1, np.int64)
    dec: dict[str, np.ndarray] = {
        "inputs_embeds": table[[tok]][None].astype(np.float32),
        "attention_mask": decode_mask(S, MAX_CACHE),
        "position_ids": dpos,
    }
    n_layers = (len(outs) - 1) // 2
    for i in range(n_layers):
        for j, kind in enumerate(("key", "value")):
            kv = outs[1 + 2 * i + j].numpy()
            buf = np.zeros((*kv.shape[:2], MAX_CACHE, kv.shape[3]), np.float32)
            buf[:, :, :S] = kv
            dec[f"past.{i}.{kind}"] = buf
    return {"vision": vf, "prefill": pf, "decode": dec}


# ------------------------------------------------------------------------------------- export
def _export_one(
    module: Any, feeds: dict[str, np.ndarray], output_names: Sequence[str], path: Path, exporter: str,
    opset: int, dynamic_axes: dict[str, dict[int, str]] | None = None, dynamic_shapes: Any = None,
) -> None:
    """Export ``module`` called with ``feeds`` (in order); static shapes unless ``dynamic_axes`` (legacy)
    or ``dynamic_shapes`` (dynamo, ``torch.export`` form) name the dynamic dimensions."""
    import torch

    args = tuple(torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values())
    input_names = list(feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(
                module, args, str(path), dynamo=False, opset_version=opset, input_names=input_names,
                output_names=list(output_names), do_constant_folding=True, dynamic_axes=dynamic_axes,
            )
        else:
            prog = torch.onnx.export(
                module, args, dynamo=True, opset_version=opset, input_names=input_names,
                output_names=list(output_names), optimize=True, verbose=False,
                custom_translation_table=_dynamo_translations(opset), dynamic_shapes=dynamic_shapes,
            )
            prog.save(str(path))


def _dynamo_translations(opset: int) -> dict[Any, Any]:
    """aten.gelu → the ONNX ``Gelu`` op (torchlib emits an Erf chain, which QNN HTP cannot quantize)."""
    import torch
    from onnxscript import opset20

    def gelu(self: Any, approximate: str = "none") -> Any:
        return opset20.Gelu(self, approximate=approximate)

    if opset < 20:
        return {}
    return {torch.ops.aten.gelu.default: gelu}


def mark_mask_adds(model_proto: Any, n_layers: int) -> list[str]:
    """Rename each layer's mask + scores ``Add`` to :data:`MASK_ADD_NODE` (and its output); returns names.

    The Adds are found by following the ``attention_mask`` graph input through shape-only ops
    (Slice, Cast, Expand, Reshape, Unsqueeze, Identity) to the first ``Add`` on each path; they are
    numbered in graph (topological) order, which is layer order.
    """
    g = model_proto.graph
    consumers: dict[str, list[Any]] = {}
    for node in g.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    passthrough = {"Slice", "Cast", "Expand", "Reshape", "Unsqueeze", "Identity", "Squeeze"}
    found: list[Any] = []
    frontier, seen = ["attention_mask"], set()
    while frontier:
        name = frontier.pop()
        for node in consumers.get(name, []):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "Add":
                found.append(node)
            elif node.op_type in passthrough:
                frontier.extend(node.output)
    order = {id(n): k for k, n in enumerate(g.node)}
    found.sort(key=lambda n: order[id(n)])
    if len(found) != n_layers:
        raise RuntimeError(f"expected {n_layers} mask Add nodes fed by attention_mask, found {len(found)}")
    renamed = []
    graph_outputs = {o.name for o in g.output}
    for layer, node in enumerate(found):
        old_out = node.output[0]
        new_out = MASK_ADD_OUTPUT.format(layer=layer)
        node.name = MASK_ADD_NODE.format(layer=layer)
        if old_out not in graph_outputs:
            node.output[0] = new_out
            for c in consumers.get(old_out, []):
                for k, name in enumerate(c.input):
                    if name == old_out:
                        c.input[k] = new_out
            for vi in g.value_info:
                if vi.name == old_out:
                    vi.name = new_out
        props = {p.key: p for p in node.metadata_props}
        for key, val in (("ivq.role", MASK_ADD_ROLE), ("ivq.layer", str(layer))):
            if key in props:
                props[key].value = val
            else:
                node.metadata_props.append(_prop(key, val))
        renamed.append(node.name)
    return renamed


def _prop(key: str, value: str) -> Any:
    from onnx import StringStringEntryProto

    return StringStringEntryProto(key=key, value=value)


def _shapes(vis: Any) -> dict[str, list[int | str]]:
    """Graph I/O shapes; a symbolic (dynamic) dimension is given by its name."""
    return {v.name: [d.dim_param if d.HasField("dim_param") else d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in vis}


def verify_part(
    module: Any, feeds: dict[str, np.ndarray] | Sequence[dict[str, np.ndarray]], path: str | os.PathLike,
    part: str, bucket: int | None, exporter: str, tolerance: float | None = None,
) -> PartCheck:
    """Run one exported graph in ORT (CPU fp32) and the torch wrapper; max_abs per output.

    ``feeds`` is one feed dict or several (one per sample); the check keeps the worst over them.
    """
    import onnxruntime as ort
    import torch


    tol = EXPORT_OUTPUT_MAX_ABS if tolerance is None else tolerance
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    errs: dict[str, float] = {}
    for fd in [feeds] if isinstance(feeds, dict) else list(feeds):
        got = sess.run(names, {k: np.ascontiguousarray(v) for k, v in fd.items()})
        with torch.no_grad():
            ref = module(*[torch.from_numpy(np.ascontiguousarray(v)) for v in fd.values()])
        ref = (ref,) if isinstance(ref, torch.Tensor) else ref
        for n, a, b in zip(names, got, ref, strict=True):
            b = b.numpy()
            if a.shape != b.shape:
                raise RuntimeError(f"{part}: output {n} has shape {a.shape} in ONNX, {b.shape} in torch")
            e = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
            errs[n] = max(errs.get(n, 0.0), e)
    return PartCheck(part, bucket, exporter, errs, tol)


def export_parts(
    model: Any,
    folder: str | os.PathLike,
    buckets: Sequence[int] | None = None,
    exporter: str = DEFAULT_EXPORTER,
    opset: int = DEFAULT_OPSET,
    parts: Sequence[str] = PARTS,
    verify: bool = True,
    overwrite: bool = False,
    model_id: str | None = None,
    verify_samples: int = 1,
) -> ExportResult:
    """Export the vision / prefill / decode graphs of ``model`` into ``folder`` (static shapes).

    Args:
        model: a reference VLM (``InternVLForConditionalGeneration`` / ``Qwen2VLForConditionalGeneration``,
            eager attention, eval mode), e.g. from :func:`ivq_debug.vlm.load.load_vlm`.
        folder: output folder (created).
        buckets: resolution buckets (square image sizes); default: the model's default bucket.
        exporter: ``"legacy"`` (TorchScript, default) or ``"dynamo"`` (torch.export + onnxscript).
        opset: ONNX opset (>= 17; default 20 for the ``Gelu`` op).
        parts: which parts to export.
        verify: run ORT vs torch on real eval samples and store max_abs per output.
        verify_samples: number of eval samples per bucket the verification runs (worst kept).
        overwrite: replace existing graphs in ``folder``.
        model_id: the model's name or path, recorded in the manifest.
    """
    import onnx
    import torch

    from ivq_debug.vlm.parts import (
        DecodePart,
        PrefillPart,
        VisionPart,
        kv_names,
        kv_shape,
        num_layers,
        static_vision,
    )

    if exporter not in EXPORTERS:
        raise UsageError(f"unknown exporter {exporter!r}; choose from {', '.join(EXPORTERS)}")
    if opset < 17:
        raise UsageError(f"opset {opset} is too old; use >= 17")
    bad = set(parts) - set(PARTS)
    if bad:
        raise UsageError(f"unknown parts {sorted(bad)}; choose from {', '.join(PARTS)}")
    family = family_of(model)
    buckets = list(buckets) if buckets else [DEFAULT_BUCKET]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / MANIFEST).exists() and not overwrite:
        raise UsageError("an export already exists here; pass overwrite=True", folder / MANIFEST)
    model.eval()
    L = num_layers(model)
    result = ExportResult(folder, family, exporter, opset)
    table = model.get_input_embeddings().weight.detach().numpy().astype(np.float32)
    _save_npy(folder / EMBEDDING_FILE, table)

    jobs: list[tuple[str, int | None, Any, list[dict[str, np.ndarray]], list[str]]] = []
    decode_feeds: list[dict[str, np.ndarray]] = []
    kv_out = ["logits", *kv_names("present", L)]
    for b in buckets:
        exs = [example_inputs(model, b, s) for s in task.eval_set(b, max(1, verify_samples))]
        decode_feeds += [ex["decode"] for ex in exs]
        if "vision" in parts:
            jobs.append(("vision", b, VisionPart(model, b), [ex["vision"] for ex in exs], ["image_features"]))
        if "prefill" in parts:
            jobs.append(("prefill", b, PrefillPart(model), [ex["prefill"] for ex in exs], kv_out))
    if "decode" in parts and decode_feeds:
        jobs.append(("decode", None, DecodePart(model), decode_feeds, kv_out))

    for part, b, module, feed_list, out_names in jobs:
        feeds = feed_list[0]
        path = folder / (f"{part}_b{b}.onnx" if b is not None else f"{part}.onnx")
        tmp = path.with_name(f".{path.name}.tmp")
        t0 = time.perf_counter()
        with static_vision(model, b) if part == "vision" else contextlib.nullcontext():
            _export_one(module, feeds, out_names, tmp, exporter, opset)
        proto = onnx.load(str(tmp))
        # static graphs for QNN: fold the exporter's leftover shape arithmetic (names kept, bit-exact)
        fold_constants(proto)
        if part != "vision":
            mark_mask_adds(proto, L)
        proto.doc_string = f"ivq-debug {family} {part} bucket={b} exporter={exporter}"
        onnx.save(proto, str(tmp))
        os.replace(tmp, path)
        secs = time.perf_counter() - t0
        ep = ExportedPart(
            part, b, str(path), _shapes(proto.graph.input), _shapes(proto.graph.output), len(proto.graph.node), secs
        )
        if verify:
            with torch.no_grad():
                ep.check = verify_part(module, feed_list, path, part, b, exporter)
        result.parts.append(ep)

    cfg = model.config
    manifest: dict[str, Any] = {
        "schema": "ivq-vlm-export/1",
        "model": model_id,
        "family": family,
        "exporter": exporter,
        "opset": opset,
        "buckets": buckets,
        "max_cache": MAX_CACHE,
        "mask_value": MASK_VALUE,
        "mask_add_node": MASK_ADD_NODE,
        "num_layers": L,
        "kv_shape": list(kv_shape(model, MAX_CACHE)),
        "hidden_size": int(cfg.text_config.hidden_size),
        "vocab_size": int(cfg.text_config.vocab_size),
        "image_token_id": int(cfg.image_token_id),
        "eos_token_id": task.VOCAB[task.EOS],
        "embedding": EMBEDDING_FILE,
        "prompt_ids": {str(b): task.prompt_ids(num_image_tokens(b)) for b in buckets},
        "prefill_position_ids": {},
        "parts": [
            {k: v for k, v in asdict(p).items() if k != "check"} | {"path": Path(p.path).name}
            for p in result.parts
        ],
        "verify_samples": verify_samples if verify else 0,
        "checks": [asdict(c) | {"ok": c.ok} for c in result.checks],
    }

    for b in buckets:
        manifest["prefill_position_ids"][str(b)] = prefill_positions(family, model, b).tolist()
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)
    result.manifest = manifest
    return result


def _save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, path)


def load_manifest(folder: str | os.PathLike, schema: str = "ivq-vlm-export/1") -> dict[str, Any]:
    """Read ``export.json`` of an export folder (InputError when missing, malformed or of another ``schema``)."""

    p = Path(folder) / MANIFEST
    if not p.is_file():
        raise InputError("not an ivq VLM export folder (no export.json)", folder)
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"bad JSON: {e}", p) from e
    if m.get("schema") != schema:
        raise InputError(f"unknown export schema {m.get('schema')!r}", p)
    return m
