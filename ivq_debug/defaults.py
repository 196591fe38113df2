"""Defaults, in one place.

Anything a user might want to change has its default here; modules read these names instead of
repeating literals.
"""

from __future__ import annotations

# --- golden dumps -----------------------------------------------------------------------------------
DUMP_FORMAT = "ivq-dump"
DUMP_FORMAT_VERSION = 1
#: HDF5 compression filter for tensor datasets: None (default), "auto", "gzip" or "lzf".
#: None stores every tensor raw, which keeps captures and diffs fast: readers take uncompressed tensors
#: straight from their file offsets (``os.pread``, no HDF5 lock), while every compressed one is decoded under
#: h5py's global lock, one thread at a time. "auto" compresses (lzf) only tensors on a quantization grid.
#: Measured on the ViT-S float / QNN a8w8 dumps of ``bench/bench_many.py --compression`` (one image, 239 MiB
#: each; docs/dump-format.md): float activations do not compress (lzf 1.00, gzip-1+shuffle 0.84 at 30× the
#: write time); the a8w8 dump compresses to 0.61 with "auto" but writes 4.4× and reads 2.2× slower than
#: raw, and ``ivq-diff`` of float vs a8w8 took 19–23 s raw against 24–35 s with "auto".
DUMP_COMPRESSION: str | None = None
#: gzip level when DUMP_COMPRESSION == "gzip".
DUMP_COMPRESSION_LEVEL = 1
#: target bytes per HDF5 chunk.
DUMP_CHUNK_BYTES = 1 << 20
#: tensors smaller than this are stored contiguous (no chunking / compression).
DUMP_MIN_CHUNKED_BYTES = 64 << 10

# --- comparison -------------------------------------------------------------------------------------
#: metric used to rank layers (worst first) when none is given.
RANK_METRIC = "sqnr_db"
#: bytes per block when metrics stream through a tensor.
COMPARE_BLOCK_BYTES = 4 << 20
#: fraction of tensors that may stay unmatched before ivq-diff exits 4 (per side, of the smaller dump).
MAX_UNMATCHED_FRACTION = 0.5
#: number of worst layers printed by ivq-diff.
TOP_N = 10
#: platform comparisons: a kernel whose float output differs by at most this many float32 ulps of the tensor's
#: largest magnitude rounds differently (noise); more is a kernel error or, in an integer op, saturation. Measured
#: x86 AVX-512 VNNI vs ARM64 cortex-a76 on dynamic INT8 (docs/arm64.md): LayerNorm 4, Softmax 12, fused
#: MatMulIntegerToFloat 3 ulps; AVX2-only x86 saturation moved DynamicQuantizeMatMul outputs by ~1e5 ulps.
PLATFORM_ULP_NOISE = 64.0
#: ``ivq-diff --fail-on``: findings of this severity or worse fail the run (exit 1), like a broken budget
DIFF_FAIL_ON = "error"

#: Threshold presets (see docs/metrics.md). Each maps a metric to a (direction, value) budget:
#: "min" means the metric must be >= value, "max" means <= value.
PRESETS: dict[str, dict[str, tuple[str, float]]] = {
    # fp32 ONNX vs PyTorch. The seed's "max_abs <= 1e-5" is about model outputs of magnitude ~1; per layer,
    # activations reach |x| ~ 20, so the relative form is used: SQNR >= 90 dB (relative error ~3e-5).
    "export": {"sqnr_db": ("min", 90.0)},

    # quantized vs reference (seed: max_abs <= 0.02 usable, > 0.1 rework)
    "quant-usable": {"max_abs": ("max", 0.02)},
    "quant-rework": {"max_abs": ("max", 0.1)},
}

#: export verification of a model part's *outputs* against PyTorch, fp32 (seed: max_abs <= 1e-5)
EXPORT_OUTPUT_MAX_ABS = 1e-5

#: KV-cache position inference: a decode step's offset is reported only when the rotation fits the
#: appended key slot this well (1 = exact rotation; identical pre-RoPE layer-0 keys give > 0.999 in fp32) and
#: the best offset beats every other hypothesis by this confidence (``docs/findings.md``, Position ids)
POSITION_MIN_FIT = 0.9
POSITION_MIN_CONFIDENCE = 0.5
#: offsets searched by the KV-cache inference: [-max, +max]
POSITION_MAX_OFFSET = 4096

#: projector output mean relative error above which the projector is said to drift (seed: 5 %).
PROJECTOR_DRIFT_MEAN_REL = 0.05
#: the drift is the projector's own (an error) when it amplifies the vision tower's relative error this much,
#: or when this share of its reference activations falls outside its encodings (calibration coverage)
PROJECTOR_AMPLIFICATION = 1.5
PROJECTOR_COVERAGE_MISS = 1e-3

# --- QNN (HTP through onnxruntime-qnn) --------------------------------------------------------------
#: Snapdragon X Elite; the x86 HTP emulator defaults to SM8350/v68 without it, where several ops fail.
QNN_SOC_MODEL = "60"
QNN_HTP_ARCH = "73"
QNN_EP_NAME = "QNNExecutionProvider"
#: when nodes are unsupported at ORT optimization "disable", the session is tried once more at "all" (to say
#: whether ``--optimization all`` fixes it) for models up to this size; larger ones get the advice unchecked.
#: A retry is one more QNN compile: 1-4 s for the test models here, minutes for a 2B-parameter part.
QNN_RETRY_ALL_MAX_BYTES = 64 << 20

#: tensors whose names match these patterns also get logits metrics (top-1 agreement, KL)
LOGITS_PATTERNS = ("*logits*", "lm_head", "*.lm_head")
#: when no threshold is given, the first divergence is the first tensor below this SQNR (dB)
DIVERGENCE_SQNR_DB = 40.0
#: --baseline: a layer regresses when its rank metric got worse by more than this (dB for SQNR,
#: otherwise a relative change)
REGRESSION_TOL_DB = 1.0
REGRESSION_TOL_REL = 0.10

#: introduced-error replay: maximum bytes of reference inputs per replay batch (one session + one run)
REPLAY_BATCH_BYTES = 256 << 20

#: quantization hazards (docs/findings.md): share of reference values outside the encoding range (warning),
#: and the clipping SNR (signal power over the power clipped away, dB) below which saturation is an error
SATURATION_WARN = 1e-3
SATURATION_WARN_CLIP_SNR_DB = 40.0
SATURATION_ERROR_CLIP_SNR_DB = 20.0
#: ops that only move or view data: their tensors repeat their producer's encoding problem, so hazards are
#: reported on the producer only
VIEW_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Identity", "Slice",
            "Concat", "Split", "Gather", "Neg")
#: SNR (dB) of the reference values fake-quantized with the test encoding, above its lowest bin
RESOLUTION_WARN_DB = 20.0
RESOLUTION_ERROR_DB = 10.0
