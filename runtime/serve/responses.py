"""The responses of completions and chat completions: a request's handles (one per choice)
turned into OpenAI's JSON, or into server-sent events as tokens arrive.

Each choice's tokens become text with the export's tokenizer (``TextStream``), held back while
its end could be the start of a ``stop`` string (``StopText``); every choice also carries its
``token_ids`` (stop token excluded), so exports without a tokenizer are served on ids, and its
``logprobs`` when asked (``logprobs``: OpenAI's shapes; a streamed chunk carries its tokens').
A completion with ``echo`` starts with its prompt (the first chunk of a stream), and with
``logprobs`` the prompt tokens' too (``ServedModel.prompt_logprobs``); ``max_tokens: 0`` with
``echo`` scores the prompt only. A completion's stop token (end-of-text) is counted in its usage
and, with logprobs, has the last entry (not shown in the text), as OpenAI's and vLLM's
completions do; a chat's end of turn is neither. A chat with ``tools``
has its replies parsed in the template's call format (``tfport.runtime.tools``): ``tool_calls``
in the message, ``delta.tool_calls`` items in a stream, finish reason "tool_calls". A client
that goes away (a closed stream, or a disconnect while a JSON answer is pending) cancels its rows,
which frees them at the scheduler's next step. A stream the stopping server ends
(``lifecycle``) ends cleanly: a last chunk with finish reason "abort", then ``[DONE]``; a JSON
answer gets a 503. ``embedding_response`` builds an embeddings answer
(in a worker thread: the JSON of 2,048 vectors takes a while).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..chat import chat_format
from ..tool_parser import ToolCallParser, parse_reply
from .errors import ApiError
from .protocol import DecodingRequest, EmbeddingRequest
from .handles import Failed, Finished, Handle, Token
from .logprobs import Scored, chat_logprobs, completion_logprobs
from .served import ServedModel

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
SHUTTING_DOWN = "shutting_down"  # the error code of a request the stopping server ended
ABORT = "abort"  # the finish reason of a stream the stopping server ended (vLLM's)


class StopText:
    """Text pieces in, text out up to the first ``stop`` string: a piece is held back while the
    text's end could be the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything pushed
        self.shown = 0  # characters returned so far
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        if self.stops:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._show(min(hits))
        return self._show(len(self.text) - self.hold)

    def finish(self) -> str:
        return "" if self.stopped else self._show(len(self.text))

    def _show(self, end: int) -> str:
        if end <= self.shown:
            return ""
        out, self.shown = self.text[self.shown:end], end
        return out


@dataclass(frozen=True)
class Piece:
    """What one step of a choice adds: its ``text``, its token ``ids`` (the stop token left
    out), its ``finish`` reason once it ends, the ``scored`` entries of its tokens when logprobs
    are asked (``logprobs.Scored``) and the tokens it ``generated`` (usage)."""

    text: str
    ids: list[int]
    finish: str | None = None
    scored: list[Scored] = field(default_factory=list)
    generated: int = 0


async def choice_pieces(served: ServedModel, handle: Handle, stops: list[str],
                        markers: Mapping[int, str] | None = None, stop_token: bool = False
                        ) -> AsyncIterator[Piece]:
    """One choice's ``Piece``s as it is generated; ``ApiError`` for a row that timed out, was
    cancelled by the server or failed. ``markers``: special token ids shown as their text
    (tool-call markers, ``ChatFormat.marker_ids``). ``stop_token``: the stop token that ends the
    row is scored and counted as generated, though neither shown nor in ``ids`` (completions, as
    OpenAI's and vLLM's: lm-eval scores a continuation with ``echo`` and ``max_tokens: 1`` and
    drops the last entry, the token generated, end-of-text included)."""
    markers = markers or {}
    text = served.text_stream()
    stop = StopText(stops)
    stop_ids = handle.request.stop_ids
    async for event in handle:
        if isinstance(event, Token):
            offset = len(text.shown) if text is not None else 0  # the choice's text before it
            scored = [] if event.logprob is None else [(event.logprob, offset)]
            if event.id in stop_ids:  # the Finished("stop") that follows ends the choice
                if stop_token:
                    yield Piece("", [], None, scored, 1)
                continue
            piece = stop.push(text.push(event.id) + markers.get(event.id, "")) if text is not None else ""
            yield Piece(piece, [event.id], None, scored, 1)
            if stop.stopped:
                handle.cancel()
                yield Piece("", [], "stop")
                return
        elif isinstance(event, Finished):
            if event.reason == "timeout":
                raise ApiError(504, f"the request ran past this server's timeout of "
                                    f"{handle.request.timeout:g} s", code="timeout")
            if event.reason == "cancelled":
                raise ApiError(503, "the request was cancelled: the server is stopping (running "
                                    "requests get --shutdown-timeout seconds)", code=SHUTTING_DOWN)
            tail = text.finish() if text is not None else ""
            yield Piece(stop.push(tail) + stop.finish(), [], "stop" if stop.stopped else event.reason)
            return
        elif isinstance(event, Failed):
            raise ApiError.internal(event.error, "generation")


