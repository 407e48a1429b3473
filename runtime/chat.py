"""Chat with an instruct export: its Jinja chat template, end-of-turn tokens, streamed replies.

    >>> model = load_model("out/smollm2")
    >>> model.chat([{"role": "user", "content": "What is the capital of France?"}])
    'The capital of France is Paris.'
    >>> for piece in model.chat_stream(messages, max_new_tokens=64):
    ...     print(piece, end="", flush=True)

The template (``chat_template.jinja`` of the export, from the checkpoint's GGUF metadata,
``tokenizer_config.json`` or ``chat_template.jinja``) is rendered as transformers'
``apply_chat_template`` renders it: a sandboxed ``jinja2`` environment with ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, the ``raise_exception`` and ``strftime_now``
globals, a ``tojson`` filter that leaves non-ASCII as is, the special tokens (``bos_token``,
``eos_token``, ``unk_token``, ``pad_token``) and ``add_generation_prompt=True``. The rendered text
is tokenized without adding special tokens (the template writes them).

Generation stops at the template's end-of-turn token(s) -- the special token(s) the template
writes after an assistant message, found by rendering one -- and at the config's EOS.

Tools (``tfport.runtime.tools``): ``tools=`` reaches the template as transformers passes it (a
list of ``{"type": "function", "function": {...}}``), assistant messages may carry
``tool_calls`` (``function.arguments`` as JSON text, OpenAI's way, or a dict, transformers'
way: the template gets a dict) and ``tool`` messages answer them. The reply is parsed in the
call format the template teaches; ``tool_choice="required"`` or a named function forces a call
whose arguments match the function's parameter schema (a grammar, ``decoding.grammar``):

    >>> reply = model.chat(messages, tools=[weather_tool], tool_choice="required")
    >>> reply.tool_calls[0].name, json.loads(reply.tool_calls[0].arguments)
    ('get_weather', {'city': 'Paris'})

Needs ``jinja2`` and ``tokenizers`` (extra ``text``); no torch.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from tfport.config import ModelConfig
from tfport.contract import CHAT_TEMPLATE_FILE
from tfport.manifest import Manifest

from .request import LIBRARY_CHAT, Request, split_request
from .tokenizer import TextStream, TextTokenizer
from .tool_parser import ToolCallParser, parse_reply
from .tools import CallDelta, ChatReply, ToolFormat, ToolRequest, template_message, tool_request



class Model(Protocol):
    """What a chat reads of a ``model.Model`` (whose ``chat`` / ``chat_stream`` call in here)."""

    directory: Path
    manifest: Manifest
    config: ModelConfig
    tokenizer: TextTokenizer | None

    def stop_ids(self, stop_token_ids: Sequence[int] | None = None) -> tuple[int, ...]: ...

    def stream(self, input_ids: Any, attention_mask: Any = None, request: Request | None = None,
               **options: Any) -> Iterator[Any]: ...

Messages = Sequence[Mapping[str, Any]]
_PROBE = "\u2063tfport-probe\u2063"  # an assistant message's content, to find what follows it


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError("chat needs the 'jinja2' package to render the chat template "
                          "(pip install 'tfport[text]')") from None
    return jinja2


def compile_template(text: str):
    """A ``jinja2.Template`` of chat template ``text``, in the environment described above."""
    jinja2 = _jinja()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's tokens for training
        masks in transformers): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ValueError(f"chat template: not a valid Jinja template ({err})") from None


def check_messages(messages: Messages) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts, each with a str ``role`` and ``content`` (an assistant
    message with ``tool_calls`` may leave content out), tool calls as templates take them
    (``tools.template_message``)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise TypeError(f"messages: expected a non-empty list of {{'role': ..., 'content': ...}} "
                        f"dicts, got {type(messages).__name__}")
    out = []
    for index, message in enumerate(messages):
        if isinstance(message, Mapping):
            message = template_message(message, index)
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise TypeError(f"messages[{index}]={message!r}: expected a dict with a str 'role' "
                            "and a str 'content'")
        out.append(message)
    return out


class ChatFormat:
    """An export's chat template with its tokenizer: prompt ids and end-of-turn ids."""

    def __init__(self, template: str, tokenizer: TextTokenizer, bos_token_id: int | None,
                 eos_token_id: int | None, pad_token_id: int | None = None):
        self.template = compile_template(template)
        self.source = template
        self.tokenizer = tokenizer
        names = {"bos_token": bos_token_id, "eos_token": eos_token_id, "pad_token": pad_token_id}
        self.special_tokens = {name: tokenizer.token(i) for name, i in names.items() if i is not None}
        self.special_tokens.setdefault("unk_token", tokenizer.unknown_token())
        self.stop_ids = tuple(dict.fromkeys(
            [*self._end_of_turn(), *([eos_token_id] if eos_token_id is not None else [])]))

    def render(self, messages: Messages, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of ``messages`` (``kwargs`` reach the template, e.g. ``tools``)."""
        jinja2 = _jinja()
        variables = {**self.special_tokens, **kwargs}
        try:
            return self.template.render(messages=check_messages(messages),
                                        add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"messages: the chat template refused them: {err}") from None

    def prompt_ids(self, messages: Messages, **kwargs: Any) -> list[int]:
        """Token ids of the rendered prompt (the template writes the special tokens)."""
        return self.tokenizer.encode(self.render(messages, **kwargs), add_special_tokens=False)

    def tool_request(self, tools: Any = None, tool_choice: Any = None,
                     parallel_tool_calls: bool = True) -> ToolRequest:
        """What ``tools`` / ``tool_choice`` ask of this template (``tools.tool_request``); its
        grammar writes markers that are special tokens as ``<[id]>``."""

        def literal(text: str) -> str:
            token = self._special_id(text)
            return json.dumps(text) if token is None else f"<[{token}]>"

        return tool_request(self.source, tools, tool_choice, parallel_tool_calls, literal)

    def marker_ids(self, fmt: ToolFormat) -> dict[int, str]:
        """Ids of ``fmt``'s markers that are special tokens here -> their text (which decoding
        leaves out, and the call parser needs)."""
        ids = {text: self._special_id(text) for text in fmt.special_texts}
        return {token: text for text, token in ids.items() if token is not None}

    def _special_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one special token of the tokenizer, else None."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and ids[0] in self.tokenizer.special_ids() else None

    def _end_of_turn(self) -> list[int]:
        """The special tokens the template writes right after an assistant message's text."""
        jinja2 = _jinja()
        turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        for messages in (turn, [{"role": "system", "content": "S"}, *turn]):
            try:
                text = self.template.render(messages=messages, add_generation_prompt=False,
                                            **self.special_tokens)
            except jinja2.exceptions.TemplateError:
                continue  # e.g. a template that wants a system message first
            if _PROBE not in text:
                continue
            after = text.split(_PROBE, 1)[1]
            special = self.tokenizer.special_ids()
            ids = self.tokenizer.encode(after, add_special_tokens=False)
            for token in ids:  # the first special token; text before it (" ") does not count
                if token in special:
                    return [token]
        return []


