"""Defaults, in one place.

Anything a user might want to change has its default here; modules read these names instead of
repeating literals.
"""

from __future__ import annotations

# --- golden dumps -----------------------------------------------------------------------------------
DUMP_FORMAT = "ivq-dump"
#: the newest dump format version readers read; a writer writes 2 only when it stored a tensor as its integers
#: only (DUMP_INTEGERS_ONLY), 1 otherwise (docs/dump-format.md, Versioning)
DUMP_FORMAT_VERSION = 2
#: HDF5 compression filter for tensor datasets: None (default), "auto", "gzip" or "lzf".
#: None stores every tensor raw, which keeps captures and diffs fast: readers take uncompressed tensors
#: straight from their file offsets (``os.pread``, no HDF5 lock), while every compressed one is decoded under
#: h5py's global lock, one thread at a time. "auto" compresses (lzf) only tensors on a quantization grid.
#: Measured on the ViT-S float / QNN a8w8 dumps of ``bench/bench_many.py --compression`` (one image, 239 MiB
#: each; docs/dump-format.md): float activations do not compress (lzf 1.00, gzip-1+shuffle 0.84 at 30× the
#: write time); the a8w8 dump compresses to 0.61 with "auto" but writes 4.4× and reads 2.2× slower than
#: raw, and ``ivq-diff`` of float vs a8w8 took 19–23 s raw against 24–35 s with "auto". Measured again for
#: issue 33 (docs/scale.md#dump-size-issue-33-item-4; gzip levels 1–9, lzf, shuffle, "auto" with lzf or gzip):
#: every filter costs 3–30× the raw write time of the a8w8 dump for 0.39–0.77 of its size, while capture ×2 +
#: diff already runs at 1.19× the machine's limit, mostly writing; raw stays the default.
DUMP_COMPRESSION: str | None = None
#: gzip level when DUMP_COMPRESSION == "gzip".
DUMP_COMPRESSION_LEVEL = 1
#: target bytes per HDF5 chunk of a compressed tensor (uncompressed ones are contiguous: chunks only serve filters).
DUMP_CHUNK_BYTES = 1 << 20
#: tensors smaller than this are stored contiguous and uncompressed, whatever the compression setting.
DUMP_MIN_CHUNKED_BYTES = 64 << 10
#: a quantized tensor captured with its raw integers is stored as the integers alone when their dequantization
#: gives its values bit for bit (format version 2, docs/dump-format.md "Integers only"): the 12-block ViT's a8w8
#: data drops to 0.20 of its size and its write to about a third (docs/scale.md, "Integers only"). False, or
#: ``$IVQ_DUMP_INTEGERS_ONLY=0``, stores both as format version 1 does (for readers older than version 2).
DUMP_INTEGERS_ONLY = True
DUMP_INTEGERS_ONLY_ENV = "IVQ_DUMP_INTEGERS_ONLY"


def dump_integers_only() -> bool:
    """:data:`DUMP_INTEGERS_ONLY`, unless ``$IVQ_DUMP_INTEGERS_ONLY`` says ``0`` / ``off`` / ``false`` / ``no``
    (or ``1`` / ``on`` / ``true`` / ``yes``)."""
    import os

    v = os.environ.get(DUMP_INTEGERS_ONLY_ENV, "").strip().lower()
    if v in ("0", "off", "false", "no"):
        return False
    if v in ("1", "on", "true", "yes"):
        return True
    return DUMP_INTEGERS_ONLY


#: a tensor a capture hands over to the dump writer (``DumpWriter.add_tensor(..., owned=True)``: the runner's own
#: outputs) gets its statistics and content digest in the writer's thread while the capture goes on (HDF5 writes,
#: the next forward): SHA-256 and the float64 sums release the GIL (docs/scale.md, "Capture ×2 + diff against the
#: machine's limit"). ``False``: computed in the caller's thread, as before; the dump is the same either way.
DUMP_STATS_THREAD = True
#: bytes of handed-over tensors whose statistics may wait for the writer's thread; past it the writer waits for
#: the oldest (the arrays stay alive until their statistics are made)
DUMP_STATS_PENDING_BYTES = 256 << 20

#: off a terminal, a long phase (a QNN compile) is announced in the log after this many seconds
PROGRESS_PHASE_NOTE_S = 10.0

