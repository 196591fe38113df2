"""Many small tensors: a 12-layer ViT-S, float vs its QNN QDQ a8w8 model, ivq-debug against Polygraphy and
ORT ``qdq_loss_debug`` on the same 4 images.

The scale benchmark (``bench_scale.py``) has few, very large tensors. This one has the shape of a real
deployment check with many small ones: a ViT-S/16 at 224² (dim 384, 6 heads, MLP 1536, 197 tokens, 12 blocks)
whose LayerNorms (without bias) are written out in torch (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul)
so that both the export and the QNN preprocessing keep them decomposed (see ``DecomposedLayerNorm``). Random weights with a short
deterministic init (no downloads). The QDQ model comes from onnxruntime's QNN flow (``qnn_preprocess_model`` ->
``get_qnn_qdq_config`` -> ``quantize``, a8w8, through ``ivq_debug.qnn.quantize``), calibrated on 8 images
that are not the 4 test images.

Each step runs in its own process (wall time and peak RSS from ``os.wait4``; see ``bench/common.py``):

- ivq-debug: ``ivq capture onnx`` of the float and of the QDQ model (4 ``--inputs``), ``ivq-diff --json``;
  with ``--baseline-src DIR`` also the same three steps with the ``ivq_debug`` package found in DIR (an
  exported older revision: ``git archive REV ivq_debug | tar -x -C DIR``), in the same run;
- Polygraphy: ``polygraphy run --onnxrt --onnx-outputs '*' --save-outputs`` per model, the saved runs compared
  with ``SnrCompareFunc`` (float ``X`` vs the QDQ model's ``X_DequantizeLinear_Output``);
- ORT ``qdq_loss_debug``: augment both models, ``collect_activations``, ``create_activation_matching(qdq,
  float)``, ``compute_activation_error`` (``xmodel_err``).

Extras: ``--profile`` runs the QDQ capture and the diff once more under cProfile (main thread, call counts)
and py-spy (every thread), and prints where the time goes; ``--compression`` rewrites both dumps with each
HDF5 filter setting and measures size, write and read time.

    python bench/bench_many.py [--images 4] [--workdir DIR] [--baseline-src DIR] [--profile] [--compression]

See bench/README.md and docs/scale.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, when run as a script or loaded by path
from common import (
    DIFF_OK,
    GiB,
    MiB,
    Row,
    bin_path,
    gib,
    ivq_env,
    load_avg,
    mem_available,
    mem_total,
    ratio,
    row_json,
    run_ivq,
    run_measured,
    run_ort,
    run_polygraphy,
    sanity,
    say,
    secs,
    step_result,
    table,
)
from common import self_cmd as _common_self_cmd

TOOLS = ("ivq", "polygraphy", "ort")
#: goals of issue 22 (ivq capture ×2 + diff against each peer): time, peak RSS, disk
GOALS = {"time_ort": 1 / 3, "time_poly": 1 / 8, "rss": 1 / 10, "disk_poly": 1.0}


def _self_cmd(step: str, args: dict[str, Any]) -> list[str]:
    return _common_self_cmd(__file__, step, args)


# ------------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class VitConfig:
    """ViT-S/16 at 224² (timm ``vit_small_patch16_224`` shapes)."""

    image: int = 224
    patch: int = 16
    dim: int = 384
    heads: int = 6
    mlp: int = 1536
    layers: int = 12
    classes: int = 1000

    @property
    def tokens(self) -> int:
        """Patch tokens + CLS (197)."""
        return (self.image // self.patch) ** 2 + 1


def _vit_class() -> Any:
    """The torch ViT (defined lazily: torch is imported only in the build step)."""
    import torch
    from torch import nn

    class DecomposedLayerNorm(nn.Module):
        """LayerNorm without bias (``nn.LayerNorm(d, bias=False)``) written out, so the exporter emits
        ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul. ORT's LayerNormFusion (run by ``qnn_preprocess_model``
        through its basic graph optimization) fuses only the form with the bias ``Add``, so the QDQ model keeps
        the decomposition as well (and quantizes every one of its tensors)."""

        def __init__(self, d: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
            self.eps = eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            u = x.mean(-1, keepdim=True)
            d = x - u
            var = d.pow(2).mean(-1, keepdim=True)
            return d / torch.sqrt(var + self.eps) * self.weight

    class Attention(nn.Module):
        def __init__(self, c: VitConfig) -> None:
            super().__init__()
            self.heads = c.heads
            self.qkv = nn.Linear(c.dim, 3 * c.dim)
            self.proj = nn.Linear(c.dim, c.dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, d = x.shape
            hd = d // self.heads
            qkv = self.qkv(x).reshape(b, n, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            a = ((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(-1)
            return self.proj((a @ v).transpose(1, 2).reshape(b, n, d))

    class Block(nn.Module):
        def __init__(self, c: VitConfig) -> None:
            super().__init__()
            self.norm1 = DecomposedLayerNorm(c.dim)
            self.attn = Attention(c)
            self.norm2 = DecomposedLayerNorm(c.dim)
            self.fc1 = nn.Linear(c.dim, c.mlp)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(c.mlp, c.dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.norm1(x))
            return x + self.fc2(self.act(self.fc1(self.norm2(x))))

    class ViT(nn.Module):
        def __init__(self, c: VitConfig) -> None:
            super().__init__()
            self.patch_embed = nn.Conv2d(3, c.dim, c.patch, c.patch)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, c.dim))
            self.pos_embed = nn.Parameter(torch.zeros(1, c.tokens, c.dim))
            self.blocks = nn.ModuleList([Block(c) for _ in range(c.layers)])
            self.norm = DecomposedLayerNorm(c.dim)
            self.head = nn.Linear(c.dim, c.classes)
            g = torch.Generator().manual_seed(0)
            for name, p in self.named_parameters():  # timm-like: trunc-normal 0.02 weights, small biases
                with torch.no_grad():
                    if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                    elif p.ndim == 1:
                        p.copy_(0.02 * torch.randn(p.shape, generator=g))
                    else:
                        p.copy_((0.02 * torch.randn(p.shape, generator=g)).clamp(-0.04, 0.04))

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), 1) + self.pos_embed
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x)[:, 0])

    return ViT


def synthetic_images(n: int, size: int, seed: int) -> list[Any]:
    """``n`` deterministic 224² RGB images (gradients, a disc and a bar, noise), ImageNet-normalized NCHW."""
    import numpy as np

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    out = []
    for _ in range(n):
        a, b, c = rng.uniform(0, 1, 3)
        img = np.stack([a * xx + (1 - a) * yy, b * (1 - xx), c * yy * xx]).astype(np.float32)
        cx, cy, r = [*rng.uniform(0.25, 0.75, 2).tolist(), rng.uniform(0.08, 0.2)]
        disc = ((xx - cx) ** 2 + (yy - cy) ** 2) < r * r
        img[:, disc] = rng.uniform(0, 1, (3, 1)).astype(np.float32)
        y0 = int(rng.integers(0, size - 20))
        img[:, y0 : y0 + 12, :] = rng.uniform(0, 1, (3, 1, 1)).astype(np.float32)
        img = np.clip(img + 0.03 * rng.standard_normal(img.shape, dtype=np.float32), 0, 1)
        out.append(((img - mean) / std)[None].astype(np.float32))
    return out


def step_build(a: dict[str, Any]) -> dict[str, Any]:
    """Export the float ViT, write the test images and quantize it with the QNN QDQ flow (one process)."""
    import io

    import numpy as np
    import onnx
    import torch

    from ivq_debug.qnn.quantize import quantize_for_qnn

    c = VitConfig(**a["config"])
    out = Path(a["dir"])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = _vit_class()(c).eval()
    images = synthetic_images(a["images"], c.image, seed=1)
    for i, x in enumerate(images):
        np.savez(out / f"input_{i}.npz", pixel_values=x)
    t0 = time.perf_counter()
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(model, (torch.from_numpy(images[0]),), buf, input_names=["pixel_values"],
                          output_names=["logits"], opset_version=17, dynamo=False)
    m = onnx.load_from_string(buf.getvalue())
    onnx.save(m, str(out / "float.onnx"))
    t_export = time.perf_counter() - t0
    ops = defaultdict(int)
    for n in m.graph.node:
        ops[n.op_type] += 1
    t0 = time.perf_counter()
    calib = [{"pixel_values": x} for x in synthetic_images(8, c.image, seed=2)]
    q = quantize_for_qnn(out / "float.onnx", out / "qdq.onnx", calib, preset="a8w8", overwrite=True)
    t_quant = time.perf_counter() - t0
    qm = onnx.load(str(out / "qdq.onnx"))
    with torch.no_grad():
        ref = model(torch.from_numpy(images[0])).numpy()
    import onnxruntime as ort

    got = ort.InferenceSession(str(out / "float.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"pixel_values": images[0]})[0]
    return {"export_s": t_export, "quantize_s": t_quant, "nodes": len(m.graph.node), "ops": dict(ops),
            "onnx_bytes": (out / "float.onnx").stat().st_size, "qdq_nodes": len(qm.graph.node),
            "qdq_bytes": (out / "qdq.onnx").stat().st_size, "quantize_nodes": q.quantize_nodes,
            "dequantize_nodes": q.dequantize_nodes, "preprocessed": q.preprocessed,
            "export_max_abs": float(np.abs(ref - got).max())}


# ------------------------------------------------------------------------------------------- profiling
def _collapsed_summary(path: Path, top: int = 25) -> list[str]:
    """Self and inclusive shares per function from py-spy ``--format raw`` (collapsed stacks)."""
    self_n: dict[str, int] = defaultdict(int)
    incl_n: dict[str, int] = defaultdict(int)
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        k = int(n)
        total += k
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  if " (" in f else f for f in stack.split(";")]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        self_n[frames[-1]] += k
        for f in set(frames):
            incl_n[f] += k
    if not total:
        return ["(no samples)"]
    lines = [f"{total} samples", "", "| self % | function |", "|---:|---|"]
    lines += [f"| {100 * v / total:.1f} | `{f}` |" for f, v in sorted(self_n.items(), key=lambda x: -x[1])[:top]]
    lines += ["", "| inclusive % | function |", "|---:|---|"]
    lines += [f"| {100 * v / total:.1f} | `{f}` |" for f, v in sorted(incl_n.items(), key=lambda x: -x[1])[:top]]
    return lines


def _pstats_summary(path: Path, top: int = 30) -> list[str]:
    """cProfile: the top functions by own time and by cumulative time, with call counts."""
    import pstats

    st = pstats.Stats(str(path))
    total = st.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((f"{Path(file).name}:{line}({fn})", nc, tt, ct))
    out = [f"total {total:.2f} s (main thread)", "", "| own s | own % | calls | µs/call | function |",
           "|---:|---:|---:|---:|---|"]
    for name, nc, tt, _ct in sorted(rows, key=lambda r: -r[2])[:top]:
        out.append(f"| {tt:.2f} | {100 * tt / total:.1f} | {nc} | {1e6 * tt / max(nc, 1):.0f} | `{name}` |")
    out += ["", "| cumulative s | % | calls | function |", "|---:|---:|---:|---|"]
    for name, nc, _tt, ct in sorted(rows, key=lambda r: -r[3])[:top]:
        out.append(f"| {ct:.2f} | {100 * ct / total:.1f} | {nc} | `{name}` |")
    return out


def run_profiles(work: Path, models: Path, inputs: list[Path], opts: argparse.Namespace) -> dict[str, Any]:
    """Capture of the QDQ model and the diff, each under cProfile and under py-spy (separate runs)."""
    d = work / "profile"
    d.mkdir(parents=True, exist_ok=True)
    env = ivq_env()
    feeds = [x for p in inputs for x in ("--inputs", str(p))]
    ref = work / "ivq-full" / "ref.h5"
    # the console scripts are plain Python files: cProfile and py-spy run them as __main__
    capture = [bin_path("ivq"), "capture", "onnx", str(models / "qdq.onnx"), *feeds, "-o", str(d / "qdq.h5"), "--force"]
    diff = [bin_path("ivq-diff"), str(ref), str(d / "qdq.h5"), "--json", str(d / "diff.json"), "--force", "-q"]
    out: dict[str, Any] = {}
    pyspy = bin_path("py-spy")
    for what, args, ok in (("capture", capture, (0,)), ("diff", diff, DIFF_OK)):
        say(f"  profile: {what} under cProfile")
        m = run_measured([sys.executable, "-m", "cProfile", "-o", str(d / f"{what}.prof"), *args],
                         log=d / f"{what}_cprofile", env=env, ok_codes=ok)
        out[f"{what}_cprofile_s"] = m.seconds
        if m.ok:
            (d / f"{what}.cprofile.md").write_text("\n".join(_pstats_summary(d / f"{what}.prof")) + "\n")
        if shutil.which(pyspy) or Path(pyspy).exists():
            say(f"  profile: {what} under py-spy")
            m = run_measured([pyspy, "record", "--format", "raw", "-r", "200", "--threads", "-o",
                              str(d / f"{what}.pyspy.txt"), "--", sys.executable, *args],
                             log=d / f"{what}_pyspy", env=env, ok_codes=ok)
            out[f"{what}_pyspy_s"] = m.seconds
            if (d / f"{what}.pyspy.txt").exists():
                (d / f"{what}.pyspy.md").write_text("\n".join(_collapsed_summary(d / f"{what}.pyspy.txt")) + "\n")
        else:
            out["pyspy"] = "py-spy not installed (pip install '.[bench]')"
    out["dir"] = str(d)
    return out


# ------------------------------------------------------------------------------------------ compression
#: filter settings compared by --compression: label -> h5py create_dataset keywords
COMPRESSIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "lzf": {"compression": "lzf"},
    "lzf+shuffle": {"compression": "lzf", "shuffle": True},
    "gzip-1": {"compression": "gzip", "compression_opts": 1},
    "gzip-1+shuffle": {"compression": "gzip", "compression_opts": 1, "shuffle": True},
    "gzip-4+shuffle": {"compression": "gzip", "compression_opts": 4, "shuffle": True},
    "gzip-6": {"compression": "gzip", "compression_opts": 6},
    "gzip-9+shuffle": {"compression": "gzip", "compression_opts": 9, "shuffle": True},
    # what DumpWriter(compression=...) does: "auto" = lzf on the dequantized tensors of a quantized capture only
    "auto": {"auto": "lzf"},
    # the same rule with gzip-1 (no shuffle: the grid values' byte planes compress worse shuffled)
    "auto-gzip-1": {"auto": "gzip"},
    # a format change, not a filter: the dequantized float copy of a quantized tensor is not stored (it is
    # (q - zero_point) * scale of the raw integers stored beside it); every dataset raw
    "integers only (format change)": {"drop_dequantized": True},
}


def step_compression(a: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the datasets of a dump (tensors ``t/`` and raw integers ``q/``; of its first ``records`` records)
    with each filter setting and the writer's chunking; time the writes (data already in memory, to an
    fsync'd file) and a full read back."""
    import h5py
    import numpy as np

    from ivq_debug import defaults
    from ivq_debug.dump import format as fmt
    from ivq_debug.dump import open_dump
    from ivq_debug.dump.writer import _chunk_shape

    src = open_dump(a["dump"])
    arrays: list[tuple[str, np.ndarray, bool, bool]] = []  # (group, data, quantized, its raw integers stored)
    first = src.records["rid"].tolist()[: a.get("records") or None]
    for e in src.entries:
        if e.kind != "tensor" or e.stored != "full" or e.rid not in first:
            continue
        values = src.read(e) if e.derived else src.dataset(e)[()]  # (integers only: the values rebuilt)
        arrays.append(("t", np.asarray(values), e.encoding is not None, e.has_raw))
        if e.has_raw:
            arrays.append(("q", np.asarray(src.read_raw(e)), False, False))
    src.close()
    raw_bytes = sum(x.nbytes for _, x, _, _ in arrays)
    res: dict[str, Any] = {"datasets": len(arrays), "bytes": raw_bytes,
                           "t_bytes": sum(x.nbytes for g, x, _, _ in arrays if g == "t"),
                           "q_bytes": sum(x.nbytes for g, x, _, _ in arrays if g == "q"), "settings": {}}
    settings = dict(COMPRESSIONS)
    for label, kw in settings.items():
        p = Path(a["dir"]) / f"c-{label.split(' ')[0]}.h5"
        t0 = time.perf_counter()
        with h5py.File(p, "w", libver="latest") as f:
            for i, (g, x, quantized, has_raw) in enumerate(arrays):
                if kw.get("drop_dequantized") and has_raw:
                    continue
                k: dict[str, Any] = {}
                if x.ndim and x.nbytes >= defaults.DUMP_MIN_CHUNKED_BYTES:
                    k["chunks"] = _chunk_shape(x.shape, x.itemsize, defaults.DUMP_CHUNK_BYTES)
                    if kw.get("auto"):
                        if quantized and g == "t":
                            k["compression"] = kw["auto"]
                            if kw["auto"] == "gzip":
                                k["compression_opts"] = 1
                    elif not kw.get("drop_dequantized"):
                        k.update(kw)
                f.require_group(g).create_dataset(fmt.record_id(0) + f"_{i}", data=x, **k)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        t_write = time.perf_counter() - t0
        size = p.stat().st_size
        t0 = time.perf_counter()
        with h5py.File(p, "r") as f:
            for g in f:
                for name in f[g]:
                    f[g][name][()]
        t_read = time.perf_counter() - t0
        res["settings"][label] = {"bytes": size, "ratio": size / raw_bytes, "write_s": t_write, "read_s": t_read}
        p.unlink()
    return res


