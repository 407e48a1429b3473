"""The openai SDK against ``tfport serve``: completions and chat (streamed and not, ``n``,
``seed``, ``stop``, logprobs and echo), the ``parse`` helpers with nested Pydantic models,
``pydantic_function_tool`` calls, embeddings, ``models.retrieve`` and the Responses API
(``responses.create`` streamed and not, ``responses.parse``, function tools and a continued
turn). References: the library (``load_model``) for tokens and vectors, the PyTorch module for
log-probabilities, Pydantic's validation for structured output."""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK (extra 'dev')")
torch = pytest.importorskip("torch", reason="the log-probability reference")

from tfport.runtime import load_model  # noqa: E402

from .conftest import CHAT, ENCODER, Person, SavePerson  # noqa: E402

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Who lives where? Answer as JSON."}]


@pytest.fixture(scope="module")
def library(client_exports):
    return load_model(client_exports[CHAT], intra_op_threads=1)


def test_completions_streamed_and_not_equal_the_library(client, library):
    ids = library.tokenizer.encode(PROMPT)
    expected = library.generate([ids], max_new_tokens=12, stop_token_ids=library.stop_ids())[0].tolist()
    expected = expected[:next((i for i, t in enumerate(expected) if t in library.stop_ids()), len(expected))]
    answer = client.completions.create(model=CHAT, prompt=PROMPT, max_tokens=12, temperature=0)
    assert answer.choices[0].text == library.tokenizer.decode(expected)
    chunks = list(client.completions.create(model=CHAT, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == answer.choices[0].text
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_n_seed_and_stop(client):
    kwargs = dict(model=CHAT, prompt=PROMPT, max_tokens=10, temperature=1.0, n=3, seed=5)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and len(set(texts)) > 1  # seed + i per choice
    whole = client.completions.create(model=CHAT, prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = next(whole[i:i + 2] for i in range(4, len(whole) - 2) if whole[i:i + 2].strip())
    cut = client.completions.create(model=CHAT, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert (cut.text, cut.finish_reason) == (whole[:whole.index(stop)], "stop")


def test_logprobs_and_echo_equal_the_pytorch_module(client, library, decoder_module):
    answer = client.completions.create(model=CHAT, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                       echo=True, extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    ids = [*library.tokenizer.encode(PROMPT), *choice.token_ids]
    with torch.no_grad():
        logits = decoder_module(torch.tensor([ids]))[0][0].double()  # [S, V]
    reference = torch.log_softmax(logits, -1).numpy()
    values = choice.logprobs.token_logprobs
    assert choice.text.startswith(PROMPT) and len(values) == len(ids) and values[0] is None
    np.testing.assert_allclose(values[1:], [reference[n - 1, ids[n]] for n in range(1, len(ids))], atol=1e-4)
    # greedy: each generated token is its position's best (top_logprobs is keyed by text, and
    # byte-level tokens of partial characters share one, so its entries are not compared)
    assert all(reference[n - 1].argmax() == ids[n] for n in range(len(ids) - 3, len(ids)))


def test_chat_streamed_and_not(client):
    answer = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


def test_parse_helpers_return_nested_models(client):
    for seed in range(2):
        parsed = client.chat.completions.parse(model=CHAT, messages=MESSAGES, response_format=Person,
                                               max_tokens=200, temperature=1.0, seed=seed)
        assert isinstance(parsed.choices[0].message.parsed, Person)
    with client.chat.completions.stream(model=CHAT, messages=MESSAGES, response_format=Person, max_tokens=200,
                                        temperature=1.0, seed=3) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_pydantic_function_tool_calls(client, choice):
    tool = openai.pydantic_function_tool(SavePerson)
    assert "$defs" in tool["function"]["parameters"]  # nested models: references to resolve
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "SavePerson"}}
    parsed = client.chat.completions.parse(model=CHAT, messages=MESSAGES, tools=[tool], tool_choice=tool_choice,
                                           parallel_tool_calls=False, max_tokens=250, temperature=1.0, seed=1)
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls"
    call, = choice.message.tool_calls
    assert isinstance(call.function.parsed_arguments, SavePerson)


def test_embeddings_equal_the_library(client, client_exports):
    texts = ["w5 w6 w7", "w9"]
    expected = load_model(client_exports[ENCODER], intra_op_threads=1).embed_text(texts)
    out = client.embeddings.create(model=ENCODER, input=texts)
    np.testing.assert_allclose(np.array([d.embedding for d in out.data]), expected, atol=1e-6)


def test_models_retrieve(client):
    assert client.models.retrieve(CHAT).id == CHAT
    assert sorted(m.id for m in client.models.list().data) == sorted([CHAT, ENCODER])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_responses_text_streamed_and_not(client):
    kwargs = dict(model=CHAT, input=MESSAGES, max_output_tokens=10, temperature=0)
    answer = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=10, temperature=0)
    assert answer.output_text == chat.choices[0].message.content
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[0].type == "response.created" and events[-1].response.output_text == answer.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text


def test_responses_parse_and_stream_helper_with_a_json_schema(client):
    parsed = client.responses.parse(model=CHAT, input=MESSAGES, text_format=Person, max_output_tokens=200,
                                    extra_body={"seed": 4})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    with client.responses.stream(model=CHAT, input=MESSAGES, text_format=Person, max_output_tokens=200,
                                 extra_body={"seed": 4}) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed  # the same seed


def test_responses_function_tool_and_its_result(client):
    schema = openai.pydantic_function_tool(SavePerson)["function"]
    tool = {"type": "function", "name": schema["name"], "parameters": schema["parameters"], "strict": True}
    first = client.responses.create(model=CHAT, input=MESSAGES, tools=[tool], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=250, extra_body={"seed": 2})
    call, = [item for item in first.output if item.type == "function_call"]
    SavePerson.model_validate_json(call.arguments)
    second = client.responses.create(  # tools are sent again each turn, as OpenAI's API takes them
        model=CHAT, previous_response_id=first.id, tools=[tool], max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"saved": True})}])
    assert second.usage.input_tokens > first.usage.input_tokens
    # the first turn's prompt starts the second's: its whole blocks come from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 32
