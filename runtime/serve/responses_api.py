"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) on the chat
machinery: a request's ``instructions`` and ``input`` (a text, or message, ``function_call`` and
``function_call_output`` items) become chat messages rendered with the export's template, its
``text.format`` the chat's ``response_format`` and its function ``tools`` / ``tool_choice`` the
chat's (``ServedModel.chat_inputs``); the reply comes back as ``output`` items (a ``message``
with its ``output_text``, one ``function_call`` per call), whole or as the Responses stream's
typed events (``response.created`` ... ``response.completed``, no ``[DONE]``).

``previous_response_id`` continues a conversation: each response (unless ``store: false``) is
kept in the server's memory with its conversation (``ResponseStore``, the last ``STORED``), and
the next turn's messages start with it. Its prompt then starts with the previous prompt's tokens,
so the prefix cache serves them (``usage.input_tokens_details.cached_tokens``: how many it held
when the request came). A response not stored here (evicted, another replica, a restart) is a 400
naming ``previous_response_id``; as in OpenAI's API, the previous ``instructions`` are not
carried over.

A reply cut at ``max_output_tokens`` is ``status: "incomplete"`` (reason ``max_output_tokens``),
as is a stream the stopping server ends (reason ``shutting_down``, ``lifecycle``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from ..chat import chat_format
from ..tool_parser import ToolCallParser, parse_reply
from ..tools import CallDelta
from .handles import Handle
from .errors import ApiError, quote
from .protocol import ChatRequest, ResponsesRequest
from .responses import ABORT, SHUTTING_DOWN, cancel_when_gone, choice_pieces
from .responses_input import chat_tool_choice, chat_tools, input_messages, rename, renamed, response_format
from .served import ServedModel

STORED = 1024  # responses kept for previous_response_id, the least recently used dropped first
# The chat field an error names -> the Responses field it came from.


@dataclass
class StoredResponse:
    """A response kept for ``previous_response_id``: its conversation as chat ``messages``
    (the earlier turns, its input and its reply; instructions left out) and its JSON."""

    messages: list[dict]
    response: dict


class ResponseStore:
    """The last ``capacity`` responses by id (thread-safe: turns are read in worker threads)."""

    def __init__(self, capacity: int = STORED):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored


# ----------------------------------------------------------------------------- the answer
def _usage(prompt: int, cached: int, output: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Output:
    """A reply's output items as they are made (message text, calls), in output order."""

    items: list[dict] = field(default_factory=list)  # {"kind", "id", "text" | "call_id", "name", "arguments"}
    held: str = ""  # whitespace before a message has begun (no message item for it next to calls)

    def text(self, piece: str) -> tuple[dict | None, str, bool]:
        """Add content ``piece`` -> (the message item, the text it gained, whether it began
        now); no item while only whitespace came."""
        message = next((i for i in self.items if i["kind"] == "message"), None)
        begun = message is None
        if begun:
            self.held += piece
            if not self.held.strip():
                return None, "", False
            message = {"kind": "message", "id": _item_id("msg"), "text": ""}
            self.items.append(message)
            piece, self.held = self.held, ""
        message["text"] += piece
        return message, piece, begun

    def call(self, delta: CallDelta) -> dict:
        """Add a call delta -> its call item (new for a delta with an id)."""
        if delta.id is not None:
            self.items.append({"kind": "call", "index": delta.index, "id": _item_id("fc"), "call_id": delta.id,
                               "name": delta.name, "arguments": ""})
        item = next(i for i in self.items if i["kind"] == "call" and i["index"] == delta.index)
        item["arguments"] += delta.arguments
        return item

    @classmethod
    def of_reply(cls, text: str, fmt) -> "_Output":
        """The items of a whole reply: its content, then its complete calls (``parse_reply``, as
        a chat's message has them; a call cut short stays content)."""
        content, calls = parse_reply(fmt, text) if fmt is not None else (text, [])
        output = cls()
        if content.strip() or not calls:
            output.items.append({"kind": "message", "id": _item_id("msg"), "text": content})
        for index, call in enumerate(calls):
            output.items.append({"kind": "call", "index": index, "id": _item_id("fc"), "call_id": call.id,
                                 "name": call.name, "arguments": call.arguments})
        return output

    def finish(self) -> dict | None:
        """The end of the reply: a message item for a reply of whitespace or nothing and no call."""
        if self.items:
            return None
        message = {"kind": "message", "id": _item_id("msg"), "text": self.held}
        self.items.append(message)
        return message

    def json(self, status: str) -> list[dict]:
        return [_message_item(i["id"], i["text"], status) if i["kind"] == "message"
                else _call_item(i["id"], i["call_id"], i["name"], i["arguments"], status) for i in self.items]

    def message(self) -> dict:
        """The reply as a chat message, for the conversation kept with the response."""
        text = "".join(i["text"] for i in self.items if i["kind"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["kind"] == "call"]
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


class ResponseTurn:
    """One /v1/responses request on ``served``: its chat request and prompt (made in a worker
    thread: it tokenises), then its answer from the handle it was submitted as."""

    def __init__(self, served: ServedModel, body: ResponsesRequest, store: ResponseStore):
        if body.background:
            raise ApiError(400, "background: not supported by this server", "background")
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise ApiError(400, f"previous_response_id={quote(body.previous_response_id)}: no such "
                                    f"response on this server (it keeps the last {store.capacity} in "
                                    "memory, those stored with store: true)", "previous_response_id")
            history = previous.messages
        self.served, self.body, self.store = served, body, store
        self.conversation = [*history, *input_messages(body.input)]
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            self.chat = ChatRequest.model_validate({
                "model": body.model, "messages": [*system, *self.conversation],
                "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                "top_p": body.top_p, "seed": body.seed, "tools": chat_tools(body.tools),
                "tool_choice": chat_tool_choice(body.tool_choice),
                "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format(body.text)})
        except ValidationError as err:
            raise rename(ApiError.from_validation(err.errors())) from None
        self.prompts, self.decoding = renamed(served.chat_inputs, self.chat)
        cache = served.model.prefix_cache
        self.cached = 0 if cache is None else cache.cached_length(self.prompts[0])
        self.tool_format = renamed(served.tool_request, self.chat).format
        self.markers = chat_format(served.model).marker_ids(self.tool_format) if self.tool_format else {}
        self.id = _item_id("resp")
        self.created = int(time.time())

    def _response(self, status: str, output: list[dict], generated: int | None = None,
                  reason: str | None = None) -> dict:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": None if reason is None else {"reason": reason},
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": self.served.name, "output": output, "parallel_tool_calls": body.parallel_tool_calls,
                "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
                "usage": None if generated is None else _usage(len(self.prompts[0]), self.cached, generated),
                "user": body.user, "metadata": body.metadata or {}}

    def _final(self, output: _Output, finish: str | None, generated: int) -> dict:
        """The whole response once the reply ended with ``finish``; kept when ``store``."""
        reason = {"length": "max_output_tokens", ABORT: SHUTTING_DOWN}.get(finish)
        status = "completed" if reason is None else "incomplete"
        response = self._response(status, output.json("completed" if reason is None else "incomplete"),
                                  generated, reason)
        if self.body.store:
            self.store.put(self.id, StoredResponse([*self.conversation, output.message()], response))
        return response

    async def _pieces(self, handle: Handle) -> AsyncIterator[tuple[str, list[CallDelta], str | None, int]]:
        """The reply as (content, call deltas, finish reason, tokens generated) pieces, calls
        parsed as they are written (a chat stream's ``ToolCallParser``)."""
        parser = ToolCallParser(self.tool_format) if self.tool_format else None
        async for piece in choice_pieces(self.served, handle, [], self.markers):
            content, deltas = parser.push(piece.text) if parser else (piece.text, [])
            if piece.finish and parser:
                tail, more = parser.finish()
                content, deltas = content + tail, deltas + more
            yield content, deltas, piece.finish, piece.generated

    async def respond(self, handles: list[Handle], request: Request) -> JSONResponse | StreamingResponse:
        handle, = handles
        if self.body.stream:
            return StreamingResponse(self._events(handle), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(cancel_when_gone(request, handles))
        texts, finish, generated = [], None, 0
        try:
            async for piece in choice_pieces(self.served, handle, [], self.markers):
                texts.append(piece.text)
                finish, generated = piece.finish or finish, generated + piece.generated
        finally:
            watcher.cancel()
            handle.cancel()
        output = _Output.of_reply("".join(texts), self.tool_format)
        return JSONResponse(self._final(output, finish, generated))

    async def _events(self, handle: Handle) -> AsyncIterator[str]:
        """The Responses stream: created, in_progress, then each item's added / delta / done
        events, then completed or incomplete (an ``error`` event for a failed reply)."""
        numbers = itertools.count()

        def event(kind: str, **data) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(numbers), **data})}\n\n"

        def added(item: dict, index: int) -> list[str]:
            if item["kind"] == "message":
                return [event("response.output_item.added", output_index=index,
                              item={**_message_item(item["id"], "", "in_progress"), "content": []}),
                        event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
            return [event("response.output_item.added", output_index=index,
                          item=_call_item(item["id"], item["call_id"], item["name"], "", "in_progress"))]

        def done(item: dict, index: int, status: str) -> list[str]:
            if item["kind"] == "message":
                part = {"type": "output_text", "text": item["text"], "annotations": [], "logprobs": []}
                return [event("response.output_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=item["text"], logprobs=[]),
                        event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=part),
                        event("response.output_item.done", output_index=index,
                              item=_message_item(item["id"], item["text"], status))]
            return [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"]),
                    event("response.output_item.done", output_index=index,
                          item=_call_item(item["id"], item["call_id"], item["name"], item["arguments"], status))]

        yield event("response.created", response=self._response("in_progress", []))
        yield event("response.in_progress", response=self._response("in_progress", []))
        output, finish, generated = _Output(), None, 0
        try:
            async for content, deltas, reason, tokens in self._pieces(handle):
                finish, generated = reason or finish, generated + tokens
                message, text, begun = output.text(content) if content else (None, "", False)
                if begun:
                    for line in added(message, output.items.index(message)):
                        yield line
                if text:
                    yield event("response.output_text.delta", item_id=message["id"],
                                output_index=output.items.index(message), content_index=0,
                                delta=text, logprobs=[])
                for delta in deltas:
                    item = output.call(delta)
                    index = output.items.index(item)
                    if delta.id is not None:
                        for line in added(item, index):
                            yield line
                    if delta.arguments:
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=index, delta=delta.arguments)
        except ApiError as err:
            if err.code != SHUTTING_DOWN:
                yield event("error", code=err.code, message=err.message, param=err.param)
                return
            finish = ABORT
        finally:
            handle.cancel()
        last = output.finish()
        if last is not None:
            for line in added(last, 0):
                yield line
        response = self._final(output, finish, generated)
        for index, item in enumerate(output.items):
            for line in done(item, index, response["output"][index]["status"]):
                yield line
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield event(kind, response=response)


def stored_response(store: ResponseStore, response_id: str) -> dict:
    """``GET /v1/responses/{id}``: a stored response; ``ApiError`` 404 otherwise."""
    stored = store.get(response_id)
    if stored is None:
        raise ApiError(404, f"response {quote(response_id)} is not stored on this server", "response_id",
                       "response_not_found")
    return stored.response