def step_replay(a: dict[str, Any]) -> dict[str, Any]:
    """Write a dump again through ``DumpWriter`` from memory (what a capture does after each forward): the
    writer's cost alone. ``compression``, ``integers_only``: as ``DumpWriter`` takes them (default: the current
    defaults; a revision whose writer lacks ``integers_only`` is run without it)."""
    from ivq_debug.dump import DumpWriter, open_dump

    src = open_dump(a["dump"])
    data = []
    for r in src.records.to_dict("records"):
        ins = [(e, src.read(e)) for e in src.tensors(r["rid"], kind="input")]
        ts = [(e, src.read(e), src.read_raw(e)) for e in src.tensors(r["rid"])]
        data.append((r, ins, ts))
    backend = src.backend
    src.close()
    kw = {k: a[k] for k in ("compression", "integers_only") if k in a}
    t0, c0 = time.perf_counter(), time.process_time()
    with DumpWriter(a["out"], backend=backend, overwrite=True, **kw) as w:
        for r, ins, ts in data:
            w.begin_record(sample=r["sample"], part=r["part"], step=r["step"], **r["meta"])
            for e, v in ins:
                w.add_input(e.name, v)
            for e, v, raw in ts:
                w.add_tensor(e.name, v, op_type=e.op_type, order=e.order, scope=e.scope, layout=e.layout,
                             encoding=e.encoding, raw=raw)
    return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "tensors": sum(len(t) for _, _, t in data),
            "bytes": Path(a["out"]).stat().st_size}


