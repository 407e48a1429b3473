"""``Model``'s text side (``TextMethods``): ``generate_text``, ``chat`` and ``chat_stream`` take
and give text, through the export's tokenizer and chat template, on ``Model.generate`` /
``stream``; and ``cut_at_stop``, the tokens of a row its text shows.

    >>> model.generate_text("The capital of France is", max_new_tokens=8)
    >>> model.chat([{"role": "user", "content": "Hi"}], response_format={"type": "json_object"})
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .decoding.grammar import KINDS, constraint_arguments
from .request import Request, split_request
from .tools import CallDelta, ChatReply


class TextMethods:
    """``Model``'s text-in, text-out methods. Uses the model's ``text_tokenizer``, ``generate``
    and ``stop_ids``; the chat module is imported when a chat starts (it needs jinja2)."""

    def generate_text(self, prompts: str | Sequence[str], request: Request | None = None,
                      **kwargs: Any) -> str | list[str]:
        """Generate from text prompt(s) -> the continuation text(s) (one per prompt).

        ``request`` and keyword arguments are those of ``generate``; text stops before the first
        stop token.
        """
        tokenizer = self.text_tokenizer("prompts")
        single = isinstance(prompts, str)
        options, rest = split_request(kwargs)
        request = Request.of(request, **options)
        tokens = self.generate(tokenizer.encode_batch(prompts, "prompts"), None, request, **rest)
        stops = request.stop_ids(self.defaults)
        texts = [tokenizer.decode(cut_at_stop(row, stops)) for row in tokens]
        return texts[0] if single else texts

    def chat(self, messages: Sequence[dict], **kwargs: Any) -> str | ChatReply:
        """The assistant's reply to ``messages`` (``[{"role": "user", "content": "..."}, ...]``),
        rendered with the export's chat template and stopped at its end-of-turn token.

        Keyword arguments: ``max_new_tokens`` (default 256), ``temperature``, ``top_k``,
        ``top_p``, ``seed``, ``stop_token_ids``, ``json_schema`` / ``regex`` / ``grammar`` (see
        ``generate``); see ``tfport.runtime.chat``. ``response_format`` is OpenAI's:
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``,
        ``{"type": "json_object"}`` or ``{"type": "text"}`` (``decoding.grammar.constraint_arguments``).

        Tools (``tfport.runtime.tools``): ``tools`` (OpenAI's function tools), ``tool_choice``
        ("auto", "none", "required" or ``{"type": "function", "function": {"name": ...}}``),
        ``parallel_tool_calls``; with ``tools`` the reply is a ``ChatReply`` (``content``,
        ``tool_calls``).
        """
        from .chat import chat
        return chat(self, messages, **_response_format(kwargs))

    def chat_stream(self, messages: Sequence[dict], **kwargs: Any) -> Iterator[str | CallDelta]:
        """``chat``, streamed: one text piece per generated token (see ``tfport.runtime.chat``);
        with ``tools``, calls come as ``tools.CallDelta`` items."""
        from .chat import chat_stream
        return chat_stream(self, messages, **_response_format(kwargs))


def _response_format(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``chat`` keyword arguments with ``response_format`` turned into ``json_schema`` / ``regex``
    / ``grammar`` (``constraint_arguments``); ``ValueError`` when a constraint is given twice."""
    kwargs = dict(kwargs)
    constraint = constraint_arguments(kwargs.pop("response_format", None))
    given = [name for name in KINDS if kwargs.get(name) is not None]
    if constraint and given:
        raise ValueError(f"response_format, {', '.join(given)}: give the output's constraint once")
    return {**kwargs, **constraint}


def cut_at_stop(tokens: Sequence[int], stop_token_ids: Sequence[int]) -> list[int]:
    """Tokens before the first stop id."""
    out = []
    for token in tokens:
        if int(token) in stop_token_ids:
            break
        out.append(int(token))
    return out
