"""Reading tool calls out of a model's text: ``ToolCallParser`` takes the text in pieces as it
is generated (content text, and ``CallDelta`` items as soon as a call's name, then pieces of its
arguments, are complete); ``parse_reply`` reads a whole reply. The formats and the rules they
follow (vLLM's tool parsers) are in ``tools``.

    >>> parser = ToolCallParser(detect_format(template_text))
    >>> for piece in pieces:
    ...     content, deltas = parser.push(piece)      # content text, [CallDelta]
    >>> content, deltas = parser.finish()
    >>> parser.calls                                  # [ToolCall], complete calls
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .tools import CallDelta, ToolCall, ToolFormat

_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()

def _literals(text: str, pos: int, literals: Sequence[str], final: bool) -> int | None:
    """Where ``literals`` (whitespace around each free) end when they follow ``text[pos:]``
    and something does after them: the index, -1 when they do not follow, None when the text
    is too short to tell (never when ``final``)."""
    for literal in literals:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(literal, pos):
            pos += len(literal)
        elif literal.startswith(text[pos:]) and not final:
            return None
        else:
            return -1
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos if pos < len(text) or final else None


def _json_value(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at ``text[pos]`` and where it ends, or None while it is incomplete (or
    invalid: the two look alike until the text ends)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


@dataclass
class _Call:
    """The call being read: its delta so far (id, name, argument characters sent)."""

    index: int
    id: str | None = None
    name: str | None = None
    sent: int = 0


@dataclass
class ToolCallParser:
    """A reply's text in, pieces at a time -> its content and calls (see the module docstring)."""

    format: ToolFormat
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""  # all content returned so far
    _buffer: str = ""  # text not consumed yet
    _raw: str = ""  # text of the section consumed but not yet a complete call
    _state: str = "begin"  # begin, content, open, calling, between: the step run next
    _call: _Call | None = None

    def push(self, piece: str) -> tuple[str, list[CallDelta]]:
        """Text ``piece`` -> (content that became final, call deltas)."""
        self._buffer += piece
        return self._run(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The end of the reply: what is still held back; an unfinished section is content."""
        content, deltas = self._run(final=True)
        if self._state in ("open", "calling"):
            rest = self._raw + self._buffer
            self._raw = self._buffer = ""
            self._state = "content"
            self.content += rest
            content += rest
        return content, deltas

    def _run(self, final: bool) -> tuple[str, list[CallDelta]]:
        content, deltas = [], []
        while True:
            step = getattr(self, f"_{self._state}")(final, deltas)
            if step is None:
                break
            content.append(step)
        text = "".join(content)
        self.content += text
        return text, deltas

    def _take(self, end: int, section: bool) -> str:
        """Consume ``_buffer[:end]``: into the section's raw text, or returned as content."""
        taken, self._buffer = self._buffer[:end], self._buffer[end:]
        if section:
            self._raw += taken
            return ""
        return taken

    def _fail(self) -> str:
        """The section did not parse: its text is content; look for the next one."""
        text, self._raw = self._raw, ""
        self._state, self._call = "content", None
        return text

    # Each state step returns content (possibly "") when it made progress, None to wait.
    def _begin(self, final: bool, deltas: list) -> str | None:
        fmt = self.format
        if fmt.start:
            self._state = "content"
            return ""
        text = self._buffer.lstrip()
        if not text and not final:
            return None
        if fmt.prefix and text.startswith(fmt.prefix):
            self._take(len(self._buffer) - len(text) + len(fmt.prefix), section=True)
            self._state = "open"
        elif text.startswith("{"):
            self._take(len(self._buffer) - len(text), section=True)
            self._state = "open"
        elif fmt.prefix.startswith(text) and text and not final:
            return None
        else:
            self._state = "content"
        return ""

    def _content(self, final: bool, deltas: list) -> str | None:
        start = self.format.start
        if not self._buffer:
            return None
        if not start:  # the section is only at the reply's start
            return self._take(len(self._buffer), section=False)
        found = self._buffer.find(start)
        if found >= 0:
            text = self._take(found, section=False)
            self._take(len(start), section=True)
            self._state = "open"
            return text
        keep = 0 if final else next((n for n in range(min(len(start) - 1, len(self._buffer)), 0, -1)
                                     if start.startswith(self._buffer[-n:])), 0)
        text = self._take(len(self._buffer) - keep, section=False)
        return text or None

    def _open(self, final: bool, deltas: list) -> str | None:
        end = _literals(self._buffer, 0, self.format.opener, final)
        if end is None:
            return None
        if end < 0 or not self._buffer[end:].startswith("{"):
            return self._fail()
        self._take(end, section=True)
        self._state, self._call = "calling", _Call(len(self.calls))
        return ""

    def _between(self, final: bool, deltas: list) -> str | None:
        fmt = self.format
        more = _literals(self._buffer, 0, fmt.separator, final) if fmt.separator else -1
        if more is None:
            return None
        if more >= 0 and self._buffer[more:].startswith("{"):
            self._take(more, section=True)
            self._state, self._call = "calling", _Call(len(self.calls))
            return ""
        end = _literals(self._buffer, 0, fmt.closer, final) if fmt.closer else 0
        if end is None:
            return None
        self._take(max(end, 0), section=True)
        self._raw = ""
        self._state = "content"  # text after the section (or what broke it) is content
        return ""

    def _calling(self, final: bool, deltas: list) -> str | None:
        call, text = self._call, self._buffer
        header = _HEADER.match(text)
        if header and call.id is None:
            try:
                name = json.loads(f'"{header.group(1)}"')
            except json.JSONDecodeError:
                return self._fail()
            call.id, call.name = self.format.call_id(), name
            deltas.append(CallDelta(call.index, "", call.id, call.name))
        arguments_at = header.end() if header else None
        decoded = _json_value(text, 0)
        if decoded is None:
            if header and text[arguments_at:arguments_at + 1] == "{":  # stream the arguments
                done = _json_value(text, arguments_at)
                self._send(text[arguments_at:done[1] if done else None], deltas)
            return None
        value, end = decoded
        if not isinstance(value, dict):
            return self._fail()
        arguments = value.get("arguments", value.get("parameters"))
        if not isinstance(value.get("name"), str) or not isinstance(arguments, dict) \
                or call.name not in (None, value["name"]):
            return self._fail()
        if header:  # the model's own text of the arguments
            raw = text[arguments_at:_json_value(text, arguments_at)[1]]
        else:
            raw = json.dumps(arguments, ensure_ascii=False)
        if call.id is None:
            call.id, call.name = self.format.call_id(), value["name"]
            deltas.append(CallDelta(call.index, "", call.id, call.name))
        self._send(raw, deltas)
        self.calls.append(ToolCall(call.id, call.name, raw))
        self._take(end, section=True)
        self._raw = ""
        self._state, self._call = "between", None
        return ""

    def _send(self, arguments: str, deltas: list) -> None:
        """A delta with the arguments' text past what was sent (``arguments`` grows)."""
        call = self._call
        if len(arguments) > call.sent:
            deltas.append(CallDelta(call.index, arguments[call.sent:]))
            call.sent = len(arguments)



def parse_reply(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply -> (content, complete calls), as the streamed parse ends."""
    parser = ToolCallParser(fmt)
    parser.push(text)
    parser.finish()
    return parser.content, parser.calls
