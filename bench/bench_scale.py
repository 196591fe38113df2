"""Dumps and diffs at InternVL2-2B layer shapes: ivq-debug against Polygraphy and ORT ``qdq_loss_debug``.

One command builds a synthetic VLM with InternVL2-2B-like layer shapes (InternViT-300M blocks: hidden 1024,
MLP 4096, 16 heads, 1025 tokens per 448² tile; a pixel-shuffle projector; InternLM2-1.8B-like decoder blocks:
hidden 2048, intermediate 8192, 16 query / 8 KV heads, 256 image + 32 text tokens; vocab 92553), exports it
with the legacy torch exporter, makes a perturbed copy, and measures, each step in its own process (peak RSS
from ``os.wait4``, wall time):

- ivq-debug: ``ivq capture onnx`` (reference and test) and ``ivq-diff --json``; also with
  ``--max-outputs-per-run`` and with ``--summary-only``;
- Polygraphy: ``polygraphy run --onnxrt --onnx-outputs '*' --save-outputs`` for both models, then
  ``polygraphy run --load-outputs ref.json test.json --compare snr --save-accuracy-results``;
- ORT ``qdq_loss_debug``: ``modify_model_output_intermediate_tensors`` per model, then one process with
  ``collect_activations`` (both models), ``create_activation_matching`` and ``compute_activation_error``.

It prints one markdown table, a cross-tool sanity check (same worst layer, same SQNR on shared tensors), and
the bounded-memory check: ``ivq-diff`` under ``RLIMIT_AS`` on dumps several times larger than the limit, with
peak RSS against ``2 × largest tensor + fixed overhead``.

    python bench/bench_scale.py [--scale S|tiny] [--workdir DIR] [--mem-limit-gib G] [--keep]

See bench/README.md and docs/scale.md for the columns and the measured figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, when run as a script or loaded by path
from common import (
    DIFF_OK,
    GiB,
    Measured,
    MiB,
    Row,
    bin_path,
    dir_bytes,
    gib,
    layer_sqnr,
    load_avg,
    mem_available,
    mem_total,
    row_json,
    run_measured,
    run_ort,
    run_polygraphy,
    sanity,
    say,
    step_result,
    table,
)
from common import run_ivq as run_ivq_row
from common import self_cmd as _common_self_cmd

PROTOBUF_LIMIT = 2 * GiB - 1
TOOLS = ("ivq", "polygraphy", "ort")


def _self_cmd(step: str, args: dict[str, Any]) -> list[str]:
    return _common_self_cmd(__file__, step, args)


# ------------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class ModelConfig:
    """Layer shapes of the synthetic VLM (defaults: InternVL2-2B widths, 6 ViT + 3 LLM layers)."""

    image: int = 448
    patch: int = 14
    vit_hidden: int = 1024
    vit_mlp: int = 4096
    vit_heads: int = 16
    vit_layers: int = 6
    llm_hidden: int = 2048
    llm_mlp: int = 8192
    llm_heads: int = 16
    llm_kv_heads: int = 8
    llm_layers: int = 3
    text_tokens: int = 32
    vocab: int = 92553

    @property
    def vit_tokens(self) -> int:
        """Patch tokens + CLS per tile (1025 at 448² / 14)."""
        return (self.image // self.patch) ** 2 + 1

    @property
    def llm_tokens(self) -> int:
        """Prefill length: pixel-shuffled image tokens + text tokens (288 at default)."""
        return (self.image // self.patch // 2) ** 2 + self.text_tokens

    @property
    def perturbed_vit_layer(self) -> int:
        """The ViT layer whose ``fc1`` weights the test model changes (the middle one)."""
        return self.vit_layers // 2

    def weight_bytes(self) -> int:
        """fp32 parameter bytes (approximate: biases and norms included, buffers not)."""
        v, f, d, m = self.vit_hidden, self.vit_mlp, self.llm_hidden, self.llm_mlp
        kv = d // self.llm_heads * self.llm_kv_heads
        vit = self.vit_layers * (4 * v * v + 2 * v * f + 10 * v + f)
        llm = self.llm_layers * (2 * d * d + 2 * d * kv + 3 * d * m + 2 * d)
        proj = 4 * v * d + d * d + 10 * v + 2 * d
        rest = 3 * self.patch**2 * v + (self.vit_tokens + 2) * v + self.vocab * d
        return 4 * (vit + llm + proj + rest)


def config_for_scale(scale: str) -> ModelConfig:
    """``tiny`` (narrow widths, for tests) or a number: layer counts are ``round(6·S)`` ViT and
    ``round(3·S)`` LLM (at least 1 each) at the real InternVL2-2B widths."""
    if scale == "tiny":
        return ModelConfig(image=112, vit_hidden=128, vit_mlp=512, vit_heads=4, vit_layers=2, llm_hidden=256,
                           llm_mlp=1024, llm_heads=4, llm_kv_heads=2, llm_layers=2, text_tokens=16, vocab=1000)
    s = float(scale)
    if not s > 0:
        raise SystemExit("--scale must be 'tiny' or a positive number")
    return ModelConfig(vit_layers=max(1, round(6 * s)), llm_layers=max(1, round(3 * s)))


def _model_class() -> Any:
    """The torch module of the synthetic VLM (defined lazily: torch is imported only in the build step)."""
    import torch
    from torch import nn

    class VitAttention(nn.Module):
        def __init__(self, c: ModelConfig) -> None:
            super().__init__()
            self.heads = c.vit_heads
            self.qkv = nn.Linear(c.vit_hidden, 3 * c.vit_hidden)
            self.proj = nn.Linear(c.vit_hidden, c.vit_hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, d = x.shape
            hd = d // self.heads
            qkv = self.qkv(x).reshape(b, n, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            a = ((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(-1)  # attention probs: [1, 16, 1025, 1025]
            return self.proj((a @ v).transpose(1, 2).reshape(b, n, d))

    class VitLayer(nn.Module):  # InternViT block: pre-LN, layer scale
        def __init__(self, c: ModelConfig) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(c.vit_hidden, eps=1e-6)
            self.attn = VitAttention(c)
            self.ls1 = nn.Parameter(0.1 * torch.ones(c.vit_hidden))
            self.norm2 = nn.LayerNorm(c.vit_hidden, eps=1e-6)
            self.fc1 = nn.Linear(c.vit_hidden, c.vit_mlp)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(c.vit_mlp, c.vit_hidden)
            self.ls2 = nn.Parameter(0.1 * torch.ones(c.vit_hidden))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.norm1(x)) * self.ls1
            return x + self.fc2(self.act(self.fc1(self.norm2(x)))) * self.ls2

    class RMSNorm(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)

    class LlmLayer(nn.Module):  # InternLM2 block: RMSNorm, GQA with RoPE, SwiGLU
        def __init__(self, c: ModelConfig) -> None:
            super().__init__()
            self.c = c
            hd = c.llm_hidden // c.llm_heads
            self.attention_norm = RMSNorm(c.llm_hidden)
            self.wq = nn.Linear(c.llm_hidden, c.llm_hidden, bias=False)
            self.wk = nn.Linear(c.llm_hidden, c.llm_kv_heads * hd, bias=False)
            self.wv = nn.Linear(c.llm_hidden, c.llm_kv_heads * hd, bias=False)
            self.wo = nn.Linear(c.llm_hidden, c.llm_hidden, bias=False)
            self.ffn_norm = RMSNorm(c.llm_hidden)
            self.w1 = nn.Linear(c.llm_hidden, c.llm_mlp, bias=False)
            self.w3 = nn.Linear(c.llm_hidden, c.llm_mlp, bias=False)
            self.w2 = nn.Linear(c.llm_mlp, c.llm_hidden, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            c = self.c
            b, n, d = x.shape
            hd, kvh, rep = d // c.llm_heads, c.llm_kv_heads, c.llm_heads // c.llm_kv_heads
            h = self.attention_norm(x)
            q = self.wq(h).reshape(b, n, c.llm_heads, hd).transpose(1, 2)
            k = self.wk(h).reshape(b, n, kvh, hd).transpose(1, 2)
            v = self.wv(h).reshape(b, n, kvh, hd).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            k = k[:, :, None].expand(b, kvh, rep, n, hd).reshape(b, c.llm_heads, n, hd)
            v = v[:, :, None].expand(b, kvh, rep, n, hd).reshape(b, c.llm_heads, n, hd)
            a = ((q @ k.transpose(-2, -1)) * hd**-0.5 + mask).softmax(-1)
            x = x + self.wo((a @ v).transpose(1, 2).reshape(b, n, d))
            h = self.ffn_norm(x)
            return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))

    class SyntheticVLM(nn.Module):
        """InternVL2-2B-shaped prefill: one 448² tile → InternViT → pixel shuffle → mlp1 → InternLM2 → logits."""

        def __init__(self, c: ModelConfig) -> None:
            super().__init__()
            self.c = c
            g = c.image // c.patch
            self.grid = g
            self.patch_embedding = nn.Conv2d(3, c.vit_hidden, c.patch, c.patch)
            self.class_embedding = nn.Parameter(0.02 * torch.randn(1, 1, c.vit_hidden))
            self.position_embedding = nn.Parameter(0.02 * torch.randn(1, g * g + 1, c.vit_hidden))
            self.vision = nn.ModuleList([VitLayer(c) for _ in range(c.vit_layers)])
            self.mlp1 = nn.Sequential(nn.LayerNorm(4 * c.vit_hidden), nn.Linear(4 * c.vit_hidden, c.llm_hidden),
                                      nn.GELU(), nn.Linear(c.llm_hidden, c.llm_hidden))
            self.layers = nn.ModuleList([LlmLayer(c) for _ in range(c.llm_layers)])
            self.norm = RMSNorm(c.llm_hidden)
            self.output = nn.Linear(c.llm_hidden, c.vocab, bias=False)
            n, hd = c.llm_tokens, c.llm_hidden // c.llm_heads
            inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(n).float(), inv)
            emb = torch.cat((ang, ang), -1)
            self.register_buffer("cos", emb.cos()[None, None])
            self.register_buffer("sin", emb.sin()[None, None])
            self.register_buffer("mask", torch.full((n, n), -1e4).triu(1)[None, None])

        def forward(self, pixel_values: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
            c, g = self.c, self.grid
            x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
            x = torch.cat((self.class_embedding.expand(x.shape[0], -1, -1), x), 1) + self.position_embedding
            for layer in self.vision:
                x = layer(x)
            x = x[:, 1:]
            b = x.shape[0]
            x = x.reshape(b, g, g // 2, 2 * c.vit_hidden).permute(0, 2, 1, 3)  # pixel shuffle, scale 0.5
            x = x.reshape(b, g // 2, g // 2, 4 * c.vit_hidden).permute(0, 2, 1, 3).reshape(b, -1, 4 * c.vit_hidden)
            h = torch.cat((self.mlp1(x), text_embeds), 1)
            for layer in self.layers:
                h = layer(h, self.cos, self.sin, self.mask)
            return self.output(self.norm(h))

    return SyntheticVLM


def _save_onnx(model: Any, path: Path) -> None:
    """Save an ONNX model, with its weights as one external data file when it is over the 2 GB protobuf limit."""
    import onnx

    for p in (path, path.with_name(path.name + ".data")):
        p.unlink(missing_ok=True)
    if model.ByteSize() > PROTOBUF_LIMIT:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save(model, str(path))


def step_build(a: dict[str, Any]) -> dict[str, Any]:
    """Export the reference model, write the perturbed test model and the inputs (one process)."""
    import numpy as np
    import onnx
    import torch
    from onnx import numpy_helper

    c = ModelConfig(**a["config"])
    out = Path(a["dir"])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    model = _model_class()(c).eval()
    rng = np.random.default_rng(1)
    feeds = {
        "pixel_values": rng.standard_normal((1, 3, c.image, c.image), dtype=np.float32),
        "text_embeds": (0.02 * rng.standard_normal((1, c.text_tokens, c.llm_hidden))).astype(np.float32),
    }
    np.savez(out / "inputs.npz", **feeds)
    ref = out / "ref.onnx"
    t0 = time.perf_counter()
    with torch.no_grad():
        args = tuple(torch.from_numpy(feeds[k]) for k in ("pixel_values", "text_embeds"))
        if c.weight_bytes() > PROTOBUF_LIMIT * 0.95:  # the exporter writes external data itself
            tmp = out / "export"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            torch.onnx.export(model, args, str(tmp / "ref.onnx"), input_names=["pixel_values", "text_embeds"],
                              output_names=["logits"], opset_version=17, dynamo=False)
            m = onnx.load(str(tmp / "ref.onnx"))
            shutil.rmtree(tmp)
        else:
            import io

            buf = io.BytesIO()
            torch.onnx.export(model, args, buf, input_names=["pixel_values", "text_embeds"],
                              output_names=["logits"], opset_version=17, dynamo=False)
            m = onnx.load_from_string(buf.getvalue())
            del buf
    t_export = time.perf_counter() - t0
    del model
    _save_onnx(m, ref)
    # the test model: the same graph with two weights changed
    #  - ViT layer k fc1: + 1 % Gaussian noise (a "bad calibration / drifted weight" fault),
    #  - LLM layer 0 w2 (down projection): rounded to a per-row int8 grid (weight-only quantization).
    k = c.perturbed_vit_layer
    targets = {f"/vision.{k}/fc1/MatMul": "noise", "/layers.0/w2/MatMul": "int8"}
    inits = {t.name: t for t in m.graph.initializer}
    changed = []
    wrng = np.random.default_rng(2)
    for node in m.graph.node:
        how = targets.get(node.name)
        if how is None:
            continue
        init = inits[node.input[1]]
        w = numpy_helper.to_array(init).astype(np.float32)
        if how == "noise":
            w = w + (0.01 * float(w.std())) * wrng.standard_normal(w.shape, dtype=np.float32)
        else:
            scale = np.abs(w).max(axis=0, keepdims=True) / 127.0
            w = np.clip(np.round(w / scale), -127, 127) * scale
        init.CopyFrom(numpy_helper.from_array(w.astype(np.float32), init.name))
        changed.append(node.name)
    if len(changed) != len(targets):
        raise SystemExit(f"perturbation targets not found: {sorted(set(targets) - set(changed))}")
    _save_onnx(m, out / "test.onnx")
    return {"export_s": t_export, "perturbed": changed, "onnx_bytes": ref.stat().st_size,
            "external_data": (out / "ref.onnx.data").exists(), "nodes": len(m.graph.node)}


def run_ivq(work: Path, models: Path, variant: str, opts: argparse.Namespace) -> Row:
    """ivq-debug: ``ivq capture onnx`` ×2 and ``ivq-diff --json`` (variant: full, max-outputs, summary)."""
    extra_args: list[str] = []
    name = "ivq-debug"
    if variant == "maxout":
        extra_args = ["--max-outputs-per-run", str(opts.max_outputs_per_run)]
        name = f"ivq-debug --max-outputs-per-run {opts.max_outputs_per_run}"
    elif variant == "summary":
        extra_args = ["--summary-only"]
        name = "ivq-debug --summary-only"
    return run_ivq_row(work, name, models / "ref.onnx", models / "test.onnx", [models / "inputs.npz"], opts,
                       capture_args=extra_args, tag=variant)


# ---------------------------------------------------------------------------------------- memory bound
def step_tiny_dumps(a: dict[str, Any]) -> dict[str, Any]:
    """Two tiny dumps: 16 four-element tensors (enough to start every ivq-diff worker thread) and, with
    ``block``, one plain and one logits tensor of one streaming block each (``defaults.COMPARE_BLOCK_BYTES``),
    so that the run holds the whole per-worker streaming working set, which no dump size changes."""
    import numpy as np

    from ivq_debug import defaults
    from ivq_debug.dump import DumpWriter

    elems = defaults.COMPARE_BLOCK_BYTES // 4
    vocab = ModelConfig().vocab
    rng = np.random.default_rng(4)
    for i, p in enumerate(a["paths"]):
        with DumpWriter(p, backend="onnxruntime-cpu", overwrite=True) as w:
            w.begin_record()
            for k in range(16):
                w.add_tensor(f"t{k}", np.full(4, 1.0 + i * 1e-3 * (k + 1), np.float32), order=k)
            if a["block"]:
                w.add_tensor("block", rng.standard_normal((1, elems // 1024, 1024), dtype=np.float32), order=16)
                w.add_tensor("model.logits", rng.standard_normal((1, max(1, elems // vocab), vocab), dtype=np.float32),
                             order=17)
    return {"bytes": sum(Path(p).stat().st_size for p in a["paths"])}


def synth_shapes(c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Shapes of a synthetic dump: the logits once, then attention probs, fc1, hidden, cycled.

    The model's own shapes at the real widths (probs [1, 16, 1025, 1025] = 64 MiB, logits 102 MiB); the tiny
    scale uses them too: its own ~100 KiB tensors would make a GiB dump of ~20 000 tensors, which measures
    per-tensor bookkeeping rather than streaming (see docs/scale.md).
    """
    if c.vit_hidden < 1024:
        c = ModelConfig()
    n, h = c.vit_tokens, c.vit_heads
    return [("logits", (1, c.llm_tokens, c.vocab)), ("attn_probs", (1, h, n, n)), ("fc1", (1, n, c.vit_mlp)),
            ("hidden", (1, n, c.vit_hidden))]


