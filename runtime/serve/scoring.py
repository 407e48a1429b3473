"""Sequence classification exports: cross-encoders (a head with one logit: rerankers) on
/v1/rerank and /v1/score, classifiers on /v1/classify.

A pair's score is the library's (``Model.classify(query, pairs=documents)``, ``tfport
classify``): the sigmoid of the head's logit, as sentence-transformers' ``CrossEncoder.predict``
gives it for a one-label model, in (0, 1). Pairs are tokenised as the checkpoint's tokenizer
pairs them and truncated to the model's limit (longest side first). A classifier with more than
one label has no single relevance score: rerank and score refuse it (400); /v1/classify (vLLM's
shape) gives any classifier's labels and probabilities (``Classification``).

    POST /v1/rerank {"model", "query", "documents": [...], "top_n"?, "return_documents"?}
      -> {"results": [{"index", "relevance_score", "document"?: {"text"}}, ...] best first, "usage"}
    POST /v1/score {"model", "text_1": str | [str], "text_2": str | [str]}
      -> {"data": [{"index", "object": "score", "score"}, ...] in pair order, "usage"}
    POST /v1/classify {"model", "input": str | [str]}
      -> {"data": [{"index", "label", "probs", "num_classes"}, ...] in input order, "usage"}

Both run in a worker thread (tokenising, the encoder).
"""

from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi.responses import JSONResponse

from ..classify import Classification, classify_encoded
from .errors import ApiError, check_text
from .protocol import ClassifyRequest, RerankRequest, ScoreRequest
from .request_limits import text_lengths
from .served import ServedModel


def require_head(served: ServedModel, endpoint: str, one_label: bool = True) -> None:
    """``ApiError`` 400 naming ``model`` unless ``served`` has a sequence classification head
    (with ``one_label``: a cross-encoder's single logit)."""
    head = served.model.config.classifier
    if not head.n_labels:
        raise ApiError(400, f"model {served.name!r} is a {served.family} export without a sequence "
                            f"classification head; {endpoint} needs a *ForSequenceClassification "
                            "export", "model")
    if one_label and head.n_labels != 1:
        raise ApiError(400, f"model {served.name!r} is a classifier with {head.n_labels} labels; "
                            f"{endpoint} needs a cross-encoder, whose one logit is the relevance "
                            "score (/v1/classify serves classifiers)", "model")


def classify(served: ServedModel, texts: list[str], pairs: list[str] | None, params: tuple[str, str]
             ) -> tuple[Classification, int]:
    """``Model.classify`` of the texts (or (text, pair) rows), tokenised once, and the tokens
    the rows take, within the server's limits (``params``: the fields the texts and the pairs
    came in)."""
    if len(texts) > served.options.max_inputs:
        raise ApiError(400, f"{params[1]}: {len(texts):,} texts, more than this server's limit of "
                            f"{served.options.max_inputs:,} per request (--max-embedding-inputs)",
                       params[1])
    for values, param in zip((texts, pairs), params):
        if values is not None:
            served.limit_chars(text_lengths(values, param), param)
    if served.model.tokenizer is None:
        raise ApiError(400, f"{params[0]}: model {served.name!r} has no tokenizer.json to encode "
                            "texts with", params[0])
    try:
        encoded = served.model.encode_texts(texts, pairs, method="classify")
        tokens = sum(len(row) for row in encoded.ids)
        served.limit_request_tokens(tokens, f"{len(texts):,} rows", params[1])
        return classify_encoded(served.model, encoded, progress=False), tokens
    except (ValueError, TypeError) as err:
        raise ApiError(400, f"{params[1]}: {err}", params[1]) from None


def rerank_response(served: ServedModel, body: RerankRequest) -> JSONResponse:
    """The answer to /v1/rerank: the documents by relevance to the query, best first (the
    first ``top_n``)."""
    check_text(body, "")
    result, tokens = classify(served, [body.query] * len(body.documents), body.documents,
                              ("query", "documents"))
    scores = result.scores[:, 0]
    order = np.argsort(-scores, kind="stable")[:body.top_n]
    results = []
    for index in order.tolist():
        result = {"index": index, "relevance_score": float(scores[index])}
        if body.return_documents:
            result["document"] = {"text": body.documents[index]}
        results.append(result)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": served.name,
                         "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def score_response(served: ServedModel, body: ScoreRequest) -> JSONResponse:
    """The answer to /v1/score: one score per pair, in order. ``text_1`` a str pairs with every
    ``text_2``; lists pair index by index (a ``text_2`` str with every ``text_1``)."""
    check_text(body, "")
    first, second = body.text_1, body.text_2
    for value, param in ((first, "text_1"), (second, "text_2")):
        if isinstance(value, list) and not value:
            raise ApiError(400, f"{param}: expected at least one text", param)
    if isinstance(first, list) and isinstance(second, list) and len(first) != len(second):
        raise ApiError(400, f"text_2: {len(second)} texts for {len(first)} in text_1; expected as many, "
                            "or one text in text_1 to score against each", "text_2")
    count = max(len(v) if isinstance(v, list) else 1 for v in (first, second))
    texts = [first] * count if isinstance(first, str) else first
    pairs = [second] * count if isinstance(second, str) else second
    result, tokens = classify(served, texts, pairs, ("text_1", "text_2"))
    data = [{"index": index, "object": "score", "score": float(score)}
            for index, score in enumerate(result.scores[:, 0])]
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": served.name, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def classify_response(served: ServedModel, body: ClassifyRequest) -> JSONResponse:
    """The answer to /v1/classify: each input's label (the highest logit's name) and the
    probabilities of every label (softmax; the sigmoid for a one-label head), in order."""
    check_text(body, "")
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise ApiError(400, "input: expected at least one text", "input")
    result, tokens = classify(served, texts, None, ("input", "input"))
    data = [{"index": index, "object": "classification", "label": label,
             "probs": [float(p) for p in probs], "num_classes": len(probs)}
            for index, (label, probs) in enumerate(zip(result.labels, result.scores))]
    return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": served.name, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
