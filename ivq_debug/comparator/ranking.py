"""Which metric ranks the layers of a comparison when none is asked for (``docs/metrics.md``, Ranking).

- **quantized vs quantized** (both dumps carry encodings: CPU-QDQ vs HTP, HTP vs a device): ``lsb_rmse``, the
  error in quantization steps of the test encoding. Both sides sit on the same grid, so one step of disagreement
  is the unit a backend can be judged in; it does not grow with a layer's activation scale, and a tensor whose
  step is coarse next to its spread is not ranked first for a one-step flip, as SQNR would rank it.
- **float vs quantized** or float vs float: ``sqnr_db``, a scale-invariant metric (``−20·log10(rel_l2)``): raw
  errors grow with depth because activations do (an AIMET report: raw MSE ×750 over 19 layers where the
  scale-normalized error grew ×37), and a float reference has no grid to count steps on.
"""

from __future__ import annotations

from typing import Any

from ivq_debug import defaults


def quantized(dump: Any) -> bool:
    """True when any tensor of the dump carries a quantization encoding."""
    return any(e.encoding for e in dump.tensors())


def default_rank_metric(ref: Any, test: Any) -> str:
    """``lsb_rmse`` for quantized-vs-quantized dumps, else ``defaults.RANK_METRIC`` (``sqnr_db``)."""
    return defaults.RANK_METRIC_QUANTIZED if quantized(ref) and quantized(test) else defaults.RANK_METRIC