def step_synth(a: dict[str, Any]) -> dict[str, Any]:
    """A synthetic reference/test dump pair of about ``bytes`` each, plus the exact expected SQNR per tensor.

    test = ref + ε_i · noise with ε_i varying per tensor; the expected SQNR is computed here in float64,
    independently of ivq-debug, to check the bounded run's result. The model's logits shape is included so
    the logits path (top-1, KL per row) runs too.
    """
    import numpy as np

    from ivq_debug.dump import DumpWriter

    c = ModelConfig(**a["config"])
    shapes = synth_shapes(c)
    rng = np.random.default_rng(3)
    big = max(math.prod(s) for _, s in shapes)
    base = rng.standard_normal(big, dtype=np.float32)
    noise = rng.standard_normal(big, dtype=np.float32)
    expected: dict[str, float] = {}
    total = 0
    plan: list[tuple[str, tuple[int, ...], float]] = []
    i = 0
    while total < a["bytes"] or i < len(shapes):  # the logits once, then attention probs, fc1, hidden, ...
        nm, shp = shapes[0] if i == 0 else shapes[1 + (i - 1) % (len(shapes) - 1)]
        eps = 10.0 ** (-1.0 - 3.0 * ((i * 7) % 11) / 10.0)
        plan.append((f"{nm}.{i}" if i else "model.logits", shp, eps))
        total += 4 * math.prod(shp)
        i += 1
    with DumpWriter(a["ref"], backend="onnxruntime-cpu", overwrite=True) as wr, \
            DumpWriter(a["test"], backend="onnxruntime-cpu", overwrite=True) as wt:
        wr.begin_record()
        wt.begin_record()
        for order, (nm, shp, eps) in enumerate(plan):
            n = math.prod(shp)
            r = (base[:n] * np.float32(1.0 + order % 5)).reshape(shp)
            t = (r + np.float32(eps) * noise[:n].reshape(shp)).astype(np.float32)
            r64, d64 = r.astype(np.float64).ravel(), (t.astype(np.float64) - r.astype(np.float64)).ravel()
            expected[nm] = 10.0 * math.log10(float(r64 @ r64) / float(d64 @ d64))
            wr.add_tensor(nm, r, order=order, op_type="MatMul")
            wt.add_tensor(nm, t, order=order, op_type="MatMul")
            del r, t, r64, d64
    Path(a["expected"]).write_text(json.dumps(expected))
    return {"tensors": len(plan), "bytes": total, "largest": 4 * big}


