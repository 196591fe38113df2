"""x86 vs ARM64 (qemu cortex-a76) vs AVX2-only x86 (qemu Haswell) numerics of dynamic-INT8 models.

    python bench/bench_arm64.py all [--out DIR]               # everything below, then the tables (docs/arm64.md)
    python bench/bench_arm64.py prepare DIR                   # host, needs torch: models + inputs
    python bench/bench_arm64.py capture MODEL X.npz OUT [--threads N]   # any platform: numpy, onnx, onnxruntime
    python bench/bench_arm64.py compare A_DIR B_DIR DIR NAME...         # markdown tables, per op type
    python bench/bench_arm64.py saturation A_DIR B_DIR DIR NAME...      # int16-saturation check of MatMulInteger

``prepare`` exports the embedded reference's vision and prefill parts (``ivq_debug.vlm.pipeline.prepare``) and
a tiny two-block transformer, and quantizes each with ``quantize_dynamic(weight_type=QInt8)`` (plus
``reduce_range=True`` variants). ``capture`` saves every tensor twice, at intra-op threads 1:

* ``disable``: every node output exposed, ``ORT_DISABLE_ALL``;
* ``all``: ``ORT_ENABLE_ALL`` exposing only the tensors that survive in this platform's optimized graph; the
  model outputs are checked bit-identical with and without that exposure (and the every-node exposure's
  deviation is recorded: it stops fusions).

``compare`` prints, per op type (as run: the optimized graph's op at ``all``), how many tensors are
bit-identical, in how many the kernel itself differs (output differs, every input known identical), the max
abs difference and that difference in ulps of the tensor's largest magnitude (``max|a-b| / spacing(max|a|)``).
``all`` runs the ARM captures through ``scripts/arm64-root.sh run`` and the Haswell ones through
``qemu-x86_64-static -cpu Haswell`` on this interpreter; it skips what is not installed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
NAMES = ("vision", "prefill", "tiny")


# ------------------------------------------------------------------------------------------------- prepare
def prepare(out: Path) -> None:
    """Write ``NAME.onnx``, ``NAME.dq8.onnx``, ``NAME.dq8rr.onnx`` and ``NAME.npz`` for each of NAMES."""
    import onnx
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from ivq_debug.vlm import pipeline
    from ivq_debug.vlm.export import example_inputs

    out.mkdir(parents=True, exist_ok=True)
    prep = pipeline.prepare("internvl-tiny", out / "work", overwrite=True)
    ex = example_inputs(prep.loaded.model, prep.bucket, prep.samples[0])
    for part in ("vision", "prefill"):
        np.savez(out / f"{part}.npz", **ex[part])
        onnx.save(onnx.load(str(prep.paths[part])), str(out / f"{part}.onnx"))

    class Block(torch.nn.Module):
        def __init__(self, d: int = 64, h: int = 4) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.up, self.down, self.h = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d), h

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.h) ** 0.5, -1) @ v
            x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, self.head = torch.nn.ModuleList([Block(), Block()]), torch.nn.Linear(64, 32)

        def forward(self, x: Any) -> Any:
            for blk in self.blocks:
                x = blk(x)
            return self.head(x)

    torch.manual_seed(0)
    x = torch.randn(1, 16, 64)
    torch.onnx.export(Tiny().eval(), (x,), str(out / "tiny.onnx"), input_names=["x"], output_names=["y"],
                      opset_version=20, dynamo=False)
    np.savez(out / "tiny.npz", x=x.numpy())
    for name in NAMES:
        for suffix, rr in (("dq8", False), ("dq8rr", True)):
            quantize_dynamic(str(out / f"{name}.onnx"), str(out / f"{name}.{suffix}.onnx"),
                             weight_type=QuantType.QInt8, reduce_range=rr)


# ------------------------------------------------------------------------------------------------- capture
def capture(model_path: str, inputs_path: str, outdir: str, threads: int = 1) -> str:
    """Save the ``disable`` and ``all`` captures of one model into ``outdir``; returns a one-line summary."""
    import onnx
    import onnxruntime as ort

    os.makedirs(outdir, exist_ok=True)
    m = onnx.load(model_path)
    given = dict(np.load(inputs_path, allow_pickle=False))
    feeds = {i.name: given[i.name] for i in m.graph.input}
    outs = [o.name for o in m.graph.output]
    producer = {o: n.op_type for n in m.graph.node for o in n.output if o}
    level = ort.GraphOptimizationLevel

    def session(model: Any, lvl: Any, opt_path: str | None = None) -> Any:
        so = ort.SessionOptions()
        so.graph_optimization_level, so.intra_op_num_threads, so.log_severity_level = lvl, threads, 3
        if opt_path:
            so.optimized_model_filepath = opt_path
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    def exposing(names: list[str]) -> bytes:
        a = onnx.ModelProto()
        a.CopyFrom(m)
        a.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in outs)
        return a.SerializeToString()

    def save(tag: str, names: list[str], values: list[np.ndarray], ops: list[str], **extra: Any) -> None:
        np.savez(os.path.join(outdir, f"{tag}.npz"), **{f"t{i}": v for i, v in enumerate(values)})
        meta = {"names": names, "ops": ops, "machine": platform.machine(), "onnxruntime": ort.__version__,
                "threads": threads, **extra}
        Path(outdir, f"{tag}.json").write_text(json.dumps(meta))

    t0 = time.perf_counter()
    names = [o for n in m.graph.node if n.op_type != "Constant" for o in n.output if o and o not in outs]
    inputs = {o: [i for i in n.input if i] for n in m.graph.node for o in n.output if o}
    vals = session(exposing(names), level.ORT_DISABLE_ALL).run(outs + names, feeds)
    save("disable", outs + names, vals, [producer[n] for n in outs + names], inputs=inputs)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as td:
        p = os.path.join(td, "opt.onnx")
        plain = session(model_path, level.ORT_ENABLE_ALL, p)
        g = onnx.load(p).graph
        opt_op = {o: (n.domain + "." if n.domain else "") + n.op_type for n in g.node for o in n.output if o}
        opt_inputs = {o: [i for i in n.input if i] for n in g.node for o in n.output if o}
        survivors = [o for o in names if o in opt_op]
        ref = plain.run(outs, feeds)
        vals = session(exposing(survivors), level.ORT_ENABLE_ALL).run(outs + survivors, feeds)
        same = all(a.tobytes() == b.tobytes() for a, b in zip(ref, vals[: len(outs)], strict=True))
        full = session(exposing(names), level.ORT_ENABLE_ALL).run(outs, feeds)
        full_dev = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                       for a, b in zip(ref, full, strict=True))
    save("all", outs + survivors, vals, [opt_op.get(n, producer.get(n, "?")) for n in outs + survivors],
         inputs=opt_inputs, exposure_bit_identical=same, every_node_exposure_max_abs=full_dev)
    return (f"{Path(model_path).name} on {platform.machine()}: disable {len(names)} tensors {t1 - t0:.1f} s; all "
            f"{len(survivors)} survivors, outputs bit-identical with/without exposure: {same}; every-node "
            f"exposure moves the outputs by {full_dev:.3g}; {time.perf_counter() - t1:.1f} s")


# ------------------------------------------------------------------------------------------------- compare
def _ordered(x: np.ndarray) -> np.ndarray:
    i = x.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def diff(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Bit-identity, max abs, max abs in ulps of ``max|a|`` (float32) or in integer steps."""
    if a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes():
        return {"same": True, "abs": 0.0}
    if a.dtype.kind in "iub":
        d = int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max())
        return {"same": False, "abs": float(d), "lsb": d, "ref_max": int(np.abs(a.astype(np.int64)).max())}
    d = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
    scale = np.float32(np.abs(a).max() or 1.0)
    return {"same": False, "abs": d, "ulp_of_max": d / float(np.spacing(scale))}


