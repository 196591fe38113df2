"""Device-session folders are laid out as qnn-net-run writes them and carry exactly what the device ran."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.dump import open_dump
from ivq_debug.qnn.names import qnn_sanitize
from tests.support.device_sessions import graph_io, session_calls

QNN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _input_list(folder: Path) -> tuple[str, list[dict[str, str]]]:
    lines = (folder / "input_list.txt").read_text().splitlines()
    return lines[0], [dict(tok.split(":=", 1) for tok in line.split(" ")) for line in lines[1:]]


@pytest.mark.parametrize("name", ["internvl-tiny-dynamic-restart", "qwen2vl-tiny-fixed-naive_text"])
def test_folders_are_qnn_net_run_layout(name, device_sessions):
    s = device_sessions[name]
    steps = len(s.tokens) - 1
    assert steps >= 3
    for part, n_runs in (("vision", 1), ("prefill", 1), ("decode", steps)):
        folder = s.folders[part]
        ins, outs = graph_io(s.parts[part])
        header, rows = _input_list(folder)
        assert header == "#" + " ".join(qnn_sanitize(o) for o in outs)  # a comment line qnn-net-run skips
        assert len(rows) == n_runs
        results = sorted(p.name for p in (folder / "output").iterdir())
        assert results == sorted(f"Result_{i}" for i in range(n_runs))
        calls = session_calls(s.dump, part, s.parts)
        for i, (row, (_, feeds, fetched)) in enumerate(zip(rows, calls, strict=True)):
            assert list(row) == [qnn_sanitize(n) for n in ins if n in feeds]
            for qname, rel in row.items():
                assert QNN_NAME.match(qname) and not Path(rel).is_absolute()
                raw = np.fromfile(folder / rel, dtype="<f4")  # float32, as qnn-net-run reads them by default
                value = feeds[next(n for n in feeds if qnn_sanitize(n) == qname)]
                assert raw.size == value.size and np.array_equal(raw, value.reshape(-1).astype(np.float32))
            for o in outs:
                raw = np.fromfile(folder / "output" / f"Result_{i}" / f"{qnn_sanitize(o)}.raw", dtype="<f4")
                assert np.array_equal(raw, fetched[o].reshape(-1))


def test_dynamic_decode_folder_grows_one_slot_per_step_and_has_no_positions(device_sessions):
    s = device_sessions["internvl-tiny-dynamic-restart"]
    assert not s.decode_has_positions
    _, rows = _input_list(s.folders["decode"])
    S, kv_slot = s.prefill_len, 2 * 16 * 4  # H_kv * d * float32 bytes
    for i, row in enumerate(rows):
        assert "position_ids" not in row
        assert (s.folders["decode"] / row["past_key_values_0_key"]).stat().st_size == (S + i) * kv_slot
        assert (s.folders["decode"] / row["attention_mask"]).stat().st_size == (S + i + 1) * 4
        out = s.folders["decode"] / "output" / f"Result_{i}" / "present_0_key.raw"
        assert out.stat().st_size == (S + i + 1) * kv_slot  # the whole cache, past + the new slot
    assert "position_ids" in _input_list(s.folders["prefill"])[1][0]


def test_fixed_decode_folder_keeps_the_buffer_and_returns_the_new_slot(device_sessions):
    s = device_sessions["internvl-tiny-fixed-restart"]
    _, rows = _input_list(s.folders["decode"])
    for i, row in enumerate(rows):
        pos = np.fromfile(s.folders["decode"] / row["position_ids"], dtype="<f4")
        assert pos.tolist() == [float(i)]  # restarted at 0 (step i + 1 at position i)
        assert (s.folders["decode"] / row["past_0_key"]).stat().st_size == 32 * 2 * 16 * 4  # MAX_CACHE slots
        assert (s.folders["decode"] / "output" / f"Result_{i}" / "present_0_key.raw").stat().st_size == 2 * 16 * 4


def test_fault_offsets_match_the_fixture(device_sessions):
    """Each faulty run's decode positions differ from the correct run's by the fixture's expected offset."""
    for name, s in device_sessions.items():
        if s.fault == "correct" or not s.decode_has_positions:
            continue
        correct = device_sessions.get(name.replace(s.fault, "correct")) or device_sessions[
            f"{s.model}-dynamic-correct"]
        with open_dump(s.dump) as d, open_dump(correct.dump) as c:
            for (sample, part, step), rid in d.record_keys().items():
                if part == "decode" and step <= 2:
                    got = d.record_meta(rid)["position_ids"][0]
                    want = c.record_meta(c.record_keys()[(sample, part, step)])["position_ids"][0]
                    assert got - want == s.expected_offset, (name, step)


def test_native_inputs_keep_the_graph_dtypes(device_sessions, tmp_path):
    from tests.support.device_sessions import make_session, session_image

    s = device_sessions["qwen2vl-tiny-dynamic-correct"]
    n = make_session("native", s.model, s.cache, s.fault, s.parts["decode"].parent, tmp_path / "native",
                     session_image(), s.config, native_inputs=True)
    _, rows = _input_list(n.folders["decode"])
    pos = np.fromfile(n.folders["decode"] / rows[0]["position_ids"], dtype="<i8")
    assert pos.tolist() == [8, 8, 8]  # M-RoPE: max(prefill positions) + 1 on all three rows, int64
    mask = np.fromfile(n.folders["decode"] / rows[1]["attention_mask"], dtype="<i8")
    assert mask.tolist() == [1] * (s.prefill_len + 2)
    emb = np.fromfile(n.folders["decode"] / rows[0]["inputs_embeds"], dtype="<f4")
    assert emb.size == 64  # float inputs stay float32
