"""QDQ quantization for QNN: presets, calibration sources, overrides, atomic and safe output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ivq_debug.errors import InputError, UsageError
from tests.support import qnn_models as models
from tests.support.qnn_models import needs_qnn

# ORT's QNN quantization helpers ship with onnxruntime itself: these tests run without onnxruntime-qnn,
# except the one that needs a QDQ model from the QNN fixtures


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("float") / "block.onnx"
    onnx.save(models.build_block(0), str(p))
    return p


def _inits(path: Path) -> dict[str, np.ndarray]:
    m = onnx.load(str(path))
    return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


@pytest.mark.parametrize(("preset", "act", "wt", "domain", "opset"), [
    ("a8w8", "QUInt8", "QUInt8", "ai.onnx", 20),
    ("a16w8", "QUInt16", "QUInt8", "com.microsoft", 21),
    ("a16w16", "QUInt16", "QInt16", "com.microsoft", 21),  # 16-bit weights signed symmetric (quantize.WEIGHT16)
])
def test_presets(block: Path, tmp_path: Path, preset: str, act: str, wt: str, domain: str, opset: int) -> None:
    from ivq_debug.onnxgraph.sites import list_sites
    from ivq_debug.qnn.quantize import quantize_for_qnn

    r = quantize_for_qnn(block, tmp_path / "q.onnx", models.block_feeds(1, 4), preset=preset)
    assert (r.activation_type, r.weight_type) == (act, wt)
    assert r.calibration_samples == 4 and r.calibration_source == "in-memory feeds"
    assert r.qdq_domains == [domain] and r.opset["ai.onnx"] == opset
    assert r.quantize_nodes > 30 and r.dequantize_nodes > r.quantize_nodes
    assert r.seconds > 0 and r.model_path == tmp_path / "q.onnx"
    inits = _inits(r.model_path)
    assert inits["x1_zero_point"].dtype == (np.uint16 if act == "QUInt16" else np.uint8)
    wz = inits["Wq_zero_point"]
    assert wz.dtype == {"QUInt8": np.uint8, "QInt16": np.int16}[wt] and (wt != "QInt16" or not wz.any())
    # the 16-bit com.microsoft Q/DQ model is read without shape inference by the capture code
    sites = list_sites(onnx.load(str(r.model_path), load_external_data=False))
    assert {s.encoding["bitwidth"] for s in sites} == {16 if act == "QUInt16" else 8}
    assert json.dumps(r.to_dict())


def test_per_channel_weights(block: Path, tmp_path: Path) -> None:
    from ivq_debug.qnn.quantize import quantize_for_qnn

    conv = tmp_path / "conv.onnx"
    onnx.save(models.build_conv(0), str(conv))
    px = np.random.default_rng(0).random((2, 1, 3, 16, 16)).astype(np.float32)
    r = quantize_for_qnn(conv, tmp_path / "conv.q.onnx", {"pixel_values": px}, per_channel=True)
    assert r.per_channel and r.calibration_samples == 2
    assert _inits(r.model_path)["conv_w_scale"].shape == (4,)  # one scale per output channel
    # QNN has no per-channel MatMul: the QNN config keeps MatMul weights per-tensor
    r = quantize_for_qnn(block, tmp_path / "q.onnx", models.block_feeds(1, 2), per_channel=True)
    assert _inits(r.model_path)["W1_scale"].size == 1


def test_quantizations_that_calibrate_alike_share_one_calibration_and_give_the_uncached_bytes(
        block: Path, tmp_path: Path) -> None:
    """The calibration key holds what ORT's calibration reads (``calibration_cache_key``): the types enter only as
    the opset of the model calibrated (a 16-bit type anywhere raises it to 21), per-channel not at all (the block
    is opset 20: no upgrade). So a16w8, a16w16 and a8w8 with a 16-bit override calibrate once, a8w8 and a8w8 per
    channel once more, and each model is the bytes of a quantization without the cache."""
    import hashlib

    from ivq_debug.qnn.quantize import quantize_for_qnn

    feeds, cache = models.block_feeds(1, 4), tmp_path / "cache"
    runs = [("a16w8", {}), ("a16w16", {}), ("a8w8", {"overrides": {"p": [{"quant_type": "QUInt16"}]}}),
            ("a8w8", {}), ("a8w8", {"per_channel": True})]
    files, digest = [], lambda f: hashlib.sha256(Path(f).read_bytes()).hexdigest()
    for i, (preset, kw) in enumerate(runs):
        cached = quantize_for_qnn(block, tmp_path / f"c{i}.onnx", feeds, preset=preset, calibration_cache=cache, **kw)
        fresh = quantize_for_qnn(block, tmp_path / f"f{i}.onnx", feeds, preset=preset, **kw)
        assert digest(cached.model_path) == digest(fresh.model_path), (preset, kw)
        files.append(sorted(cache.glob("*.json")))
    assert [len(f) for f in files] == [1, 1, 1, 2, 2]  # one calibration per opset calibrated: 21, then 20
    # what a hit reads is that file: its ranges widened, the next a16w16 model is no longer the uncached one
    (q16,) = files[0]
    doc = json.loads(q16.read_text())
    for t in doc["data"].values():
        t["highest"]["data"] = [2 * v + 1 for v in t["highest"]["data"]]
    q16.write_text(json.dumps(doc))
    again = quantize_for_qnn(block, tmp_path / "again.onnx", feeds, preset="a16w16", calibration_cache=cache)
    assert digest(again.model_path) != digest(tmp_path / "f1.onnx") and len(list(cache.glob("*.json"))) == 2


def test_calibration_sources(block: Path, tmp_path: Path) -> None:
    from ivq_debug.qnn.quantize import load_calibration

    rng = np.random.default_rng(0)
    pos = {"pos": np.arange(models.S, dtype=np.float32).reshape(models.S, 1)}
    np.savez(tmp_path / "set.npz", x=rng.standard_normal((5, 1, models.S, models.D)).astype(np.float32),
             pos=np.repeat(pos["pos"][None], 5, axis=0))
    s, desc = load_calibration(tmp_path / "set.npz", block)
    assert len(s) == 5 and s[0]["x"].shape == (1, models.S, models.D) and desc.startswith("npz")
    folder = tmp_path / "npy"
    folder.mkdir()
    for i in range(3):  # no batch axis in the files: added
        np.save(folder / f"{i:02d}.npy", rng.standard_normal((models.S, models.D)))
    s, _ = load_calibration(folder, block, fixed_feeds=pos, max_samples=2)
    assert len(s) == 2 and s[1]["x"].dtype == np.float32 and s[1]["x"].shape == (1, models.S, models.D)
    with pytest.raises(InputError, match="exactly one free model input"):
        load_calibration(folder, block)
    (folder / "99.npy").write_bytes(b"not numpy")
    with pytest.raises(InputError, match=r"99\.npy"):
        load_calibration(folder, block, fixed_feeds=pos)
    np.save(tmp_path / "bad.npy", rng.standard_normal((3, models.S, models.D + 1)))
    with pytest.raises(InputError, match="dimension 2 is 33, the model expects 32"):
        load_calibration(tmp_path / "bad.npy", block, fixed_feeds=pos)
    with pytest.raises(UsageError, match="not model inputs"):
        load_calibration(folder, block, fixed_feeds={"nope": 1})


def test_image_folder_calibration(tmp_path: Path) -> None:
    from PIL import Image

    from ivq_debug.qnn.quantize import load_calibration, quantize_for_qnn

    model = tmp_path / "conv.onnx"
    onnx.save(models.build_conv(0, hw=16), str(model))
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):  # 20x20 RGBA PNGs: alpha dropped, resized to 16x16, laid out NCHW
        Image.fromarray((rng.random((20, 20, 4)) * 255).astype(np.uint8), "RGBA").save(imgs / f"img{i}.png")
    s, desc = load_calibration(imgs, model, image_mean=(0.5, 0.5, 0.5), image_std=(0.25, 0.25, 0.25))
    assert len(s) == 3 and s[0]["pixel_values"].shape == (1, 3, 16, 16) and "3 files" in desc
    assert "3 image(s) through Pillow, bicubic resize (antialiased)" in desc
    assert -2.1 <= s[0]["pixel_values"].min() and s[0]["pixel_values"].max() <= 2.1
    r = quantize_for_qnn(model, tmp_path / "conv.qdq.onnx", imgs)
    assert r.calibration_samples == 3


PHOTO = Path(__file__).resolve().parents[1] / "fixtures" / "images" / "grace_hopper.jpg"


def _band_resize(img: object, hw: int, f: object) -> np.ndarray:
    """The explicit Pillow resize of each channel as a float image, HWC in [0, 1], NCHW with a batch axis."""
    bands = [np.asarray(b.convert("F").resize((hw, hw), f), np.float32) / np.float32(255) for b in img.split()]
    return np.stack(bands)[None]


def _input_encoding(path: Path) -> tuple[float, int]:
    i = _inits(path)
    return float(i["pixel_values_scale"]), int(i["pixel_values_zero_point"])


def test_calibration_images_are_resized_as_deployed(tmp_path: Path) -> None:
    """A real photograph (512x600) calibrated at 32x32: the default (Pillow bicubic, antialiased) gives the
    encodings an explicit Pillow resize of the same image gives, and not those of nearest-neighbour, whose
    aliasing keeps single bright and dark pixels a deployed resize averages away."""
    from PIL import Image

    from ivq_debug.qnn.quantize import quantize_for_qnn

    model = tmp_path / "conv.onnx"
    onnx.save(models.build_conv(0, hw=32), str(model))
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    photo = Image.open(PHOTO).convert("RGB")
    photo.save(imgs / "a.png")
    photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT).crop((0, 100, 512, 600)).save(imgs / "b.png")
    default = quantize_for_qnn(model, tmp_path / "default.onnx", imgs)
    assert "2 image(s) through Pillow, bicubic resize (antialiased)" in default.calibration_source
    explicit = [{"pixel_values": _band_resize(Image.open(f).convert("RGB"), 32, Image.Resampling.BICUBIC)}
                for f in sorted(imgs.iterdir())]
    by_hand = quantize_for_qnn(model, tmp_path / "explicit.onnx", explicit)
    nearest = quantize_for_qnn(model, tmp_path / "nearest.onnx", imgs, image_resize="nearest")
    assert "nearest resize" in nearest.calibration_source
    d, e, n = _inits(default.model_path), _inits(by_hand.model_path), _inits(nearest.model_path)
    scales = [k for k in d if k.endswith("_scale")]
    assert scales and all(np.array_equal(d[k], e[k]) for k in d)  # every encoding, to the bit
    assert _input_encoding(default.model_path) != _input_encoding(nearest.model_path)
    assert sum(not np.array_equal(d[k], n[k]) for k in scales) >= 2


def test_calibration_images_through_the_model_folders_image_processor(tmp_path: Path) -> None:
    from PIL import Image
    from transformers import ViTImageProcessor

    from ivq_debug.qnn.quantize import load_calibration

    model = tmp_path / "conv.onnx"
    onnx.save(models.build_conv(0, hw=32), str(model))
    folder = tmp_path / "hf"
    proc = ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    proc.save_pretrained(folder)
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    (imgs / "a.jpg").write_bytes(PHOTO.read_bytes())
    s, desc = load_calibration(imgs, model, image_processor=folder)
    assert "1 image(s) through the image processor ViTImageProcessor" in desc
    want = proc(images=Image.open(PHOTO), return_tensors="np")["pixel_values"]
    assert np.array_equal(s[0]["pixel_values"], want) and want.shape == (1, 3, 32, 32)
    with pytest.raises(InputError, match=r"no preprocessor_config\.json"):
        load_calibration(imgs, model, image_processor=tmp_path)


def test_overrides_dict_and_json(block: Path, tmp_path: Path) -> None:
    from ivq_debug.qnn.quantize import quantize_for_qnn

    feeds = models.block_feeds(1, 4)
    r = quantize_for_qnn(block, tmp_path / "a.onnx", feeds,
                         overrides={"g": [{"scale": 0.05, "zero_point": 10}], "sc": {"rmin": -10.0, "rmax": 10.0}})
    i = _inits(r.model_path)
    assert r.overrides == 2
    assert i["g_scale"].dtype == np.float32 and float(i["g_scale"]) == pytest.approx(0.05)
    assert int(i["g_zero_point"]) == 10
    assert float(i["sc_scale"]) == pytest.approx(20 / 255, rel=1e-6)
    (tmp_path / "ort.json").write_text(json.dumps({"p": [{"quant_type": "QUInt16"}], "sc": [{"quant_type": "u16"}]}))
    r = quantize_for_qnn(block, tmp_path / "b.onnx", feeds, overrides=tmp_path / "ort.json")
    assert _inits(r.model_path)["p_zero_point"].dtype == np.uint16
    with pytest.raises(UsageError, match="lacks"):
        quantize_for_qnn(block, tmp_path / "c.onnx", feeds, overrides={"nope": {"quant_type": "QUInt16"}})
    r = quantize_for_qnn(block, tmp_path / "c.onnx", feeds, overrides={"nope": {"quant_type": "QUInt16"}},
                         strict_overrides=False)
    assert r.overrides_unmatched == ["nope"] and r.overrides == 0


def test_qnn_encodings_overrides(block: Path, tmp_path: Path) -> None:
    """QNN legacy and 1.0.0 encodings JSON, converted through ivq_debug.qnn.encodings."""
    from ivq_debug.qnn.quantize import quantize_for_qnn

    feeds = models.block_feeds(1, 4)
    legacy = {"activation_encodings": {"g": [{"bitwidth": 8, "dtype": "int", "is_symmetric": "False",
                                                "min": -0.2, "max": 4.0}]},
              "param_encodings": {"W1": [{"bitwidth": 8, "dtype": "int", "is_symmetric": "True",
                                           "scale": 0.01, "offset": -128}]}}
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    r = quantize_for_qnn(block, tmp_path / "l.onnx", feeds, overrides=tmp_path / "legacy.json")
    i = _inits(r.model_path)
    assert r.overrides == 2
    assert float(i["W1_scale"]) == pytest.approx(0.01) and i["W1_zero_point"].dtype == np.int8
    assert float(i["g_scale"]) == pytest.approx(4.2 / 255, rel=1e-3)
    v1 = {"version": "1.0.0", "param_encodings": [],
          "activation_encodings": [{"name": "g", "enc_type": "PER_TENSOR", "dtype": "INT", "bw": 16,
                                    "is_sym": False, "scale": [1e-4], "offset": [-2000]}]}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    r = quantize_for_qnn(block, tmp_path / "v.onnx", feeds, preset="a16w8", overrides=tmp_path / "v1.json")
    i = _inits(r.model_path)
    assert float(i["g_scale"]) == pytest.approx(1e-4) and int(i["g_zero_point"]) == 2000


def test_a_float_request_leaves_its_producer_unquantized(block: Path, tmp_path: Path) -> None:
    """What ``ivq tune`` delivers for ``fp16``: a float encoding of the node's output (QNN formats) or the node in
    the ORT file's ``nodes_to_exclude`` sidecar; ``quantize_for_qnn`` leaves that node float either way."""
    from ivq_debug.errors import InputError
    from ivq_debug.qnn.quantize import EXCLUDE_SUFFIX, quantize_for_qnn

    feeds = models.block_feeds(1, 4)

    def weight_is_quantized(path: Path) -> bool:  # v_proj reads the weight Wv
        node = next(n for n in onnx.load(str(path)).graph.node if n.name == "v_proj")
        return node.input[1] != "Wv"

    assert weight_is_quantized(quantize_for_qnn(block, tmp_path / "q.onnx", feeds).model_path)
    (tmp_path / "legacy.json").write_text(json.dumps(
        {"activation_encodings": {"v": [{"bitwidth": 16, "dtype": "float"}]}, "param_encodings": {}}))
    r = quantize_for_qnn(block, tmp_path / "l.onnx", feeds, overrides=tmp_path / "legacy.json")
    assert not weight_is_quantized(r.model_path)
    assert "overrides: v: float: its producer v_proj left unquantized" in r.warnings
    (tmp_path / "ort.json").write_text("{}")
    (tmp_path / f"ort.json{EXCLUDE_SUFFIX}").write_text(json.dumps({"nodes_to_exclude": ["v_proj"]}))
    r = quantize_for_qnn(block, tmp_path / "o.onnx", feeds, overrides=tmp_path / "ort.json")
    assert not weight_is_quantized(r.model_path)
    (tmp_path / f"ort.json{EXCLUDE_SUFFIX}").write_text(json.dumps(["v_proj"]))
    with pytest.raises(InputError, match="nodes_to_exclude") as e:
        quantize_for_qnn(block, tmp_path / "b.onnx", feeds, overrides=tmp_path / "ort.json")
    assert e.value.path == str(tmp_path / f"ort.json{EXCLUDE_SUFFIX}") and not (tmp_path / "b.onnx").exists()


