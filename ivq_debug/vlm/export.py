"""Split ONNX export of a reference VLM, as deployments do it, with static shapes and verification.

One call writes, into one folder:

* ``vision_b{bucket}.onnx`` per resolution bucket: vision tower + projector (grid fixed); for Qwen3-VL
  also the DeepStack mergers (outputs ``deepstack_features.{k}`` beside ``image_features``),
* ``prefill_b{bucket}.onnx`` per bucket: the LLM over the whole prompt (``S`` fixed per bucket); for
  Qwen3-VL with inputs ``deepstack_embeds.{k}``, added after LLM layer ``k`` inside the graph,
* on request, fault variants: ``prefill_b{bucket}.mrope_sectioned.onnx`` (an interleaved M-RoPE model's
  prefill with Qwen2-VL's sectioned layout, for the scheduler's ``mrope_layout`` knob),
* ``decode.onnx``: one LLM step over a fixed ``max_cache``-slot KV cache (shared by all buckets),
* ``embed_tokens.npy``: the token-embedding table (embedding and image scatter happen in numpy),
* ``export.json``: the manifest (shapes, names, token ids, prompts, prefill ``position_ids``, checks).

Graph conventions (see ``docs/reference-models.md``):

* the attention mask is an additive float32 input with a finite −1e4 (``build.MASK_VALUE``);
* the mask + scores addition of every decoder layer is an explicit ``Add`` node named
  ``/language_model/layers.{i}/self_attn/MaskAdd`` with output ``…/MaskAdd_output_0`` and node metadata
  ``ivq.role = attention_mask_add`` (both exporters);
* Qwen3-VL: the DeepStack add of feature ``k`` is the ``Add`` ``/language_model/DeepStackAdd_{k}`` (output
  ``…_output_0``, metadata ``ivq.role = deepstack_add``, ``ivq.deepstack = k``, ``ivq.after_layer``);
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
from ivq_debug.errors import UsageError
from ivq_debug.onnxgraph.fold import fold_constants
from ivq_debug.outputs import atomic_write_text
from ivq_debug.vlm import task
from ivq_debug.vlm.build import (
    DEEPSTACK_INPUT,
    DEFAULT_BUCKET,
    MASK_VALUE,
    MAX_CACHE,
    deepstack_count,
    family,
    num_image_tokens,
)
from ivq_debug.vlm.inputs import prefill_positions
from ivq_debug.vlm.manifest import CONFIG_FILE, MANIFEST, SCHEMA
from ivq_debug.vlm.scheduler import collect_feeds
from ivq_debug.vlm.torch_generate import torch_scheduler

EXPORTERS: tuple[str, ...] = ("legacy", "dynamo")
DEFAULT_EXPORTER = "legacy"
#: opset 20 for the ``Gelu`` op (QNN HTP runs it; the Erf chain falls back to the CPU when quantized)
DEFAULT_OPSET = 20
EMBEDDING_FILE = "embed_tokens.npy"
MASK_ADD_NODE = "/language_model/layers.{layer}/self_attn/MaskAdd"
MASK_ADD_OUTPUT = MASK_ADD_NODE + "_output_0"
MASK_ADD_ROLE = "attention_mask_add"
#: the DeepStack add of feature ``k`` in the prefill graph (after LLM layer ``k``)
DEEPSTACK_ADD_NODE = "/language_model/DeepStackAdd_{k}"
DEEPSTACK_ADD_OUTPUT = DEEPSTACK_ADD_NODE + "_output_0"
DEEPSTACK_ADD_ROLE = "deepstack_add"
PARTS: tuple[str, ...] = ("vision", "prefill", "decode")
#: fault-variant graphs :func:`export_parts` writes on request (variant -> what differs)
VARIANTS: dict[str, str] = {"mrope_sectioned": "prefill with the sectioned M-RoPE layout (interleaved models)"}


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
    variant: str | None = None  # a fault variant (:data:`VARIANTS`), None for the deployment graph


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

    def path(self, part: str, bucket: int | None = None, variant: str | None = None) -> Path:
        """Path of one part's graph (``bucket`` ignored for ``decode``; ``variant`` None: the deployment graph)."""
        for p in self.parts:
            if p.part == part and (part == "decode" or p.bucket == bucket) and p.variant == variant:
                return Path(p.path)
        raise KeyError(f"no exported {part} for bucket {bucket}" + (f" (variant {variant})" if variant else ""))


