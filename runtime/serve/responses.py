"""The responses of completions and chat completions: a request's handles (one per choice)
turned into OpenAI's JSON, or into server-sent events as tokens arrive.

Each choice's tokens become text with the export's tokenizer (``TextStream``), held back while
its end could be the start of a ``stop`` string (``StopText``); every choice also carries its
``token_ids`` (stop token excluded), so exports without a tokenizer are served on ids. A client
that goes away (a closed stream, or a disconnect while a JSON answer is pending) cancels its rows,
which frees them at the scheduler's next step. ``embedding_response`` builds an embeddings answer
(in a worker thread: the JSON of 2,048 vectors takes a while).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .protocol import ApiError, DecodingRequest, EmbeddingRequest, check_text, quote
from .handles import Failed, Finished, Handle, Token
from .served import ServedModel

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there


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


async def choice_pieces(served: ServedModel, handle: Handle, stops: list[str]
                        ) -> AsyncIterator[tuple[str, list[int], str | None]]:
    """One choice's (text piece, new token ids, finish reason or None) as it is generated;
    ``ApiError`` for a row that timed out, was cancelled by the server or failed."""
    text = served.text_stream()
    stop = StopText(stops)
    stop_ids = handle.request.stop_ids
    async for event in handle:
        if isinstance(event, Token):
            if event.id in stop_ids:
                continue  # the Finished("stop") that follows ends the choice
            piece = stop.push(text.push(event.id)) if text is not None else ""
            yield piece, [event.id], None
            if stop.stopped:
                handle.cancel()
                yield "", [], "stop"
                return
        elif isinstance(event, Finished):
            if event.reason == "timeout":
                raise ApiError(504, f"the request ran past this server's timeout of "
                                    f"{handle.request.timeout:g} s", code="timeout")
            if event.reason == "cancelled":
                raise ApiError(503, "the request was cancelled (the server is stopping)")
            tail = text.finish() if text is not None else ""
            yield stop.push(tail) + stop.finish(), [], "stop" if stop.stopped else event.reason
            return
        elif isinstance(event, Failed):
            raise ApiError.internal(event.error, "generation")


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

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()

    async def respond(self, request: Request) -> JSONResponse | StreamingResponse:
        if self.body.stream:
            return StreamingResponse(self._events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(self._watch(request))
        try:
            results = await asyncio.gather(*(self._collect(h) for h in self.handles))
        finally:
            watcher.cancel()
            self.cancel()  # a no-op for finished rows; frees the others after an error
        choices = []
        completion_tokens = 0
        for index, (text, ids, reason) in enumerate(results):
            completion_tokens += len(ids)
            output = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": index, **output, "logprobs": None, "finish_reason": reason,
                            "token_ids": ids})
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

    async def _watch(self, request: Request) -> None:
        """Cancel the rows when the client of a non-streaming request goes away."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.cancel()

    async def _collect(self, handle: Handle) -> tuple[str, list[int], str]:
        pieces, ids, reason = [], [], None
        async for piece, new, finish in choice_pieces(self.served, handle, self.stops):
            pieces.append(piece)
            ids.extend(new)
            reason = finish or reason
        return "".join(pieces), ids, reason

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                "created": self.created, "model": self.served.name, "choices": choices, **extra}

    def _choice_chunk(self, index: int, piece: str | None, reason: str | None, ids: list[int]) -> dict:
        if self.chat:
            output = {"delta": {} if piece is None else {"content": piece}}
        else:
            output = {"text": piece or ""}
        return self._chunk([{"index": index, **output, "logprobs": None, "finish_reason": reason,
                             "token_ids": ids}])

    async def _events(self) -> AsyncIterator[str]:
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, handle: Handle) -> None:
            try:
                async for item in choice_pieces(self.served, handle, self.stops):
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
            remaining = len(tasks)
            while remaining:
                index, item = await events.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, ApiError):
                    yield sse(item.body())
                else:
                    piece, ids, reason = item
                    completion_tokens += len(ids)
                    if piece or ids or reason:
                        yield sse(self._choice_chunk(index, piece if piece or not reason else None,
                                                     reason, ids))
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


def embedding_response(served: ServedModel, body: EmbeddingRequest) -> JSONResponse:
    """The answer to /v1/embeddings: each vector as floats or base64 of little-endian float32.
    Embeds and writes the JSON: call it in a worker thread."""
    check_text(body, "")
    vectors, tokens = served.embed(body.input)
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise ApiError(400, f"dimensions={quote(body.dimensions)}: this model's embeddings have "
                            f"{vectors.shape[1]}", "dimensions")
    data = []
    for index, vector in enumerate(vectors):
        if body.encoding_format == "base64":
            value = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            value = vector.astype(float).tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    return JSONResponse({"object": "list", "data": data, "model": served.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