def run_compression(work: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """The compression study on the float and the QDQ dump of the ivq-debug row."""
    d = work / "compression"
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for side, label in (("ref", "float"), ("test", "a8w8")):
        say(f"  compression: {label} dump")
        m = run_measured(_self_cmd("compression", {"dump": str(work / "ivq-full" / f"{side}.h5"), "dir": str(d),
                                                    "records": opts.compression_records}), log=d / side)
        if not m.ok:
            raise SystemExit(f"compression study failed: {m.why()}")
        out[label] = step_result(m)
    return out


# ---------------------------------------------------------------------------------------------- report
def issue_table(rows: list[Row]) -> list[str]:
    """One line per step (the layout of issue 22): wall s, peak RSS, disk."""
    lines = ["| step (float vs a8w8, same images) | wall s | peak RSS | disk |", "|---|---:|---:|---:|"]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.tool} | skipped: {r.skipped} | | |")
            continue
        if r.tool.startswith("ivq-debug"):
            d = Path(r.extra.get("dir", ""))
            parts = [("capture float", "capture_ref", d / "ref.h5"), ("capture a8w8", "capture_test", d / "test.h5"),
                     ("ivq-diff --json", "compare", None)]
            for label, step, f in parts:
                disk = gib(f.stat().st_size) if f is not None and f.exists() else "—"
                lines.append(f"| {r.tool}: {label} | {secs(r.sec(step))} | {gib(r.peak(step))} | {disk} |")
            lines.append(f"| **{r.tool} total** | **{secs(r.total)}** | **{gib(r.max_rss)}** | **{gib(r.disk)}** |")
        else:
            lines.append(f"| {r.tool} (capture ×2 + compare) | {secs(r.total)} | {gib(r.max_rss)} | "
                         f"{gib(r.disk) if r.disk else '(in RAM)'} |")
    return lines


