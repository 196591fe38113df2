"""The comparison's table views: the vectorized divergence and the JSON rows equal the row-by-row forms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ivq_debug.comparator import Budgets, compare
from ivq_debug.comparator.comparison import _clean, _layer_json_from_dict
from ivq_debug.dump import DumpWriter
from ivq_debug.jsonio import json_safe

ENC = {"scale": 0.02, "zero_point": 128, "bitwidth": 8}


def _pair(tmp: Path) -> tuple[Path, Path]:
    """Two dumps whose pairs cover every status and both sides of the default divergence budget."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((2, 30, 40)).astype(np.float32)
    tests = {
        "same": base.copy(),  # identical
        "close": base + 1e-4 * rng.standard_normal(base.shape).astype(np.float32),  # ~80 dB: not diverged
        "noisy": base + 0.3 * rng.standard_normal(base.shape).astype(np.float32),  # ~10 dB: diverged
        "nan": np.where(rng.random(base.shape) < 0.01, np.nan, base).astype(np.float32),  # non_finite
        "zero": np.ones(base.shape, np.float32),  # against a zero reference: zero_norm
        "empty": np.zeros((0, 4), np.float32),
        "coarse": np.round(base / 0.02) * np.float32(0.02),  # with an encoding: the fit columns
    }
    refs = {k: (np.zeros(base.shape, np.float32) if k == "zero" else v if k == "empty" else base) for k, v in tests.items()}
    out = []
    for side, data in (("ref", refs), ("test", tests)):
        p = tmp / f"{side}.h5"
        with DumpWriter(p, backend="x", overwrite=True) as w:
            for sample in range(2):
                w.begin_record(sample=sample)
                for order, (name, v) in enumerate(data.items()):
                    enc = ENC if side == "test" and name == "coarse" else None
                    w.add_tensor(name, v, op_type="Add", order=order, encoding=enc)
        out.append(p)
    return out[0], out[1]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _pair(tmp_path_factory.mktemp("cmp"))


def test_default_divergence_equals_the_budget_checked_row_by_row(dumps: tuple[Path, Path]) -> None:
    cmp = compare(*dumps, progress=False)
    t = cmp.table
    assert set(t["status"]) == {"ok", "identical", "non_finite", "zero_norm", "empty"}
    b = cmp.divergence_budgets
    rowwise = t.apply(lambda r: bool(b.check(r["ref_name"], r.to_dict())), axis=1)
    fast = cmp._diverged()
    assert fast.dtype == bool and fast.tolist() == rowwise.tolist()
    assert sorted(set(t.loc[fast, "ref_name"])) == ["noisy"]
    assert cmp.first_divergence["ref_name"] == "noisy" and len(cmp.first_divergences()) == 2
    with_budget = compare(*dumps, progress=False, budgets=Budgets.from_args(min_sqnr=90))
    assert with_budget._diverged().tolist() == (~with_budget.table["passed"]).tolist()


def test_json_layers_equal_the_rows_read_one_by_one(dumps: tuple[Path, Path]) -> None:
    cmp = compare(*dumps, progress=False)
    doc = cmp.to_json()
    one_by_one = [_layer_json_from_dict(_clean(r.to_dict())) for _, r in cmp.worst(len(cmp.table)).iterrows()]
    assert doc["layers"] == json_safe(one_by_one)
    assert len(doc["layers"]) == len(cmp.table) == 14
    assert doc["layers"][0]["status"] == "non_finite" and doc["first_divergence"]["ref_name"] == "noisy"
    coarse = cmp.table[cmp.table["ref_name"] == "coarse"].iloc[0]
    assert 0 < coarse["clipped_fraction"] < 0.05 and coarse["grid_snr_db"] > 20  # range ±2.56: ~1 % clip
