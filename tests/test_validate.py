"""validate: the checks the commands make before any work (feeds vs the model, outputs vs inputs, --map and
--baseline documents), on the committed fixture model and a real comparison."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from ivq_debug.errors import InputError, UsageError
from ivq_debug.onnxgraph.inputs import check_feeds
from ivq_debug.validate import check_outputs, read_baseline, read_name_map
from tests.support.qnn_fixtures import FIX

MODEL = FIX / "model.onnx"  # inputs input.1 float32 [1, 3, 8, 8], text.embeds float32 [1, 4, 16]


def _feeds() -> dict[str, np.ndarray]:
    with np.load(FIX / "reference.npz", allow_pickle=False) as z:
        return {"input.1": z["feeds|0|input.1"], "text.embeds": z["feeds|0|text.embeds"]}


def test_valid_feeds_pass() -> None:
    check_feeds([_feeds()], MODEL, ["x.npz"])


@pytest.mark.parametrize(("change", "message"), [
    ({"text.embeds": None}, r"missing model input\(s\) \['text.embeds'\]"),
    ({"zzz": np.zeros(3, np.float32)}, r"array\(s\) \['zzz'\] are not inputs of the model"),
    ({"input.1": np.zeros((1, 3, 8, 8), np.float64)}, "'input.1' is float64, the model expects float32"),
    ({"input.1": np.zeros((1, 3, 8, 8), np.complex64)}, "'input.1' is complex64"),
    ({"input.1": np.zeros((3, 8, 8), np.float32)}, r"'input.1' has rank 3 \(shape \[3, 8, 8\]\), the model expects rank 4"),
    ({"input.1": np.zeros((1, 3, 8, 9), np.float32)}, "'input.1': dimension 3 is 9, the model expects 8"),
])
def test_bad_feeds_name_the_file(change: dict, message: str) -> None:
    feeds = _feeds()
    for k, v in change.items():
        if v is None:
            del feeds[k]
        else:
            feeds[k] = v
    with pytest.raises(InputError, match=message) as e:
        check_feeds([_feeds(), feeds], MODEL, ["a.npz", "b.npz"])
    assert e.value.path == "b.npz"


def test_outputs_never_replace_inputs_or_each_other(tmp_path: Path) -> None:
    inp = tmp_path / "ref.h5"
    inp.write_bytes(b"x")
    os.symlink(inp, tmp_path / "alias")
    for out in (inp, tmp_path / "alias", tmp_path / "sub" / ".." / "ref.h5"):
        with pytest.raises(UsageError, match="would replace the input"):
            check_outputs([out], [inp], overwrite=True)
    with pytest.raises(UsageError, match="two outputs name the same file"):
        check_outputs([tmp_path / "r.html", tmp_path / "." / "r.html"], [inp])
    check_outputs([tmp_path / "r.html", "-", None, tmp_path / "j.xml"], [inp])  # distinct, stdout skipped


def test_hard_link_into_an_input_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "output" / "Result_0"
    folder.mkdir(parents=True)
    (folder / "a.raw").write_bytes(b"\0" * 8)
    os.link(folder / "a.raw", tmp_path / "o.h5")
    with pytest.raises(UsageError, match="file of the input folder"):
        check_outputs([tmp_path / "o.h5"], [tmp_path / "output"], overwrite=True)


def _dump(path: Path, scale: float) -> Path:
    from ivq_debug.dump import DumpWriter

    rng = np.random.default_rng(0)
    with DumpWriter(path, backend="test") as w:
        w.begin_record(sample=0, part="model", step=0)
        for name in ("a", "b"):
            w.add_tensor(name, rng.standard_normal((4, 8)).astype(np.float32) * scale)
    return path


def test_map_and_baseline_documents(tmp_path: Path) -> None:
    from ivq_debug.comparator import compare

    p = tmp_path / "m.json"
    p.write_text('{"a": "b"}')
    assert read_name_map(p) == {"a": "b"}
    p.write_text('{"a": 5}')
    with pytest.raises(InputError, match=r"m.json: a: must be a string, got 5"):
        read_name_map(p)
    doc = compare(_dump(tmp_path / "r.h5", 1.0), _dump(tmp_path / "t.h5", 1.01), progress=False).to_json()
    b = tmp_path / "b.json"
    b.write_text(json.dumps(doc))
    assert read_baseline(b)["layers"][0]["ref_name"] in ("a", "b")  # a real ivq-diff/1 result is accepted
    doc["layers"][0]["metrics"]["sqnr_db"] = "high"
    b.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"layers\[0\]\.metrics\.sqnr_db: must be a number, 'inf', '-inf', 'nan'"):
        read_baseline(b)
    b.write_text(json.dumps({**doc, "schema": "ivq-diff/99"}))
    with pytest.raises(InputError, match="schema: must be 'ivq-diff/1'"):
        read_baseline(b)
    b.write_text(json.dumps({**doc, "findings": [{"kind": "x", "where": ["t"]}]}))  # what --fail-on reads
    with pytest.raises(InputError, match=r"findings\[0\]\.where: "):
        read_baseline(b)
