"""Small float ONNX models built with onnx.helper (no torch) for the dynamic-INT8 and platform tests, the
AVX2 u8s8 kernel's arithmetic, and a dump re-written as if another platform had captured it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ivq_debug.cli.common import run
from ivq_debug.cli.main import _main
from ivq_debug.dump import DumpWriter, open_dump


def run_ivq(args: list[Any], capfd: Any) -> tuple[int, str, str]:
    """``ivq ARGS`` in this process, as the console script runs it: (exit code, stdout, stderr)."""
    capfd.readouterr()
    code = run("ivq", _main, [str(a) for a in args])
    out, err = capfd.readouterr()
    return code, out, err


def build_mlp(path: Path, seed: int = 0, d: int = 32, hidden: int = 128, blocks: int = 2,
              outlier: int | None = None, erf_gelu: bool = False) -> Path:
    """x [2, 8, d] → blocks of (LayerNorm → MatMul+bias → Gelu → MatMul+bias → residual) → head MatMul → y.

    ``outlier``: the block whose first weight gets one huge column (a per-tensor weight scale 40× too coarse
    for the rest: the unit that introduces most of the dynamic-INT8 error). ``erf_gelu``: GELU written out as
    ``x·0.5·(1 + erf(x/√2))`` (ONNX Runtime fuses it into ``com.microsoft.Gelu``) instead of the opset-20 op.
    """
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def w(name: str, shape: tuple[int, ...], scale: float) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def gelu(x: str, y: str, p: str) -> list[Any]:
        if not erf_gelu:
            return [helper.make_node("Gelu", [x], [y], name=p)]
        c = {k: f"{p}/{k}" for k in ("sqrt2", "one", "half")}
        for k, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5)):
            inits.append(numpy_helper.from_array(np.array(v, np.float32), c[k]))
        return [helper.make_node("Div", [x, c["sqrt2"]], [f"{p}/div"]), helper.make_node("Erf", [f"{p}/div"], [f"{p}/erf"]),
                helper.make_node("Add", [f"{p}/erf", c["one"]], [f"{p}/add"]),
                helper.make_node("Mul", [x, f"{p}/add"], [f"{p}/mul"]),
                helper.make_node("Mul", [f"{p}/mul", c["half"]], [y])]

    h = "x"
    for b in range(blocks):
        p = f"/blocks.{b}"
        nodes.append(helper.make_node("LayerNormalization", [h, w(f"ln{b}.g", (d,), 0.1), w(f"ln{b}.b", (d,), 0.1)],
                                      [f"{p}/ln/out"], axis=-1, name=f"{p}/ln"))
        w1 = w(f"fc1_{b}.w", (d, hidden), d ** -0.5)
        if outlier == b:
            arr = numpy_helper.to_array(inits[-1]).copy()
            arr[:, 0] *= 40.0
            inits[-1] = numpy_helper.from_array(arr, w1)
        nodes += [
            helper.make_node("MatMul", [f"{p}/ln/out", w1], [f"{p}/fc1/MatMul_output_0"], name=f"{p}/fc1/MatMul"),
            helper.make_node("Add", [f"{p}/fc1/MatMul_output_0", w(f"fc1_{b}.b", (hidden,), 0.1)],
                             [f"{p}/fc1/Add_output_0"], name=f"{p}/fc1/Add"),
            *gelu(f"{p}/fc1/Add_output_0", f"{p}/act/out", f"{p}/act"),
            helper.make_node("MatMul", [f"{p}/act/out", w(f"fc2_{b}.w", (hidden, d), hidden ** -0.5)],
                             [f"{p}/fc2/MatMul_output_0"], name=f"{p}/fc2/MatMul"),
            helper.make_node("Add", [f"{p}/fc2/MatMul_output_0", w(f"fc2_{b}.b", (d,), 0.1)],
                             [f"{p}/fc2/Add_output_0"], name=f"{p}/fc2/Add"),
            helper.make_node("Add", [h, f"{p}/fc2/Add_output_0"], [f"{p}/res"], name=f"{p}/res"),
        ]
        h = f"{p}/res"
    nodes.append(helper.make_node("MatMul", [h, w("head.w", (d, 10), d ** -0.5)], ["y"], name="/head/MatMul"))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17 if erf_gelu else 20)])  # (fusion to com.microsoft.Gelu: < 20)
    m.ir_version = 10
    onnx.save(m, str(path))
    return path


def mlp_input(seed: int = 1, d: int = 32) -> dict[str, np.ndarray]:
    """One input of :func:`build_mlp`."""
    return {"x": np.random.default_rng(seed).standard_normal((2, 8, d)).astype(np.float32) * 2.0}


def avx2_u8s8_matmul(a: np.ndarray, w: np.ndarray, a_zp: Any, w_zp: Any) -> np.ndarray:
    """``MatMulInteger`` as ONNX Runtime's AVX2 u8s8 kernel computes it: each adjacent pair of raw u8·s8 products is
    summed into int16 with saturation (``vpmaddubsw``), then the zero points are applied exactly (docs/arm64.md:
    the Haswell result equals this, bit for bit, on every MatMulInteger measured)."""
    a, w = a.astype(np.int64), w.astype(np.int64)
    azp, wzp = np.int64(np.asarray(a_zp).reshape(())), np.asarray(w_zp, dtype=np.int64)
    rows = a.reshape(-1, a.shape[-1])
    k = rows.shape[1]
    prod = rows[:, :, None] * w[None, :, :]
    pairs = np.clip(prod[:, 0::2] + prod[:, 1::2], -32768, 32767)
    out = pairs.sum(1) - azp * w.sum(0)[None, :] - rows.sum(1)[:, None] * wzp + k * azp * wzp
    return out.reshape(*a.shape[:-1], w.shape[-1]).astype(np.int32)


def as_platform(src: Path, dst: Path, platform: dict[str, Any], values: dict[str, np.ndarray] | None = None,
                kernels: dict[str, Any] | None = None) -> Path:
    """A copy of dump ``src`` whose recorded platform is ``platform`` (merged), whose tensors ``values`` are
    replaced (and ``/meta/kernels``, when given): what another machine's capture of the same model would hold
    (an injected platform fault)."""
    values = values or {}
    with open_dump(src) as d:
        info = dict(d.backend_info)
        info["platform"] = {**info.get("platform", {}), **platform}
        with DumpWriter(dst, backend=d.backend, backend_info=info, model=d.model, overwrite=True) as w:
            for (sample, part, step), rid in sorted(d.record_keys().items(), key=lambda kv: kv[1]):
                w.begin_record(sample, part, step, **d.record_meta(rid))
                for e in d.tensors(rid, kind="input"):
                    w.add_input(e.name, d.read(e))
                for e in d.tensors(rid):
                    w.add_tensor(e.name, values.get(e.name, d.read(e)), op_type=e.op_type, order=e.order,
                                 scope=e.scope, encoding=e.encoding)
            kernels = kernels if kernels is not None else d.meta("kernels")
            if kernels is not None:
                w.set_meta("kernels", kernels)
    return dst