VMPEAK_WRAPPER = r"""
import atexit, os, sys
def _report():
    with open("/proc/self/status") as f:
        vals = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmPeak", "VmHWM"))}
    with open(os.environ["IVQ_BENCH_VM_OUT"], "w") as f:
        f.write(repr(vals))
atexit.register(_report)
from ivq_debug.cli.diff import main
sys.argv[0] = "ivq-diff"
main()
"""


@dataclass
class BoundCase:
    """One ivq-diff run checked against the memory bound."""

    label: str
    dump_bytes: int  # ref + test
    largest: int
    limit_as: int | None
    m: Measured
    bound: int
    correct: bool | None = None
    detail: str = ""

    @property
    def within(self) -> bool:
        """Completed and peak RSS under 2 × largest + fixed overhead."""
        return self.m.ok and self.m.peak_rss <= self.bound

    @property
    def verdict(self) -> str:
        """``ok``; ``over`` (RSS above the bound); ``failed`` (did not complete under RLIMIT_AS); ``wrong``
        (wrong result); ``n/a`` (a run without a limit that stopped for a reason that is not memory, e.g. a
        usage error: it says nothing about the bound and is reported in the main table)."""
        if self.m.peak_rss > self.bound:
            return "over"
        if not self.m.ok:
            oom = self.limit_as is not None or "MemoryError" in self.m.stderr or self.m.killed
            return "failed" if oom else "n/a"
        return "wrong" if self.correct is False else "ok"


