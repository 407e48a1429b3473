"""The HTTP API: OpenAI's completions, chat completions, embeddings and models, plus health and
Prometheus metrics, on FastAPI.

    app = create_app(lambda: ServerState.load(["out/dec", "out/minilm"], ServeOptions()))
    uvicorn.run(app, host="127.0.0.1", port=8000)

| endpoint | what |
| --- | --- |
| ``POST /v1/completions`` | prompt (text, texts, ids, id lists) -> text; ``n``, ``stream`` (SSE) |
| ``POST /v1/chat/completions`` | messages rendered with the export's chat template -> message |
| ``POST /v1/embeddings`` | encoder exports: mean-pooled, L2-normalised vectors |
| ``GET /v1/models`` | the served models (id = export directory name) |
| ``GET /health`` | 200 while every scheduler runs, else 503 |
| ``GET /metrics`` | Prometheus text: requests, queue depth, tokens/s, time to first token |

Every choice also carries ``token_ids`` (the generated ids, stop token excluded), so exports
without a tokenizer are served on ids. Errors are OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON or parameters, 404 for
an unknown model, 429 when the model's queue is full, 504 for a request past its timeout, 500 for
a request that failed (the server carries on).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import SamplingParams
from .metrics import CONTENT_TYPE_LATEST, ServeMetrics
from .protocol import ApiError, ChatRequest, CompletionRequest, EmbeddingRequest, _Request
from .scheduler import Failed, Finished, GenerationRequest, Handle, QueueFull, Token
from .served import ServedModel, ServeOptions, StopText

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there


@dataclass
class ServerState:
    """The served models by name, the limits and the metrics of one app."""

    models: dict[str, ServedModel]
    options: ServeOptions
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def load(cls, directories: Sequence[str | Path], options: ServeOptions,
             names: Sequence[str] | None = None) -> "ServerState":
        """Open each export directory (its name is the model id unless ``names`` says)."""
        if not directories:
            raise ValueError("directories: expected at least one export directory")
        if names is not None and len(names) != len(directories):
            raise ValueError(f"names: {len(names)} names for {len(directories)} directories")
        metrics = ServeMetrics()
        models: dict[str, ServedModel] = {}
        for index, directory in enumerate(directories):
            name = names[index] if names else None
            served = ServedModel.load(directory, options, name, metrics.observer)
            if served.name in models:
                raise ValueError(f"model name {served.name!r} is used twice; name them "
                                 "(--name) or serve directories with different names")
            models[served.name] = served
        return cls(models, options, metrics)

    def start(self) -> None:
        for served in self.models.values():
            served.start()

    def stop(self) -> None:
        for served in self.models.values():
            served.stop()

    def get(self, name: str) -> ServedModel:
        if name not in self.models:
            raise ApiError(404, f"model {name!r} is not served here (served: {sorted(self.models)})",
                           "model", "model_not_found")
        return self.models[name]


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status and times it (to the last byte)."""

    def __init__(self, app, metrics: Callable[[], ServeMetrics | None]):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            metrics = self.metrics()
            if metrics is not None:
                route = scope.get("route")
                endpoint = getattr(route, "path", None) or "other"
                metrics.requests.labels(endpoint, str(status["code"])).inc()
                metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - start)


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    errors = err.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})", None
    fields = {next((str(p) for p in e.get("loc", ()) if p != "body"), None) for e in errors}
    if len(errors) > 1 and len(fields) == 1 and None not in fields:  # a union: none of its forms fits
        field = fields.pop()
        reasons = list(dict.fromkeys(e.get("msg") for e in errors))
        return f"{field}: none of its accepted forms fits ({'; '.join(reasons)})", field
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg')}", param


