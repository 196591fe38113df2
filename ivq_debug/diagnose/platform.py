"""Platform findings: two captures of one model on two machines, and the kernels that make them differ.

The same ONNX Runtime build picks different kernels per CPU (x86_64 AVX-512 VNNI / AMX, AVX2 only, ARM64
dotprod). Comparing two captures of the same model (same SHA-256) on the same backend whose recorded platforms differ
(machine, CPU features or ONNX Runtime version in ``backend_info["platform"]``,
:mod:`ivq_debug.capture.onnxrt.platform`), each tensor is

* **bit-identical**;
* **inherited**: it differs, but so does one of its inputs (or an input was not captured);
* **kernel differs**: it differs while every input it reads is bit-identical (``/meta/kernels``: the op and
  inputs of each tensor *as run*), so the op's own kernel computes differently on the two platforms.

A differing kernel gets one verdict (``evidence["verdict"]``):

* ``ulp_noise``: a float kernel that rounds differently: at most :data:`ivq_debug.defaults.PLATFORM_ULP_NOISE`
  float32 ulps of the tensor's largest magnitude (measured x86 VNNI vs ARM cortex-a76: LayerNorm 4, Softmax 12,
  ``MatMulIntegerToFloat`` 3 ulps; docs/arm64.md). Expected, benign.
* ``saturation``: an op that accumulates in integers (:data:`INTEGER_ACCUMULATING`) whose result differs by
  whole integer steps (an exact integer kernel gives the same integers everywhere) or, fused with its float
  scaling, by more than ulp noise: the accumulator overflowed or saturated. AVX2-only x86 sums each pair of
  u8·s8 products into int16 with saturation (``vpmaddubsw``); the error is integer steps that grow with the
  accumulation length K (more pairs, more that can saturate; measured K = 64: up to 17363 steps of 84380).
* ``kernel_error``: a float kernel that differs by more than ulp noise.

Each verdict is one ``platform_kernel`` finding naming the ops (as run), their tensors, the largest error in ulps
or integer steps and the accumulation lengths, with the fix that applies to the two platforms: ``reduce_range``
(7-bit weights), u8u8 weights or ``session.x64quantprecision=1`` (ONNX Runtime converts s8 weights to u8 on x86
without VNNI, above ``ORT_DISABLE_ALL`` only) for saturation; ``session.qdqisint8allowed=1`` when the two platforms fused the graph differently (s8s8 QDQ); an
ulp-scaled tolerance for noise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding

#: ops that accumulate in integers (as run: the file's ops and ONNX Runtime's fusions)
INTEGER_ACCUMULATING = frozenset({
    "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "com.microsoft.QGemm",
    "com.microsoft.DynamicQuantizeMatMul", "com.microsoft.MatMulIntegerToFloat", "com.microsoft.QAttention",
    "com.microsoft.DynamicQuantizeLSTM", "com.microsoft.QLinearConv", "com.microsoft.NhwcQLinearConv",
})
#: what makes two captures *platforms* apart (``backend_info["platform"]`` keys): one of these must differ
PLATFORM_FACTS = ("machine", "cpu_features", "onnxruntime")
#: settings reported beside them when they differ too (they change kernels on one machine as well)
SETTINGS = ("intra_op_threads", "graph_optimization_level", "session_options")
FACTS = PLATFORM_FACTS + SETTINGS
_VNNI = ("AVX512VNNI", "AVX512_VNNI", "AVXVNNI", "AVX_VNNI")


def platform_label(p: dict[str, Any]) -> str:
    """A short name for a platform: ``x86_64 (AVX2, no VNNI)``, ``x86_64 (AVX-512 VNNI)``, ``aarch64 (dotprod)``."""
    feats = set(p.get("cpu_features") or [])
    machine = p.get("machine") or "?"
    if machine in ("x86_64", "AMD64", "i686"):
        if feats & set(_VNNI):
            isa = "AVX-512 VNNI" if feats & {"AVX512VNNI", "AVX512_VNNI"} else "AVX-VNNI"
        elif "AVX2" in feats:
            isa = "AVX2, no VNNI"
        else:
            isa = "SSE"
    elif machine in ("aarch64", "arm64"):
        isa = ", ".join(x for x, f in (("dotprod", "ASIMDDP"), ("i8mm", "I8MM"), ("SVE", "SVE")) if f in feats) or "NEON"
    else:
        isa = ""
    return f"{machine} ({isa})" if isa else machine


def differences(ref: dict[str, Any], test: dict[str, Any]) -> dict[str, Any]:
    """The platform facts that differ: ``{fact: [ref value, test value]}`` (CPU features as the two set differences)."""
    out: dict[str, Any] = {}
    for k in FACTS:
        a, b = ref.get(k), test.get(k)
        if k == "cpu_features":
            only_ref, only_test = sorted(set(a or []) - set(b or [])), sorted(set(b or []) - set(a or []))
            if only_ref or only_test:
                out[k] = {"only_ref": only_ref, "only_test": only_test}
        elif a != b:
            out[k] = [a, b]
    return out


def _no_vnni_x86(p: dict[str, Any]) -> bool:
    feats = set(p.get("cpu_features") or [])
    return p.get("machine") == "x86_64" and "AVX2" in feats and not feats & set(_VNNI)


def _ulps(max_abs: float, magnitude: float) -> float:
    spacing = float(np.spacing(np.float32(magnitude))) if magnitude > 0 else float(np.finfo(np.float32).tiny)
    return max_abs / spacing


def _classify(op: str, integer: bool, max_abs: float, ulps: float) -> str:
    if integer:
        return "saturation" if op in INTEGER_ACCUMULATING or max_abs > 1 else "ulp_noise"
    if ulps <= defaults.PLATFORM_ULP_NOISE:
        return "ulp_noise"
    return "saturation" if op in INTEGER_ACCUMULATING else "kernel_error"


def kernel_differences(cmp: Any) -> dict[str, Any]:
    """Per aligned tensor of a same-model comparison: bit-identical, inherited or kernel-differs (with its op as run,
    error in ulps / integer steps and accumulation length). Returns counts and the kernel-differs rows."""
    kr = (cmp.ref.meta("kernels") or {}).get("tensors", {})
    kt = (cmp.test.meta("kernels") or {}).get("tensors", {})
    stats = {(e.sample, e.part, e.step, e.name): e for e in cmp.ref.tensors()}
    t = cmp.table
    same: dict[tuple[Any, ...], bool] = {}
    for r in t.itertuples(index=False):
        same[(r.sample, r.part, r.step, r.ref_name)] = r.status == "identical" or r.max_abs == 0
    rows, inherited, identical, regraphed = [], 0, 0, []
    for r in t.itertuples(index=False):
        key = (r.sample, r.part, r.step, r.ref_name)
        if same[key]:
            identical += 1
            continue
        k = kt.get(r.test_name) or kr.get(r.ref_name)
        if k is None:
            inherited += 1
            continue
        if r.ref_name in kr and r.test_name in kt and kr[r.ref_name]["op"] != kt[r.test_name]["op"]:
            regraphed.append({"tensor": r.ref_name, "ref_op": kr[r.ref_name]["op"], "test_op": kt[r.test_name]["op"]})
        if not all(same.get((r.sample, r.part, r.step, x), False) for x in k["inputs"]):
            inherited += 1
            continue
        e = stats.get(key)
        mag = max(abs(float(e.stats.get("min") or 0.0)), abs(float(e.stats.get("max") or 0.0))) if e else 0.0
        integer = str(r.test_dtype).startswith(("int", "uint"))
        max_abs = float(r.max_abs) if r.max_abs is not None and not math.isnan(r.max_abs) else math.inf
        ulps = math.nan if integer else _ulps(max_abs, mag)
        rows.append({"tensor": r.ref_name, "record": {"sample": int(r.sample), "part": r.part, "step": int(r.step)},
                     "order": int(r.order), "op": k["op"], "k": k.get("k"), "integer": integer, "max_abs": max_abs,
                     "max_ref_abs": mag, "ulps": ulps, "verdict": _classify(k["op"], integer, max_abs, ulps)})
    return {"compared": len(t), "identical": identical, "inherited": inherited, "kernel_differs": rows,
            "fused_differently": regraphed}


def _grows_with_k(items: list[dict[str, Any]]) -> bool | None:
    by_k: dict[int, float] = {}
    for x in items:
        if x["k"]:
            by_k[x["k"]] = max(by_k.get(x["k"], 0.0), x["max_abs"] if x["integer"] else x["ulps"])
    if len(by_k) < 2:
        return None
    ks = sorted(by_k)
    return bool(np.corrcoef(ks, [by_k[k] for k in ks])[0, 1] > 0)


_SEVERITY = {"saturation": "error", "kernel_error": "warning", "ulp_noise": "info"}


def _suggestion(verdict: str, ref: dict[str, Any], test: dict[str, Any], diffs: dict[str, Any]) -> str:
    if verdict == "saturation":
        side = [p for p in (ref, test) if _no_vnni_x86(p)]
        where = f"{platform_label(side[0])}: its" if side else "one platform's"
        return (f"{where} u8s8 kernel sums pairs of u8·s8 products into int16 with saturation. Re-quantize with "
                "7-bit weights (`ivq quantize --dynamic --reduce-range`, quantize_dynamic(reduce_range=True)) or "
                "with u8 weights (`--weight-type QUInt8`: u8u8 kernels), or run the s8 model with "
                "`--session-option session.x64quantprecision=1` (ONNX Runtime converts the weights to u8 on x86 "
                "without VNNI; a graph optimization, so not at --optimization disable). Each was measured "
                "bit-identical with a VNNI host (docs/arm64.md)")
    if verdict == "kernel_error":
        return ("a float kernel differs beyond rounding: capture both platforms at `--optimization disable` to see "
                "which unfused op differs, and compare ONNX Runtime versions")
    tail = " (intra-op thread counts differ too: fp32 reductions split differently)" if "intra_op_threads" in diffs else ""
    return ("expected: float kernels round differently on the two platforms; compare them with an ulp-scaled "
            f"tolerance (e.g. ivq-diff --max-abs) rather than bit equality{tail}")


def platform_findings(cmp: Any) -> list[Finding]:
    """``platform_kernel`` findings of a comparison of one model captured on two platforms (none otherwise)."""
    pr, pt = cmp.ref.backend_info.get("platform"), cmp.test.backend_info.get("platform")
    if not pr or not pt or len(cmp.table) == 0:
        return []
    sha_r, sha_t = cmp.ref.model.get("sha256"), cmp.test.model.get("sha256")
    if not sha_r or sha_r != sha_t:
        return []
    diffs = differences(pr, pt)
    if cmp.ref.backend != cmp.test.backend or not any(k in diffs for k in PLATFORM_FACTS):
        return []  # another backend (CPU-QDQ vs HTP) or the same machine with other settings: not a platform
    kd = kernel_differences(cmp)
    labels = {"ref": platform_label(pr), "test": platform_label(pt)}
    base = {"platforms": labels, "differences": diffs, "compared": kd["compared"], "bit_identical": kd["identical"],
            "inherited": kd["inherited"]}
    out: list[Finding] = []
    if kd["fused_differently"]:
        fd = kd["fused_differently"]
        out.append(Finding(
            "platform_kernel", "warning",
            f"{len(fd)} tensor(s) are computed by different ops on {labels['ref']} and {labels['test']}: ONNX Runtime "
            f"fused the graph differently (first {fd[0]['tensor']}: {fd[0]['ref_op']} vs {fd[0]['test_op']})",
            where={"tensor": fd[0]["tensor"]}, evidence=base | {"verdict": "fused_differently", "tensors": fd[:50]},
            suggestion="s8s8 QDQ graphs are fused differently on x86 and ARM: capture x86 with "
                       "`--session-option session.qdqisint8allowed=1` to run ARM's graph"))
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in kd["kernel_differs"]:
        groups[row["verdict"]].append(row)
    for verdict in ("saturation", "kernel_error", "ulp_noise"):
        items = groups.get(verdict)
        if not items:
            continue
        ops: dict[str, dict[str, Any]] = {}
        for x in sorted(items, key=lambda x: x["order"]):
            o = ops.setdefault(x["op"], {"tensors": 0, "max_abs": 0.0, "max_ulps": None, "max_steps": None,
                                         "k": [], "first": x["tensor"]})
            o["tensors"] += 1
            o["max_abs"] = max(o["max_abs"], x["max_abs"])
            key = "max_steps" if x["integer"] else "max_ulps"
            o[key] = max(o[key] or 0.0, x["max_abs"] if x["integer"] else x["ulps"])
            if x["k"] and x["k"] not in o["k"]:
                o["k"].append(x["k"])
        first = min(items, key=lambda x: (x["record"]["sample"], x["record"]["step"], x["order"]))
        names = ", ".join(f"{op} ({o['tensors']})" for op, o in ops.items())
        if verdict == "saturation":
            worst = max(items, key=lambda x: (x["integer"], x["max_abs"]))
            size = (f"{worst['max_abs']:.0f} integer steps" if worst["integer"] else f"{worst['max_abs']:.3g} "
                    f"({worst['ulps']:.0f} ulps)") + (f" at accumulation length K={worst['k']}" if worst["k"] else "")
            msg = (f"integer kernels differ between {labels['ref']} and {labels['test']} with identical inputs: "
                   f"{names}; up to {size}, far beyond rounding: the accumulation saturates")
        elif verdict == "kernel_error":
            worst = max(items, key=lambda x: x["ulps"])
            msg = (f"float kernels differ beyond rounding between {labels['ref']} and {labels['test']}: {names}; up to "
                   f"{worst['max_abs']:.3g} ({worst['ulps']:.0f} ulps)")
        else:
            worst = max(items, key=lambda x: x["ulps"] if not x["integer"] else 0.0)
            most = max((x["ulps"] for x in items if not x["integer"]), default=0)
            msg = (f"kernels round differently between {labels['ref']} and {labels['test']} (ulp-level noise): "
                   f"{names}; at most {most:.0f} ulp{'' if round(most) == 1 else 's'}")
        out.append(Finding(
            "platform_kernel", _SEVERITY[verdict], msg,
            where={"record": first["record"], "tensor": first["tensor"], "op": first["op"]},
            evidence=base | {"verdict": verdict, "ops": ops, "worst": worst, "grows_with_k": _grows_with_k(items)},
            suggestion=_suggestion(verdict, pr, pt, diffs)))
    if not kd["kernel_differs"] and not kd["fused_differently"] and kd["identical"] == kd["compared"]:
        out.append(Finding(
            "platform_kernel", "info",
            f"all {kd['compared']} tensors are bit-identical between {labels['ref']} and {labels['test']}",
            evidence=base | {"verdict": "identical", "ops": {}}, suggestion=""))
    return out