def goals(rows: list[Row], ivq_tool: str = "ivq-debug") -> tuple[list[str], bool]:
    """The ratios issue 22 asks for and whether each goal is met."""
    by = {r.tool: r for r in rows if not r.failed}
    ivq, poly, ort = by.get(ivq_tool), by.get("Polygraphy"), by.get("ORT qdq_loss_debug")
    if ivq is None or ivq.total is None:
        return [f"goals: no complete {ivq_tool} row"], False
    lines = [f"ratios ({ivq_tool} / peer; goal in brackets):"]
    met = True

    def check(label: str, a: float | None, b: float | None, goal: float) -> None:
        nonlocal met
        if a is None or b is None or not b:
            lines.append(f"  {label}: —")
            return
        ok = a / b <= goal
        met &= ok
        lines.append(f"  {label}: {a / b:.2f} (≤ {goal:.3g}) {'met' if ok else 'NOT met'}")

    if ort is not None:
        check("time vs ORT qdq_loss_debug", ivq.total, ort.total, GOALS["time_ort"])
        check("peak RSS vs ORT qdq_loss_debug", ivq.max_rss, ort.max_rss, GOALS["rss"])
    if poly is not None:
        check("time vs Polygraphy", ivq.total, poly.total, GOALS["time_poly"])
        check("peak RSS vs Polygraphy", ivq.max_rss, poly.max_rss, GOALS["rss"])
        check("disk vs Polygraphy", ivq.disk, poly.disk, GOALS["disk_poly"])
    return lines, met