# --- comparison -------------------------------------------------------------------------------------
#: metric used to rank layers (worst first) when none is given: scale-invariant when a side is float, error in
#: quantization steps when both sides are quantized (comparator/ranking.py, docs/metrics.md Ranking)
RANK_METRIC = "sqnr_db"
RANK_METRIC_QUANTIZED = "lsb_rmse"
#: bytes per block when metrics stream through a tensor.
COMPARE_BLOCK_BYTES = 4 << 20
#: fraction of tensors that may stay unmatched before ivq-diff exits 4 (per side, of the smaller dump).
MAX_UNMATCHED_FRACTION = 0.5
#: input names whose role is ``carried`` unless the producer says otherwise (``docs/dump-format.md``, Contract): the
#: KV cache an earlier step of the same backend wrote, which differs whenever the backends do
CONTRACT_CARRIED_INPUTS = ("past*",)
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

#: ``mrope_layout``: the test's post-RoPE prefill keys at the image tokens, projected on the line from the model
#: layout's recomputed rotation (0) to the other layout's (1), must lie within this of 1 (qwen3vl-tiny, bucket 56,
#: 2 images: the sectioned knob 0.99-1.06 in fp32, a16w8 and a8w8; clean runs -0.04-0.01; DeepStack added before
#: layer 0, keys that differ by more than a rotation: up to 0.53) ...
MROPE_SHIFT_TOLERANCE = 0.25
#: ... and the other layout's relative residual at most this (fp32: ~5e-8; a8w8: 0.05-0.08; DeepStack before
#: layer 0: 0.36-0.66)
MROPE_MAX_RESIDUAL = 0.25

#: ``preprocess_mismatch``: vision inputs whose relative L2 difference is at most this are the same preprocessing
PREPROCESS_MAX_REL = 1e-4
#: an affine map of the reference's pixel values explains the test's when R² is at least this (a range or
#: normalization mismatch is exact: R² = 1 to float rounding)
PREPROCESS_AFFINE_R2 = 0.9999

#: DeepStack: a residual-stream jump between two LLM layers counts when it is at least this share of the
#: stream's norm at the image rows (qwen3vl-tiny: 0.52 and 1.23 at bucket 112; HF's own forward checked > 5 %,
#: ``tests/vlm/test_qwen3vl.py``) ...
DEEPSTACK_MIN_JUMP = 0.05
#: ... and a test jump carries a reference jump when their relative difference is at most this
#: (fp32: < 1e-6; a jump moved by one layer carries another feature: 1.3 on qwen3vl-tiny)
DEEPSTACK_MAX_ERROR = 0.5

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
#: the HTP architectures the x86 emulator compiles for (another number compiled silently for nothing: issue 31)
QNN_HTP_ARCHS = ("68", "69", "73", "75", "79", "81")
QNN_EP_NAME = "QNNExecutionProvider"
#: when nodes are unsupported at ORT optimization "disable", the session is tried once more at "all" (to say
#: whether ``--optimization all`` fixes it) for models up to this size; larger ones get the advice unchecked.
#: A retry is one more QNN compile: 1-4 s for the test models here, minutes for a 2B-parameter part.
QNN_RETRY_ALL_MAX_BYTES = 64 << 20
#: the compiled-context cache (``capture/qnn_ep/cache.py``): a folder under ``${XDG_CACHE_HOME:-~/.cache}``,
#: or the folder this environment variable names; ``--qnn-cache DIR`` / ``--no-qnn-cache`` on the CLI
QNN_CACHE_ENV = "IVQ_QNN_CACHE"
QNN_CACHE_SUBDIR = "ivq-debug/qnn-contexts"
#: least recently used entries are removed past this size (a context is about the size of the model's weights:
#: 2.6-6.9 MB for the OCR / ViT bench models)
QNN_CACHE_MAX_BYTES = 4 << 30
#: expose channels-last (NCHW conv) tensors through an explicit NHWC Transpose that ORT cancels against the one
#: QNN adds per exposed output (PP-OCRv4 a16w8, 369 tensors: session 27.6 -> 7.1 s, tensors bit-identical)
QNN_CHANNELS_LAST_EXPOSURE = True
#: the search for tensors QNN refuses to expose compiles throw-away sessions: at most this many per capture,
#: and no more than fit in this many seconds at the compile time measured on the model (an unrolled LSTM
#: recompiles in 15-45 s); what is left is listed as unexposable ("not probed") and said on the console.
#: The time budget is the bound that matters on slow compiles; the count must leave room for bisection on
#: fast ones: the demo's 2-layer vision tower (a8w8, 76 tensors, ~1 s a compile) needs 24-28 probes to find
#: its two Kᵀ culprits, and a cap of 8 left all 72 vision / projector tensors out unprobed
QNN_MAX_PROBES = 64
QNN_PROBE_BUDGET_S = 90.0
#: ``--fast-compile``: QNN's "faster preparation, less optimized graph" finalization (10x faster finalize on
#: PP-OCRv4 but its output moved by one 8-bit step), opt-in only and recorded in the dump
QNN_FAST_COMPILE_OPTIONS = {"htp_graph_finalization_optimization_mode": "1"}

