"""Tool calling in the library: call text parsed whole and streamed (split anywhere), formats told
apart by the template, tools and tool messages rendered as transformers renders them, and
``Model.chat(tools=..., tool_choice="required" | named)`` on tiny random decoders, whose calls
always validate against the function's parameter schema (jsonschema) thanks to the grammar."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from tfport.runtime.chat import ChatFormat
from tfport.runtime.tokenizer import TextTokenizer
from tfport.runtime.tool_parser import ToolCallParser, parse_reply
from tfport.runtime.tools import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, detect_format

from .tool_cases import TEMPLATES, TOOLS, WEATHER, tool_exports, write_byte_tokenizer

pytest.importorskip("jinja2", reason="chat templates need the 'jinja2' package (extra 'text')")

MESSAGES = [{"role": "user", "content": "Weather in Paris? And book for 2."}]


@dataclass(frozen=True)
class ParseCase:
    """A reply in ``format`` -> its content and calls as (name, arguments as JSON values)."""

    format: str
    text: str
    content: str
    calls: tuple = ()


PARSE_CASES = [
    # Qwen2.5 / Hermes: text before the calls is content; two calls; a "}" inside a string
    ParseCase("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"tags": ["}", {"x": 1}]}}\n</tool_call>\n<tool_call>\n{"name": "book_table", '
              '"arguments": {"guests": 2}}\n</tool_call>',
              "Checking.\n", (("get_weather", {"city": "Paris", "tags": ["}", {"x": 1}]}),
                              ("book_table", {"guests": 2}))),
    # keys in the other order (no early name: the call comes whole), unicode, escapes
    ParseCase("hermes", '<tool_call>{"arguments": {"q": "caf\\u00e9 \\"x\\""}, "name": "s"}</tool_call>',
              "", (("s", {"q": 'café "x"'}),)),
    ParseCase("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and "
              "<tool is not a tag."),
    # a section that does not parse is given back as content
    ParseCase("hermes", "<tool_call>\nI would call something", "<tool_call>\nI would call something"),
    ParseCase("hermes", '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
              '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    # Llama 3.x: the whole reply is the call, "parameters"; <|python_tag|> and ";" optional
    ParseCase("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
              (("get_weather", {"city": "Oslo"}),)),
    ParseCase("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", '
              '"parameters": {"n": [1, 2]}}', "", (("a", {}), ("b", {"n": [1, 2]}))),
    ParseCase("llama3_json", 'Sure: {"name": "a", "parameters": {}}',
              'Sure: {"name": "a", "parameters": {}}'),
    ParseCase("llama3_json", '{"answer": 42}', '{"answer": 42}'),
    # Mistral v3: [TOOL_CALLS] then a JSON list of calls
    ParseCase("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
              '{"name": "book_table", "arguments": {"guests": 4, "when": {"day": "mon"}}}]', "",
              (("get_weather", {"city": "Rome"}),
               ("book_table", {"guests": 4, "when": {"day": "mon"}}))),
    ParseCase("mistral", "Plain answer [TOOL] not a call.", "Plain answer [TOOL] not a call."),
    ParseCase("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing"),
]


def _streamed(fmt, pieces):
    """Feed ``pieces`` -> (content, {index: (id, name, joined arguments)}, parser)."""
    parser = ToolCallParser(fmt)
    content, calls = "", {}
    for piece in [*pieces, None]:
        text, deltas = parser.finish() if piece is None else parser.push(piece)
        content += text
        for delta in deltas:
            if delta.id is not None:
                assert delta.index not in calls and delta.arguments == ""  # the header comes once
                calls[delta.index] = (delta.id, delta.name, "")
            else:
                call_id, name, arguments = calls[delta.index]
                calls[delta.index] = (call_id, name, arguments + delta.arguments)
    return content, calls, parser


@pytest.mark.parametrize("case", PARSE_CASES, ids=lambda c: f"{c.format}:{c.text[:24]}")
def test_parse_whole_and_streamed(case):
    fmt = FORMATS[case.format]
    content, calls = parse_reply(fmt, case.text)
    assert content == case.content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == list(case.calls)
    for call in calls:  # the arguments are the model's own text when it wrote name first
        assert call.arguments in case.text or '"arguments": {"q"' in case.text
    # the same result however the text is cut: in two at every point, and in random small pieces
    rng = random.Random(0)
    cuts = [[case.text[:i], case.text[i:]] for i in range(len(case.text) + 1)]
    for _ in range(20):
        count = min(len(case.text) - 1, len(case.text) // 3)
        points = sorted(rng.sample(range(1, len(case.text)), count))
        cuts.append([case.text[a:b] for a, b in zip([0, *points], [*points, len(case.text)])])
    for pieces in cuts:
        streamed, deltas, parser = _streamed(fmt, pieces)
        assert streamed == content
        assert [(c.id, c.name, c.arguments) for c in parser.calls] == \
            [deltas[i] for i in range(len(parser.calls))]
        assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in calls]


def test_streamed_name_comes_before_the_arguments_end():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parser = ToolCallParser(HERMES)
    cut = text.index('"Paris"')
    _, deltas = parser.push(text[:cut])
    assert [(d.name, d.arguments) for d in deltas] == [("get_weather", ""), (None, '{"city": ')]
    assert parser.calls == []


def test_formats_are_told_by_the_template():
    assert {name: detect_format(text) for name, text in TEMPLATES.items()} == \
        {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL}
    chatml = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    assert detect_format(chatml) is None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return TextTokenizer(write_byte_tokenizer(tmp_path_factory.mktemp("byte") / "tokenizer.json"))


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a1b2c3d4e", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "21 °C in Paris."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tools_and_tool_messages_render_as_transformers_renders_them(name, tokenizer):
    """OpenAI messages (arguments as JSON text) render as transformers renders the same
    conversation with arguments as dicts, its documented convention, and ``tools=``."""
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer.path), bos_token="<s>",
                                        eos_token="</s>")
    fmt = ChatFormat(TEMPLATES[name], tokenizer, bos_token_id=1, eos_token_id=2)
    dict_arguments = json.loads(json.dumps(CONVERSATION))
    call = dict_arguments[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    dict_arguments[2]["content"] = ""
    for messages in (CONVERSATION[:2], CONVERSATION):
        expected = reference.apply_chat_template(
            dict_arguments[:len(messages)], tools=TOOLS, chat_template=TEMPLATES[name], tokenize=False,
            add_generation_prompt=True)
        rendered = fmt.render(messages, tools=TOOLS)
        assert rendered == expected
        assert '"book_table"' in rendered  # the tools reached the template
    assert '{"city": "Paris", "unit": "celsius"}' in fmt.render(CONVERSATION, tools=TOOLS)


@pytest.mark.parametrize("tools, choice, error", [
    ("get_weather", "auto", r"tools='get_weather'.*expected a non-empty list"),
    ([], "auto", r"tools=\[\]"),
    ([{"type": "function", "function": {"name": "no spaces"}}], "auto", r"tools\[0\]\.function\.name"),
    ([WEATHER, WEATHER], "auto", r"tools\[1\]\.function\.name='get_weather': used by an earlier tool"),
    ([{"type": "retrieval"}], "auto", r"tools\[0\]=.*expected \{'type': 'function'"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto",
     r"tools\[0\]\.function\.parameters=\[\]: expected a JSON schema"),
    (TOOLS, "sometimes", r"tool_choice='sometimes': expected one of \['auto', 'none', 'required'\]"),
    (TOOLS, {"type": "function", "function": {"name": "fly"}},
     r"tool_choice\.function\.name='fly': not one of"),
    (TOOLS, {"name": "get_weather"}, r"tool_choice=.*expected one of"),
    (None, "required", r"tool_choice='required': needs tools"),
])
def test_bad_tools_and_tool_choice_name_the_field(tokenizer, tools, choice, error):
    fmt = ChatFormat(TEMPLATES["hermes"], tokenizer, 1, 2)
    with pytest.raises(ValueError, match=error):
        fmt.tool_request(tools, choice)


def test_a_template_without_a_call_format_refuses_tools_unless_none(tokenizer):
    fmt = ChatFormat("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}", tokenizer, 1, 2)
    with pytest.raises(ValueError, match="teaches no tool-call format"):
        fmt.tool_request(TOOLS, "auto")
    assert fmt.tool_request(TOOLS, "none").format is None
    error = r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not JSON"
    with pytest.raises(ValueError, match=error):
        fmt.render([MESSAGES[0], {"role": "assistant", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{city"}}]}])


def test_grammar_markers_that_are_special_tokens(tokenizer):
    """Mistral's [TOOL_CALLS] is a special token here: the grammar names it by id, and the parser
    is shown its text (decoding leaves special tokens out)."""
    fmt = ChatFormat(TEMPLATES["mistral"], tokenizer, 1, 2)
    request = fmt.tool_request(TOOLS, "required")
    marker = tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)
    assert len(marker) == 1 and f"<[{marker[0]}]>" in request.grammar
    assert fmt.marker_ids(request.format) == {marker[0]: "[TOOL_CALLS]"}
    hermes = ChatFormat(TEMPLATES["hermes"], tokenizer, 1, 2)
    assert '"<tool_call>"' in hermes.tool_request(TOOLS, "required").grammar  # text, not a token
    assert hermes.marker_ids(HERMES) == {}


# ------------------------------------------------------------------------- on tiny random models
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tfport.runtime import load_model

    pytest.importorskip("llguidance", reason="tool_choice 'required' needs llguidance (extra 'text')")
    return {name: load_model(path) for name, path in tool_exports(tmp_path_factory).items()}


def _validate(calls, tools):
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.name in schemas
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_required_always_calls_a_tool_with_valid_arguments(models, name):
    """Unconstrained, this random model writes byte soup ("auto" finds no call in it); the
    grammar makes every reply a call of one of the tools whose arguments validate against its
    schema, or of the named tool."""
    model = models[name]
    free = model.chat(MESSAGES, tools=TOOLS, max_new_tokens=12, seed=0, temperature=1.0)
    assert free.tool_calls == [] and free.content
    reply = model.chat(MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                       max_new_tokens=160, temperature=1.0, seed=0)
    assert reply.content == "" and len(reply.tool_calls) == 1
    _validate(reply.tool_calls, TOOLS)
    if name == "mistral":  # its templates check the ids of earlier calls
        assert len(reply.tool_calls[0].id) == 9 and reply.tool_calls[0].id.isalnum()
    book = {"type": "function", "function": {"name": "book_table"}}
    named = model.chat(MESSAGES, tools=TOOLS, tool_choice=book, max_new_tokens=160, temperature=1.0,
                       seed=1, parallel_tool_calls=False)
    assert [c.name for c in named.tool_calls] == ["book_table"]
    _validate(named.tool_calls, TOOLS)


def test_parallel_calls_and_the_stream_match_the_whole_reply(models):
    """Greedy, so the stream and the whole reply are the same tokens: the streamed deltas join
    to the same calls; parallel calls are each valid (the last may be cut by max_new_tokens)."""
    from tfport.runtime.tools import CallDelta

    model = models["mistral"]
    kwargs = dict(tools=TOOLS, tool_choice="required", max_new_tokens=120)
    reply = model.chat(MESSAGES, **kwargs)
    _validate(reply.tool_calls, TOOLS)
    pieces = list(model.chat_stream(MESSAGES, **kwargs))
    content = "".join(p for p in pieces if isinstance(p, str))
    joined: dict[int, list] = {}
    for delta in (p for p in pieces if isinstance(p, CallDelta)):
        joined.setdefault(delta.index, []).append(delta)
    streamed = [(d[0].name, "".join(x.arguments for x in d)) for d in joined.values()]
    assert content == reply.content
    assert streamed[:len(reply.tool_calls)] == [(c.name, c.arguments) for c in reply.tool_calls]


def test_auto_parses_what_the_model_writes(models):
    """"auto" on a reply forced (by a regex) to be a Hermes call: the library parses it."""
    import re

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    reply = models["hermes"].chat(MESSAGES, tools=TOOLS, regex=re.escape(call), max_new_tokens=120)
    assert reply.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]
    plain = models["hermes"].chat(MESSAGES, tools=TOOLS, tool_choice="none", regex=re.escape(call),
                                  max_new_tokens=120)
    assert plain.content == call and plain.tool_calls == []  # "none" parses nothing
    with pytest.raises(ValueError, match="tool_choice='required': forces a call by grammar; it takes no "
                                         "regex"):
        models["hermes"].chat(MESSAGES, tools=TOOLS, tool_choice="required", regex="x")