async def cancel_when_gone(request: Request, handles: Sequence[Handle]) -> None:
    """Cancel ``handles``' rows when the client of a non-streaming request goes away (run it as
    a task while the answer is pending)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    for handle in handles:
        handle.cancel()


@dataclass(frozen=True)
class Echo:
    """What a completion with ``echo`` shows before its tokens: the prompt's ``text``, and with
    logprobs its token ``ids`` and their ``scored`` entries (``ServedModel.prompt_logprobs``)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)


class Completion:
    """The handles of one request and the response they make (JSON or server-sent events):
    ``chat`` says whether it answers /v1/chat/completions or /v1/completions."""

    def __init__(self, served: ServedModel, body: DecodingRequest, handles: list[Handle],
                 prompts: list[list[int]], chat: bool):
        self.served = served
        self.body = body
        self.handles = handles
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p) for p in prompts) * body.n
        self.chat = chat
        self.stops = body.stop_strings()
        self.prompts = prompts
        self.top = body.logprobs_top()  # alternatives per token; None: no logprobs
        self.echo = not chat and body.echo
        # tool calls: the format the replies are parsed in (None: plain content), one parser a choice
        self.tool_format = served.tool_request(body).format if chat else None
        self.markers = chat_format(served.model).marker_ids(self.tool_format) if self.tool_format else {}
        self.parsers = [ToolCallParser(self.tool_format) for _ in handles] if self.tool_format else []

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()

    async def respond(self, request: Request) -> JSONResponse | StreamingResponse:
        if self.body.stream:
            return StreamingResponse(self._events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(cancel_when_gone(request, self.handles))
        try:
            echoes, *results = await asyncio.gather(self._echoes(),
                                                    *(self._collect(h) for h in self.handles))
        finally:
            watcher.cancel()
            self.cancel()  # a no-op for finished rows; frees the others after an error
        choices = []
        completion_tokens = 0
        for index, (text, ids, reason, scored, generated) in enumerate(results):
            completion_tokens += generated
            echo = echoes[index]
            output = {"message": self._message(text)} if self.chat else {"text": echo.text + text}
            if self.chat and output["message"].get("tool_calls") and reason == "stop":
                reason = "tool_calls"
            choices.append({"index": index, **output, "logprobs": self._logprobs(scored, echo),
                            "finish_reason": reason, "token_ids": ids})
        # written by json at once, not walked item by item by FastAPI's encoder first
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created,
                             "model": self.served.name, "choices": choices,
                             "usage": self._usage(completion_tokens)})

    def _usage(self, completion_tokens: int) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": self.prompt_tokens + completion_tokens}
        if self.served.speculates:  # draft tokens proposed and accepted for this request
            usage["speculative"] = {"proposed": sum(h.proposed for h in self.handles),
                                    "accepted": sum(h.accepted for h in self.handles)}
        return usage

    async def _collect(self, handle: Handle) -> tuple[str, list[int], str, list[Scored], int]:
        """A choice's (text, ids, finish reason, scored entries, tokens generated)."""
        texts, ids, reason, scored, generated = [], [], None, [], 0
        async for piece in self._pieces(handle):
            texts.append(piece.text)
            ids.extend(piece.ids)
            scored.extend(piece.scored)
            generated += piece.generated
            reason = piece.finish or reason
        return "".join(texts), ids, reason, scored, generated

    def _pieces(self, handle: Handle) -> AsyncIterator[Piece]:
        """``choice_pieces`` of a choice; a completion's stop token is scored and counted."""
        return choice_pieces(self.served, handle, self.stops, self.markers, stop_token=not self.chat)

    async def _echoes(self) -> list[Echo]:
        """Each choice's ``Echo``: its prompt (text, ids, scores) with ``echo``, else empty.
        Scoring the prompts runs the decoder: in a worker thread."""
        if not self.echo:
            return [Echo()] * len(self.handles)
        echoes = await asyncio.to_thread(lambda: [self._echo(i) for i in range(len(self.prompts))])
        return [echoes[index // self.body.n] for index in range(len(self.handles))]

    def _echo(self, index: int) -> Echo:
        """The echo of prompt ``index``: the prompt as sent (decoded when sent as ids) and, with
        logprobs, its tokens' scores at their offsets in the decoded prompt."""
        prompt, tokenizer = self.prompts[index], self.served.model.tokenizer
        sent = self.body.prompt
        text = sent if isinstance(sent, str) else sent[index] if isinstance(sent[index], str) \
            else tokenizer.decode(prompt) if tokenizer is not None else ""
        if self.top is None:
            return Echo(text)
        stream = self.served.text_stream()
        offsets = []
        for token in prompt:
            offsets.append(len(stream.shown) if stream is not None else 0)
            if stream is not None:
                stream.push(token)
        return Echo(text, prompt, list(zip(self.served.prompt_logprobs(prompt, self.top), offsets)))

    def _logprobs(self, scored: list[Scored], echo: Echo, prompt: bool = True) -> dict | None:
        """A choice's (or chunk's) ``logprobs`` of its tokens' ``scored`` entries, in the
        endpoint's shape, after ``echo``'s text (and its prompt tokens' entries when ``prompt``);
        None when not asked."""
        if self.top is None:
            return None
        tokenizer = self.served.model.tokenizer
        if self.chat:
            return chat_logprobs(tokenizer, [score for score, _ in scored])
        ids, entries = (echo.ids, echo.scored) if prompt else ([], [])
        shift = len(echo.text)
        return completion_logprobs(tokenizer, [*ids, *(score.token for score, _ in scored)],
                                   [*entries, *((score, offset + shift) for score, offset in scored)])

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                "created": self.created, "model": self.served.name, "choices": choices, **extra}

    def _message(self, text: str) -> dict:
        """A chat choice's message: ``text`` as content, or parsed into content and
        ``tool_calls`` (content None when only whitespace is left)."""
        if self.tool_format is None:
            return {"role": "assistant", "content": text}
        content, calls = parse_reply(self.tool_format, text)
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content if content.strip() else None,
                "tool_calls": [call.openai() for call in calls]}

    def _parse(self, index: int, piece: str, reason: str | None
               ) -> tuple[str, list[dict], str | None]:
        """A streamed choice's piece (and finish reason) -> (content, ``delta.tool_calls`` items,
        finish reason: "tool_calls" for a reply that ended with calls)."""
        if not self.parsers:
            return piece, [], reason
        parser = self.parsers[index]
        content, deltas = parser.push(piece)
        if reason is not None:
            tail, more = parser.finish()
            content, deltas = content + tail, deltas + more
            if parser.calls and reason == "stop":
                reason = "tool_calls"
        return content, [delta.openai() for delta in deltas], reason

    def _choice_chunk(self, index: int, piece: str | None, reason: str | None, ids: list[int],
                      logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            output = {"delta": {} if piece is None else {"content": piece}}
            if tool_calls:
                output["delta"]["tool_calls"] = tool_calls
        else:
            output = {"text": piece or ""}
        return self._chunk([{"index": index, **output, "logprobs": logprobs, "finish_reason": reason,
                             "token_ids": ids}])

    async def _events(self) -> AsyncIterator[str]:
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, handle: Handle) -> None:
            try:
                async for item in self._pieces(handle):
                    await events.put((index, item))
            except ApiError as err:
                await events.put((index, err))
            except Exception as err:  # noqa: BLE001 -- reported to the client, server carries on
                await events.put((index, ApiError.internal(err, "stream")))
            finally:
                await events.put((index, None))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(self.handles)]
        completion_tokens = 0
        try:
            if self.chat:
                for index in range(len(self.handles)):
                    chunk = self._choice_chunk(index, "", None, [])
                    chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield sse(chunk)
            echoes = await self._echoes()
            if self.echo:  # the prompt first, with its tokens' logprobs when asked
                for index, echo in enumerate(echoes):
                    logprobs = self._logprobs([], echo)
                    yield sse(self._choice_chunk(index, echo.text, None, [], logprobs))
            remaining = len(tasks)
            while remaining:
                index, item = await events.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, ApiError) and item.code == SHUTTING_DOWN:  # a clean end
                    yield sse(self._choice_chunk(index, None, ABORT, []))
                elif isinstance(item, ApiError):
                    yield sse(item.body())
                else:
                    piece, calls, reason = self._parse(index, item.text, item.finish)
                    completion_tokens += item.generated
                    if piece or item.ids or item.scored or reason or calls:
                        logprobs = self._logprobs(item.scored, echoes[index], prompt=False) \
                            if item.scored else None
                        yield sse(self._choice_chunk(index, piece if piece or not reason else None,
                                                     reason, item.ids, logprobs, calls))
            if (self.body.stream_options or {}).get("include_usage"):
                yield sse(self._chunk([], usage=self._usage(completion_tokens)))
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: free the rows at the next step
            self.cancel()
            for task in tasks:
                task.cancel()


def sse(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


def embedding_response(served: ServedModel, body: EmbeddingRequest, vectors: np.ndarray,
                       tokens: int) -> JSONResponse:
    """The answer to /v1/embeddings: each of ``vectors`` float32 [B, E] (from ``tokens`` input
    tokens), cut to ``dimensions`` where the export declares them (``Model.matryoshka``), as
    floats or base64 of little-endian float32. Writes the JSON: call it in a worker thread."""
    if body.dimensions is not None:
        try:
            vectors = served.model.matryoshka(vectors, body.dimensions)
        except ValueError as err:
            raise ApiError(400, str(err), "dimensions") from None
    data = []
    for index, vector in enumerate(vectors):
        if body.encoding_format == "base64":
            value = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            value = vector.astype(float).tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    return JSONResponse({"object": "list", "data": data, "model": served.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
