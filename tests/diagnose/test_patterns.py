"""Pattern grouping of replay units (tables written here; the fix by cause: tests/diagnose/test_remedy.py)."""

from __future__ import annotations

import pandas as pd

from ivq_debug.diagnose.patterns import groups, role


def _table(rows: list[dict]) -> pd.DataFrame:
    base = {"intro_status": "ok", "weights": "", "weight_noise": 0.0, "act_noise": 1.0, "input_ops": ""}
    return pd.DataFrame([base | r for r in rows])


def test_role_replaces_block_indices_only() -> None:
    assert role("/vit/encoder/layer.11/attention/Pow") == ("/vit/encoder/layer.*/attention/Pow", ("11",))
    assert role("/blocks.3/ln1/ReduceMean_1") == ("/blocks.*/ln1/ReduceMean_1", ("3",))  # _1 is not a block
    assert role("gemm_input_reshape_token_12") == ("gemm_input_reshape_token_12", ())


def test_layernorm_statistics_group_across_blocks_and_norms() -> None:
    rows = []
    for b in range(3):
        for ln in ("layernorm_before", "layernorm_after"):
            rows += [{"node": f"/m/layers.{b}/{ln}/Pow", "op_type": "Pow", "tensor": f"p{b}{ln}",
                      "intro_sqnr_db": 10.0 + b, "input_ops": "Sub"},
                     {"node": f"/m/layers.{b}/{ln}/ReduceMean_1", "op_type": "ReduceMean", "tensor": f"v{b}{ln}",
                      "intro_sqnr_db": 30.0, "input_ops": "Pow"},
                     {"node": f"/m/layers.{b}/{ln}/ReduceMean", "op_type": "ReduceMean", "tensor": f"m{b}{ln}",
                      "intro_sqnr_db": 40.0, "input_ops": "Add"}]
    gs = groups(_table(rows))
    assert [g.label for g in gs] == ["LayerNorm x² (Pow)", "LayerNorm variance (ReduceMean)",
                                     "LayerNorm mean (ReduceMean)"]
    assert len(gs[0].rows) == 6 and gs[0].total_blocks == 3 and gs[0].worst()["tensor"] == "p0layernorm_before"
