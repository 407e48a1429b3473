"""Tool calling: the tool-call formats chat templates teach, told apart by the template's text;
the model's call text parsed into OpenAI ``tool_calls`` (whole, or as streamed deltas); and the
Lark grammar that makes the model call a tool (``tool_choice`` "required" or a named function).

    >>> fmt = detect_format(template_text)            # HERMES, LLAMA3_JSON, MISTRAL or None
    >>> parser = ToolCallParser(fmt)                  # tool_parser: the text, piece by piece

Formats (``FORMATS``, a registry; each says where its calls start, what separates and closes
them, and the key of the arguments), told apart by a marker in the template:

* ``hermes`` (Qwen2.5, Hermes; ``<tool_call>``): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`` once per call;
* ``llama3_json`` (Llama 3.1-3.3; ``<|python_tag|>`` or ``ipython``): ``{"name": ...,
  "parameters": {...}}`` as the whole reply (``<|python_tag|>`` optional, ``;`` between calls);
* ``mistral`` (Mistral v3; ``[TOOL_CALLS]``): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}},
  ...]``.

Parsing follows vLLM's tool parsers: text before a call is the message's content; a call is a
JSON object with a str ``name`` and an object of arguments; a call section that does not parse
(``<tool_call>`` then prose) is given back as content when the text ends. A streamed call
starts with a delta carrying its ``id`` and ``name`` as soon as the name is complete, then its
arguments' raw JSON text in pieces (joined, they are the call's ``arguments``). A delta already
sent stays sent: a section that fails after its name was streamed still ends as content.

Tools are OpenAI's (and transformers' ``apply_chat_template(tools=...)``):
``{"type": "function", "function": {"name", "description", "parameters": <JSON schema>}}``.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolCall:
    """One complete call: ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        """As an OpenAI message's ``tool_calls`` item."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index``: its first delta carries ``id`` and ``name`` (and arguments ""),
    the next ones pieces of the arguments' JSON text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        """As an OpenAI streamed ``delta.tool_calls`` item."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ChatReply:
    """A reply to a chat with tools (``Model.chat(..., tools=...)``): its ``content`` (the text
    around the calls) and ``tool_calls`` (empty when the model called none)."""

    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolFormat:
    """How one family of templates writes calls.

    ``markers``: text in a template that selects this format. ``start``: the text that opens a
    call section ("" : the section is the whole reply, starting at its first "{"), ``prefix``
    optional text before it at the reply's start (``<|python_tag|>``). ``opener``, ``separator``
    and ``closer``: the literals before the first call, between calls and after the last one
    (whitespace around them is free). ``key``: the name of the arguments in a call object.
    ``parallel``: whether the template teaches several calls in one reply.

    How the grammar of ``tool_choice="required"`` writes calls, as the template shows them:
    ``section[0] call (join call)* section[1]``, each call ``wrap[0] <JSON object> wrap[1]``.
    """

    name: str
    markers: tuple[str, ...]
    start: str
    key: str
    opener: tuple[str, ...] = ()
    separator: tuple[str, ...] = ()
    closer: tuple[str, ...] = ()
    prefix: str = ""
    parallel: bool = True
    id_chars: int = 0  # > 0: call ids are this many letters and digits (Mistral's templates check)
    section: tuple[str, str] = ("", "")
    wrap: tuple[str, str] = ("", "")
    join: str = ""

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The texts a tokenizer may hold as single special tokens (shown to the parser)."""
        return tuple(t for t in (self.start, self.prefix) if t)

    def call_id(self) -> str:
        if self.id_chars:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.id_chars))
        return f"call_{uuid.uuid4().hex[:24]}"

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool,
                literal: Callable[[str], str] = json.dumps) -> str:
        """A Lark grammar (llguidance's dialect) of a reply that calls one of ``tools`` (several
        when ``parallel`` and the format allows), the arguments valid against the function's
        ``parameters`` schema. ``literal(text)`` writes a marker (a special token: ``<[id]>``)."""
        where = (lambda i: "") if len(tools) == 1 else (lambda i: f"/anyOf/{i}")
        objects = [{"type": "object", "additionalProperties": False, "required": ["name", self.key],
                    "properties": {"name": {"const": tool["function"]["name"]},
                                   self.key: rebased(tool["function"].get("parameters") or {"type": "object"},
                                                     f"{where(i)}/properties/{self.key}")}}
                   for i, tool in enumerate(tools)]
        schema = objects[0] if len(objects) == 1 else {"anyOf": objects}
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        many = parallel and self.parallel
        calls = f"call ({self._lark(self.join, literal)} call)*" if many else "call"
        start = " ".join(filter(None, (self._lark(self.section[0], literal), calls,
                                       self._lark(self.section[1], literal))))
        call = " ".join(filter(None, (self._lark(self.wrap[0], literal), "body",
                                      self._lark(self.wrap[1], literal))))
        return f"start: {start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"

    def _lark(self, text: str, literal: Callable[[str], str]) -> str:
        """``text`` as Lark literals, its start marker written by ``literal`` ("" for none)."""
        parts = text.split(self.start) if self.start else [text]
        pieces = [json.dumps(part) if part else "" for part in parts]
        return f" {literal(self.start)} ".join(pieces).strip() if len(parts) > 1 else pieces[0]


# Keywords whose values are data, not schemas (a "$ref" in them is no reference), and those
# whose values map names to schemas (a property may be called "default").
_DATA_KEYWORDS = ("const", "enum", "default", "examples")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def rebased(schema: Any, base: str) -> Any:
    """``schema`` with its local references (``#/$defs/Address``, ``#``) pointing to where it
    sits in a document that embeds it at JSON pointer ``base`` (``/properties/arguments``):
    a function's ``parameters`` inside the schema of a call, where ``#/$defs/...`` would look
    for definitions at the call's top (pydantic models with nested models send them)."""
    if isinstance(schema, list):
        return [rebased(item, base) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: rebased(item, base) for name, item in value.items()}
        else:
            out[key] = rebased(value, base)
    return out


HERMES = ToolFormat("hermes", markers=("<tool_call>",), start="<tool_call>", key="arguments",
                    closer=("</tool_call>",), wrap=("<tool_call>\n", "\n</tool_call>"), join="\n")
LLAMA3_JSON = ToolFormat("llama3_json", markers=("<|python_tag|>", "ipython"), start="",
                         key="parameters", separator=(";",), prefix="<|python_tag|>", parallel=False,
                         join="; ")
MISTRAL = ToolFormat("mistral", markers=("[TOOL_CALLS]",), start="[TOOL_CALLS]", key="arguments",
                     opener=("[",), separator=(",",), closer=("]",), id_chars=9,
                     section=("[TOOL_CALLS] [", "]"), join=", ")
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def detect_format(template: str) -> ToolFormat | None:
    """The format whose marker the chat ``template``'s text holds (the first in ``FORMATS``
    order), or None: the template teaches no call format tfport parses."""
    for fmt in FORMATS.values():
        if any(marker in template for marker in fmt.markers):
            return fmt
    return None


# ------------------------------------------------------------------------------------ requests
def check_tools(tools: Any) -> list[dict]:
    """``tools`` as a list of OpenAI function tools, names unique; ``ValueError`` naming the
    field (``tools[1].function.name``) otherwise."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise ValueError(f"tools={tools!r:.80}: expected a non-empty list of "
                         "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function" \
                or not isinstance(tool.get("function"), Mapping):
            raise ValueError(f"{where}={tool!r:.80}: expected "
                             "{'type': 'function', 'function': {...}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"{where}.function.name={name!r:.80}: expected 1 to 64 letters, digits, "
                             "'_', '.' or '-'")
        if name in names:
            raise ValueError(f"{where}.function.name={name!r}: used by an earlier tool too")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ValueError(f"{where}.function.parameters={parameters!r:.80}: expected a JSON "
                             "schema object")
    return [dict(tool) for tool in tools]


def chosen_tools(tools: list[dict], tool_choice: Any) -> tuple[str, list[dict]]:
    """(``"auto"``, ``"none"`` or ``"required"``, the tools a call may use) of ``tool_choice``:
    one of ``TOOL_CHOICES`` or ``{"type": "function", "function": {"name": ...}}`` (required, that
    tool only); ``ValueError`` naming ``tool_choice`` otherwise."""
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice={tool_choice!r}: expected one of {list(TOOL_CHOICES)} or "
                             "{'type': 'function', 'function': {'name': ...}}")
        return tool_choice, tools
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" \
            or not isinstance(name, str):
        raise ValueError(f"tool_choice={tool_choice!r:.80}: expected one of {list(TOOL_CHOICES)} or "
                         "{'type': 'function', 'function': {'name': ...}}")
    named = [tool for tool in tools if tool["function"]["name"] == name]
    if not named:
        raise ValueError(f"tool_choice.function.name={name!r}: not one of the tools "
                         f"{[t['function']['name'] for t in tools]}")
    return "required", named


@dataclass(frozen=True)
class ToolRequest:
    """What a request's tools ask of decoding: ``tools`` for the template (None: none),
    ``format`` to parse the reply with (None: the reply is plain content), ``grammar`` (Lark)
    that forces a call (None: free text)."""

    tools: list[dict] | None = None
    format: ToolFormat | None = None
    grammar: str | None = None


def tool_request(template: str, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool = True,
                 literal: Callable[[str], str] = json.dumps) -> ToolRequest:
    """The ``ToolRequest`` of ``tools`` / ``tool_choice`` (default "auto" with tools, "none"
    without) / ``parallel_tool_calls`` for a chat ``template``'s text. "none" still shows the
    tools to the template (as vLLM does) but parses nothing; "auto" parses calls the model
    writes; "required" or a named function also forces one by ``grammar``. ``ValueError`` naming
    ``tools`` / ``tool_choice`` when they are malformed, or when the template teaches no format
    tfport parses; ``literal`` as in ``ToolFormat.grammar``."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError(f"tool_choice={tool_choice!r:.80}: needs tools")
        return ToolRequest()
    tools = check_tools(tools)
    choice, callable_tools = chosen_tools(tools, "auto" if tool_choice is None else tool_choice)
    if not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls={parallel_tool_calls!r}: expected true or false")
    if choice == "none":
        return ToolRequest(tools)
    fmt = detect_format(template)
    if fmt is None:
        markers = [m for f in FORMATS.values() for m in f.markers]
        raise ValueError(f"tools: this model's chat template teaches no tool-call format tfport "
                         f"parses (it has none of the markers {markers}); send tool_choice='none' "
                         "to show the tools without parsing calls")
    grammar = fmt.grammar(callable_tools, parallel_tool_calls, literal) if choice == "required" else None
    return ToolRequest(tools, fmt, grammar)


def template_message(message: Mapping[str, Any], index: int) -> dict:
    """A chat message as templates take it (transformers' conventions): an assistant's
    ``tool_calls`` with each ``function.arguments`` a dict (OpenAI sends JSON text), content ""
    when there is none. ``ValueError`` naming ``messages[i].tool_calls[j]...`` otherwise."""
    message = dict(message)
    calls = message.get("tool_calls")
    if calls is None:
        return message
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ValueError(f"{where}={calls!r:.80}: expected a list of calls")
    converted = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}[{j}]={call!r:.80}: expected {{'id': ..., 'type': 'function', "
                             "'function': {'name': ..., 'arguments': ...}}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}[{j}].function.arguments: not JSON ({err})") from None
        converted.append({**call, "function": {**function, "arguments": arguments}})
    message["tool_calls"] = converted
    if message.get("content") is None:
        message["content"] = ""
    return message
