"""The synthetic caption task: determinism, caption rule, tokenizer, accuracy numbers."""

from __future__ import annotations

import numpy as np
import pytest

from ivq_debug.vlm import task


def test_images_are_deterministic_and_in_range():
    a = task.make_samples(4, 56, seed=3)
    b = task.make_samples(4, 56, seed=3)
    for x, y in zip(a, b, strict=True):
        assert x.caption == y.caption
        assert np.array_equal(x.image, y.image)
        assert x.image.shape == (56, 56, 3) and x.image.dtype == np.float32
        assert 0.0 <= x.image.min() and x.image.max() <= 1.0
    assert [s.caption for s in task.make_samples(4, 56, seed=4)] != [s.caption for s in a]


def test_caption_rule_colour_order_and_relation_geometry():
    rng = np.random.default_rng(0)
    order = list(task.COLOURS)
    for _ in range(200):
        sc = task.sample_scene(rng)
        assert order.index(sc.colours[0]) < order.index(sc.colours[1])  # first-named = earlier colour
        (x1, y1), (x2, y2) = sc.centres
        expect = {"left of": x1 < x2, "right of": x1 > x2, "above": y1 < y2, "below": y1 > y2}
        assert expect[sc.relation]
        assert task.parse_caption(sc.caption) == (sc.colours[0], sc.shapes[0], sc.relation, sc.colours[1], sc.shapes[1])


def test_rendered_colours_are_where_the_objects_are():
    sc = task.Scene(("red", "blue"), ("square", "circle"), "left of", ((0.25, 0.5), (0.75, 0.5)), 0.18)
    im = task.render(sc, 112)
    assert np.allclose(im[56, 28], task.COLOURS["red"])
    assert np.allclose(im[56, 84], task.COLOURS["blue"])
    assert np.allclose(im[5, 5], 0.35)


def test_eval_set_fixed():
    s1, s2 = task.eval_set(84), task.eval_set(84)
    assert len(s1) == task.EVAL_SIZE
    assert [s.caption for s in s1] == [s.caption for s in s2]
    assert len({s.caption for s in s1}) > 30  # varied


def test_tokenizer_is_a_real_hf_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    task.save_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    cap = "red square left of blue circle"
    ids = tok(cap, add_special_tokens=False)["input_ids"]
    assert ids == task.caption_ids(cap)[:-1]
    assert tok.decode([*ids, task.VOCAB[task.EOS]], skip_special_tokens=True) == cap
    assert tok.convert_tokens_to_ids(task.IMAGE) == task.VOCAB[task.IMAGE]
    assert tok.pad_token_id == task.VOCAB[task.PAD] and tok.eos_token_id == task.VOCAB[task.EOS]
    assert max(task.VOCAB.values()) < task.VOCAB_SIZE


def test_prompt_and_decode():
    ids = task.prompt_ids(4)
    assert len(ids) == 8 and ids.count(task.VOCAB[task.IMAGE]) == 4
    assert task.decode_ids([*task.caption_ids("green triangle above yellow square"), 9, 9]) == (
        "green triangle above yellow square"
    )


def test_caption_accuracy_numbers():
    refs = ["red square left of blue circle", "green circle above yellow triangle",
            "red triangle below green square", "blue square right of yellow circle"]
    preds = ["red square left of blue circle", "green circle below yellow triangle",
             "red triangle below blue square", "blue"]
    acc = task.caption_accuracy(preds, refs)
    assert acc.n == 4
    assert acc.exact_match == pytest.approx(0.25)
    assert acc.colour == pytest.approx(5 / 8)  # 2 + 2 + 1 + 0 (unparseable)
    assert acc.shape == pytest.approx(6 / 8)
    assert acc.position == pytest.approx(2 / 4)
    assert [f[0] for f in acc.failures] == [1, 2, 3]
    with pytest.raises(ValueError):
        task.caption_accuracy(["a"], [])
