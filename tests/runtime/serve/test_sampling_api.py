"""The sampling API of the server through the openai client: penalties, ``logit_bias``,
``min_p``, ``logprobs`` / ``top_logprobs`` (completions and chat, streamed and not) and ``echo``,
against the PyTorch module's own forward (the whole sequence each step, no cache) and the numpy
references of tests/runtime/test_sampling_api.py."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from tfport.runtime.decoding import layout

from tests.runtime.test_sampling_api import (_torch_on_one_thread, reference_greedy,  # noqa: F401
                                             reference_log_softmax, torch_logits)

PROMPT = [1, 5, 7, 9, 11, 5, 7]  # "[BOS] w5 w7 w9 w11 w5 w7"
TEXT_PROMPT = "w5 w7 w9 w11 w5 w7"  # the same ids: the tokenizer adds [BOS]
STEPS = 10
NAMES = ["dec-ort", "dec-portable"]
CASES = {  # the options as the openai client sends them (vLLM's extensions in extra_body)
    "repetition": {"extra_body": {"repetition_penalty": 1.8}},
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 1.5},
    "bias": {"logit_bias": {"7": 5.0, "20": -100}},
    "all": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"30": 2.0},
            "extra_body": {"repetition_penalty": 1.3, "min_p": 0.2}},
}


def reference_options(case: str) -> dict:
    """A case's options as the references take them (min_p does not change greedy picks)."""
    sent = {**CASES[case], **CASES[case].get("extra_body", {})}
    options = {k: v for k, v in sent.items() if k in ("repetition_penalty", "presence_penalty",
                                                      "frequency_penalty")}
    if "logit_bias" in sent:
        options["logit_bias"] = {int(k): v for k, v in sent["logit_bias"].items()}
    return options


@pytest.fixture(scope="module")
def module():
    """The PyTorch decoder both served exports were made from (tests/runtime/serve/conftest.py:
    tiny-decoder, d_model 64, untied, seed 0)."""
    from tfport.models import build_model
    from tfport.presets import get_preset

    return build_model(get_preset("tiny-decoder").replace(d_model=64, tie_embeddings=False), seed=0)


def complete(client, name, **kwargs):
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    return client.completions.create(model=name, prompt=PROMPT, max_tokens=STEPS, temperature=0,
                                     extra_body=extra, **kwargs)


def word(token: int) -> str:
    """The text of a token of the word-level vocabulary (tests/runtime/runtime_cases.py)."""
    return ["[PAD]", "[BOS]", "[EOS]", "[UNK]"][token] if token < 4 else f"w{token}"


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_with_each_option_equals_the_reference(server, client, module, name):
    plain = reference_greedy(module, PROMPT, STEPS)[0]
    for case in CASES:
        expected = reference_greedy(module, PROMPT, STEPS, **reference_options(case))[0]
        assert expected != plain, f"{case}: the option must change the greedy tokens"
        got = complete(client, name, **CASES[case])
        assert token_ids(got.choices[0]) == expected, case


def check_completion_logprobs(logprobs, tokens, text, module, top):
    """Completions ``logprobs`` of generated ``tokens``: the model's log-softmax at each step,
    the ``top`` most likely texts (w<id> for this word-level vocabulary) plus the chosen token,
    offsets into ``text``."""
    assert logprobs.tokens == [word(t) for t in tokens]
    for n, token in enumerate(tokens):
        reference = reference_log_softmax(torch_logits(module, [*PROMPT, *tokens[:n]]))
        assert logprobs.token_logprobs[n] == pytest.approx(reference[token], abs=2e-4)
        best = np.argsort(-reference)[:top]
        expected = {word(i): reference[i] for i in [*best, token]}
        assert logprobs.top_logprobs[n].keys() == expected.keys()
        for key, value in expected.items():
            assert logprobs.top_logprobs[n][key] == pytest.approx(value, abs=2e-4)
        assert text[logprobs.text_offset[n]:].lstrip().startswith(logprobs.tokens[n])


