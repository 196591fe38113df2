"""Entropy calibration: ONNX Runtime's algorithm, its threshold search vectorized.

ORT's ``EntropyCalibrater`` (onnxruntime 1.32, ``quantization/calibrate.py``) makes one histogram per tensor over
every calibration sample (``HistogramCollector.collect_value``: ``num_bins`` bins over ``[-T, T]``, ``T`` the largest
magnitude seen) and picks, per tensor, the window ``[edges[z - i], edges[z + i + 1]]`` (``z`` the middle bin, ``i``
from ``num_quantized_bins // 2`` to ``z``) whose histogram, outliers folded into its end bins, loses the least
information (KL divergence) when merged into ``num_quantized_bins`` bins (``get_entropy_threshold``), then clips the
window to the tensor's min and max. ``quantize_static`` hands the calibrator no bins, so it searched ORT's default
128 of 128: one window, the full range, MinMax's bytes (the PP-OCRv4 recognizer, all 404 tensor ranges).

With :data:`ENTROPY_BINS` (2048 / 128, TensorRT's) ORT's search is a Python loop over 961 windows per tensor, each
with two Python loops over the 128 quantized bins: 0.6 s per tensor, 399 s for the PP-OCRv4 recognizer. :func:`entropy_threshold`
gives the same window: every candidate's divergence at once in float64 from prefix sums (:func:`divergences`: O(bins)
for the histogram, O(windows x quantized bins) for the merged distribution), then ORT's own float32 arithmetic (its
``smooth_distribution`` and ``entropy``) on the few windows within the float32 error of the smallest, so that ties and
near-ties fall as ORT's ``argmin`` lets them fall: on the 384 tensors of PP-OCRv4 ORT's thresholds, all of them, in
1.4 s where ORT's loop took 257 s (load 8).
:func:`entropy_ranges` collects the histograms with ORT's calibrator (its augmented model and session) in two passes
over the samples — the range, then the histograms on the range's fixed edges (:func:`histogram`: numpy's bins to the
count), up to :data:`HELD_BYTES` of outputs kept between them where ORT holds every sample's (3.7 GB on PP-OCRv4).
Measured on PP-OCRv4 (16 lines, one run): the quantization takes about twice MinMax's (29-31 s against 12-13 s at
load 6-8, user CPU 13-15 s against 7 s), the histograms of its 804 M values the largest part.
``tests/qnn/test_entropy.py`` compares every tensor's range with ORT's own ``create_calibrator(...,
CalibrationMethod.Entropy, extra_options={"num_bins": 2048, "num_quantized_bins": 128})``.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.errors import UsageError

#: ``--calibrate-method entropy`` at 8-bit activations: (histogram bins, quantized bins) of ORT's KL-divergence
#: threshold search, TensorRT's and pytorch-quantization's 2048 / 128 (the numbers microsoft/onnxruntime#9342 and
#: #10204 cite). ``quantize_static`` passes none (it maps five ``Calib*`` options only): ORT's default 128 / 128 is one
#: candidate, the full range, MinMax. ORT's histogram spans [-T, T], so 128 quantized bins over a window price a grid
#: coarser than uint8's over it: a threshold clips at least as much as 8 bits need. At 16-bit activations entropy is
#: MinMax (``ivq_debug.qnn.quantize``): a 65536-level grid is finer than any histogram affordable here.
ENTROPY_BINS = (2048, 128)
#: ORT's ``smooth_distribution`` epsilon (float32, as ORT adds it)
_EPS = float(np.float32(1e-4))
#: the float32 error of ORT's divergence, relative to ``1 + 2 H(p) + KL`` (H the window's entropy; the sum of the
#: magnitudes of ORT's terms is at most that): about 20 float32 roundings (pairwise sums of blocks of 128, the logs,
#: the normalizations) are 1.2e-6 (measured: at most 0.02 of this tolerance, ``tests/qnn/test_entropy.py``); windows
#: within twice this of the smallest are computed again as ORT does
_RTOL = 1e-5
#: counts up to this are summed exactly in :func:`_interior`, larger ones by a Taylor series in the smoothing
_SMALL = 16
_TAYLOR = 6
#: bytes of calibrated outputs the range pass keeps for the histogram pass (the samples past it run twice). ORT's
#: calibrator holds every sample's: 3.4 GB of float32 on the PP-OCRv4 recognizer's 16 lines
HELD_BYTES = 1 << 30
#: run the next sample while the histograms of this one are made (:func:`_outputs`)
PREFETCH = True


def _xlogx(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)


def _interior(hist: np.ndarray, lo: np.ndarray, hi: np.ndarray, eps1: np.ndarray) -> np.ndarray:
    """``sum(f(h - eps1[k]) for h in hist[lo[k]:hi[k]] if h)`` per window ``k``, ``f(x) = x log x``, in float64:
    counts up to :data:`_SMALL` by their number in the window, larger ones by ``f(x - e) = f(x) - e (log x + 1) +
    sum_n e^n / (n (n - 1) x^(n-1))`` over prefix sums (``e / x < 1 / 16``: the terms after ``n = 6`` are below
    1e-10 of a count)."""
    h = hist.astype(np.float64)
    big = hist > _SMALL
    xb = np.where(big, h, 1.0)
    cols = [np.where(big, xb * np.log(xb), 0.0), np.where(big, np.log(xb) + 1.0, 0.0)]
    cols += [np.where(big, xb ** (1 - n), 0.0) for n in range(2, _TAYLOR + 1)]
    small = np.arange(1, _SMALL + 1)
    cols += list((hist[None, :] == small[:, None]).astype(np.float64))
    pre = np.zeros((len(cols), hist.size + 1))
    np.cumsum(np.stack(cols), axis=1, out=pre[:, 1:])
    win = pre[:, hi] - pre[:, lo]  # (columns, windows)
    out = win[0] - eps1 * win[1]
    for n in range(2, _TAYLOR + 1):
        out += eps1 ** n / (n * (n - 1)) * win[n]
    fv = _xlogx(small[:, None] - eps1[None, :])  # (values, windows)
    return out + (win[_TAYLOR + 1:] * fv).sum(axis=0)


def divergences(hist: np.ndarray, num_quantized_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """ORT's KL divergence of every window of ``get_entropy_threshold`` (``i`` from ``num_quantized_bins // 2`` to
    ``hist.size // 2``), in float64 from prefix sums, and a bound on its float32 error: (divergences, tolerances).
    ``inf`` where ORT's ``smooth_distribution`` gives None (an empty histogram, or every merged bin zero).

    The window's distribution ``p`` (outliers added to its end bins) and the merged one ``q`` (each quantized bin's
    sliced count spread over the bins of ``p`` that are nonzero, truncated to integers; the bins past the last full
    quantized bin zero) are smoothed as ORT smooths them (zeros become 1e-4, the rest lose ``1e-4 zeros / nonzeros``),
    which leaves their sums as they were. ``q`` is constant on each quantized bin, so ``sum p log q`` needs the
    chunk sums of ``p`` only, and ``sum p log p`` is :func:`_interior` plus the end bins."""
    hist = np.asarray(hist).astype(np.int64)
    n, nq = hist.size, int(num_quantized_bins)
    z, half = n // 2, nq // 2
    i = np.arange(half, z + 1)
    s, e = z - i, np.minimum(z + i + 1, n)
    size = e - s
    m = size // nq
    rem = size - nq * m
    cum = np.concatenate([[0], np.cumsum(hist)])
    nzc = np.concatenate([[0], np.cumsum(hist != 0)])
    total = int(cum[-1])
    left, right = cum[s], total - cum[e]
    p0, p1 = hist[s] + left, hist[e - 1] + right
    zeros_p = (size - 2 - (nzc[e - 1] - nzc[s + 1])) + (p0 == 0) + (p1 == 0)
    nonzero_p = size - zeros_p
    eps_p = 1e-4 * zeros_p / np.maximum(nonzero_p, 1)
    f = lambda x: _xlogx(np.asarray(x, np.float64) - eps_p)  # noqa: E731
    plogp = _interior(hist, s + 1, e - 1, eps_p) + f(p0) * (p0 > 0) + f(p1) * (p1 > 0) + zeros_p * _EPS * np.log(_EPS)
    # the merged distribution: quantized bin c of window k spans hist[s + c m : s + (c + 1) m]
    b = s[:, None] + np.arange(nq + 1)[None, :] * m[:, None]
    sliced = np.diff(cum[b], axis=1)
    nonzero = np.diff(nzc[b], axis=1)
    nonzero[:, 0] += (hist[s] == 0) & (left > 0)  # p's first bin holds the left outliers
    last_in = rem == 0  # p's last bin is in the last quantized bin, else past it
    nonzero[:, -1] += last_in & (hist[e - 1] == 0) & (right > 0)
    merged = sliced.copy()
    merged[:, -1] += cum[e] - cum[s + nq * m]  # the bins past the last full quantized bin
    q = np.where(nonzero > 0, merged // np.maximum(nonzero, 1), 0)
    zeros_q = m * (q == 0).sum(axis=1) + rem
    nonzero_q = size - zeros_q
    eps_q = 1e-4 * zeros_q / np.maximum(nonzero_q, 1)
    qs = np.where(q > 0, q - eps_q[:, None], _EPS)
    chunk_p = sliced.astype(np.float64)
    chunk_p[:, 0] += left
    chunk_p[:, -1] += np.where(last_in, right, 0)
    chunk_p += -nonzero * eps_p[:, None] + (m[:, None] - nonzero) * _EPS
    rest_nonzero = nzc[e] - nzc[s + nq * m] + (~last_in & (hist[e - 1] == 0) & (right > 0))
    rest_p = (cum[e] - cum[s + nq * m]) + np.where(last_in, 0, right) - rest_nonzero * eps_p + \
        (rem - rest_nonzero) * _EPS
    plogq = (chunk_p * np.log(qs)).sum(axis=1) + rest_p * np.log(_EPS)
    sum_q = m * q.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = (plogp - plogq) / total + np.log(sum_q) - np.log(total)
        h = np.log(total) - plogp / total
    kl = np.where((nonzero_p > 0) & (nonzero_q > 0) & (total > 0), kl, np.inf)
    return kl, _RTOL * (1.0 + 2.0 * np.abs(h) + np.abs(kl))


def orts_divergence(hist: np.ndarray, i: int, num_quantized_bins: int, dtype: Any = np.float32) -> float:
    """ORT's divergence of window ``i`` of ``get_entropy_threshold``, with ORT's arithmetic to the bit: its integer
    merge (the quotient truncated into an int64 array), then its own ``smooth_distribution`` and ``entropy`` in
    float32, rounded to ``dtype`` (the histogram edges' type) as ORT stores it."""
    from onnxruntime.quantization.calibrate import entropy
    from onnxruntime.quantization.quant_utils import smooth_distribution

    n, nq = hist.size, num_quantized_bins
    s, e = n // 2 - i, min(n // 2 + i + 1, n)
    sliced = hist[s:e]
    p = sliced.copy()
    p[0] += hist[:s].sum()
    p[-1] += hist[e:].sum()
    m = sliced.size // nq
    merged = sliced[:nq * m].reshape(nq, m).sum(axis=1)
    merged[-1] += sliced[nq * m:].sum()
    norm = (p[:nq * m] != 0).reshape(nq, m).sum(axis=1)
    spread = np.zeros(nq)
    np.divide(merged, norm, out=spread, where=norm != 0)
    q = np.zeros(p.size, dtype=np.int64)
    q[:nq * m] = np.repeat(spread, m)  # truncated, as ORT's assignment into its int64 array
    ps, qs = smooth_distribution(p), smooth_distribution(q)
    if ps is None or qs is None:
        return float("inf")
    return float(np.array(entropy(ps, qs), dtype=dtype))


def entropy_threshold(hist: np.ndarray, edges: np.ndarray, min_value: Any, max_value: Any,
                      num_quantized_bins: int) -> tuple[Any, Any]:
    """ORT's ``HistogramCollector.get_entropy_threshold`` of one tensor's histogram (``hist``, ``edges``, its min and
    max): the window of least divergence, clipped to ``[min_value, max_value]``, as ORT's float types. The windows
    :func:`divergences` puts within the float32 error of the smallest are computed again by
    :func:`orts_divergence`; the first of ORT's smallest wins, as ``np.argmin`` picks it."""
    hist = np.asarray(hist).astype(np.int64)
    n, nq = hist.size, int(num_quantized_bins)
    if not 2 <= nq <= n or n > 10_000:  # ORT's smoothing asserts 1e-4 zeros / nonzeros < 1 past 10000 bins
        raise ValueError(f"entropy calibration needs 2 <= quantized bins <= bins <= 10000, got {nq} / {n}")
    kl, tol = divergences(hist, nq)
    tol = tol + np.finfo(edges.dtype).eps * np.abs(np.nan_to_num(kl, posinf=0.0))  # ORT stores it as the edges' type
    half = nq // 2
    if np.isfinite(kl).any():
        best = int(np.argmin(kl))
        near = np.flatnonzero(kl <= kl[best] + tol + tol[best])
        exact = [orts_divergence(hist, half + int(k), nq, edges.dtype) for k in near]
        k = int(near[int(np.argmin(exact))])
    else:
        k = 0  # every divergence inf: ORT's argmin takes the first
    z = n // 2
    lo, hi = edges[z - half - k], edges[min(z + half + k + 1, n)]
    if lo < min_value:
        lo = min_value
    if hi > max_value:
        hi = max_value
    return lo, hi


# ---------------------------------------------------------------------------------------- collection
def _outputs(session: Any, reader: Any, names: list[str], skip: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """One sample's calibrated tensors at a time, from sample ``skip`` on (the reader rewound first: ivq's feeds
    reader, ``ivq_debug.qnn.quantize._reader``). With :data:`PREFETCH` the session runs the next sample in a thread
    (ORT releases the GIL) while the caller reads this one: two samples' outputs held."""
    reader.rewind()
    feeds = [f for i, f in enumerate(iter(reader.get_next, None)) if i >= skip and f]
    wanted = set(names)
    out_names = [o.name for o in session.get_outputs()]

    def pick(outs: list[np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v for k, v in zip(out_names, outs, strict=True) if k in wanted}

    if not PREFETCH:
        for feed in feeds:
            yield pick(session.run(None, feed))
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="ivq-entropy") as pool:
        ahead = pool.submit(session.run, None, feeds[0]) if feeds else None
        for j in range(len(feeds)):
            assert ahead is not None
            outs = ahead.result()
            ahead = pool.submit(session.run, None, feeds[j + 1]) if j + 1 < len(feeds) else None
            yield pick(outs)


def _ranges(session: Any, reader: Any, names: list[str], held: list[dict[str, np.ndarray]],
            budget: int) -> dict[str, tuple[Any, Any]]:
    """Each tensor's min and max over every sample, NaN ignored (ORT's ``nanmin`` / ``nanmax`` of all samples at
    once; None for an empty or all-NaN tensor). The first samples' outputs are appended to ``held`` while they fit
    in ``budget`` bytes."""
    lo: dict[str, Any] = {}
    hi: dict[str, Any] = {}
    for outs in _outputs(session, reader, names):
        for k, a in outs.items():
            if a.size == 0:
                continue
            mn, mx = a.min(), a.max()
            if np.isnan(mn) or np.isnan(mx):
                if np.isnan(a).all():
                    continue
                mn, mx = np.nanmin(a), np.nanmax(a)
            lo[k] = mn if k not in lo else min(lo[k], mn)
            hi[k] = mx if k not in hi else max(hi[k], mx)
        size = sum(a.nbytes for a in outs.values())
        if size <= budget:
            held.append(outs)
            budget -= size
        else:
            budget = -1  # held samples are the first ones: the histogram pass runs the rest
    return {k: (lo.get(k), hi.get(k)) for k in names}


def permuted(model: Any, names: list[str]) -> dict[str, str]:
    """``{tensor: source}`` for each of ``names`` that a chain of ``defaults.PERMUTING_OPS`` makes of another of
    ``names``: its histogram is the source's (ORT computes it again)."""
    want = set(names)
    src = {n.output[0]: n.input[0] for n in model.graph.node
           if n.op_type in defaults.PERMUTING_OPS and n.input and n.output and n.input[0]}
    out: dict[str, str] = {}
    for t in names:
        root, seen = t, {t}
        while root in src and src[root] not in seen:
            root = src[root]
            seen.add(root)
            if root in want:
                out[t] = root
    return out


def collect_histograms(session: Any, reader: Any, names: list[str], num_bins: int,
                       same: dict[str, str] | None = None) -> dict[str, tuple]:
    """ORT's ``HistogramCollector.collect_value`` of ``names`` over every sample of ``reader`` (one ``collect_data``:
    one histogram per tensor over all samples): ``{name: (hist, edges, min, max, threshold)}``. Two passes: the
    range, then each sample's histogram on its fixed edges (:func:`histogram`), summed; the range pass keeps the
    outputs of the first samples up to :data:`HELD_BYTES`, which the histogram pass does not run again. ``same``
    (:func:`permuted`): tensors given their source's histogram, not made again."""
    same = same or {}
    names = [n for n in names if n not in same]
    held: list[dict[str, np.ndarray]] = []
    ranges = _ranges(session, reader, names, held, HELD_BYTES)
    out: dict[str, Any] = {}
    for outs in itertools.chain(held, _outputs(session, reader, names, skip=len(held))):
        for k, a in outs.items():
            if k not in out:
                mn, mx = ranges[k]
                if mn is None:  # empty, or NaN only: ORT's min and max are its zeros (NaN: nanmin's NaN)
                    mn = mx = np.array(0 if a.size == 0 else np.nan, dtype=a.dtype)
                t = np.array(max(abs(mn), abs(mx)), dtype=a.dtype)
                edges = np.histogram(a[:0], num_bins, range=(-t, t))[1]  # ORT's call: its edges
                out[k] = [np.zeros(num_bins, np.int64), edges, mn, mx, t]
            out[k][0] += histogram(a, out[k][4], out[k][1])
        del outs
    held.clear()
    out |= {k: out[v] for k, v in same.items() if v in out}
    return {k: tuple(v) for k, v in out.items()}


#: values per block of :func:`histogram` (numpy's ``np.histogram`` block: in cache)
_BLOCK = 1 << 16
#: :func:`histogram` computes numpy's corrections for the values whose bin position is within this fraction of a bin
#: from an edge; float32 places a value within 4e-4 of a bin (three roundings of a position below 2048 bins)
_NEAR_EDGE = 0.01


def histogram(a: np.ndarray, t: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``np.histogram(a, edges.size - 1, range=(-t, t))[0]`` (ORT's call; ``edges`` its edges), count for count, in
    a third less time on float32 data within ``[-t, t]``: numpy's bin of a value is the truncated position
    ``(a + t) / 2t * bins`` unless its ~1-ulp corrections against ``edges`` apply, which they can only within
    :data:`_NEAR_EDGE` of an edge; those values (and zeros, NaN) get numpy's own computation."""
    bins = edges.size - 1
    w = (float(edges[-1]) - float(edges[0])) / bins
    off = np.abs(edges.astype(np.float64) - (float(edges[0]) + w * np.arange(bins + 1))).max() / w if w > 0 else 1.0
    if a.dtype != np.float32 or t.dtype != np.float32 or not t > 0 or off > 1e-3:
        return np.histogram(a, bins, range=(-t, t))[0]
    first, denom = -t, np.subtract(t, -t, dtype=np.float32)  # numpy's float32 arithmetic
    zero = int(_exact_bins(np.zeros(1, np.float32), first, t, denom, edges)[0])
    h = np.zeros(bins + 1, np.int64)  # the last: NaN, dropped
    flat = a.ravel()
    for s in range(0, flat.size, _BLOCK):
        x = flat[s:s + _BLOCK]
        f = np.subtract(x, first, dtype=np.float32)
        f /= denom
        f *= bins
        with np.errstate(invalid="ignore"):
            i = f.astype(np.intp)  # NaN: replaced below
        r = f - i.astype(np.float32)
        r -= 0.5
        np.abs(r, out=r)
        near = ~(r <= 0.5 - _NEAR_EDGE)  # NaN too
        zeros = x == 0
        np.putmask(i, zeros, zero)
        near &= ~zeros
        if near.any():
            k = np.flatnonzero(near)
            i[k] = _exact_bins(x[k], first, t, denom, edges)
        h += np.bincount(i, minlength=bins + 1)
    return h[:bins]


def _exact_bins(x: np.ndarray, first: Any, last: Any, denom: Any, edges: np.ndarray) -> np.ndarray:
    """numpy's bin of each value (``np.histogram``'s uniform-bin algorithm: truncated position, then its corrections
    against the edges); ``bins`` (dropped) for a value outside ``[first, last]`` or NaN."""
    bins = edges.size - 1
    out = np.full(x.size, bins, np.intp)
    keep = (x >= first) & (x <= last)
    xs = x[keep]
    i = (np.subtract(xs, first, dtype=np.float32) / denom * bins).astype(np.intp)
    i[i == bins] -= 1
    i[xs < edges[i]] -= 1
    i[(xs >= edges[i + 1]) & (i != bins - 1)] += 1
    out[keep] = i
    return out


#: ``quantize_static``'s ``extra_options`` -> calibrator options (onnxruntime 1.32, ``quantization/quantize.py``)
_CALIB_OPTIONS = (("CalibTensorRangeSymmetric", "symmetric"), ("CalibMovingAverage", "moving_average"),
                  ("CalibMovingAverageConstant", "averaging_constant"),
                  ("CalibMaxIntermediateOutputs", "max_intermediate_outputs"), ("CalibPercentile", "percentile"))


def entropy_ranges(source: str | os.PathLike, cfg: Any, bins: tuple[int, int] = ENTROPY_BINS) -> Any:
    """The tensor ranges (ORT ``TensorsData``, method Entropy, ``lowest`` / ``highest`` per tensor) of ORT's entropy
    calibration of ``source`` with ``bins`` (histogram bins, quantized bins; :data:`ENTROPY_BINS`), on what
    ``quantize_static`` calibrates for the static config ``cfg``: the model loaded with shape inference and raised by
    ``update_opset_version`` (then saved aside), the op types (all ORT quantizes when none), the providers, the
    ``Calib*`` options and the samples of ``cfg.calibration_data_reader``. ORT's calibrator makes the augmented
    model and its session; the histograms are :func:`collect_histograms`, the thresholds :func:`entropy_threshold`.

    Raises:
        UsageError: ``SmoothQuant`` or ``CalibStridedMinMax`` in the config (not computed here).
    """
    import onnx
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, create_calibrator
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer, update_opset_version
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    ex = dict(cfg.extra_options or {})
    for opt in ("SmoothQuant", "CalibStridedMinMax"):
        if ex.get(opt):
            raise UsageError(f"entropy calibration is computed here, without {opt}")
    op_types = list(cfg.op_types_to_quantize or []) or list(set(QLinearOpsRegistry) | set(QDQRegistry))
    options = {key: ex[name] for name, key in _CALIB_OPTIONS if name in ex}
    options |= {"num_bins": bins[0], "num_quantized_bins": bins[1]}
    with tempfile.TemporaryDirectory(prefix="ivq.entropy.") as tmp:
        model_input = Path(source)
        model = load_model_with_shape_infer(model_input)
        updated = update_opset_version(model, cfg.weight_type, cfg.activation_type,
                                       tensor_quant_overrides=ex.get("TensorQuantOverrides"),
                                       block_size=ex.get("BlockSize", 0))
        if updated is not model:  # as quantize_static: the converted model is calibrated
            model_input = Path(tmp) / "model_input.onnx"
            onnx.save_model(updated, str(model_input), save_as_external_data=True)
        calibrator = create_calibrator(model_input, op_types, augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                                       calibrate_method=CalibrationMethod.Entropy,
                                       use_external_data_format=cfg.use_external_data_format,
                                       providers=cfg.calibration_providers, extra_options=options)
        names = sorted(calibrator.tensors_to_calibrate)
        same = permuted(calibrator.model, names)
        hists = collect_histograms(calibrator.infer_session, cfg.calibration_data_reader, names, bins[0], same)
        del calibrator  # its session holds the augmented model's file
    if not hists:
        raise ValueError("No data is collected.")
    data = {}
    for k in sorted(hists, key=lambda k: k in same):  # a source before the tensors that take its range
        hist, edges, mn, mx, _ = hists[k]
        lo, hi = data[same[k]].range_value if k in same else entropy_threshold(hist, edges, mn, mx, bins[1])
        data[k] = TensorData(lowest=np.asarray(lo), highest=np.asarray(hi))
    return TensorsData(CalibrationMethod.Entropy, data)