def _largest_in(*dumps: Path) -> int:
    from ivq_debug.dump import open_dump

    out = 0
    for p in dumps:
        with open_dump(p) as d:
            out = max([out, *(e.nbytes for e in d.entries)])
    return out


def memory_bound(work: Path, config: ModelConfig, rows: list[Row], opts: argparse.Namespace) -> dict[str, Any]:
    """Fixed overhead, RLIMIT_AS, and ivq-diff on dumps several times larger than the limit."""
    d = work / "bound"
    d.mkdir(parents=True, exist_ok=True)
    bare = [d / "bare_a.h5", d / "bare_b.h5"]
    tiny = [d / "tiny_a.h5", d / "tiny_b.h5"]
    run_measured(_self_cmd("tiny-dumps", {"paths": [str(p) for p in bare], "block": False}), log=d / "bare")
    tiny_info = step_result(run_measured(_self_cmd("tiny-dumps", {"paths": [str(p) for p in tiny], "block": True}),
                                          log=d / "tiny"))
    interp = run_measured([bin_path("ivq-diff"), *map(str, bare), "--json", str(d / "bare.json"), "--force", "-q"],
                          log=d / "bare_diff", ok_codes=DIFF_OK, require=d / "bare.json")
    base = run_measured([bin_path("ivq-diff"), *map(str, tiny), "--json", str(d / "tiny.json"), "--force", "-q"],
                        log=d / "tiny_diff", ok_codes=DIFF_OK, require=d / "tiny.json")
    if not base.ok or not interp.ok:
        raise SystemExit(f"ivq-diff on tiny dumps failed: {base.why()} / {interp.why()}")
    overhead = base.peak_rss
    vm_out = d / "vm.txt"
    vm_run = run_measured([sys.executable, "-c", VMPEAK_WRAPPER, *map(str, tiny), "--json", str(d / "tiny2.json"),
                           "--force", "-q"], log=d / "tiny_vm", env=dict(os.environ, IVQ_BENCH_VM_OUT=str(vm_out)), ok_codes=DIFF_OK)
    import ast

    vm = ast.literal_eval(vm_out.read_text()) if vm_run.ok and vm_out.exists() else {"VmPeak": 0}
    vm_base = int(vm["VmPeak"])
    largest_model = 4 * max(math.prod(s) for _, s in synth_shapes(config))
    captured = [r for r in rows if r.tool == "ivq-debug" and r.steps.get("compare") is not None and r.steps["compare"].ok]
    cap_dir = work / "ivq-full"
    cap_largest = _largest_in(cap_dir / "ref.h5", cap_dir / "test.h5") if captured else 0
    largest = max(largest_model, cap_largest)
    margin = int(opts.margin_mib * MiB)
    auto_limit = vm_base + 2 * largest + margin
    limit = int(opts.mem_limit_gib * GiB) if opts.mem_limit_gib else auto_limit
    out: dict[str, Any] = {"overhead": overhead, "interpreter": interp.peak_rss, "tiny_bytes": tiny_info.get("bytes"),
                           "vm_base": vm_base, "largest": largest, "margin": margin, "limit": limit,
                           "auto_limit": auto_limit, "cases": []}
    cases: list[BoundCase] = []
    # 1. every ivq-diff already run in the table (no limit): the bound at the captured sizes
    for r in rows:
        m = r.steps.get("compare")
        if not r.tool.startswith("ivq-debug") or m is None:
            continue
        v = "full" if r.tool == "ivq-debug" else ("maxout" if "max-outputs" in r.tool else "summary")
        p = work / f"ivq-{v}"
        if not (p / "ref.h5").exists():
            continue
        lg = _largest_in(p / "ref.h5", p / "test.h5")
        cases.append(BoundCase(f"{r.tool} (table run, no limit)", dir_bytes([p / "ref.h5", p / "test.h5"]), lg, None,
                               m, 2 * lg + overhead))
    # 2. the captured pair again, under RLIMIT_AS: same result as without the limit?
    if captured:
        say(f"  ivq-diff on the captured dumps under RLIMIT_AS {limit / MiB:,.0f} MiB")
        m = run_measured([bin_path("ivq-diff"), str(cap_dir / "ref.h5"), str(cap_dir / "test.h5"), "--json",
                          str(d / "captured.json"), "--force", "-q"], log=d / "captured", limit_as=limit, ok_codes=DIFF_OK,
                         require=d / "captured.json")
        c = BoundCase("captured pair, under RLIMIT_AS", dir_bytes([cap_dir / "ref.h5", cap_dir / "test.h5"]),
                      cap_largest, limit, m, 2 * cap_largest + overhead)
        if m.ok and (d / "captured.json").exists():
            a, b = layer_sqnr(d / "captured.json"), layer_sqnr(cap_dir / "diff.json")
            c.correct = a == b
            c.detail = f"{len(a)} layers, identical to the unlimited run" if c.correct else "differs from the unlimited run"
        cases.append(c)
    # 3. synthetic pairs at multiples of the limit (each dump that many times the limit)
    for mult in opts.bound_multiples:
        size = int(mult * limit)
        ref, test, exp = d / f"synth_{mult:g}_ref.h5", d / f"synth_{mult:g}_test.h5", d / f"synth_{mult:g}.json"
        say(f"  synthetic dumps of {size / GiB:.2f} GiB each ({mult:g} × the limit)")
        g = run_measured(_self_cmd("synth", {"config": asdict(config), "bytes": size, "ref": str(ref), "test": str(test),
                                             "expected": str(exp)}), log=d / f"synth_{mult:g}")
        if g.returncode != 0:
            raise SystemExit(f"writing synthetic dumps failed: {g.why()}")
        info = step_result(g)
        m = run_measured([bin_path("ivq-diff"), str(ref), str(test), "--json", str(d / f"synth_{mult:g}.diff.json"),
                          "--force", "-q"], log=d / f"synth_{mult:g}_diff", limit_as=limit, ok_codes=DIFF_OK,
                         require=d / f"synth_{mult:g}.diff.json")
        c = BoundCase(f"synthetic, each dump {mult:g} × limit", dir_bytes([ref, test]), info["largest"], limit, m,
                      2 * info["largest"] + overhead)
        if m.ok:
            got, want = layer_sqnr(d / f"synth_{mult:g}.diff.json"), json.loads(exp.read_text())
            worst = max(abs(got[k] - want[k]) for k in want) if set(got) == set(want) else math.inf
            c.correct = worst < 1e-6
            c.detail = f"{len(want)} tensors, max |SQNR − exact| = {worst:.1e} dB"
        if not opts.keep:
            for p in (ref, test):
                p.unlink(missing_ok=True)
        cases.append(c)
    out["cases"] = cases
    return out