def create_app(load_state: Callable[[], ServerState]) -> FastAPI:
    """The FastAPI app; ``load_state`` runs at startup (in each Ray replica, too)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if getattr(app.state, "server", None) is None:
            app.state.server = await run_in_threadpool(load_state)
        app.state.server.start()
        try:
            yield
        finally:
            app.state.server.stop()

    app = FastAPI(title="tfport", lifespan=lifespan)
    app.state.server = None
    app.add_middleware(MetricsMiddleware,
                       metrics=lambda: getattr(app.state.server, "metrics", None))

    def state() -> ServerState:
        if app.state.server is None:
            raise ApiError(503, "the server is still loading its models")
        return app.state.server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, err: RequestValidationError):
        message, param = _validation_message(err)
        return _error(ApiError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return _error(ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        logger.exception("request failed")
        return _error(ApiError(500, f"internal error: {type(err).__name__}: {err}"))

    @app.get("/health")
    async def health():
        server = state()
        models = {}
        healthy = True
        for name, served in server.models.items():
            scheduler = served.scheduler
            if scheduler is None:
                models[name] = {"family": served.family}
                continue
            alive = scheduler._thread is not None and scheduler._thread.is_alive()
            healthy &= alive
            models[name] = {"family": served.family, "running": scheduler.running,
                            "waiting": scheduler.waiting, "alive": alive}
        return JSONResponse({"status": "ok" if healthy else "unhealthy", "models": models,
                             "pid": os.getpid()},  # tells Ray Serve replicas apart
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        server = state()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": server.created, "owned_by": "tfport",
             "family": served.family} for name, served in server.models.items()]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server = state()
        served = server.get(body.model)
        served.require("decoder", "/v1/completions")
        body.refuse_unsupported()
        prompts = served.prompts(body.prompt)
        stop_ids = served.stop_ids(body.ignore_eos, body.stop_token_ids)
        max_tokens = _max_tokens(body.max_tokens or min(DEFAULT_COMPLETION_TOKENS, server.options.max_tokens),
                                 server.options)
        handles = _submit(served, prompts, body, max_tokens, stop_ids, server.options)
        run = _Run(served, body, handles, "cmpl", prompts, chat=False)
        return await run.respond(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        server = state()
        served = server.get(body.model)
        served.require("decoder", "/v1/chat/completions")
        body.refuse_unsupported()
        messages = [{**m.model_dump(exclude_none=True), "content": m.text(i)}
                    for i, m in enumerate(body.messages)]
        prompt, turn_ends = served.chat(messages)
        stop_ids = served.stop_ids(body.ignore_eos, body.stop_token_ids, turn_ends)
        requested = body.max_completion_tokens or body.max_tokens
        if requested is None:  # as much as the context and the server's cap allow
            room = served.scheduler.max_length - len(prompt) + 1
            requested = max(1, min(server.options.max_tokens, room))
        max_tokens = _max_tokens(requested, server.options)
        handles = _submit(served, [prompt], body, max_tokens, stop_ids, server.options)
        run = _Run(served, body, handles, "chatcmpl", [prompt], chat=True)
        return await run.respond(request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        served = state().get(body.model)
        served.require("encoder", "/v1/embeddings")
        rows = served.prompts(body.input, "input")
        longest = max(len(r) for r in rows)
        limit = served.model.config.max_positions
        if longest > limit:
            raise ApiError(400, f"input: {longest} tokens, more than the model's max_positions="
                                f"{limit}", "input")
        vectors = await run_in_threadpool(served.embed, rows)
        if body.dimensions is not None and body.dimensions != vectors.shape[1]:
            raise ApiError(400, f"dimensions={body.dimensions}: this model's embeddings have "
                                f"{vectors.shape[1]}", "dimensions")
        data = []
        for index, vector in enumerate(vectors):
            if body.encoding_format == "base64":
                value = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            else:
                value = vector.astype(float).tolist()
            data.append({"object": "embedding", "index": index, "embedding": value})
        tokens = sum(len(r) for r in rows)
        return {"object": "list", "data": data, "model": served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app


def _max_tokens(requested: int, options: ServeOptions) -> int:
    if requested > options.max_tokens:
        raise ApiError(400, f"max_tokens={requested}: more than this server's limit of "
                            f"{options.max_tokens} per request", "max_tokens")
    return requested


def _submit(served: ServedModel, prompts: list[list[int]], body: _Request, max_tokens: int,
            stop_ids: tuple[int, ...], options: ServeOptions) -> list[Handle]:
    defaults = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # OpenAI's
    generation = served.model.generation
    if generation is not None and generation.do_sample:  # the checkpoint's, as Model.generate takes them
        defaults = generation.sampling
    given = {"temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p}
    chosen = {name: defaults[name] if value is None else value for name, value in given.items()}
    try:
        params = SamplingParams(chosen["temperature"], max(chosen["top_k"], 0), chosen["top_p"])
    except ValueError as err:
        raise ApiError(400, str(err), str(err).split("=")[0]) from None
    count = len(prompts) * body.n
    if count > served.scheduler.limits.max_queue:
        raise ApiError(400, f"n: {len(prompts)} prompt(s) x n={body.n} = {count} sequences, more than "
                            f"this server's queue of {served.scheduler.limits.max_queue}", "n")
    requests = []
    for prompt in prompts:
        for _ in range(body.n):
            seed = None if body.seed is None else body.seed + len(requests)
            requests.append(GenerationRequest(prompt, max_tokens, params, seed, stop_ids,
                                              options.timeout))
    try:
        return served.scheduler.submit(requests, loop=asyncio.get_running_loop())
    except QueueFull as err:
        raise ApiError(429, str(err), code="queue_full") from None
    except ValueError as err:
        raise ApiError(400, str(err), "max_tokens" if "max_tokens" in str(err) else "prompt") from None


async def _choice(served: ServedModel, handle: Handle, stops: list[str]
                  ) -> AsyncIterator[tuple[str, list[int], str | None]]:
    """One choice's (text piece, new token ids, finish reason or None) as it is generated."""
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
            err = event.error
            raise ApiError(500, f"generation failed: {type(err).__name__}: {err}")


