"""What the API answers, for its OpenAPI schema (``/openapi.json``, ``/docs``).

The handlers write their JSON themselves (``responses``); the models here only describe it: the
fields every answer carries, with their types (an answer may carry more, such as ``logprobs``),
and OpenAI's error shape under each status the server gives. A client generator, or schemathesis
in the suite (tests/runtime/serve/test_schemathesis.py), checks responses against them.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel

ERROR_STATUSES = {
    400: "malformed JSON, an invalid or unsupported parameter, a request over a limit, a Host "
         "this server does not answer to",
    401: "no or a wrong API key (--api-key)",
    404: "a model this server does not serve",
    413: "a body over --max-body-bytes",
    429: "the model's queue is full",
    500: "the request failed (the message shows a request id; the log has the details)",
    503: "loading, shutting down, or past --limit-concurrency",
    504: "the request ran past --timeout",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorBody(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str]
    token_ids: list[int]


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatReply(BaseModel):
    role: str
    content: Optional[str]


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    finish_reason: Optional[str]
    token_ids: list[int]


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Embedding(BaseModel):
    object: str
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: Optional[RerankDocument] = None  # with return_documents


class RerankResponse(BaseModel):
    id: str
    object: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class Score(BaseModel):
    index: int
    object: str
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    data: list[Score]
    usage: EmbeddingUsage


class ClassifiedText(BaseModel):
    index: int
    object: str
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    data: list[ClassifiedText]
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    family: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class ResponseObject(BaseModel):
    """/v1/responses: OpenAI's Response object (its items described loosely)."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: Optional[dict[str, Any]]


class Health(BaseModel):
    status: str
    models: dict[str, dict[str, Any]]
    pid: int


def _errors(*statuses: int) -> dict[int, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": ERROR_STATUSES[status]} for status in statuses}


def _answer(model: type[BaseModel], description: str, *statuses: int, stream: bool = False
            ) -> dict[int, dict[str, Any]]:
    """The ``responses`` of a route: ``model`` for 200 (or server-sent events with ``stream``),
    OpenAI's error shape for ``statuses`` and for what any request may get."""
    ok: dict[str, Any] = {"model": model, "description": description}
    if stream:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    return {200: ok, **_errors(400, 401, 500, 503, *statuses)}


GENERATION_ERRORS = (404, 413, 429, 504)
COMPLETIONS = _answer(CompletionResponse, "the completion; with stream: server-sent events "
                                          "ending with 'data: [DONE]'", *GENERATION_ERRORS, stream=True)
CHAT_COMPLETIONS = _answer(ChatCompletionResponse, "the reply; with stream: server-sent events "
                                                   "ending with 'data: [DONE]'", *GENERATION_ERRORS,
                           stream=True)
EMBEDDINGS = _answer(EmbeddingResponse, "one embedding per input", 404, 413)
RERANK = _answer(RerankResponse, "the documents by relevance, best first", 404, 413)
SCORE = _answer(ScoreResponse, "one score per text pair", 404, 413)
CLASSIFY = _answer(ClassifyResponse, "each text's label and probabilities", 404, 413)
MODELS = _answer(ModelList, "the served models")
MODEL = _answer(ModelCard, "one served model", 404)
RESPONSES = _answer(ResponseObject, "the response; with stream: the Responses API's server-sent events, "
                                    "ending with response.completed or response.incomplete",
                    *GENERATION_ERRORS, stream=True)
RESPONSE = _answer(ResponseObject, "a stored response", 404)
HEALTH = {200: {"model": Health, "description": "every model's scheduler runs"},
          503: {"model": Union[Health, ErrorBody],
                "description": "a scheduler stopped or the server is shutting down (the health "
                               "body), or it is still loading (an error)"},
          **_errors(400)}
METRICS = {200: {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}},
           **_errors(400, 401)}
