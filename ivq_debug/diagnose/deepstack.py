"""``deepstack_missing`` / ``deepstack_misrouted``: the DeepStack residual-stream jumps of the reference, in the test.

DeepStack (Qwen3-VL) adds vision feature ``k`` to the hidden states at the image-token rows right after LLM
layer ``k``. Between two decoder layers the residual stream therefore *jumps*: the stream entering layer
``b`` minus the output of layer ``b − 1``. A runtime that drops the features has no jump; one that adds them
after the wrong layers has the reference's jump at another layer boundary; one that scatters them to the
wrong rows has it at other positions.

**Residual stream from a dump.** In a prefill record, the tensors whose scope lies in ``…layers.{i}`` are
layer ``i``; its output is the last of them (execution order) shaped like ``inputs_embeds`` ``[1, S, D]``.
A tensor of that shape *between* layer ``b − 1``'s last tensor and layer ``b``'s first (outside every
layer) is the stream entering layer ``b`` (the exported DeepStack ``Add``); without one the stream enters
unchanged (jump 0). Boundary 0, before layer 0, compares the ``inputs_embeds`` inputs of the two dumps
(the reference's boundary-0 jump is 0 by definition). A capture without scoped layer tensors (a torch dump,
whose in-place add leaves no tensor) gives nothing.

**Matching.** A reference jump counts at the rows where it is at least ``DEEPSTACK_MIN_JUMP`` of the
stream's norm. For each, the relative difference ``‖J_test(b') − J_ref(b)‖ / ‖J_ref(b)‖`` on those rows is
computed at every test boundary ``b'``: at ``b`` within ``DEEPSTACK_MAX_ERROR`` is correct; at another
boundary only is ``deepstack_misrouted`` (layer); at ``b`` but on other rows is ``deepstack_misrouted``
(positions); nowhere is ``deepstack_missing``. The evidence holds the per image token and boundary table
(the report's heatmap): the reference's jump, the test's and their difference, each relative to the stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ivq_debug import defaults
from ivq_debug.diagnose.findings import Finding
from ivq_debug.diagnose.positions import record_input

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass
class Stream:
    """The residual stream of one prefill record at the layer boundaries."""

    entry: np.ndarray  # [S, D] the inputs_embeds input
    outputs: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> its output [S, D]
    entering: dict[int, tuple[str, np.ndarray]] = field(default_factory=dict)  # boundary b >= 1 -> (tensor, stream)

    @property
    def layers(self) -> int:
        """Number of decoder layers found."""
        return len(self.outputs)

    def jump(self, b: int) -> np.ndarray:
        """``stream entering layer b − stream leaving layer b − 1`` (b >= 1)."""
        if b in self.entering:
            return self.entering[b][1] - self.outputs[b - 1]
        return np.zeros_like(self.outputs[b - 1])


def residual_stream(dump: Any, rid: str) -> Stream | None:
    """The :class:`Stream` of a prefill record; None without ``inputs_embeds`` or scoped decoder layers."""
    emb = record_input(dump, rid, "inputs_embeds")
    if emb is None or len(emb.shape) != 3:
        return None
    shape = tuple(emb.shape)
    entries = dump.tensors(rid)
    span: dict[int, list[int]] = {}
    last: dict[int, Any] = {}
    for e in entries:
        m = _LAYER.search(e.scope or "")
        if m is None:
            continue
        i = int(m.group(1))
        lo_hi = span.setdefault(i, [e.order, e.order])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], e.order), max(lo_hi[1], e.order)
        if tuple(e.shape) == shape and (i not in last or e.order > last[i].order):
            last[i] = e
    if not last or sorted(last) != list(range(len(last))):
        return None

    def rows(e: Any) -> np.ndarray:
        return np.asarray(dump.read(e), dtype=np.float64).reshape(shape[1], shape[2])

    s = Stream(rows(emb), {i: rows(e) for i, e in last.items()})
    for b in range(1, len(last)):
        lo, hi = span[b - 1][1], span[b][0]
        between = [e for e in entries if lo < e.order < hi and tuple(e.shape) == shape
                   and _LAYER.search(e.scope or "") is None]
        if between:
            e = max(between, key=lambda x: x.order)
            s.entering[b] = (e.name, rows(e))
    return s


def _norm(a: np.ndarray, axis: int | None = None) -> Any:
    return np.linalg.norm(a, axis=axis)


def boundary_label(b: int) -> str:
    """``before layer 0`` for boundary 0, ``after layer b − 1`` otherwise."""
    return "before layer 0 (onto the input embeddings)" if b == 0 else f"after layer {b - 1}"


def deepstack_table(ref: Stream, test: Stream, min_jump: float = defaults.DEEPSTACK_MIN_JUMP) -> dict[str, Any]:
    """Jumps per boundary and image row, each relative to the stream's norm there: the reference's, the test's and
    their difference.

    Returns ``{"boundaries": [0..L-1], "rows": image rows, "ref": {b: [per row]}, "test": …, "difference": …,
    "ref_jumps": {b: rows where the reference jumps}}`` (floats rounded to 4 significant digits).
    """
    L = min(ref.layers, test.layers)
    jr = {0: np.zeros_like(ref.entry)} | {b: ref.jump(b) for b in range(1, L)}
    jt = {0: test.entry - ref.entry} | {b: test.jump(b) for b in range(1, L)}
    base = {0: ref.entry} | {b: ref.outputs[b - 1] for b in range(1, L)}
    scale = {b: np.maximum(_norm(base[b], 1), 1e-30) for b in jr}
    ref_rows = {b: np.flatnonzero(_norm(j, 1) >= min_jump * scale[b]) for b, j in jr.items()}
    image = sorted(set().union(*[set(r.tolist()) for r in ref_rows.values()]))
    rnd = lambda v: [float(f"{x:.4g}") for x in v]  # noqa: E731
    return {
        "boundaries": list(jr), "rows": image,
        "ref": {b: rnd((_norm(jr[b], 1) / scale[b])[image]) for b in jr},
        "test": {b: rnd((_norm(jt[b], 1) / scale[b])[image]) for b in jr},
        "difference": {b: rnd((_norm(jt[b] - jr[b], 1) / scale[b])[image]) for b in jr},
        "ref_jumps": {b: r.tolist() for b, r in ref_rows.items() if r.size},
        "_jr": jr, "_jt": jt, "_scale": scale,
    }


def deepstack_findings(ref: Any, test: Any, *, min_jump: float = defaults.DEEPSTACK_MIN_JUMP,
                       max_error: float = defaults.DEEPSTACK_MAX_ERROR) -> list[Finding]:
    """``deepstack_missing`` / ``deepstack_misrouted`` findings of every prefill record pair."""
    rk, tk = ref.record_keys(), test.record_keys()
    out: list[Finding] = []
    for key in sorted(set(rk) & set(tk)):
        if key[1] != "prefill":
            continue
        sr, st = residual_stream(ref, rk[key]), residual_stream(test, tk[key])
        if sr is None or st is None or sr.entry.shape != st.entry.shape:
            continue
        tab = deepstack_table(sr, st, min_jump)
        jr, jt, scale = tab.pop("_jr"), tab.pop("_jt"), tab.pop("_scale")
        record = {"sample": key[0], "part": "prefill", "step": key[2]}
        for feature, (b, rows_list) in enumerate(sorted(tab["ref_jumps"].items())):
            rows = np.asarray(rows_list)
            ref_j = jr[b][rows]
            err = {c: float(_norm(jt[c][rows] - ref_j) / _norm(ref_j)) for c in jt}
            where = {"record": record, "tensor": sr.entering[b][0] if b in sr.entering else f"layer {b} input",
                     "layer": b - 1, "positions": rows.tolist()}
            ev = {"feature": feature, "boundary": b, "after_layer": b - 1, "positions": rows.tolist(),
                  "first_position": int(rows[0]), "error_by_boundary": {c: round(v, 6) for c, v in err.items()},
                  "ref_jump": float(_norm(ref_j) / _norm(scale[b][rows])),
                  "test_jump": float(_norm(jt[b][rows]) / _norm(scale[b][rows])), "table": tab}
            if err[b] <= max_error:
                stray = np.setdiff1d(np.flatnonzero(_norm(jt[b], 1) >= min_jump * scale[b]), rows)
                if stray.size:
                    out.append(_misrouted_rows(where, ev, b, stray))
                continue
            moved = [c for c in err if c != b and err[c] <= max_error]
            if moved:
                c = min(moved, key=lambda x: err[x])
                ev.update(found_at=c, found_after_layer=c - 1)
                out.append(Finding(
                    "deepstack_misrouted", "error",
                    f"DeepStack feature {feature} (the reference's jump {boundary_label(b)}, "
                    f"{ev['ref_jump']:.2f} of the stream at {rows.size} image rows) is added {boundary_label(c)} "
                    f"in the test (difference {err[c]:.1e} there, {err[b]:.2f} where it belongs)",
                    where=where, evidence=ev,
                    suggestion=f"add DeepStack feature {feature} to the hidden states right after LLM layer {b - 1} "
                               f"(vision_config.deepstack_visual_indexes order), not {boundary_label(c)}"))
                continue
            perm = _row_match(jr[b], jt[b], rows, max_error)
            if perm is not None:
                ev.update(found_at_positions=perm)
                out.append(Finding(
                    "deepstack_misrouted", "error",
                    f"DeepStack feature {feature} is added {boundary_label(b)} at other positions than the "
                    f"image tokens (first image row {int(rows[0])} carries row {perm[0]}'s feature)",
                    where=where, evidence=ev,
                    suggestion="scatter each DeepStack feature to the image-token rows in the order of the "
                               "image features (the same rows as the image embeddings)"))
                continue
            if ev["test_jump"] < ev["ref_jump"] * max_error:
                out.append(Finding(
                    "deepstack_missing", "error",
                    f"DeepStack feature {feature} is missing: the reference's residual stream jumps "
                    f"{boundary_label(b)} by {ev['ref_jump']:.2f} of its norm at {rows.size} image rows, the "
                    f"test's by {ev['test_jump']:.2g} and at no other layer",
                    where=where, evidence=ev,
                    suggestion="wire the vision graph's DeepStack outputs to the prefill: feature k is added to "
                               f"the image-token rows after LLM layer k (here {len(tab['ref_jumps'])} features)"))
    return out


def _misrouted_rows(where: dict, ev: dict, b: int, stray: np.ndarray) -> Finding:
    ev.update(stray_positions=stray.tolist())
    return Finding(
        "deepstack_misrouted", "error",
        f"DeepStack feature {ev['feature']} is added {boundary_label(b)} also at {stray.size} rows that are not "
        f"image tokens (first {int(stray[0])})", where=where, evidence=ev,
        suggestion="scatter DeepStack features to the image-token rows only (zeros on text rows)")


def _row_match(jr: np.ndarray, jt: np.ndarray, rows: np.ndarray, max_error: float) -> list[int] | None:
    """For each reference row, the test row carrying its jump (None unless every row finds one, not all in place)."""
    found = []
    for r in rows:
        e = _norm(jt - jr[r], 1) / max(_norm(jr[r]), 1e-30)
        best = int(np.argmin(e))
        if e[best] > max_error:
            return None
        found.append(best)
    return None if found == rows.tolist() else found