# ------------------------------------------------------------------------------------- example data
def example_inputs(model: Any, bucket: int, sample: Any = None) -> dict[str, dict[str, np.ndarray]]:
    """Realistic feeds of every part for one eval sample: vision, prefill, and the first decode step.

    They are the feeds the torch scheduler gives its part wrappers (teacher-forced on the sample's
    caption, so a decode step exists even for an untrained model), i.e. exactly what ORT will receive.
    """

    sample = sample if sample is not None else task.eval_set(bucket, 1)[0]
    feeds = collect_feeds(torch_scheduler(model, bucket), [sample], forced=True)
    return {part: feeds[part][0] for part in PARTS}


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


def _consumers(graph: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


def mark_mask_adds(model_proto: Any, n_layers: int) -> list[str]:
    """Rename each layer's mask + scores ``Add`` to :data:`MASK_ADD_NODE` (and its output); returns names.

    The Adds are found by following the ``attention_mask`` graph input through shape-only ops
    (Slice, Cast, Expand, Reshape, Unsqueeze, Identity) to the first ``Add`` on each path; they are
    numbered in graph (topological) order, which is layer order.
    """
    g = model_proto.graph
    consumers = _consumers(g)
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
    for layer, node in enumerate(found):
        _name_node(g, consumers, node, MASK_ADD_NODE.format(layer=layer), MASK_ADD_OUTPUT.format(layer=layer),
                   {"ivq.role": MASK_ADD_ROLE, "ivq.layer": str(layer)})
    return [n.name for n in found]


def mark_deepstack_adds(model_proto: Any, n_deepstack: int) -> list[str]:
    """Rename the ``Add`` consuming each ``deepstack_embeds.{k}`` input to :data:`DEEPSTACK_ADD_NODE`; returns names.

    Metadata ``ivq.role = deepstack_add``, ``ivq.deepstack = k`` and, when the scope of the node producing
    the other operand names it (legacy ``/language_model/layers.{i}/…``, dynamo ``name_scopes``),
    ``ivq.after_layer``: the decoder layer whose output the add reads.
    """
    import re


    g = model_proto.graph
    consumers = _consumers(g)
    producer = {o: n for n in g.node for o in n.output}
    names = []
    for k in range(n_deepstack):
        adds = [n for n in consumers.get(DEEPSTACK_INPUT.format(k=k), []) if n.op_type == "Add"]
        if len(adds) != 1:
            raise RuntimeError(f"expected one Add consuming {DEEPSTACK_INPUT.format(k=k)}, found {len(adds)}")
        node = adds[0]
        other = next(i for i in node.input if i != DEEPSTACK_INPUT.format(k=k))
        src = producer.get(other)
        scopes = [src.name, *[q.value for q in src.metadata_props if q.key == "pkg.torch.onnx.name_scopes"]] if src else []
        layer = next((m.group(1) for sc in scopes if (m := re.search(r"layers\.(\d+)", sc))), None)
        props = {"ivq.role": DEEPSTACK_ADD_ROLE, "ivq.deepstack": str(k)}
        if layer is not None:
            props["ivq.after_layer"] = layer
        _name_node(g, consumers, node, DEEPSTACK_ADD_NODE.format(k=k), DEEPSTACK_ADD_OUTPUT.format(k=k), props)
        names.append(node.name)
    return names


def _name_node(
    g: Any, consumers: dict[str, list[Any]], node: Any, name: str, output: str, props: dict[str, str]
) -> None:
    """Give ``node`` a stable name and first output (unless that output is a graph output) and metadata."""
    old_out = node.output[0]
    node.name = name
    if old_out not in {o.name for o in g.output}:
        node.output[0] = output
        for c in consumers.get(old_out, []):
            for k, inp in enumerate(c.input):
                if inp == old_out:
                    c.input[k] = output
        consumers[output] = consumers.pop(old_out, [])
        for vi in g.value_info:
            if vi.name == old_out:
                vi.name = output
    existing = {p.key: p for p in node.metadata_props}
    for key, val in props.items():
        if key in existing:
            existing[key].value = val
        else:
            node.metadata_props.append(_prop(key, val))


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
    variants: Sequence[str] = (),
) -> ExportResult:
    """Export the vision / prefill / decode graphs of ``model`` into ``folder`` (static shapes).

    Args:
        model: a VLM of a supported family (``InternVL``, ``Qwen2VL``, ``Qwen3VLForConditionalGeneration``,
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
        variants: fault-variant graphs to add (:data:`VARIANTS`), e.g. ``("mrope_sectioned",)`` for the
            scheduler's ``mrope_layout="sectioned"`` knob; verified like the others (against the torch
            wrapper with the same fault).
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
        vision_output_names,
    )

    if exporter not in EXPORTERS:
        raise UsageError(f"unknown exporter {exporter!r}; choose from {', '.join(EXPORTERS)}")
    if opset < 17:
        raise UsageError(f"opset {opset} is too old; use >= 17")
    bad = set(parts) - set(PARTS)
    if bad:
        raise UsageError(f"unknown parts {sorted(bad)}; choose from {', '.join(PARTS)}")
    fam = family(model)
    bad = set(variants) - set(VARIANTS)
    if bad:
        raise UsageError(f"unknown variants {sorted(bad)}; choose from {', '.join(VARIANTS)}")
    if "mrope_sectioned" in variants and fam.mrope_layout != "interleaved":
        raise UsageError(f"variant 'mrope_sectioned' needs an interleaved M-RoPE model ({fam.name} is not)")
    buckets = list(buckets) if buckets else [DEFAULT_BUCKET]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / MANIFEST).exists() and not overwrite:
        raise UsageError("an export already exists here; pass overwrite=True", folder / MANIFEST)
    model.eval()
    L = num_layers(model)
    result = ExportResult(folder, fam.name, exporter, opset)
    table = model.get_input_embeddings().weight.detach().numpy().astype(np.float32)
    _save_npy(folder / EMBEDDING_FILE, table)

    jobs: list[tuple[str, int | None, Any, list[dict[str, np.ndarray]], list[str], str | None]] = []
    decode_feeds: list[dict[str, np.ndarray]] = []
    kv_out = ["logits", *kv_names("present", L)]
    for b in buckets:
        exs = [example_inputs(model, b, s) for s in task.eval_set(b, max(1, verify_samples))]
        decode_feeds += [ex["decode"] for ex in exs]
        if "vision" in parts:
            jobs.append(("vision", b, VisionPart(model, b), [ex["vision"] for ex in exs], vision_output_names(model),
                         None))
        if "prefill" in parts:
            jobs.append(("prefill", b, PrefillPart(model), [ex["prefill"] for ex in exs], kv_out, None))
            if "mrope_sectioned" in variants:
                jobs.append(("prefill", b, PrefillPart(model, mrope_layout="sectioned"),
                             [ex["prefill"] for ex in exs], kv_out, "mrope_sectioned"))
    if "decode" in parts and decode_feeds:
        jobs.append(("decode", None, DecodePart(model), decode_feeds, kv_out, None))

    for part, b, module, feed_list, out_names, variant in jobs:
        feeds = feed_list[0]
        stem = f"{part}_b{b}" if b is not None else part
        path = folder / (f"{stem}.{variant}.onnx" if variant else f"{stem}.onnx")
        tmp = path.with_name(f".{path.name}.tmp")
        t0 = time.perf_counter()
        with static_vision(model, b) if part == "vision" else contextlib.nullcontext():
            _export_one(module, feeds, out_names, tmp, exporter, opset)
        proto = onnx.load(str(tmp))
        # static graphs for QNN: fold the exporter's leftover shape arithmetic (names kept, bit-exact)
        fold_constants(proto)
        if part != "vision":
            mark_mask_adds(proto, L)
        if part == "prefill":
            mark_deepstack_adds(proto, deepstack_count(model))
        proto.doc_string = f"ivq-debug {fam.name} {part} bucket={b} exporter={exporter}" + (
            f" variant={variant}" if variant else "")
        onnx.save(proto, str(tmp))
        os.replace(tmp, path)
        secs = time.perf_counter() - t0
        ep = ExportedPart(
            part, b, str(path), _shapes(proto.graph.input), _shapes(proto.graph.output), len(proto.graph.node), secs,
            variant=variant,
        )
        if verify:
            with torch.no_grad():
                ep.check = verify_part(module, feed_list, path, part, b, exporter)
        result.parts.append(ep)

    cfg = model.config
    manifest: dict[str, Any] = {
        "schema": SCHEMA,
        "model": model_id,
        "family": fam.name,
        "exporter": exporter,
        "opset": opset,
        "buckets": buckets,
        "max_cache": MAX_CACHE,
        "mask_value": MASK_VALUE,
        "mask_add_node": MASK_ADD_NODE,
        "num_layers": L,
        "deepstack": deepstack_count(model),
        "mrope_layout": fam.mrope_layout,
        "variants": list(variants),
        "kv_shape": list(kv_shape(model, MAX_CACHE)),
        "hidden_size": int(cfg.text_config.hidden_size),
        "vocab_size": int(cfg.text_config.vocab_size),
        "image_token_id": int(cfg.image_token_id),
        "eos_token_id": task.VOCAB[task.EOS],
        "embedding": EMBEDDING_FILE,
        "config": CONFIG_FILE,
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
        manifest["prefill_position_ids"][str(b)] = prefill_positions(fam.name, model, b).tolist()
    atomic_write_text(folder / CONFIG_FILE, model.config.to_json_string(), overwrite=True)
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1), overwrite=True)
    result.manifest = manifest
    return result


def _save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, path)