class _Run:
    """The handles of one request and the response they make (JSON or server-sent events)."""

    def __init__(self, served: ServedModel, body: _Request, handles: list[Handle], prefix: str,
                 prompts: list[list[int]], chat: bool):
        self.served = served
        self.body = body
        self.handles = handles
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p) for p in prompts) * body.n
        self.chat = chat
        self.stops = body.stop_strings()

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()

    async def respond(self, request: Request):
        if self.body.stream:
            return StreamingResponse(self._sse(), media_type="text/event-stream",
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
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": reason, "token_ids": ids})
            else:
                choices.append({"index": index, "text": text, "logprobs": None,
                                "finish_reason": reason, "token_ids": ids})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.served.name, "choices": choices,
                "usage": self._usage(completion_tokens)}

    def _usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    async def _watch(self, request: Request) -> None:
        """Cancel the rows when the client of a non-streaming request goes away."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.cancel()

    async def _collect(self, handle: Handle) -> tuple[str, list[int], str]:
        pieces, ids, reason = [], [], None
        async for piece, new, finish in _choice(self.served, handle, self.stops):
            pieces.append(piece)
            ids.extend(new)
            reason = finish or reason
        return "".join(pieces), ids, reason

    def _chunk(self, index: int, piece: str | None, reason: str | None, ids: list[int]) -> dict:
        if self.chat:
            delta = {} if piece is None else {"content": piece}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason,
                      "token_ids": ids}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": None,
                      "finish_reason": reason, "token_ids": ids}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.served.name, "choices": [choice]}

    async def _sse(self) -> AsyncIterator[str]:
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, handle: Handle) -> None:
            try:
                async for item in _choice(self.served, handle, self.stops):
                    await events.put((index, item))
            except ApiError as err:
                await events.put((index, err))
            except Exception as err:  # noqa: BLE001 -- reported to the client, server carries on
                logger.exception("stream failed")
                await events.put((index, ApiError(500, f"internal error: {type(err).__name__}: {err}")))
            finally:
                await events.put((index, None))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(self.handles)]
        completion_tokens = 0
        try:
            if self.chat:
                for index in range(len(self.handles)):
                    chunk = self._chunk(index, "", None, [])
                    chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield _sse(chunk)
            remaining = len(tasks)
            while remaining:
                index, item = await events.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, ApiError):
                    yield _sse(item.body())
                else:
                    piece, ids, reason = item
                    completion_tokens += len(ids)
                    if piece or ids or reason:
                        yield _sse(self._chunk(index, piece if piece or not reason else None,
                                               reason, ids))
            options = self.body.stream_options or {}
            if options.get("include_usage"):
                yield _sse({"id": self.id, "object": "chat.completion.chunk" if self.chat
                            else "text_completion", "created": self.created,
                            "model": self.served.name, "choices": [],
                            "usage": self._usage(completion_tokens)})
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: free the rows at the next step
            self.cancel()
            for task in tasks:
                task.cancel()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