def test_output_is_atomic_and_never_overwritten(block: Path, tmp_path: Path) -> None:
    from ivq_debug.qnn.quantize import quantize_for_qnn

    out = tmp_path / "q.onnx"
    feeds = models.block_feeds(1, 2)
    quantize_for_qnn(block, out, feeds)
    before = out.read_bytes()
    with pytest.raises(UsageError, match="overwrite=True"):
        quantize_for_qnn(block, out, feeds, preset="a16w8")
    assert out.read_bytes() == before
    quantize_for_qnn(block, out, feeds, preset="a16w8", overwrite=True)
    assert out.read_bytes() != before
    with pytest.raises(InputError, match=r"lacks inputs"):
        quantize_for_qnn(block, tmp_path / "bad.onnx", [{"x": feeds[0]["x"]}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]  # no partial files left behind


@pytest.mark.qnn
@needs_qnn
def test_bad_arguments(block: Path, tmp_path: Path, qnn_models: dict[str, Path]) -> None:
    from ivq_debug.qnn.quantize import quantize_for_qnn

    feeds = models.block_feeds(1, 2)
    with pytest.raises(UsageError, match="preset"):
        quantize_for_qnn(block, tmp_path / "q.onnx", feeds, preset="a4w4")
    with pytest.raises(UsageError, match="already holds QuantizeLinear"):
        quantize_for_qnn(qnn_models["block.a8w8"], tmp_path / "q.onnx", feeds)
    with pytest.raises(InputError, match="no such ONNX model"):
        quantize_for_qnn(tmp_path / "missing.onnx", tmp_path / "q.onnx", feeds)


def test_cli_image_resize_and_processor_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``ivq quantize --image-resize`` says which resize made the calibration inputs; the flags are QDQ-only
    (exit 2 with --dynamic) and a folder without an image processor is an input error (exit 3)."""
    from tests.support.cli import ivq_cli

    model = tmp_path / "conv.onnx"
    onnx.save(models.build_conv(0, hw=32), str(model))
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    (imgs / "a.jpg").write_bytes(PHOTO.read_bytes())
    assert ivq_cli("quantize", model, "-o", tmp_path / "q.onnx", "--calibration", imgs, "--image-resize",
                   "bilinear") == 0
    assert "1 image(s) through Pillow, bilinear resize (antialiased)" in capsys.readouterr().out.replace("\n", " ")
    assert ivq_cli("quantize", model, "-o", tmp_path / "d.onnx", "--dynamic", "--image-resize", "nearest") == 2
    assert ivq_cli("quantize", model, "-o", tmp_path / "p.onnx", "--calibration", imgs, "--image-processor",
                   tmp_path) == 3
    assert "no preprocessor_config.json" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["percentile", "entropy"])
def test_histogram_calibration_progress_stays_off_stdout(block: Path, tmp_path: Path, capfd, method: str) -> None:
    # ORT's histogram calibrators print "Collecting tensor data and making histogram ..." on stdout, which
    # carries `ivq tune --search`'s frontier table and every command's TSV / JSON (entropy's histograms are
    # ivq_debug.qnn.entropy's: nothing printed)
    from ivq_debug.qnn.quantize import quantize_for_qnn

    r = quantize_for_qnn(block, tmp_path / "q.onnx", models.block_feeds(1, 2), calibrate_method=method)
    out, err = capfd.readouterr()
    assert r.model_path.exists()
    assert "Collecting tensor data" not in out and ("Collecting tensor data" in err) == (method == "percentile")


@pytest.mark.qnn
@needs_qnn
def test_quantize_folds_the_shape_chains_so_htp_runs_the_model_at_every_level(tmp_path: Path, capfd) -> None:
    """torch's ``x.view(x.shape[0], -1)``, ``cls.expand(b, -1, -1)`` and ``arange(t.shape[1])`` under a dynamic
    batch: HTP refused the QDQ model at ORT optimization "disable" (``Shape``, then "Cannot get shape"
    downstream) and even at "all" (ORT's folding stops at the ``Range``); ``ivq quantize`` folds the chains its
    intake made constant and HTP runs the model at every level, with the unfolded model's QDQ arithmetic."""
    import onnxruntime as ort

    from ivq_debug.dump.reader import open_dump
    from ivq_debug.errors import EXIT_RUN
    from ivq_debug.metrics import compute
    from ivq_debug.qnn.quantize import quantize_for_qnn
    from tests.support.cli import ivq_cli
    from tests.support.shape_models import build_shape_net, shape_feeds

    src = build_shape_net(tmp_path)
    np.savez(tmp_path / "cal.npz", x=np.concatenate([f["x"] for f in shape_feeds(1, 8)]))
    np.savez(tmp_path / "in.npz", **shape_feeds(2, 1)[0])
    cal, feeds = tmp_path / "cal.npz", ["--inputs", tmp_path / "in.npz"]
    # before: the chains written as they are
    unfolded = quantize_for_qnn(src, tmp_path / "unfolded.onnx", cal, fold_shapes=False).model_path
    for level, refused in (("disable", "(Shape)"), ("all", "(Range)")):
        capfd.readouterr()
        assert ivq_cli("capture", "qnn", unfolded, *feeds, "-o", tmp_path / "u.h5", "--optimization", level) \
            == EXIT_RUN
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not supported by QNN HTP" in err[0] and refused in err[0], err
    # after: ivq quantize folds them, says so, and records which
    q = tmp_path / "q.onnx"
    assert ivq_cli("quantize", src, "-o", q, "--calibration", cal, "--json", tmp_path / "q.json") == 0
    err = capfd.readouterr().err
    assert "shape node(s) folded into initializers (" in err and "Shape x5" in err
    folded = json.loads((tmp_path / "q.json").read_text())["intake"]["folded_shapes"]
    assert sum(f.endswith("(Shape)") for f in folded) == 5 and "/Range (Range)" in folded
    assert not {n.op_type for n in onnx.load(str(q)).graph.node} & {"Shape", "ConstantOfShape", "Range", "Expand"}
    x = shape_feeds(2, 1)[0]

    def cpu(path: Path) -> np.ndarray:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, x)[0]

    qdq = cpu(q)
    assert np.array_equal(qdq, cpu(unfolded))  # the same QDQ arithmetic as the unfolded model, on ORT CPU
    outs = {}
    for level in ("disable", "basic", "all"):  # every node on HTP: CPU fallback is off, a refusal is exit 7
        assert ivq_cli("capture", "qnn", q, *feeds, "-o", tmp_path / f"{level}.h5", "--optimization", level) == 0
        outs[level] = open_dump(tmp_path / f"{level}.h5").read("y")
    for level, y in outs.items():
        assert y.shape == (1, 10) and np.array_equal(y, outs["disable"]), level
        assert compute(qdq, y)["sqnr_db"] > 30, level