def inventory(dump: Path) -> list[str]:
    """Exact totals of the captured float activations (from the reference dump's manifest)."""
    from ivq_debug.dump import open_dump

    with open_dump(dump) as dd:
        ts = [e for e in dd.entries if e.kind == "tensor"]
    total = sum(e.nbytes for e in ts)
    big = max(ts, key=lambda e: e.nbytes)
    cats = {"Softmax (attention probs)": lambda e: e.op_type == "Softmax",
            "attention scores (MatMul/Mul/Add into Softmax, [*,h,n,n])": lambda e: e.op_type != "Softmax"
            and len(e.shape) == 4 and e.shape[-1] == e.shape[-2] and e.shape[-1] > 64,
            "ViT mlp.fc1 + GELU (…, 4096-wide)": lambda e: "/vision." in e.name
            and ("fc1" in e.name or "/act/" in e.name)}
    lines = [f"captured float activations (ivq-debug reference dump): {len(ts)} tensors, {total:,} bytes "
             f"= {total / GiB:.3f} GiB; largest {big.name} {list(big.shape)} {big.nbytes / MiB:.1f} MiB"]
    for label, pred in cats.items():
        sel = [e for e in ts if pred(e)]
        lines.append(f"  {label}: {len(sel)} tensors, {sum(e.nbytes for e in sel) / MiB:,.0f} MiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or one internal step when ``--step`` is given)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", default="1", help="'tiny' or S > 0: round(6·S) ViT + round(3·S) LLM layers (default 1)")
    ap.add_argument("--workdir", default="/tmp/ivq-bench-scale", help="where models, dumps and logs go")
    ap.add_argument("--mem-limit-gib", type=float, default=None,
                    help="RLIMIT_AS of the bounded ivq-diff runs (default: baseline VmPeak + 2 × largest + margin)")
    ap.add_argument("--margin-mib", type=float, default=256, help="margin added to the automatic limit (MiB)")
    ap.add_argument("--bound-multiples", default="0.5,3",
                    help="synthetic dump sizes for the bound check, as multiples of the limit (each dump)")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of ivq,polygraphy,ort")
    ap.add_argument("--variants", default="full,maxout,summary", help="ivq-debug rows: full,maxout,summary")
    ap.add_argument("--max-outputs-per-run", type=int, default=64, help="N of the --max-outputs-per-run row")
    ap.add_argument("--guard-gib", type=float, default=None,
                    help="kill a step whose RSS exceeds this (default 80%% of MemAvailable at start)")
    ap.add_argument("--no-install", action="store_true", help="do not pip-install Polygraphy when missing (skip it)")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--keep", action="store_true", help="keep models and dumps in the workdir")
    ap.add_argument("--step", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--step-args", default="{}", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.step:
        fn = STEP_FUNCS[opts.step]
        print(json.dumps(fn(json.loads(opts.step_args))), flush=True)
        return 0
    opts.bound_multiples = [float(x) for x in opts.bound_multiples.split(",") if x.strip()]
    tools = [t.strip() for t in opts.tools.split(",") if t.strip()]
    variants = [v.strip() for v in opts.variants.split(",") if v.strip()]
    if opts.guard_gib is None:
        opts.guard = int(0.8 * mem_available())
    else:
        opts.guard = int(opts.guard_gib * GiB)
    config = config_for_scale(opts.scale)
    work = Path(opts.workdir)
    work.mkdir(parents=True, exist_ok=True)
    models = work / "models"
    started = time.time()
    print(f"# ivq-debug scale benchmark — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"{mem_total() / GiB:.0f} GiB RAM; load before: {load_avg()}")
    print(f"model (--scale {opts.scale}): ViT {config.vit_layers}L × {config.vit_hidden} (MLP {config.vit_mlp}, "
          f"{config.vit_heads} heads, {config.vit_tokens} tokens/tile) → pixel-shuffle projector → LLM "
          f"{config.llm_layers}L × {config.llm_hidden} (MLP {config.llm_mlp}, {config.llm_heads}q/{config.llm_kv_heads}kv "
          f"heads, {config.llm_tokens} tokens) → logits [{config.llm_tokens}, {config.vocab}]; "
          f"fp32 weights ≈ {config.weight_bytes() / GiB:.2f} GiB")
    say(f"building the model in {models} ...")
    b = run_measured(_self_cmd("build", {"config": asdict(config), "dir": str(models)}), log=work / "build")
    if not b.ok:
        raise SystemExit(f"model build failed: {b.why()}\n{b.stderr[-3000:]}")
    binfo = step_result(b)
    print(f"ONNX: opset 17, legacy exporter, {binfo['nodes']} nodes, {binfo['onnx_bytes'] / GiB:.2f} GiB"
          f"{' + external data' if binfo['external_data'] else ''}; build {b.seconds:.0f} s (export "
          f"{binfo['export_s']:.0f} s), peak RSS {gib(b.peak_rss)}; test model = reference with weights changed "
          f"in {', '.join(binfo['perturbed'])}")
    rows: list[Row] = []
    if "ivq" in tools:
        for v in variants:
            say(f"ivq-debug ({v}) ...")
            rows.append(run_ivq(work, models, v, opts))
    if "polygraphy" in tools:
        say("Polygraphy ...")
        rows.append(run_polygraphy(work, models / "ref.onnx", models / "test.onnx", [models / "inputs.npz"], opts))
    if "ort" in tools:
        say("ORT qdq_loss_debug ...")
        rows.append(run_ort(work, models / "ref.onnx", models / "test.onnx", [models / "inputs.npz"], opts,
                            binfo["external_data"]))
    full = work / "ivq-full" / "ref.h5"
    if full.exists():
        for ln in inventory(full):
            print(ln)
    for r in rows:
        if r.extra.get("pairs") is not None:
            print(f"{r.tool}: {r.extra['pairs']} tensor pairs compared"
                  + (f" (create_activation_matching as is: {r.extra['qdq_style_pairs']} pairs, QDQ names only)"
                     if "qdq_style_pairs" in r.extra else "")
                  + (f" (of {r.extra['captured']} outputs marked by '*'; {r.extra['dropped']} int64/bool dropped)"
                     if "dropped" in r.extra else ""))
    print()
    print(f"## Capture + compare, same model, same input (load during the runs: {load_avg()})")
    print()
    for ln in table(rows):
        print(ln)
    print()
    lines, agree = sanity(rows)
    for ln in lines:
        print(ln)
    print()
    say("memory bound ...")
    mb = memory_bound(work, config, rows, opts)
    print("## ivq-diff memory bound: peak RSS ≤ 2 × largest tensor + fixed overhead")
    print()
    print(f"fixed overhead = peak RSS of ivq-diff on two tiny dumps ({gib(mb['tiny_bytes'])}: 16 four-element "
          f"tensors + one plain and one logits tensor of one 4 MiB streaming block): {gib(mb['overhead'])} "
          f"(interpreter + libraries alone, four-element tensors only: {gib(mb['interpreter'])}); its VmPeak "
          f"(virtual): {gib(mb['vm_base'])}; largest tensor {gib(mb['largest'])}")
    print(f"RLIMIT_AS = {mb['limit'] / MiB:,.0f} MiB"
          + (f" (= VmPeak {mb['vm_base'] / MiB:,.0f} + 2 × largest {2 * mb['largest'] / MiB:,.0f} + margin "
             f"{mb['margin'] / MiB:,.0f} MiB)" if mb["limit"] == mb["auto_limit"] else " (--mem-limit-gib)"))
    print()
    print("| ivq-diff run | dumps (ref + test) | × limit | largest tensor | wall s | peak RSS | bound | RSS / bound "
          "| completed | result |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    all_ok = True
    for c in mb["cases"]:
        v = c.verdict
        all_ok &= v in ("ok", "n/a")
        lim = f"{c.dump_bytes / c.limit_as:.1f}" if c.limit_as else "no limit"
        res = c.detail or ("ok" if c.m.ok else c.m.why())
        mark = {"ok": "✓", "n/a": "(n/a: not a memory failure)"}.get(v, f"✗ {v}")
        print(f"| {c.label} | {gib(c.dump_bytes)} | {lim} | {gib(c.largest)} | {c.m.seconds:.1f} | {gib(c.m.peak_rss)} "
              f"| {gib(c.bound)} | {c.m.peak_rss / c.bound:.2f} | {'yes' if c.m.ok else 'NO'} | {res} {mark} |")
    print()
    print(f"memory bound held at every size: {'YES' if all_ok else 'NO'}; load after: {load_avg()}; "
          f"benchmark wall time {time.time() - started:.0f} s")
    if opts.json:
        doc = {"config": asdict(config), "build": binfo, "rows": [row_json(r) for r in rows],
               "agree": agree,
               "bound": {k: v for k, v in mb.items() if k != "cases"} | {"cases": [_case_json(c) for c in mb["cases"]]},
               "bound_ok": all_ok}
        Path(opts.json).write_text(json.dumps(doc, indent=1))
    if not opts.keep:
        for p in [models, *(work / n for n in ("ivq-full", "ivq-maxout", "ivq-summary", "polygraphy", "ort", "bound"))]:
            shutil.rmtree(p, ignore_errors=True)
    return 0 if all_ok else 1


def _case_json(c: BoundCase) -> dict[str, Any]:
    return {"label": c.label, "dump_bytes": c.dump_bytes, "largest": c.largest, "limit_as": c.limit_as,
            "seconds": c.m.seconds, "peak_rss": c.m.peak_rss, "bound": c.bound, "completed": c.m.ok,
            "within": c.within, "verdict": c.verdict, "correct": c.correct, "detail": c.detail}


STEP_FUNCS = {
    "build": step_build,
    "tiny-dumps": step_tiny_dumps,
    "synth": step_synth,
}


if __name__ == "__main__":
    raise SystemExit(main())