_FORMATS: "weakref.WeakKeyDictionary[Model, ChatFormat]" = weakref.WeakKeyDictionary()


def chat_format(model: "Model") -> ChatFormat:
    """The ``ChatFormat`` of ``model``'s export (made once per model)."""
    if model in _FORMATS:
        return _FORMATS[model]
    name = model.manifest.chat_template or CHAT_TEMPLATE_FILE
    path = model.directory / name
    if not path.is_file():
        raise ValueError(f"messages: {model.directory} has no chat template ({CHAT_TEMPLATE_FILE}); "
                         "export an instruct checkpoint that ships one (GGUF tokenizer.chat_template, "
                         "or a Hugging Face tokenizer_config.json / chat_template.jinja)")
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(f"messages: {model.directory} has no tokenizer.json; chat needs one")
    config = model.config
    fmt = ChatFormat(path.read_text(), tokenizer, config.bos_token_id, config.eos_token_id,
                     config.pad_token_id)
    _FORMATS[model] = fmt
    return fmt


def chat_stream(model: "Model", messages: Messages, request: Request | None = None, *, tools: Any = None,
                tool_choice: Any = None, parallel_tool_calls: bool = True,
                **options: Any) -> Iterator[str | CallDelta]:
    """The assistant's reply to ``messages``, one str per generated token: the text that became
    complete with it ("" while a character's bytes are incomplete, or while a byte-level decode
    would rewrite text already yielded). Ends at an end-of-turn token (never shown) or after
    ``max_new_tokens`` (default 256, ``request.LIBRARY_CHAT``). ``request`` and ``options``: as
    ``Model.generate`` takes them (``stop_token_ids`` default to the end-of-turn ids and EOS).

    With ``tools`` (and ``tool_choice`` other than "none") the reply is parsed as it comes:
    content as str pieces, calls as ``tools.CallDelta`` items (see ``tool_parser.ToolCallParser``).
    ``tool_choice`` "required" or ``{"type": "function", "function": {"name": ...}}`` forces a
    call by grammar, so it takes no other constraint; ``parallel_tool_calls=False`` allows one."""
    texts, tool_format = _reply_texts(model, messages, request, tools, tool_choice, parallel_tool_calls,
                                      options)
    return texts if tool_format is None else _parsed(texts, ToolCallParser(tool_format))


