"""``tfport.runtime.request.Request``: one decoding's settings, checked when made, and resolved in
the order request > the export's generation_config.json > the API's defaults. No export needed:
the export's side is a ``RequestDefaults`` of a preset config. ``Model.generate`` and the server
reaching the same resolution is tested where they run (test_generate_features, serve/test_app).
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from tfport.generation import GenerationDefaults
from tfport.presets import get_preset
from tfport.runtime.defaults import RequestDefaults
from tfport.runtime.request import CHAT, COMPLETIONS, LIBRARY, LIBRARY_CHAT, Request, split_request

CONFIG = get_preset("tiny-decoder")
VOCAB = CONFIG.vocab_size
RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def export(generation: GenerationDefaults | None = None) -> RequestDefaults:
    return RequestDefaults(CONFIG, generation)


SAMPLES = GenerationDefaults(eos_token_ids=(3, 4), do_sample=True, temperature=0.6, top_k=7, top_p=0.8,
                             repetition_penalty=1.3, forced_bos_token_id=5, forced_eos_token_ids=(6,))


@pytest.mark.parametrize("api, expected", [(LIBRARY, (0.0, 0, 1.0)), (CHAT, (1.0, 0, 1.0))])
def test_sampling_falls_back_to_the_api_without_a_sampling_export(api, expected):
    greedy_file = GenerationDefaults(do_sample=False, temperature=0.3, top_k=2)
    for defaults in (export(), export(greedy_file)):
        got = Request().sampling(defaults, api)
        assert (got["temperature"], got["top_k"], got["top_p"]) == expected


def test_the_request_wins_over_the_export_which_wins_over_the_api():
    defaults = export(SAMPLES)
    assert Request().sampling(defaults, CHAT) == {"temperature": 0.6, "top_k": 7, "top_p": 0.8}
    assert Request(temperature=0.0, top_p=0.5).sampling(defaults, CHAT) == {
        "temperature": 0.0, "top_k": 7, "top_p": 0.5}
    params = Request(min_p=0.1).params(defaults)
    assert params.repetition_penalty == 1.3 and params.min_p == 0.1 and params.presence_penalty == 0
    assert Request(repetition_penalty=1.0).params(defaults).repetition_penalty == 1.0
    assert Request().params(export()).repetition_penalty == 1.0  # no file: off


def test_stop_and_forced_tokens_resolve_against_the_export():
    assert Request().stop_ids(export()) == (CONFIG.eos_token_id,)
    assert Request().stop_ids(export(SAMPLES)) == (3, 4)
    assert Request(stop_token_ids=np.array([9, 2])).stop_ids(export(SAMPLES)) == (9, 2)
    assert Request(stop_token_ids=()).stop_ids(export(SAMPLES)) == ()
    assert Request().forced(export(SAMPLES), 4) == {0: (5,), 3: (6,)}
    assert Request().forced(export(SAMPLES), 4, one_token_start=False) == {3: (6,)}
    assert Request(forced_bos_token_id=(), forced_eos_token_id=[7, 8]).forced(export(SAMPLES), 2) == {1: (7, 8)}
    assert Request(forced_bos_token_id=9).forced(export(), 1) == {0: (9,)}
    with pytest.raises(ValueError, match=rf"stop_token_ids: \[{VOCAB}\] outside \[0, {VOCAB}\)"):
        Request(stop_token_ids=[1, VOCAB]).stop_ids(export())
    with pytest.raises(ValueError, match="forced_eos_token_id: .* outside"):
        Request(forced_eos_token_id=VOCAB + 3).forced(export(), 2)
    with pytest.raises(ValueError, match="logit_bias"):
        Request(logit_bias={VOCAB: 1.0}).params(export())


@pytest.mark.parametrize("request_tokens, api, cap, expected", [
    (None, LIBRARY, None, 16), (None, LIBRARY_CHAT, None, 256), (None, COMPLETIONS, 8, 8),
    (None, CHAT, None, 1000 - 10 + 1), (None, CHAT, 100, 100), (40, CHAT, 100, 40), (991, LIBRARY, None, 991),
])
def test_the_token_budget(request_tokens, api, cap, expected):
    assert Request(max_new_tokens=request_tokens).token_budget(10, 1000, api=api, cap=cap) == expected


def test_the_token_budget_refuses_naming_the_argument_the_caller_used():
    with pytest.raises(ValueError, match="max_tokens=992: a prompt of 10 tokens leaves room for 991 new "
                                         r"tokens in a context of 1000 .*at most 991"):
        Request(max_new_tokens=992).token_budget(10, 1000, argument="max_tokens")
    with pytest.raises(ValueError, match="max_completion_tokens=101: more than this server's limit of 100"):
        Request(max_new_tokens=101).token_budget(10, 1000, cap=100, argument="max_completion_tokens")
    # an encoder-decoder's prompt is its encoder's: the decoder has the whole context
    assert Request(max_new_tokens=1000).token_budget(999, 1000, seq2seq=True) == 1000
    with pytest.raises(ValueError, match="max_new_tokens=1001: the decoder's context is 1000"):
        Request(max_new_tokens=1001).token_budget(1, 1000, seq2seq=True)
    with pytest.raises(ValueError, match="max_tokens=16: .*room for 15"):  # the API's default is checked too
        Request().token_budget(6, 20, api=COMPLETIONS, cap=1000, argument="max_tokens")


@pytest.mark.parametrize("fields, error, match", [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens=0: expected a positive integer"),
    ({"max_new_tokens": 2.5}, ValueError, "max_new_tokens=2.5"),
    ({"max_new_tokens": True}, ValueError, "max_new_tokens=True"),
    ({"temperature": -1}, ValueError, "temperature=-1"),
    ({"top_p": 2}, ValueError, "top_p=2"),
    ({"top_k": -1}, ValueError, "top_k=-1"),
    ({"presence_penalty": 3}, ValueError, "presence_penalty=3"),
    ({"logit_bias": {1: 500}}, ValueError, r"logit_bias\[1\]=500"),
    ({"logit_bias": [1]}, ValueError, "logit_bias=\\[1\\]: expected a mapping"),
    ({"seed": -1}, ValueError, "seed=-1"),
    ({"stop_token_ids": "12"}, TypeError, "stop_token_ids='12'"),
    ({"stop_token_ids": [1, 2.0]}, TypeError, r"stop_token_ids: \[2.0\] are not integer"),
    ({"forced_bos_token_id": (1, 2)}, ValueError, "forced_bos_token_id=\\(1, 2\\): expected one token id"),
    ({"forced_eos_token_id": "x"}, TypeError, "forced_eos_token_id='x'"),
    ({"regex": "a", "json_schema": {}}, ValueError, "json_schema, regex: expected exactly one"),
    ({"draft_tokens": 4}, ValueError, "draft_tokens=4: applies with speculative"),
    ({"top_logprobs": -1}, ValueError, "top_logprobs=-1"),
])
def test_a_bad_field_is_refused_when_the_request_is_made(fields, error, match):
    with pytest.raises(error, match=match):
        Request(**fields)


def test_of_merges_keywords_over_a_request_and_names_unknown_ones():
    base = Request(max_new_tokens=8, temperature=0.5)
    assert Request.of(base) is base
    assert Request.of(base, temperature=0.0) == Request(max_new_tokens=8, temperature=0.0)
    assert Request.of(None, max_new_tokens=3) == Request(max_new_tokens=3)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['max_tokens'\]"):
        Request.of(max_tokens=3)
    with pytest.raises(TypeError, match="request=3: expected a tfport.runtime.Request"):
        Request.of(3)
    fields, rest = split_request({"temperature": 0.1, "progress": True, "logprobs": object()})
    assert set(fields) == {"temperature"} and set(rest) == {"progress", "logprobs"}


def test_request_is_frozen_and_its_sequences_are_tuples():
    request = Request(stop_token_ids=[1, 2], forced_eos_token_id=[3], logit_bias={4: 1.0})
    assert request.stop_token_ids == (1, 2) and request.forced_eos_token_id == (3,)
    with pytest.raises(AttributeError):
        request.temperature = 1.0


def _compares(tree: ast.AST, name: str) -> list[int]:
    """Lines comparing something called ``name`` (a variable or an attribute) with ``<``-style
    operators: a range check."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE))
                                                 for op in node.ops):
            for side in (node.left, *node.comparators):
                if (isinstance(side, ast.Name) and side.id == name) or \
                        (isinstance(side, ast.Attribute) and side.attr == name):
                    lines.append(node.lineno)
    return lines


def test_the_token_budget_is_checked_in_one_place():
    """No runtime module but request.py range-checks a request's new tokens (``max_new_tokens``;
    ``max_tokens`` of a request object), and the library's default budgets are written once."""
    found = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        if path.name == "request.py":
            continue
        tree = ast.parse(path.read_text())
        lines = _compares(tree, "max_new_tokens")
        lines += [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
                  and any(isinstance(s, ast.Attribute) and s.attr == "max_tokens"
                          and isinstance(s.value, ast.Name) and s.value.id in ("request", "body")
                          for s in (n.left, *n.comparators))
                  and any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in n.ops)]
        if lines:
            found[str(path.relative_to(RUNTIME))] = lines
    assert found == {}