def _load(d: Path, tag: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = json.loads((d / f"{tag}.json").read_text())
    z = np.load(d / f"{tag}.npz", allow_pickle=False)
    return meta, {n: z[f"t{i}"] for i, n in enumerate(meta["names"])}


def compare(a_dir: Path, b_dir: Path, models: Path, names: list[str], suffix: str = "dq8") -> str:
    """Markdown tables (``disable`` and ``all``) of ``a_dir/NAME`` vs ``b_dir/NAME``, aggregated per op type."""
    import onnx

    text = []
    for tag in ("disable", "all"):
        rows: dict[str, dict[str, Any]] = collections.defaultdict(
            lambda: {"n": 0, "same": 0, "origin": 0, "abs": 0.0, "ulp": 0.0, "lsb": None})
        outs, checks = [], []
        for name in names:
            graph_outputs = [o.name for o in onnx.load(str(models / f"{name}.{suffix}.onnx")).graph.output]
            ma, ta = _load(a_dir / name, tag)
            mb, tb = _load(b_dir / name, tag)
            ops, ins = dict(zip(ma["names"], ma["ops"], strict=True)), ma["inputs"]
            res = {n: diff(ta[n], tb[n]) for n in ma["names"] if n in tb}
            for n, r in res.items():
                row = rows[ops[n]]
                row["n"] += 1
                row["same"] += r["same"]
                # the kernel itself differs: every input is a captured bit-identical tensor, an initializer or
                # a model input (a name no node produces)
                if not r["same"] and all(res[i]["same"] if i in res else i not in ins for i in ins.get(n, [])):
                    row["origin"] += 1
                row["abs"] = max(row["abs"], r["abs"])
                row["ulp"] = max(row["ulp"], r.get("ulp_of_max", 0.0))
                if "lsb" in r:
                    row["lsb"] = max(row["lsb"] or 0, r["lsb"])
            for o in graph_outputs:
                r = res[o]
                outs.append(f"{name} `{o}` " + ("bit-identical" if r["same"] else
                                                f"{r['abs']:.3g} ({r.get('ulp_of_max', 0):.3g} ulp)"))
            if tag == "all":
                checks.append(f"{name}: exposure-check {ma['exposure_bit_identical']}/{mb['exposure_bit_identical']}, "
                              f"every-node exposure moves outputs by {ma['every_node_exposure_max_abs']:.3g} / "
                              f"{mb['every_node_exposure_max_abs']:.3g}")
        text.append(f"\n### {tag}: {a_dir.name} ({ma['machine']}) vs {b_dir.name} ({mb['machine']}), "
                    f"{', '.join(names)} ({suffix}), threads {ma['threads']}/{mb['threads']}\n")
        text.append("| op (as run) | tensors | bit-identical | kernel differs | max abs diff | ulps of max abs | int steps |")
        text.append("|---|---:|---:|---:|---:|---:|---:|")
        for op, r in sorted(rows.items(), key=lambda kv: (-kv[1]["abs"], kv[0])):
            text.append(f"| {op} | {r['n']} | {r['same']} | {r['origin']} | {r['abs']:.3g} | {r['ulp']:.3g} | "
                        f"{'-' if r['lsb'] is None else r['lsb']} |")
        text.append("\nmodel outputs: " + "; ".join(outs))
        text.extend(checks)
    return "\n".join(text)


def saturation(a_dir: Path, b_dir: Path, models: Path, names: list[str], suffix: str = "dq8") -> str:
    """For each MatMulInteger whose input is identical in both captures: is ``b`` the exact integer product, or
    the product with each adjacent pair of u8*s8 products saturated to int16 (AVX2 ``vpmaddubsw``)?"""
    import onnx
    from onnx import numpy_helper

    lines = []
    for name in names:
        m = onnx.load(str(models / f"{name}.{suffix}.onnx"))
        inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
        ta, tb = _load(a_dir / name, "disable")[1], _load(b_dir / name, "disable")[1]
        for n in m.graph.node:
            if n.op_type != "MatMulInteger" or n.input[0] not in tb or not np.array_equal(ta[n.input[0]], tb[n.input[0]]):
                continue

            known = inits | ta
            a, w = known[n.input[0]].astype(np.int64), known[n.input[1]].astype(np.int64)
            azp = known[n.input[2]].astype(np.int64) if len(n.input) > 2 and n.input[2] else np.int64(0)
            wzp = known[n.input[3]].astype(np.int64) if len(n.input) > 3 and n.input[3] else np.int64(0)
            exact = np.matmul(a - azp, w - wzp)
            rows = a.reshape(-1, a.shape[-1])
            k = rows.shape[1]
            prod = rows[:, :, None] * w[None, :, :]
            pairs = prod[:, 0::2] + prod[:, 1::2]
            sat = np.clip(pairs, -32768, 32767).sum(1) - azp * w.sum(0)[None, :] - rows.sum(1)[:, None] * wzp \
                + k * azp * wzp
            got = tb[n.output[0]].astype(np.int64)
            lines.append(f"{name} {n.name}: K={k}, {b_dir.name} == exact {np.array_equal(got, exact)}, == int16-"
                         f"saturated pairs {np.array_equal(got, sat.reshape(exact.shape))}; max |diff| "
                         f"{int(np.abs(got - exact).max())} of max |exact| {int(np.abs(exact).max())} "
                         f"({int((pairs != np.clip(pairs, -32768, 32767)).sum())} of {pairs.size} pairs saturate)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- all
def _timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return time.perf_counter() - t0, p.stdout.strip().splitlines()[-1]


def run_all(out: Path) -> None:
    """Prepare, capture natively, on ARM64 (cortex-a76) and on Haswell, then print the tables."""
    me = [sys.executable, str(Path(__file__).resolve()), "capture"]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    prepare(out)
    m = out
    platforms: dict[str, list[str]] = {"x86": [sys.executable]}
    arm = REPO / "scripts" / "arm64-root.sh"
    if shutil.which("qemu-aarch64-static") and subprocess.run([str(arm), "build"]).returncode == 0:
        platforms["arm-a76"] = [str(arm), "run", "python"]
    if shutil.which("qemu-x86_64-static"):
        platforms["haswell"] = ["qemu-x86_64-static", "-cpu", "Haswell", sys.executable]
    for plat, prefix in platforms.items():
        for suffix in ("dq8", "dq8rr"):
            for name in NAMES:
                if suffix == "dq8rr" and plat == "arm-a76":
                    continue
                dt, line = _timed([*prefix, *me[1:], str(m / f"{name}.{suffix}.onnx"), str(m / f"{name}.npz"),
                                   str(out / f"{plat}-{suffix}" / name)])
                print(f"[{plat}] {dt:.1f} s (load {os.getloadavg()[0]:.2f}): {line}", flush=True)
    for plat in platforms:
        if plat != "x86":
            print(compare(out / "x86-dq8", out / f"{plat}-dq8", m, list(NAMES)))
    if "haswell" in platforms:
        print("\n" + saturation(out / "x86-dq8", out / "haswell-dq8", m, list(NAMES)))
        print(compare(out / "x86-dq8rr", out / "haswell-dq8rr", m, list(NAMES), "dq8rr"))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("all")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "ivq-bench-arm64")
    sub.add_parser("prepare").add_argument("dir", type=Path)
    p = sub.add_parser("capture")
    p.add_argument("model")
    p.add_argument("inputs")
    p.add_argument("out")
    p.add_argument("--threads", type=int, default=1)
    for c in ("compare", "saturation"):
        p = sub.add_parser(c)
        p.add_argument("a", type=Path)
        p.add_argument("b", type=Path)
        p.add_argument("dir", type=Path)
        p.add_argument("names", nargs="+")
        p.add_argument("--suffix", default="dq8")
    a = ap.parse_args()
    if a.cmd == "all":
        run_all(a.out)
    elif a.cmd == "prepare":
        prepare(a.dir)
    elif a.cmd == "capture":
        print(capture(a.model, a.inputs, a.out, a.threads))
    else:
        print((compare if a.cmd == "compare" else saturation)(a.a, a.b, a.dir, a.names, a.suffix))


if __name__ == "__main__":
    main()