#: tensors whose names match these patterns also get logits metrics (top-1 agreement, KL)
LOGITS_PATTERNS = ("*logits*", "lm_head", "*.lm_head")
#: when no threshold is given, the first divergence is the first tensor below this SQNR (dB)
DIVERGENCE_SQNR_DB = 40.0
#: --baseline: a layer regresses when its rank metric got worse by more than this (dB for SQNR,
#: otherwise a relative change)
REGRESSION_TOL_DB = 1.0
REGRESSION_TOL_REL = 0.10

#: three-way verdict (``ivq-diff --expected CPUQDQ.h5``, docs/findings.md backend_divergence): a tensor departs from
#: what quantization explains when the backend's relative L2 error against fp32 exceeds K times CPU-QDQ's (the
#: 1.5x of AWS Neuron's vLLM accuracy debugger); an error finding from ERROR_RATIO times on
BACKEND_DIVERGENCE_K = 1.5
BACKEND_DIVERGENCE_ERROR_RATIO = 4.0
#: ... unless the backend's own relative L2 error is below this (60 dB SQNR): float rounding, whatever the ratio
BACKEND_DIVERGENCE_MIN_REL_L2 = 1e-3
#: the default backend check (``ivq-diff CPUQDQ.h5 BACKEND.h5``: REF is the ORT CPU-QDQ capture of the QDQ model
#: TEST ran, nothing declared): a tensor departs when its rmse against CPU-QDQ exceeds this many 8-bit steps
#: (``lsb_rmse`` x 2^(8 - bits) of the test encoding: a 16-bit step is 1/256 of an 8-bit one) *and* its SQNR against
#: CPU-QDQ is below BACKEND_CHECK_MAX_SQNR_DB. Measured (onnxruntime-qnn 2.7.0, soc 60, HTP emulation): the clean
#: seed-0 block (tests/support/qnn_models.py) stays at 1.13 (a8w8) and 0.39 (a16w8) steps; the demo's clean a16w8
#: VLM at 9.5 steps at most but never below 17.9 dB, so none departs; one activation encoding corrupted on the HTP
#: side (scale x 0.1) departs at that tensor by 288 steps at 2.9 dB
BACKEND_CHECK_LSB_RMSE = 4.0
BACKEND_CHECK_MAX_SQNR_DB = 20.0

#: introduced-error replay: maximum bytes of reference inputs per replay batch (one session + one run)
REPLAY_BATCH_BYTES = 256 << 20
#: ... and, with an executor (``ivq diagnose --executor``), at least this many jobs: the batches are cut into
#: pieces of at most ``ceil(units / REPLAY_MIN_JOBS)`` units (the demo's prefill, 160 units in one batch, into 8
#: jobs of 20) so that workers have work to share; a unit's numbers do not depend on its batch's other units
REPLAY_MIN_JOBS = 8
#: ONNX Runtime session entries of the replay's own CPU sessions (the shadow model, the CPU replay, the one-graph
#: effect runs): intra-op threads that sleep instead of spinning between ops. Each of those graphs (thousands of
#: small nodes side by side) runs once per record, so a spinning thread only burns a core the other thread or
#: process needs. Measured on bench_loop's 12-block ViT at load 6-9 (2 cores; the numbers are the same to the bit,
#: a thread's spin changes no kernel): the effect graph's run 1.46-2.98 s wall / 1.2-1.6 s CPU spinning, 0.86-1.52
#: s / 0.8-0.85 s not; the shadow model's 0.54-2.10 / 0.64-1.08 s against 0.60-1.76 / 0.54-0.67 s (docs/scale.md)
REPLAY_SESSION_CONFIG = {"session.intra_op.allow_spinning": "0"}
#: threads of ``ivq diagnose``'s CPU counterfactual runs without ``--executor`` (at most one per core): the targets
#: in as many one-graph groups, each group's ONNX Runtime session run in its own thread (each group also runs the
#: unchanged model once, the values its copies read). Every figure is the same to the bit (each variant computes
#: what its own model computes, in any group). On bench_loop's 12-block ViT (7 targets) on 2 cores: docs/scale.md,
#: fourth pass
EFFECT_THREADS = 2
#: replay self-check: a unit whose isolated backend output differs from the full-graph output (fed the same
#: upstream integers) by more than this many quantization steps is computed differently in the full graph
REPLAY_SELFCHECK_STEPS = 1.0
#: introduced-error budget (dB, local attribution) by the model's activation bitwidth: the quantization preset.
#: One 8-bit encoding of a well-spread tensor gives about 40 dB and a unit stacks its weight, arithmetic and
#: output encoding, so clean a8w8 units sit around 35-45 dB (the clean ViT of tests/diagnose: minimum 35.0 dB,
#: median 40.7 dB); at a16w8 the median is 88.6 dB.
INTRO_BUDGET_DB = {8: 20.0, 16: 40.0}
#: weight_range_spread: a per-tensor weight whose output-channel ranges spread this much (largest / smallest)
#: loses log2(spread) bits on its smallest channel: a warning at 100x (about one bit left at 8 bits), an error
#: at 1000x
WEIGHT_SPREAD_WARN = 100.0
WEIGHT_SPREAD_ERROR = 1000.0