@pytest.mark.parametrize("name", NAMES)
def test_completion_logprobs_streamed_and_not(server, client, module, name):
    answer = complete(client, name, logprobs=3, extra_body={"repetition_penalty": 1.5})
    choice = answer.choices[0]
    tokens = token_ids(choice)
    assert tokens == reference_greedy(module, PROMPT, STEPS, repetition_penalty=1.5)[0]
    check_completion_logprobs(choice.logprobs, tokens, choice.text, module, 3)

    chunks = list(complete(client, name, logprobs=3, stream=True,
                           extra_body={"repetition_penalty": 1.5}))
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:  # each carries its own tokens' entries
        if chunk.choices[0].logprobs is not None:
            for key, values in chunk.choices[0].logprobs.model_dump().items():
                streamed[key].extend(values)
    assert streamed == choice.logprobs.model_dump()
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def chat_prompt(state, name, messages) -> list[int]:
    return state.models[name].chat(messages)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_streamed_and_not(server, client, module, stream):
    url, state = server
    messages = [{"role": "user", "content": "w9 w10 w9"}]
    prompt = chat_prompt(state, "dec-portable", messages)
    answer = client.chat.completions.create(
        model="dec-portable", messages=messages, max_tokens=STEPS, temperature=0, logprobs=True,
        top_logprobs=2, frequency_penalty=1.0, stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(answer)
        content = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
        tokens = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])]
    else:
        content = answer.choices[0].logprobs.content
        tokens = token_ids(answer.choices[0])
    expected, raw = reference_greedy(module, prompt, len(tokens), frequency_penalty=1.0)
    assert tokens == expected and len(content) == len(tokens)
    for entry, token, logits in zip(content, tokens, raw):
        reference = reference_log_softmax(logits)
        assert entry.token == word(token) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(reference[token], abs=2e-4)
        best = np.argsort(-reference)[:2]
        assert [e.token for e in entry.top_logprobs] == [word(i) for i in best]
        np.testing.assert_allclose([e.logprob for e in entry.top_logprobs], reference[best], atol=2e-4)


@pytest.mark.parametrize(("stream", "piece"), [(False, None), (True, None), (False, 3)])
def test_echo_with_logprobs_scores_the_prompt(server, client, module, stream, piece, monkeypatch):
    """``piece``: the prompt scored in runs of that many tokens (7 tokens: 3 + 3 + 1)."""
    if piece is not None:
        monkeypatch.setattr(layout, "PREFILL_PIECE", piece)
    answer = client.completions.create(model="dec-ort", prompt=TEXT_PROMPT, max_tokens=3,
                                       temperature=0, logprobs=1, echo=True, stream=stream,
                                       extra_body={"ignore_eos": True})
    chunks = list(answer) if stream else [answer]
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    token_logprobs = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    generated = reference_greedy(module, PROMPT, 3)[0]
    assert text.startswith(TEXT_PROMPT) and len(text) > len(TEXT_PROMPT)
    assert tokens == ["[BOS]", *TEXT_PROMPT.split(), *(word(t) for t in generated)]
    assert token_logprobs[0] is None  # nothing precedes the prompt's first token
    for token, offset in zip(tokens[1:], offsets[1:]):  # [BOS] is not shown in the text
        assert text[offset:].lstrip().startswith(token), (text, token, offset)
    with torch.no_grad():
        every = module(torch.tensor([PROMPT]))[0][0].double().numpy()  # [S, V]
    for n in range(1, len(PROMPT)):
        assert token_logprobs[n] == pytest.approx(reference_log_softmax(every[n - 1])[PROMPT[n]], abs=2e-4)


def prompt_ending_in_eos(module) -> list[int]:
    """A prompt "[BOS] wA wB" after which the module's greedy token is [EOS] (id 2)."""
    pairs = torch.tensor([[1, a, b] for a in range(4, 96) for b in range(4, 96)])
    with torch.no_grad():
        last = module(pairs)[0][:, -1].argmax(-1)  # [B]
    found = torch.nonzero(last == 2).flatten()
    assert len(found), "no prompt of three tokens ends in [EOS]: pick longer prompts"
    return pairs[int(found[0])].tolist()


