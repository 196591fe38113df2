"""A comma-separated option that names nothing (``--op-types ,``) is a usage error (exit 2, one line), not the
default (it used to capture every op type)."""

from __future__ import annotations

import numpy as np
import pytest

from ivq_debug.cli.common import run
from ivq_debug.cli.diff import _main as ivq_diff
from ivq_debug.cli.main import _main as ivq_main
from tests.support import tiny


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comma")
    _, x, model = tiny.build(tmp)
    np.savez(tmp / "x.npz", x=x)
    ref = tiny.capture_ort(model, x, tmp / "ref.h5")
    return tmp, model, ref


@pytest.mark.parametrize("value", [",", " , ", ""])
def test_empty_lists_are_refused(made, value, capsys) -> None:
    tmp, model, ref = made
    out = tmp / "o.h5"
    assert run("ivq", ivq_main, ["capture", "onnx", str(model), "--inputs", str(tmp / "x.npz"), "-o", str(out),
                                 "--op-types", value]) == 2
    assert not out.exists()
    assert run("ivq-diff", ivq_diff, [str(ref), str(ref), "--records", value, "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("names nothing" in ln for ln in err), err


def test_a_real_list_still_selects(made) -> None:
    tmp, model, ref = made
    out = tmp / "mm.h5"
    assert run("ivq", ivq_main, ["capture", "onnx", str(model), "--inputs", str(tmp / "x.npz"), "-o", str(out),
                                 "--op-types", " MatMul ,"]) == 0
    from ivq_debug.dump import open_dump

    def ops(path):
        with open_dump(path) as d:
            return [e.op_type for e in d.tensors(next(iter(d.record_keys().values())))]

    some, every = ops(out), ops(ref)
    assert "MatMul" in some and some.count("MatMul") == every.count("MatMul") and len(some) < len(every)
