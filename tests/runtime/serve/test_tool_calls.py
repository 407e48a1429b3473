"""Tool calling through /v1/chat/completions with the openai client, on tiny random decoders
exported with Qwen2.5-style (Hermes ``<tool_call>``) and Mistral-style (``[TOOL_CALLS]``, a
special token) templates: ``tool_choice="required"`` or a named function always yields calls
whose arguments validate against the function's schema (jsonschema), whole and streamed;
conversations with tool results are rendered; malformed requests get a 400 naming the field."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
pytest.importorskip("llguidance", reason="tool_choice 'required' needs llguidance (extra 'text')")
openai = pytest.importorskip("openai", reason="the tests speak through the openai client")
jsonschema = pytest.importorskip("jsonschema", reason="arguments are checked with jsonschema")

from tests.runtime.tool_cases import TOOLS, WEATHER, tool_exports  # noqa: E402

from .conftest import running_server  # noqa: E402

MESSAGES = [{"role": "user", "content": "Weather in Paris? And book for 2."}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
FORMATS = ["hermes", "mistral"]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    exports = tool_exports(tmp_path_factory)
    with running_server([exports[name] for name in FORMATS], max_rows=8) as (url, state):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120), \
            {name: f"tools-{name}" for name in FORMATS}


def _check_calls(calls: list[tuple[str, str, str]], names=tuple(SCHEMAS)) -> None:
    """(id, name, arguments) triples: at least one, each a tool of ``names`` whose arguments
    validate against its schema."""
    assert calls
    for call_id, name, arguments in calls:
        assert call_id and name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(client, **kwargs) -> tuple[str, list[tuple[str, str, str]], str, int]:
    """A streamed chat -> (content, calls joined from their deltas, finish reason, deltas)."""
    content, calls, reason, count = "", {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        count += len(choice.delta.tool_calls or [])
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: its id and name
                calls[delta.index] = [delta.id, delta.function.name, delta.function.arguments or ""]
            else:
                calls[delta.index][2] += delta.function.arguments
        reason = choice.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason, count


@pytest.mark.parametrize("name", FORMATS)
def test_required_always_yields_valid_calls(tool_server, name):
    client, models = tool_server
    kwargs = dict(model=models[name], messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=160, temperature=1.0)
    for seed in range(2):
        answer = client.chat.completions.create(seed=seed, **kwargs)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls([(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls])
        # the same seed streamed: the same tokens, so the same call, in deltas
        content, calls, reason, deltas = _streamed(client, seed=seed, **kwargs)
        assert (content, reason) == ("", "tool_calls")
        assert deltas > 3  # the name, then the arguments in pieces as they are generated
        assert [(n, a) for _, n, a in calls] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        _check_calls(calls)


def test_named_function_and_parallel_calls(tool_server):
    client, models = tool_server
    named = {"type": "function", "function": {"name": "book_table"}}
    answer = client.chat.completions.create(
        model=models["mistral"], messages=MESSAGES, tools=TOOLS, tool_choice=named, n=2,
        max_tokens=200, temperature=1.0, seed=3)
    for choice in answer.choices:
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        if choice.finish_reason == "length":  # parallel calls until max_tokens: the last is cut
            assert choice.message.content
        else:
            assert choice.finish_reason == "tool_calls"
        _check_calls(calls, names=("book_table",))
        assert len({call_id for call_id, _, _ in calls}) == len(calls)


# What openai.pydantic_function_tool and instructor's TOOLS mode send for nested pydantic models:
# the nested models in "$defs", referred to as "#/$defs/..." from the parameters' top.
DEFS = {"type": "function", "function": {
    "name": "save_person", "description": "Save a person.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["name", "home"],
                   "properties": {"name": {"type": "string", "maxLength": 6},
                                  "home": {"$ref": "#/$defs/Address"},
                                  "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]}},
                   "$defs": {"Address": {"type": "object", "additionalProperties": False,
                                         "required": ["city", "zip"],
                                         "properties": {"city": {"type": "string", "maxLength": 6},
                                                        "zip": {"type": "integer", "minimum": 0,
                                                                "maximum": 99}}}}}}}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_resolve_the_parameters_defs(tool_server, name, choice):
    """A forced call's grammar embeds the parameters in the call's schema, so "#/$defs/..."
    must be made to point there (a 400 "Pointer '/$defs/Address' does not exist" before)."""
    client, models = tool_server
    tool_choice = choice if choice == "required" else {"type": "function",
                                                        "function": {"name": "save_person"}}
    answer = client.chat.completions.create(
        model=models[name], messages=MESSAGES, tools=[WEATHER, DEFS], tool_choice=tool_choice,
        parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=1)
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schemas = {**SCHEMAS, "save_person": DEFS["function"]["parameters"]}
    assert choice == "required" or calls[0].function.name == "save_person"
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])


def test_auto_and_a_conversation_with_tool_results(tool_server):
    client, models = tool_server
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "a1b2c3d4e", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": '{"temperature": 21}'}]
    for name in FORMATS:
        plain = client.chat.completions.create(model=models[name], messages=history, max_tokens=4)
        answer = client.chat.completions.create(model=models[name], messages=history, tools=TOOLS,
                                                max_tokens=8, seed=0, temperature=1.0)
        choice = answer.choices[0]  # a random model writes no call: "auto" leaves it content
        assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
        assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tools were rendered


@pytest.mark.parametrize("extra, param, message", [
    ({"tool_choice": "sometimes"}, "tool_choice", "expected one of"),
    ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice",
     "not one of the tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools", "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "takes no response_format"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
])
def test_bad_tool_requests_name_the_field(tool_server, extra, param, message):
    client, models = tool_server
    kwargs = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=models["hermes"], messages=MESSAGES, max_tokens=4, **kwargs)
    error = info.value.body
    assert error["param"] == param and message in error["message"]


def test_a_template_without_a_call_format(serve_exports):
    """The serving tests' word-level template teaches no call format: tools are refused, unless
    tool_choice is "none" (they are only shown to the template)."""
    with running_server([serve_exports["dec-portable"]]) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "w5 w6"}]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="dec-portable", messages=messages, tools=TOOLS,
                                           max_tokens=2)
        error = info.value.body
        assert error["param"] == "tools" and "teaches no tool-call format" in error["message"]
        answer = client.chat.completions.create(model="dec-portable", messages=messages, tools=TOOLS,
                                                tool_choice="none", max_tokens=2)
        assert answer.choices[0].message.tool_calls is None
