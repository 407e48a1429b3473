"""Prompt checking, padding, position ids (runtime/inputs.py); pooling (runtime/encoding.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tfport.runtime.encoding import cls_pool, l2_normalize, mean_pool, pool
from tfport.runtime.inputs import check_vocab, pad_batch, positions_from_mask, split_prompts


def test_pad_left_and_right():
    rows = [np.array([5, 6, 7]), np.array([8])]
    ids, mask = pad_batch(rows, pad_id=0, side="left")
    np.testing.assert_array_equal(ids, [[5, 6, 7], [0, 0, 8]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])
    ids, mask = pad_batch(rows, pad_id=9, side="right")
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 9, 9]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 0, 0]])
    assert ids.dtype == mask.dtype == np.int64


@pytest.mark.parametrize("mask, query_length, expected", [
    ([[1, 1, 1, 1]], 4, [[0, 1, 2, 3]]),
    ([[0, 0, 1, 1]], 4, [[0, 0, 0, 1]]),        # left padding: pads clamp to 0
    ([[0, 0, 1, 1, 1]], 1, [[2]]),               # a decode step: last slot only
    ([[1, 1, 0, 0]], 4, [[0, 1, 1, 1]]),         # right padding continues the count
    ([[0, 1, 1], [1, 1, 1]], 2, [[0, 1], [1, 2]]),
])
def test_positions_from_mask(mask, query_length, expected):
    got = positions_from_mask(np.array(mask, dtype=np.int64), query_length)
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == np.int64


def test_split_prompts_uses_the_mask_on_either_side():
    ids = np.array([[0, 0, 4, 5], [6, 7, 0, 0]])
    mask = np.array([[0, 0, 1, 1], [1, 1, 0, 0]])
    rows = split_prompts(ids, mask)
    assert [r.tolist() for r in rows] == [[4, 5], [6, 7]]
    assert [r.tolist() for r in split_prompts([[1, 2, 3], [4]])] == [[1, 2, 3], [4]]
    assert split_prompts(np.array([[1, 2]], dtype=np.int32))[0].dtype == np.int64


@pytest.mark.parametrize("input_ids, mask, error, fragments", [
    (np.zeros((1, 3), np.float32), None, TypeError, ["input_ids", "integer dtype", "float32"]),
    (np.zeros((1, 3), bool), None, TypeError, ["input_ids", "integer dtype"]),
    (np.zeros(3, np.int64), None, ValueError, ["input_ids", "rank 2", "ids[None]"]),
    (np.zeros((1, 2, 3), np.int64), None, ValueError, ["input_ids", "rank 2"]),
    (np.zeros((1, 0), np.int64), None, ValueError, ["input_ids", "empty"]),
    ([[1, 2], []], None, ValueError, ["input_ids", "prompt 1 is empty"]),
    ([], None, ValueError, ["input_ids", "empty batch"]),
    ([1, 2, 3], None, ValueError, ["input_ids", "wrap one prompt"]),
    ([[1.5, 2.0]], None, TypeError, ["input_ids[0]", "integer"]),
    ("1,2,3", None, TypeError, ["input_ids"]),
    (np.ones((2, 3), np.int64), np.ones((1, 3), np.int64), ValueError,
     ["attention_mask", "(1, 3)", "(2, 3)"]),
    (np.ones((1, 3), np.int64), np.array([[1, 2, 1]]), ValueError, ["attention_mask", "0", "1"]),
    (np.ones((1, 3), np.int64), np.ones((1, 3), np.float32), TypeError, ["attention_mask"]),
    (np.ones((2, 3), np.int64), np.array([[1, 1, 1], [0, 0, 0]]), ValueError,
     ["input_ids", "prompt 1 is empty"]),
    ([[1, 2]], np.ones((1, 2), np.int64), ValueError, ["attention_mask"]),
    (np.array([[1, 2**63 + 5]], np.uint64), None, ValueError, ["input_ids", str(2**63 + 5), "int64"]),
    ([[1, 10**23]], None, ValueError, ["input_ids[0]", str(10**23), "int64"]),
])
def test_split_prompts_rejects(input_ids, mask, error, fragments):
    with pytest.raises(error) as info:
        split_prompts(input_ids, mask)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_check_vocab_names_the_bad_ids():
    with pytest.raises(ValueError,
                       match=r"input_ids: prompt 1 has ids \[96, -1\] outside \[0, 96\)"):
        check_vocab([np.array([1, 2]), np.array([96, 3, -1])], 96)


def test_pooling_literals():
    states = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)  # [B, S, E]
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    np.testing.assert_allclose(mean_pool(states, mask), [[1.0, 2.0], [8.0, 9.0]])
    np.testing.assert_allclose(cls_pool(states, mask), [[0.0, 1.0], [6.0, 7.0]])
    left = np.array([[0, 1, 1], [1, 1, 1]])  # first real token of a left-padded row
    np.testing.assert_allclose(cls_pool(states, left), [[2.0, 3.0], [6.0, 7.0]])
    np.testing.assert_allclose(l2_normalize(np.array([[3.0, 4.0], [0.0, 0.0]])),
                               [[0.6, 0.8], [0, 0]])
    unit = pool(states, mask, "mean", normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-6)
    # sentence-transformers' other modes: per-channel max, sum / sqrt(count), last real token
    np.testing.assert_allclose(pool(states, mask, "max"), [[2.0, 3.0], [10.0, 11.0]])
    np.testing.assert_allclose(pool(states, mask, "mean_sqrt_len_tokens"),
                               [[2.0 / np.sqrt(2), 4.0 / np.sqrt(2)], [24.0 / np.sqrt(3), 27.0 / np.sqrt(3)]])
    np.testing.assert_allclose(pool(states, mask, "lasttoken"), [[2.0, 3.0], [10.0, 11.0]])
    with pytest.raises(ValueError, match="pooling='median'"):
        pool(states, mask, "median")
