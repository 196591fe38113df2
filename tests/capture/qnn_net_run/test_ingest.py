"""qnn-net-run output folder → golden dump (backend qnn-net-run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ivq_debug.capture.qnn_net_run.ingest import capture_net_run
from ivq_debug.dump import open_dump
from ivq_debug.dump.quant import dequantize
from ivq_debug.errors import InputError, UsageError
from tests.support.qnn_fixtures import MODEL, MULTI, PROF, SINGLE


def test_capture_single_with_profiling(tmp_path: Path, ref, sites) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "qnn.h5"
    cap = capture_net_run(SINGLE / "output", out, SINGLE / "model_net.json", model=MODEL,
                          profiling=PROF / "qnn_ep_detailed.csv")
    assert cap.complete and cap.records == [(0, "model", 0), (1, "model", 0)] and cap.n_tensors == 34
    with open_dump(out) as d:
        assert d.backend == "qnn-net-run" and d.complete
        assert d.backend_info["source"] == "qnn-net-run output folder"
        for i in (0, 1):
            es = d.tensors((i, "model", 0))
            assert len(es) == 17 and [e.order for e in es] == sorted(e.order for e in es)
            for e in es:
                s = next(s for s in sites.values() if s.name == e.name)
                q = ref[("single", i, s.output)]
                assert np.array_equal(d.read_raw(e), q)
                assert np.array_equal(d.read(e).view(np.uint32), dequantize(q, s.encoding).view(np.uint32))
                assert e.encoding["scale"] == float(np.float32(s.encoding["scale"]))
                assert e.encoding["zero_point"] == s.encoding["zero_point"] and e.encoding["dtype"] == "uint16"
                assert e.op_type == s.op_type
        conv = d.entry("/conv1/Conv_output_0", (0, "model", 0))
        assert conv.layout == "NCHW" and conv.shape == (1, 8, 4, 4) and conv.op_type == "Conv"
        prof = d.table("profiling")
        ops = prof[prof.is_op == True]  # noqa: E712
        assert len(ops) == 66 and "dump_tensors" in prof.columns
        assert any("/attn/Softmax_output_0" in t for t in ops.dump_tensors)
        notes = d.meta("qnn_net_run_problems")
        assert [n["kind"] for n in notes] == ["duplicate", "duplicate"]


def test_capture_decode_steps_and_parts(tmp_path: Path) -> None:
    cap = capture_net_run(SINGLE / "output", tmp_path / "s.h5", SINGLE / "model_net.json", model=MODEL,
                          as_steps=True, first_step=1)
    assert cap.records == [(0, "model", 1), (0, "model", 2)]
    cap = capture_net_run(MULTI / "output", tmp_path / "m.h5", [MULTI / "vision_net.json", MULTI / "text_net.json"],
                          model=MODEL, parts={"vision": "vision", "text": "prefill"})
    assert cap.records == [(0, "vision", 0), (1, "vision", 0), (0, "prefill", 0), (1, "prefill", 0)]
    with open_dump(tmp_path / "m.h5") as d:
        assert len(d.tensors((1, "prefill", 0))) == 12 and len(d.tensors((1, "vision", 0))) == 5
        assert d.record_meta((1, "prefill", 0))["qnn_graph"] == "text"
    with pytest.raises(UsageError, match="unknown part"):
        capture_net_run(MULTI / "output", tmp_path / "x.h5", MULTI / "vision_net.json", parts={"vision": "img"})


def test_partial_ingest_is_marked_incomplete(tmp_path: Path, single_copy: Path) -> None:
    missing = single_copy / "output" / "Result_1" / "_mlp_act_Gelu_output_0_QuantizeLinear_Output.raw"
    missing.unlink()
    (single_copy / "output" / "Result_1" / "_mlp_act_Gelu_output_0_QuantizeLinear_Output_native.raw").unlink()
    bad = single_copy / "output" / "Result_0" / "logits.raw"
    bad.write_bytes(bad.read_bytes()[:100])
    out = tmp_path / "partial.h5"
    cap = capture_net_run(single_copy / "output", out, single_copy / "model_net.json", model=MODEL)
    assert not cap.complete
    d = open_dump(out)
    assert d.complete is False
    reasons = d.incomplete_reasons
    assert any(r.startswith(str(missing)) and "missing raw file" in r for r in reasons)
    assert any(r.startswith(str(bad)) and "wrong byte size 100" in r for r in reasons)
    assert len(d.tensors((1, "model", 0))) == 16  # what was readable is kept
    d.close()
    with pytest.raises(InputError) as ei:
        capture_net_run(single_copy / "output", tmp_path / "strict.h5", single_copy / "model_net.json",
                        model=MODEL, strict=True)
    assert "\n" not in str(ei.value) and not (tmp_path / "strict.h5").exists()


def test_capture_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "x.h5"
    capture_net_run(SINGLE / "output", out, SINGLE / "model_net.json")
    with pytest.raises(UsageError, match="output exists"):
        capture_net_run(SINGLE / "output", out, SINGLE / "model_net.json")
    cap = capture_net_run(SINGLE / "output", out, SINGLE / "model_net.json", overwrite=True)
    assert cap.n_tensors == 38  # no model: every file under its QNN name