def chat(model: "Model", messages: Messages, request: Request | None = None, *, tools: Any = None,
         tool_choice: Any = None, parallel_tool_calls: bool = True, **options: Any) -> str | ChatReply:
    """The assistant's reply to ``messages`` as one str (see ``chat_stream``); with ``tools``,
    a ``ChatReply`` with the calls parsed (``tool_parser.parse_reply``)."""
    texts, tool_format = _reply_texts(model, messages, request, tools, tool_choice, parallel_tool_calls,
                                      options)
    text = "".join(texts)
    if tools is None:
        return text
    return ChatReply(*parse_reply(tool_format, text)) if tool_format else ChatReply(text, [])


def _reply_texts(model: "Model", messages: Messages, request: Request | None, tools: Any, tool_choice: Any,
                 parallel_tool_calls: bool, options: dict[str, Any]
                 ) -> tuple[Iterator[str], ToolFormat | None]:
    """The reply's text pieces (markers that are special tokens shown) and the tool-call format
    to parse them in (None: plain content); arguments as ``chat_stream``'s."""
    fmt = chat_format(model)
    options, rest = split_request(options)
    request = Request.of(request, **options)
    tool_request = fmt.tool_request(tools, tool_choice, parallel_tool_calls)
    if tool_request.grammar is not None:
        if request.constraint:
            raise ValueError(f"tool_choice={tool_choice!r:.60}: forces a call by grammar; it takes "
                             f"no {', '.join(request.constraint)} too")
        request = request.replace(grammar=tool_request.grammar)
    prompt = fmt.prompt_ids(messages, **({"tools": tool_request.tools} if tool_request.tools else {}))
    stops = fmt.stop_ids if request.stop_token_ids is None else model.stop_ids(request.stop_token_ids)
    request = request.replace(stop_token_ids=stops, max_new_tokens=request.max_new_tokens or
                              LIBRARY_CHAT.max_new_tokens)
    steps = model.stream([prompt], None, request, **rest)
    markers = fmt.marker_ids(tool_request.format) if tool_request.format is not None else {}

    def texts() -> Iterator[str]:
        text = TextStream(fmt.tokenizer)
        for tokens in steps:
            token = int(tokens[0])
            if token in stops:
                break
            yield text.push(token) + markers.get(token, "")
        tail = text.finish()
        if tail:
            yield tail

    return texts(), tool_request.format


def _parsed(texts: Iterator[str], parser: ToolCallParser) -> Iterator[str | CallDelta]:
    """Text pieces -> content pieces and call deltas, in order."""
    for piece in texts:
        content, deltas = parser.push(piece)
        yield content
        yield from deltas
    content, deltas = parser.finish()
    if content:
        yield content
    yield from deltas