def echoed_logprobs(answer, stream: bool) -> tuple[str, list[str], list, str, int | None]:
    """A completion's (text, logprobs tokens, token_logprobs, finish reason, completion tokens)
    joined over its chunks when streamed."""
    chunks = list(answer) if stream else [answer]
    choices = [c.choices[0] for c in chunks if c.choices]
    usage = next((c.usage for c in reversed(chunks) if c.usage), None)
    return ("".join(c.text for c in choices), [t for c in choices if c.logprobs for t in c.logprobs.tokens],
            [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs],
            [c.finish_reason for c in choices if c.finish_reason][-1],
            None if usage is None else usage.completion_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_scores_a_generated_end_of_text(server, client, module, stream):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 1) drops the last entry as the
    token generated: when that token is [EOS], the entry is there (not shown in the text) and
    counted, as OpenAI's and vLLM's completions do; before the fix the prompt's last token was
    dropped instead."""
    prompt = prompt_ending_in_eos(module)
    answer = client.completions.create(model="dec-ort", prompt=prompt, max_tokens=1, temperature=0,
                                       logprobs=1, echo=True, stream=stream,
                                       stream_options={"include_usage": True} if stream else None)
    text, tokens, token_logprobs, reason, generated = echoed_logprobs(answer, stream)
    assert tokens == [word(t) for t in prompt] + ["[EOS]"]
    assert text == " ".join(word(t) for t in prompt[1:]) and reason == "stop"
    assert generated == 1
    with torch.no_grad():
        every = module(torch.tensor([prompt]))[0][0].double().numpy()  # [S, V]
    scored = [*prompt[1:], 2]
    for n, token in enumerate(scored):
        assert token_logprobs[n + 1] == pytest.approx(reference_log_softmax(every[n])[token], abs=2e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_with_echo_scores_the_prompt_only(server, client, module, stream):
    answer = client.completions.create(model="dec-portable", prompt=PROMPT, max_tokens=0, logprobs=0,
                                       echo=True, stream=stream,
                                       stream_options={"include_usage": True} if stream else None)
    text, tokens, token_logprobs, reason, generated = echoed_logprobs(answer, stream)
    assert tokens == [word(t) for t in PROMPT] and text == TEXT_PROMPT
    assert (reason, generated) == ("length", 0)
    with torch.no_grad():
        every = module(torch.tensor([PROMPT]))[0][0].double().numpy()  # [S, V]
    assert token_logprobs[0] is None
    for n in range(1, len(PROMPT)):
        assert token_logprobs[n] == pytest.approx(reference_log_softmax(every[n - 1])[PROMPT[n]], abs=2e-4)


def test_max_tokens_zero_without_echo_is_refused(server):
    response = httpx.post(server[0] + "/v1/completions", json={"model": "dec-ort", "prompt": "w5",
                                                               "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens", response.text


def test_echo_without_logprobs_prepends_the_prompt(server, client):
    plain = complete(client, "dec-ort")
    echoed = complete(client, "dec-ort", echo=True)
    assert echoed.choices[0].text.startswith("w5 w7 w9 w11 w5 w7")  # ids sent: decoded
    assert echoed.choices[0].text.endswith(plain.choices[0].text)
    assert token_ids(echoed.choices[0]) == token_ids(plain.choices[0])


def test_seeded_sampling_with_options_equals_the_library(server, client, serve_exports):
    from tfport.runtime import load_model

    answer = client.completions.create(model="dec-ort", prompt=PROMPT, max_tokens=STEPS,
                                       temperature=0.9, seed=7, extra_body={"ignore_eos": True, "min_p": 0.1},
                                       presence_penalty=1.0, logit_bias={"12": 3.0})
    model = load_model(serve_exports["dec-ort"], intra_op_threads=1)
    expected = model.generate([PROMPT], max_new_tokens=STEPS, stop_token_ids=(), temperature=0.9,
                              seed=7, presence_penalty=1.0, logit_bias={12: 3.0}, min_p=0.1)
    assert token_ids(answer.choices[0]) == expected[0].tolist()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"logit_bias": {"w5": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"96": 1}}, "logit_bias"),  # vocab_size 96
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
])
def test_out_of_range_options_are_400_naming_the_field(server, path, body, param):
    fields = {"prompt": "w5"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "w5"}]}
    response = httpx.post(server[0] + path, json={"model": "dec-ort", "max_tokens": 2, **fields, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


@pytest.mark.parametrize("name", NAMES)
def test_speculating_scheduler_with_penalties_returns_the_plain_tokens(serve_exports, module, name):
    """The scheduler behind ``tfport serve --speculative lookup`` (K fixed: adaptive K depends on
    timing): penalties that favour repeats, so prompt lookup's proposals are both accepted and
    rejected; tokens and logprobs are those of plain greedy decoding."""
    from tfport.runtime import load_model
    from tfport.runtime.decoding.speculative import Speculation
    from tfport.runtime.sampling import SamplingParams
    from tfport.runtime.serve.handles import GenerationRequest, Token
    from tfport.runtime.serve.scheduler import Scheduler, SchedulerLimits

    cases = [(PROMPT, {"repetition_penalty": 0.7, "presence_penalty": -0.5, "logit_bias": {12: 1.5}}),
             (PROMPT[:-1], {"repetition_penalty": 1.4, "frequency_penalty": 0.3, "logit_bias": {12: 1.5}})]
    references = [reference_greedy(module, prompt, STEPS, **options) for prompt, options in cases]
    for (prompt, _), (tokens, _) in zip(cases, references):
        assert tokens != reference_greedy(module, prompt, STEPS)[0]
    scheduler = Scheduler(load_model(serve_exports[name], intra_op_threads=1), SchedulerLimits(max_rows=4),
                          speculation=Speculation("lookup", 4, adaptive=False)).start()
    try:  # both rows in one batch, each with its own penalties
        handles = scheduler.submit([GenerationRequest(prompt, STEPS, SamplingParams(**options), logprobs=1)
                                    for prompt, options in cases])
        events = [[event for event in handle if isinstance(event, Token)] for handle in handles]
    finally:
        scheduler.stop()
    stats = scheduler.speculation_stats
    assert 0 < stats.accepted < stats.proposed, stats
    for row, (expected, raw) in zip(events, references):
        assert [event.id for event in row] == expected
        for event, logits in zip(row, raw):
            reference = reference_log_softmax(logits)
            assert event.logprob.logprob == pytest.approx(reference[event.id], abs=2e-4)
            assert event.logprob.top[0][0] == int(np.argmax(reference))
