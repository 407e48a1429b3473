"""Structured output through the OpenAI API (``response_format``), with the openai client: JSON
schema responses validate (jsonschema) for a generated family of schemas where the same requests
unconstrained give no JSON, streamed and not, on both cache layouts, with speculation; a malformed
``response_format`` is a 400 with param ``response_format`` and a message naming the field."""

from __future__ import annotations

import json

import pytest

from tests.runtime.grammar_cases import byte_decoder, schema_family
from tests.runtime.serve.conftest import running_server

openai = pytest.importorskip("openai", reason="the API is checked with the openai client (extra 'dev')")
jsonschema = pytest.importorskip("jsonschema", reason="the JSON reference is jsonschema (extra 'dev')")
pytest.importorskip("llguidance", reason="constrained decoding needs llguidance (extra 'text')")

TARGETS = ["portable", "ort"]  # cache layouts concat and inplace; the served model ids


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    return [byte_decoder(tmp_path_factory, target) for target in TARGETS]


@pytest.fixture(scope="module")
def client(directories):
    with running_server(directories, max_rows=8, max_queue=64) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}


def ask(client, model: str, response_format: dict | None, stream: bool, seed: int, n: int = 1,
        max_tokens: int = 200) -> list[tuple[str, str]]:
    """(content, finish_reason) of each choice of one chat completion."""
    extra = {} if response_format is None else {"response_format": response_format}
    messages = [{"role": "user", "content": "Describe the item as JSON."}]
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                               temperature=1.0, seed=seed, n=n, **extra)
        return [(c.message.content, c.finish_reason) for c in reply.choices]
    texts, reasons = [""] * n, [None] * n
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=1.0, seed=seed, n=n, stream=True, **extra):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return list(zip(texts, reasons))


@pytest.mark.parametrize("model", TARGETS)
def test_schema_family_validates_streamed_and_not(client, model):
    for index, schema in enumerate(schema_family(6, seed=11)):
        stream = index % 2 == 1
        choices = ask(client, model, schema_format(schema), stream, seed=index, n=2)
        for content, reason in choices:
            assert reason == "stop", f"schema {index} (stream={stream}): {content!r}"
            jsonschema.validate(json.loads(content), schema)
        for content, _ in ask(client, model, None, stream, seed=index):  # the same, unconstrained
            with pytest.raises(ValueError):
                json.loads(content)


def test_json_object_regex_and_grammar(client):
    content, _ = ask(client, "ort", {"type": "json_object"}, False, seed=0, max_tokens=4)[0]
    assert content.startswith("{")
    regex = {"type": "regex", "regex": "[a-f]{3}-[0-9]{2}"}
    reply = client.completions.create(model="ort", prompt="Code:", max_tokens=10, temperature=1.0, seed=0,
                                      extra_body={"response_format": regex})
    text = reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop" and len(text) == 6 and text[3] == "-"
    assert set(text[:3]) <= set("abcdef") and text[4:].isdigit()
    content, reason = ask(client, "portable", {"type": "grammar", "grammar": 'start: "yes" | "no"'},
                          True, seed=0)[0]
    assert reason == "stop" and content in ("yes", "no")


@pytest.mark.parametrize("response_format, field", [
    (schema_format({"type": "strin"}), "Invalid type: strin"),
    (schema_format({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}), "unclosed group"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "yaml"}, "response_format.type='yaml'"),
    ({"type": "regex", "regex": "(("}, "unclosed group"),
    ({"type": "grammar", "grammar": "start: nowhere"}, "unknown name"),
])
def test_malformed_response_format_is_a_400_naming_it(client, response_format, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="ort", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, response_format=response_format)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == "response_format"
    assert field in error["message"] and error["message"].startswith("response_format")


def test_constrained_request_without_a_stop_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="ort", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_object"}, extra_body={"ignore_eos": True})
    assert info.value.body["param"] == "response_format" and "ignore_eos" in info.value.body["message"]


def test_speculative_server_gives_the_same_greedy_json(client, directories):
    """The scheduler's speculative step verifies proposals through each row's grammar: greedy
    responses equal the plain server's."""
    schema = schema_family(1, seed=4)[0]
    messages = [{"role": "user", "content": f"item {i}"} for i in range(4)]

    def contents(server_client):
        return [server_client.chat.completions.create(model="portable", messages=[m], max_tokens=150,
                                                      temperature=0, response_format=schema_format(schema)
                                                      ).choices[0].message.content for m in messages]

    plain = contents(client)
    for content in plain:
        jsonschema.validate(json.loads(content), schema)
    with running_server(directories[:1], max_rows=4, speculative="lookup") as (url, state):
        fast = contents(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60))
        assert state.models["portable"].scheduler.speculation_stats.proposed > 0
    assert fast == plain
