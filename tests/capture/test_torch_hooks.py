"""The torch capture keeps one copy of each tensor object per record: a container's or a ModelOutput field's alias of
a child's output is skipped, a field computed by the parent itself is kept."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from transformers.modeling_outputs import BaseModelOutputWithPooling  # noqa: E402

from ivq_debug.capture.torch.hooks import TorchCapture  # noqa: E402
from ivq_debug.dump import DumpWriter, open_dump  # noqa: E402


class Tower(torch.nn.Module):
    """Blocks, then a head on their output; returns the blocks' output object as ``last_hidden_state`` (as
    Qwen3-VL's vision tower does) and the head's as ``pooler_output``, plus a value of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.norm = torch.nn.LayerNorm(4)  # same shape as the blocks' output: what the aligner confused
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> BaseModelOutputWithPooling:
        for b in self.blocks:
            x = b(x)
        pooled = self.head(self.norm(x))
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=pooled, attentions=(x * 2,))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = Tower()
        self.out = torch.nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.tower(x)
        return self.out(o.pooler_output + o.last_hidden_state.mean())  # a fresh tensor per call


def _names(tmp_path, dedupe: bool) -> tuple[list[str], int]:
    torch.manual_seed(0)
    m = Model().eval()
    p = tmp_path / f"d{int(dedupe)}.h5"
    with DumpWriter(p, backend="torch") as w, TorchCapture(m, w, dedupe=dedupe) as cap, torch.no_grad():
        for s in range(2):
            w.begin_record(sample=s, part="model", step=0)
            m(torch.randn(3, 4))
        aliases = cap.aliases
    with open_dump(p) as d:
        names = [e.name for e in d.tensors(d.record_keys()[(1, "model", 0)])]
    return names, aliases


def test_aliases_of_child_outputs_are_skipped_fresh_fields_kept(tmp_path):
    names, aliases = _names(tmp_path, dedupe=True)
    assert "tower.blocks.1" in names and "tower.head" in names and "tower.norm" in names
    assert "tower.last_hidden_state" not in names and "tower.pooler_output" not in names  # aliases
    assert not [n for n in names if "attentions" in n]  # AUX_KEYS
    assert aliases == 4  # two fields, two records: the per-record memory is reset
    # without dedupe every field is captured, with the child's values
    all_names, none = _names(tmp_path, dedupe=False)
    assert none == 0 and {"tower.last_hidden_state", "tower.pooler_output"} <= set(all_names)
    with open_dump(tmp_path / "d0.h5") as d:
        rid = d.record_keys()[(1, "model", 0)]
        by = {e.name: e for e in d.tensors(rid)}
        np.testing.assert_array_equal(d.read(by["tower.last_hidden_state"]), d.read(by["tower.blocks.1"]))
