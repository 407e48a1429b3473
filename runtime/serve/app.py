"""The HTTP API: OpenAI's completions, chat completions, embeddings and models, plus health and
Prometheus metrics, on FastAPI.

    app = create_app(lambda: ServerState.load(["out/dec", "out/minilm"], ServeOptions()))
    uvicorn.run(app, host="127.0.0.1", port=8000)

| endpoint | what |
| --- | --- |
| ``POST /v1/completions`` | prompt (text, texts, ids, id lists) -> text; ``n``, ``stream`` (SSE) |
| ``POST /v1/chat/completions`` | messages rendered with the export's chat template -> message |
| ``POST /v1/embeddings`` | encoder exports: vectors as ``tfport embed`` gives them |
| ``GET /v1/models`` | the served models (id = export directory name) |
| ``GET /health`` | 200 while every scheduler runs, else 503 |
| ``GET /metrics`` | Prometheus text: requests, queue depth, tokens/s, time to first token |

A handler parses, asks the library (through ``served.ServedModel``) and shapes the response
(``responses``): sampling defaults, stop ids, chat prompts and embeddings are the library's, so
the server gives what ``tfport generate`` / ``chat`` / ``embed`` give. Every choice also carries
``token_ids`` (the generated ids, stop token excluded), so exports without a tokenizer are served
on ids. Errors are OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON or parameters, 404 for an unknown model, 429 when the model's queue is full, 504
for a request past its timeout, 500 for a request that failed (the server carries on).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import CONTENT_TYPE_LATEST, MetricsMiddleware, ServeMetrics
from .protocol import ApiError, ChatRequest, CompletionRequest, EmbeddingRequest
from .responses import Completion
from .served import ServedModel, ServeOptions

logger = logging.getLogger(__name__)


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


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


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
        return _error(ApiError.from_validation(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return _error(ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        logger.exception("request failed")
        return _error(ApiError(500, f"internal error: {type(err).__name__}: {err}"))

    @app.get("/health")
    async def health():
        models = {name: served.health() for name, served in state().models.items()}
        healthy = all(model.get("alive", True) for model in models.values())
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
        served = state().get(body.model)
        served.require("decoder", "/v1/completions")
        body.refuse_unsupported()
        prompts = served.prompts(body.prompt)
        stop_ids = served.stop_ids(body.ignore_eos, body.stop_token_ids)
        max_tokens = served.max_tokens(body.max_tokens)
        handles = served.submit(prompts, body, max_tokens, stop_ids, asyncio.get_running_loop())
        return await Completion(served, body, handles, prompts, chat=False).respond(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        served = state().get(body.model)
        served.require("decoder", "/v1/chat/completions")
        body.refuse_unsupported()
        messages = [{**m.model_dump(exclude_none=True), "content": m.text(i)}
                    for i, m in enumerate(body.messages)]
        prompt, turn_ends = served.chat(messages)
        stop_ids = served.stop_ids(body.ignore_eos, body.stop_token_ids, turn_ends)
        max_tokens = served.max_tokens(body.max_completion_tokens or body.max_tokens, prompt)
        handles = served.submit([prompt], body, max_tokens, stop_ids, asyncio.get_running_loop())
        return await Completion(served, body, handles, [prompt], chat=True).respond(request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        served = state().get(body.model)
        served.require("encoder", "/v1/embeddings")
        vectors, tokens = await run_in_threadpool(served.embed, body.input)
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
        return {"object": "list", "data": data, "model": served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return app