def compression_table(study: dict[str, Any]) -> list[str]:
    """Size and time per filter setting, float and QDQ dumps side by side."""
    from ivq_debug import defaults

    lines = [f"current default: DUMP_COMPRESSION = {defaults.DUMP_COMPRESSION!r} ('auto' = lzf on the dequantized "
             f"tensors of a quantized capture, raw otherwise)"]
    for label, res in study.items():
        lines.append(f"{label} dump: {res['datasets']} datasets, {res['bytes'] / MiB:,.0f} MiB of data "
                     f"(tensors {res['t_bytes'] / MiB:,.0f} MiB, raw integers {res['q_bytes'] / MiB:,.0f} MiB)")
    lines += ["", "| setting | " + " | ".join(f"{k} size | {k} ratio | {k} write s | {k} read s" for k in study) + " |",
              "|---|" + "---:|---:|---:|---:|" * len(study)]
    first = next(iter(study.values()))
    for s in first["settings"]:
        cells = []
        for res in study.values():
            v = res["settings"][s]
            cells.append(f"{gib(v['bytes'])} | {v['ratio']:.3f} | {v['write_s']:.2f} | {v['read_s']:.2f}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or one internal step when ``--step`` is given)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=4, help="test images (records per capture; default 4)")
    ap.add_argument("--layers", type=int, default=12, help="ViT blocks (default 12)")
    ap.add_argument("--workdir", default="/tmp/ivq-bench-many", help="where models, dumps and logs go")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of ivq,polygraphy,ort")
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="also run the ivq-debug steps with the ivq_debug package in DIR (an older revision), "
                         "labelled 'ivq-debug (baseline)'")
    ap.add_argument("--max-outputs-per-run", type=int, default=0, metavar="N",
                    help="also run ivq-debug with `ivq capture --max-outputs-per-run N` (consecutive subgraphs of at "
                         "most N exposed tensors: the memory bound), labelled 'ivq-debug (groups of N)'")
    ap.add_argument("--profile", action="store_true", help="profile the QDQ capture and the diff (cProfile, py-spy)")
    ap.add_argument("--compression", action="store_true", help="measure dump size / time per HDF5 filter setting")
    ap.add_argument("--compression-records", type=int, default=1,
                    help="records (images) of each dump the compression study rewrites (default 1; 0 = all)")
    ap.add_argument("--guard-gib", type=float, default=None,
                    help="kill a step whose RSS exceeds this (default 80%% of MemAvailable at start)")
    ap.add_argument("--no-install", action="store_true", help="do not pip-install Polygraphy when missing (skip it)")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--keep", action="store_true", help="keep models and dumps in the workdir")
    ap.add_argument("--step", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--step-args", default="{}", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.step:
        print(json.dumps(STEP_FUNCS[opts.step](json.loads(opts.step_args))), flush=True)
        return 0
    tools = [t.strip() for t in opts.tools.split(",") if t.strip()]
    opts.guard = int((opts.guard_gib * GiB) if opts.guard_gib else 0.8 * mem_available())
    config = VitConfig(layers=opts.layers)
    work = Path(opts.workdir)
    work.mkdir(parents=True, exist_ok=True)
    models = work / "models"
    started = time.time()
    print(f"# ivq-debug many-tensor benchmark — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"{mem_total() / GiB:.0f} GiB RAM; {load_avg()} before")
    say(f"building the model in {models} ...")
    b = run_measured(_self_cmd("build", {"config": asdict(config), "dir": str(models), "images": opts.images}),
                     log=work / "build")
    if not b.ok:
        raise SystemExit(f"model build failed: {b.why()}\n{b.stderr[-3000:]}")
    info = step_result(b)
    ln_ops = {k: info["ops"].get(k, 0) for k in ("ReduceMean", "Sub", "Pow", "Sqrt", "Div")}
    print(f"model: ViT-S/{config.patch} {config.layers} blocks × dim {config.dim} ({config.heads} heads, MLP "
          f"{config.mlp}, {config.tokens} tokens), decomposed LayerNorm ({', '.join(f'{k} {v}' for k, v in ln_ops.items())}); "
          f"float ONNX {info['nodes']} nodes, {info['onnx_bytes'] / MiB:.1f} MiB (export max |Δ| vs torch "
          f"{info['export_max_abs']:.1e}); QNN QDQ a8w8 {info['qdq_nodes']} nodes ({info['quantize_nodes']} Q, "
          f"{info['dequantize_nodes']} DQ; qnn_preprocess_model changed the graph: {info['preprocessed']}), "
          f"{info['qdq_bytes'] / MiB:.1f} MiB; build {b.seconds:.0f} s (quantize {info['quantize_s']:.0f} s)")
    fm, qm = models / "float.onnx", models / "qdq.onnx"
    inputs = [models / f"input_{i}.npz" for i in range(opts.images)]
    rows: list[Row] = []
    if "ivq" in tools:
        if opts.baseline_src:
            say("ivq-debug (baseline) ...")
            rows.append(run_ivq(work, "ivq-debug (baseline)", fm, qm, inputs, opts, src=opts.baseline_src,
                                tag="baseline"))
        say("ivq-debug ...")
        rows.append(run_ivq(work, "ivq-debug", fm, qm, inputs, opts))
        if opts.max_outputs_per_run:
            n = opts.max_outputs_per_run
            say(f"ivq-debug (groups of {n}) ...")
            rows.append(run_ivq(work, f"ivq-debug (groups of {n})", fm, qm, inputs, opts, tag="grouped",
                                capture_args=("--max-outputs-per-run", str(n))))
    if "polygraphy" in tools:
        say("Polygraphy ...")
        rows.append(run_polygraphy(work, fm, qm, inputs, opts))
    if "ort" in tools:
        say("ORT qdq_loss_debug ...")
        rows.append(run_ort(work, fm, qm, inputs, opts, external=False))
    for r in rows:
        if r.extra.get("pairs") is not None:
            print(f"{r.tool}: {r.extra['pairs']} tensor pairs compared"
                  + (f" (of {r.extra['captured']} outputs marked by '*' per iteration; {r.extra['dropped']} "
                     f"non-float dropped)" if "dropped" in r.extra else "")
                  + (" (create_activation_matching(qdq, float): xmodel_err over all images)"
                     if r.tool.startswith("ORT") else ""))
    print()
    print(f"## Capture float + capture a8w8 + compare, {opts.images} images (load during the runs: {load_avg()})")
    print()
    for ln in table(rows):
        print(ln)
    print()
    for ln in issue_table(rows):
        print(ln)
    print()
    glines, met = goals(rows)
    for ln in glines:
        print(ln)
    if opts.max_outputs_per_run:
        print(f"with --max-outputs-per-run {opts.max_outputs_per_run}:")
        for ln in goals(rows, f"ivq-debug (groups of {opts.max_outputs_per_run})")[0]:
            print(ln)
    base = next((r for r in rows if r.tool == "ivq-debug (baseline)"), None)
    cur = next((r for r in rows if r.tool == "ivq-debug"), None)
    if base is not None and cur is not None:
        print(f"this revision vs baseline (same run): capture float {ratio(base.sec('capture_ref'), cur.sec('capture_ref'))}×, "
              f"capture a8w8 {ratio(base.sec('capture_test'), cur.sec('capture_test'))}×, diff "
              f"{ratio(base.sec('compare'), cur.sec('compare'))}×, total {ratio(base.total, cur.total)}× faster")
    print()
    lines, agree = sanity(rows, tools=("ivq-debug", "Polygraphy"), tol_db=0.01)
    for ln in lines:
        print(ln)
    extra: dict[str, Any] = {}
    if opts.profile and cur is not None and not cur.failed:
        say("profiles ...")
        extra["profile"] = prof = run_profiles(work, models, inputs, opts)
        print()
        print(f"## Profiles (files in {prof['dir']}; {load_avg()})")
        for what in ("capture", "diff"):
            for kind in ("cprofile", "pyspy"):
                p = Path(prof["dir"]) / f"{what}.{kind}.md"
                if p.exists():
                    print(f"\n### {what}, {kind} ({prof.get(f'{what}_{kind}_s', 0):.1f} s under the profiler)\n")
                    print("\n".join(p.read_text().splitlines()[:40]))
    if opts.compression and cur is not None and not cur.failed:
        say("compression ...")
        extra["compression"] = study = run_compression(work, opts)
        print()
        print(f"## HDF5 filters on the ivq-debug dumps (writer chunking; write = data in memory to fsync'd file; "
              f"{load_avg()})")
        print()
        for ln in compression_table(study):
            print(ln)
    print()
    print(f"{load_avg()} after; benchmark wall time {time.time() - started:.0f} s")
    if opts.json:
        doc = {"config": asdict(config), "build": info, "rows": [row_json(r) for r in rows], "agree": agree,
               "goals_met": met, **extra}
        Path(opts.json).write_text(json.dumps(doc, indent=1))
    if not opts.keep:
        for p in [models, *(work / n for n in ("ivq-full", "ivq-baseline", "ivq-grouped", "polygraphy", "ort", "profile",
                                               "compression"))]:
            shutil.rmtree(p, ignore_errors=True)
    return 0


STEP_FUNCS = {
    "build": step_build,
    "compression": step_compression,
    "replay": step_replay,
}


if __name__ == "__main__":
    raise SystemExit(main())
