"""The HTTP API: OpenAI's completions, chat completions, embeddings and models, plus health and
Prometheus metrics, on FastAPI.

    app = create_app(lambda: ServerState.load(["out/dec", "out/minilm"], ServeOptions()))
    uvicorn.run(app, host="127.0.0.1", port=8000)

| endpoint | what |
| --- | --- |
| ``POST /v1/completions`` | prompt (text, texts, ids, id lists) -> text; ``n``, ``stream`` (SSE) |
| ``POST /v1/chat/completions`` | messages rendered with the export's chat template -> message |
| ``POST /v1/responses`` | the Responses API on the chat machinery (``responses_api``); ``GET /v1/responses/{id}`` a stored one |
| ``POST /v1/completions`` (encoder-decoder) | translation / summarisation: ``seq2seq``, no continuous batching |
| ``POST /v1/embeddings`` | encoder exports: vectors as ``tfport embed`` gives them, batched across requests (``batcher``) |
| ``POST /v1/rerank`` | cross-encoders: documents by relevance to a query, best first (``scoring``) |
| ``POST /v1/score`` | cross-encoders: a score per text pair (vLLM's shape) |
| ``POST /v1/classify`` | classifiers: each text's label and probabilities (vLLM's shape) |
| ``GET /v1/models`` | the served models (id = directory name; ``family``, ``chat_template``); ``/v1/models/{id}`` one |
| ``GET /health`` | 200 while every scheduler runs, else 503 |
| ``GET /metrics`` | Prometheus text: requests, queue depth, tokens/s, time to first token |
| ``GET /`` | the chat page (``page``; not routed with ``--no-ui``) |

A handler parses, asks the library (through ``served.ServedModel``) and shapes the response
(``responses``): sampling defaults, stop ids, chat prompts and embeddings are the library's, so
the server gives what ``tfport generate`` / ``chat`` / ``embed`` give. Every choice also carries
``token_ids`` (the generated ids, stop token excluded), so exports without a tokenizer are served
on ids. Errors are OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON or parameters, 401 without the server's API key (``--api-key``; ``/health`` needs
none), 404 for an unknown model, 413 for a body over ``--max-body-bytes``, 429 when the model's
queue is full, 503 with ``Retry-After`` while the models load or the server shuts down
(``lifecycle``), 504 for a request past its timeout, 500 for a request that failed (the server
carries on; the body shows a request id, the log has the details). CORS and the switched-off
endpoints are ``exposure``'s.

Tokenising and building big responses run in a few worker threads (``WORKERS``), never on the
event loop, so one big request does not hold up ``/health`` or the other clients; after one,
the C heap's free pages go back to the system (``memory.TrimMemory``). Prompts are limited in
characters before they are tokenised (``--max-prompt-chars``), in tokens after
(``--max-prompt-tokens``), and a request in the tokens it takes (``--max-request-tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import openapi
from .exposure import Cors, Switches, hidden_paths
from .guards import AllowedHosts, ApiKey, BodyLimit
from .memory import TrimMemory
from .metrics import CONTENT_TYPE_LATEST, MetricsMiddleware, ServeMetrics
from .page import mount_page
from .errors import ApiError, check_text, quote
from .protocol import (ChatRequest, ClassifyRequest, CompletionRequest, EmbeddingRequest, RerankRequest,
                       ResponsesRequest, ScoreRequest)
from .responses import Completion, embedding_response
from .responses_api import ResponseStore, ResponseTurn, stored_response
from .scoring import classify_response, require_head, rerank_response, score_response
from .options import ServeOptions
from .served import ServedModel

logger = logging.getLogger(__name__)

WORKERS = 4  # threads per app that tokenise requests and build big responses
RETRY_AFTER_S = 2  # a 503's Retry-After: loading, or shutting down (a balancer moves on meanwhile)


@dataclass
class ServerState:
    """The served models by name, the limits and the metrics of one app; ``shutting_down``
    once the server stops admitting requests (``lifecycle``: /health and new model requests 503)."""

    models: dict[str, ServedModel]
    options: ServeOptions
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False

    @classmethod
    def load(cls, directories: Sequence[str | Path], options: ServeOptions,
             names: Sequence[str] | None = None) -> "ServerState":
        """Open each export directory (its name is the model id unless ``names`` says)."""
        if not directories:
            raise ValueError("directories: expected at least one export directory")
        if names is not None and len(names) != len(directories):
            raise ValueError(f"names: {len(names)} names for {len(directories)} directories")
        if options.batch_export is not None and len(directories) != 1:
            raise ValueError(f"batch_export={options.batch_export!r}: is another export of the one "
                             f"model served; got {len(directories)} model directories")
        metrics = ServeMetrics()
        models: dict[str, ServedModel] = {}
        for index, directory in enumerate(directories):
            name = names[index] if names else None
            served = ServedModel.load(directory, options, name, metrics.observer)
            if served.name in models:
                raise ValueError(f"model name {served.name!r} is used twice; name them "
                                 "(--name) or serve directories with different names")
            models[served.name] = served
            if served.scheduler is not None:
                metrics.watch(served.name, served.scheduler)
        return cls(models, options, metrics)

    def start(self) -> None:
        for served in self.models.values():
            served.start()

    def end_requests(self) -> None:
        """End every model's waiting and running requests now, streams with their last event
        (``Scheduler.end_now``); ``stop`` then stops the schedulers."""
        for served in self.models.values():
            served.end_requests()

    def stop(self) -> None:
        for served in self.models.values():
            served.stop()

    def get(self, name: str) -> ServedModel:
        """The model a request names: ``ApiError`` 404 for one not served, 503 once shutting down."""
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down and takes no new requests; retry "
                                "(another replica, or this one restarted, will answer)",
                           code="shutting_down")
        if name not in self.models:
            raise ApiError(404, f"model {quote(name)} is not served here (served: {sorted(self.models)})",
                           "model", "model_not_found")
        return self.models[name]


def _error(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(load_state: Callable[[], ServerState]) -> FastAPI:
    """The FastAPI app; ``load_state`` runs at startup (in each Ray replica, too)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if getattr(app.state, "server", None) is None:
            app.state.server = await run_in_threadpool(load_state)
        app.state.workers = anyio.CapacityLimiter(WORKERS)
        if app.state.server.options.ui:  # known once loaded (a Ray replica loads here)
            mount_page(app)
        app.state.server.start()
        try:
            yield
        finally:
            app.state.server.stop()

    app = FastAPI(title="tfport", lifespan=lifespan)
    app.state.server = None

    def body_limit() -> int | None:
        return None if app.state.server is None else app.state.server.options.max_body_bytes

    def api_key() -> str | None:
        return None if app.state.server is None else app.state.server.options.api_key

    def allowed_hosts() -> tuple[str, ...] | None:
        return None if app.state.server is None else app.state.server.options.allowed_hosts

    def option(name: str, unloaded=None):
        """The server's option ``name``; ``unloaded`` while its models load."""
        return unloaded if app.state.server is None else getattr(app.state.server.options, name)

    app.add_middleware(BodyLimit, limit=body_limit)
    app.add_middleware(TrimMemory)  # memory back to the system after a big request
    app.add_middleware(Switches, hidden=lambda: hidden_paths(option("docs", True), option("metrics", True)))
    app.add_middleware(ApiKey, key=api_key)  # before the body is read
    app.add_middleware(Cors, origins=lambda: option("cors_origins", ()))  # preflights carry no key
    app.add_middleware(AllowedHosts, hosts=allowed_hosts)
    app.add_middleware(MetricsMiddleware,  # the outermost: counts the 413s too
                       metrics=lambda: getattr(app.state.server, "metrics", None))

    def state() -> ServerState:
        if app.state.server is None:
            raise ApiError(503, "the server is still loading its models")
        return app.state.server

    async def offload(function: Callable, *args):
        """``function(*args)`` in one of the app's worker threads (tokenising, big responses)."""
        return await anyio.to_thread.run_sync(functools.partial(function, *args),
                                              limiter=app.state.workers)

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
        return _error(ApiError.internal(err, f"{request.method} {request.url.path}"))

    @app.get("/health", responses=openapi.HEALTH)
    async def health():
        models = {name: served.health() for name, served in state().models.items()}
        healthy = all(model.get("alive", True) for model in models.values())
        status = "shutting down" if state().shutting_down else "ok" if healthy else "unhealthy"
        return JSONResponse({"status": status, "models": models,
                             "pid": os.getpid()},  # tells Ray Serve replicas apart
                            status_code=200 if status == "ok" else 503)

    @app.get("/metrics", responses=openapi.METRICS, response_class=PlainTextResponse)
    async def metrics():
        return Response(state().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        served = state().models[name]
        return {"id": name, "object": "model", "created": state().created, "owned_by": "tfport",
                "family": served.family, "chat_template": served.chats}

    @app.get("/v1/models", responses=openapi.MODELS)
    async def models():
        return {"object": "list", "data": [model_card(name) for name in state().models]}

    @app.get("/v1/models/{model_id:path}", responses=openapi.MODEL)
    async def model(model_id: str):
        return model_card(state().get(model_id).name)

    @app.post("/v1/completions", responses=openapi.COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request):
        served = state().get(body.model)
        served.require(("decoder", "encoder-decoder"), "/v1/completions")
        prompts, decoding = await offload(served.completion_inputs, body)
        handles = served.submit(prompts, body, decoding, asyncio.get_running_loop())
        return await Completion(served, body, handles, prompts, chat=False).respond(request)

    @app.post("/v1/chat/completions", responses=openapi.CHAT_COMPLETIONS)
    async def chat_completions(body: ChatRequest, request: Request):
        served = state().get(body.model)
        served.require("decoder", "/v1/chat/completions")
        prompts, decoding = await offload(served.chat_inputs, body)
        handles = served.submit(prompts, body, decoding, asyncio.get_running_loop())
        return await Completion(served, body, handles, prompts, chat=True).respond(request)

    @app.post("/v1/responses", responses=openapi.RESPONSES)
    async def responses(body: ResponsesRequest, request: Request):
        server = state()
        served = server.get(body.model)
        served.require("decoder", "/v1/responses")
        turn = await offload(ResponseTurn, served, body, server.responses)
        handles = served.submit(turn.prompts, turn.chat, turn.decoding,
                                asyncio.get_running_loop())
        return await turn.respond(handles, request)

    @app.get("/v1/responses/{response_id}", responses=openapi.RESPONSE)
    async def response(response_id: str):
        return stored_response(state().responses, response_id)

    @app.post("/v1/embeddings", responses=openapi.EMBEDDINGS)
    async def embeddings(body: EmbeddingRequest):
        served = state().get(body.model)
        served.require("encoder", "/v1/embeddings")
        await offload(check_text, body, "")  # walks every input: 800k took 0.5 s on the event loop
        encoded = await offload(served.embedding_inputs, body.input)
        vectors = await served.batcher.embed(encoded)  # with the requests that arrive with it
        tokens = sum(len(row) for row in encoded.ids)
        return await offload(embedding_response, served, body, vectors, tokens)

    @app.post("/v1/rerank", responses=openapi.RERANK)
    @app.post("/rerank", responses=openapi.RERANK, include_in_schema=False)  # llama-server's aliases
    @app.post("/v1/reranking", responses=openapi.RERANK, include_in_schema=False)
    async def rerank(body: RerankRequest):
        served = state().get(body.model)
        require_head(served, "/v1/rerank")
        return await offload(rerank_response, served, body)

    @app.post("/v1/score", responses=openapi.SCORE)
    async def score(body: ScoreRequest):
        served = state().get(body.model)
        require_head(served, "/v1/score")
        return await offload(score_response, served, body)

    @app.post("/v1/classify", responses=openapi.CLASSIFY)
    async def classify(body: ClassifyRequest):
        served = state().get(body.model)
        require_head(served, "/v1/classify", one_label=False)
        return await offload(classify_response, served, body)

    return app