#: quantization hazards (docs/findings.md): share of reference values outside the encoding range (warning),
#: and the clipping SNR (signal power over the power clipped away, dB) below which saturation is an error
SATURATION_WARN = 1e-3
SATURATION_WARN_CLIP_SNR_DB = 40.0
SATURATION_ERROR_CLIP_SNR_DB = 20.0
#: ops that only move or view data: their tensors repeat their producer's encoding problem, so hazards are
#: reported on the producer only
VIEW_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Identity", "Slice",
            "Concat", "Split", "Gather", "Neg")
#: the view ops whose output holds every value of their (first) input once, rearranged: the same min, max and
#: histogram (entropy calibration takes the input's, ``ivq_debug.qnn.entropy.permuted``)
PERMUTING_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
#: SNR (dB) of the reference values fake-quantized with the test encoding, above its lowest bin
RESOLUTION_WARN_DB = 20.0
RESOLUTION_ERROR_DB = 10.0

#: ``ivq calib-stats``: histogram bins per tensor, on fixed edges ``linspace(min, nextafter(max), BINS + 1)`` from
#: the range pass (every job of the statistics pass uses the same edges, so the shards' histograms add exactly);
#: percentiles read from it are within one bin, (max - min) / 256, of the exact ones
CALIB_BINS = 256
#: ... calibration samples per job: 200 samples make 20 jobs (each job's shard holds one state per tensor)
CALIB_SAMPLES_PER_JOB = 10
#: ... the share of a tensor's calibration values inside its encoding's range below which coverage fails (exit 1);
#: an encoding made by min/max calibration on the same set covers 1.0
CALIB_MIN_COVERAGE = 0.99
#: ... the percentiles reported per tensor (read from the histogram)
CALIB_PERCENTILES = (0.1, 1.0, 50.0, 99.0, 99.9)

#: a CPU capture (``OrtRunner``) whose exposed tensors of one record would take more than this many bytes runs in
#: consecutive subgraphs of about this size each (``capture_runs`` in the dump's backend info says so), unless the
#: caller chose ``max_outputs_per_run`` / ``partition=False``; estimated from ONNX shape inference at 4 bytes per
#: element (an InternVL2-2B image prefill exposes ~5 GiB: 5-6 runs)
CAPTURE_RUN_BYTES = 1 << 30

#: ``ivq tune`` without ``--reference``: the most bytes of float reference arrays kept in memory between trials
#: (:mod:`ivq_debug.tune.reference`: an equal share per sample, the tensors the trials' comparisons read, smallest
#: first; a value not kept is made again by one float forward of its sample). PP-OCRv4's recognizer, 12 lines:
#: every tensor a search's trials measure, 22.5 MiB per line (of 192 MiB), and the alignment's value checks: 384 MiB
#: keeps them (32 MiB a line; 256 MiB, 21 MiB a line, left the largest out: a forward of every line per lever)
TUNE_REFERENCE_KEEP_BYTES = 384 << 20
#: ``ivq tune``: the QNN HTP runners of one HTP trial, the second in a worker process (``capture/worker.py``: the x86
#: HTP emulation runs a session on one core, PP-OCRv4's a16w16 recognizer ~10 s of one core per line, and two
#: sessions of one process take turns; in two processes two lines take the time of one, bit for bit; 1: one
#: runner, the samples one after the other)
TUNE_HTP_RUNNERS = 2
#: ``ivq tune``: the run's cache of quantized models (one quantization per distinct setting: a lever's job and its
#: re-run, a CPU-QDQ trial and its HTP check) holds at most this many times the float model's bytes, the least
#: recently used going first (PP-OCRv4's recognizer, 10.8 MB: 21 levers' models of 3.1-5.8 MB, 80 MB, all kept)
TUNE_MODEL_CACHE_RATIO = 8
#: ... and at least this many bytes (a small model's QDQ file is many times the float one: metadata, Q/DQ nodes)
TUNE_MODEL_CACHE_MIN_BYTES = 16 << 20
