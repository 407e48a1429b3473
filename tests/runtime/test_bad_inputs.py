"""Bad input at the Model boundary: TypeError/ValueError naming the argument, never a crash."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")


@dataclass(frozen=True)
class BadCase:
    """Call ``method`` of the ``key`` export with ``args``/``kwargs``; expect ``error`` whose
    message contains every fragment."""

    name: str
    key: str
    method: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    error: type = ValueError
    fragments: tuple = ()


DEC, S2S, ENC = "decoder-rope", "encoder-decoder", "encoder"
CASES = [
    BadCase("float ids", DEC, "generate", (np.ones((1, 3), np.float32),), error=TypeError,
            fragments=("input_ids", "integer dtype", "float32")),
    BadCase("rank-1 ids", DEC, "generate", (np.ones(3, np.int64),),
            fragments=("input_ids", "rank 2")),
    BadCase("rank-3 ids", ENC, "embed", (np.ones((1, 2, 3), np.int64),),
            fragments=("input_ids", "rank 2")),
    BadCase("id >= vocab", DEC, "generate", ([[1, 96]],),
            fragments=("input_ids", "[96]", "[0, 96)")),
    BadCase("negative id", S2S, "generate", ([[-3, 4]],),
            fragments=("input_ids", "[-3]", "[0, 96)")),
    BadCase("id >= vocab (encoder)", ENC, "embed", ([[1, 200]],),
            fragments=("input_ids", "[0, 96)")),
    BadCase("mask batch", DEC, "generate", (np.ones((2, 3), np.int64), np.ones((1, 3), np.int64)),
            fragments=("attention_mask", "(1, 3)", "(2, 3)")),
    BadCase("mask values", ENC, "encode", (np.ones((1, 3), np.int64), np.full((1, 3), 2)),
            fragments=("attention_mask", "0 (padding) and 1")),
    BadCase("empty prompt", DEC, "generate", ([[]],), fragments=("input_ids", "prompt 0 is empty")),
    BadCase("empty prompt (s2s)", S2S, "generate", (np.zeros((1, 0), np.int64),),
            fragments=("input_ids", "empty")),
    BadCase("all-padding row", ENC, "embed",
            (np.ones((2, 2), np.int64), np.array([[1, 1], [0, 0]])),
            fragments=("input_ids", "prompt 1 is empty")),
    BadCase("empty batch", DEC, "generate", ([],), fragments=("input_ids", "empty batch")),
    BadCase("flat list", DEC, "generate", ([1, 2, 3],), fragments=("input_ids", "wrap one prompt")),
    BadCase("string prompt", DEC, "generate", ("hello",), error=TypeError,
            fragments=("input_ids",)),
    # 10 prompt tokens + 56 new: 65 positions, since all new tokens but the last are fed back.
    BadCase("beyond max_positions", DEC, "generate", ([[1] * 10],), {"max_new_tokens": 56},
            fragments=("max_new_tokens=56", "room for 55", "context of 64", "at most 55")),
    BadCase("prompt beyond max_positions", DEC, "generate", ([[1] * 65],), {"max_new_tokens": 1},
            fragments=("input_ids", "65 positions", "max_positions=64")),
    BadCase("s2s prompt beyond max_positions", S2S, "generate", ([[1] * 65],),
            fragments=("input_ids", "65 positions", "max_positions=64")),
    BadCase("s2s steps beyond max_positions", S2S, "generate", ([[1, 2]],), {"max_new_tokens": 65},
            fragments=("max_new_tokens=65", "context is 64", "at most 64")),
    BadCase("encoder beyond max_positions", ENC, "embed", ([[1] * 65],),
            fragments=("input_ids", "max_positions=64")),
    BadCase("max_new_tokens 0", DEC, "generate", ([[1, 2]],), {"max_new_tokens": 0},
            fragments=("max_new_tokens=0", "positive integer")),
    BadCase("max_new_tokens float", DEC, "generate", ([[1, 2]],), {"max_new_tokens": 2.5},
            fragments=("max_new_tokens=2.5",)),
    BadCase("temperature", DEC, "generate", ([[1, 2]],), {"temperature": -1.0},
            fragments=("temperature=-1.0",)),
    BadCase("top_k", DEC, "generate", ([[1, 2]],), {"top_k": -2, "temperature": 1.0},
            fragments=("top_k=-2",)),
    BadCase("top_p", S2S, "generate", ([[1, 2]],), {"top_p": 0.0, "temperature": 1.0},
            fragments=("top_p=0.0",)),
    BadCase("seed", DEC, "generate", ([[1, 2]],), {"seed": "x", "temperature": 1.0},
            fragments=("seed='x'",)),
    BadCase("stop id", DEC, "generate", ([[1, 2]],), {"stop_token_ids": [100]},
            fragments=("stop_token_ids", "[100]", "[0, 96)")),
    BadCase("stop id type", DEC, "generate", ([[1, 2]],), {"stop_token_ids": 2}, error=TypeError,
            fragments=("stop_token_ids=2", "sequence")),
    BadCase("pooling", ENC, "embed", ([[1, 2]],), {"pooling": "median"},
            fragments=("pooling='median'", "cls", "lasttoken")),
    BadCase("token types range", ENC, "encode", ([[1, 2]],), {"token_type_ids": [[0, 2]]},
            fragments=("token_type_ids", "[2]", "[0, 2)")),
    BadCase("token types length", ENC, "encode", ([[1, 2]],), {"token_type_ids": [[0]]},
            fragments=("token_type_ids", "lengths [1]", "[2]")),
    BadCase("token types unsupported", S2S, "encode", ([[1, 2]],), {"token_type_ids": [[0, 0]]},
            fragments=("token_type_ids", "takes none")),
    BadCase("generate on an encoder", ENC, "generate", ([[1, 2]],),
            fragments=("generate", "'encoder'", "no decoder graph")),
    BadCase("embed on a decoder", DEC, "embed", ([[1, 2]],),
            fragments=("encode", "no encoder graph")),
    BadCase("text without tokenizer", DEC, "generate_text", ("hi",),
            fragments=("prompts", "tokenizer.json")),
    # Found by hand-fuzzing (issue #11): each used to fail late, with another argument's name or none.
    BadCase("callback not callable", DEC, "generate", ([[1, 2]],), {"callback": 5}, error=TypeError,
            fragments=("callback=5", "callback(step, tokens)")),
    BadCase("progress not a bool", DEC, "generate", ([[1, 2]],), {"progress": "no"}, error=TypeError,
            fragments=("progress='no'",)),
    BadCase("normalize not a bool", ENC, "embed", ([[1, 2]],), {"normalize": "no"}, error=TypeError,
            fragments=("normalize='no'",)),
    BadCase("masked array", DEC, "generate", (np.ma.masked_array([[1, 2]], mask=[[0, 1]]),),
            error=TypeError, fragments=("input_ids", "masked array", "attention_mask")),
    BadCase("temperature beyond float64", DEC, "generate", ([[1, 2]],), {"temperature": 10**400},
            fragments=("temperature=",)),
    BadCase("texts None", "encoder-text", "embed_text", (None,), error=TypeError,
            fragments=("texts", "NoneType")),
    BadCase("texts dict", "encoder-text", "embed_text", ({"w": 1},), error=TypeError,
            fragments=("texts", "dict")),
    BadCase("prompts None", "decoder-text", "generate_text", (None,), error=TypeError,
            fragments=("prompts", "NoneType")),
]


def test_matrix_prompts_are_plain_arrays(loaded):
    _, model = loaded(DEC)
    ids = np.array([[1, 5, 7], [1, 9, 9]])
    np.testing.assert_array_equal(model.generate(np.matrix(ids), max_new_tokens=4),
                                  model.generate(ids, max_new_tokens=4))


def test_thread_counts_are_the_settings_fault(exports):
    from tfport.runtime import load_model
    with pytest.raises(ValueError, match=r"intra_op_threads=1099511627776: expected 0 .* to \d+"):
        load_model(exports(DEC).path, intra_op_threads=2**40)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input(case, loaded):
    _, model = loaded(case.key)
    with pytest.raises(case.error) as info:
        getattr(model, case.method)(*case.args, **case.kwargs)
    for fragment in case.fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
