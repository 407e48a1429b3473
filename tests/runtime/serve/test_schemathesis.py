"""Property-based tests generated from the server's own OpenAPI schema (issue 27): schemathesis
sends valid and invalid requests to every operation of a live server on 127.0.0.1 and checks
that none gets a 5xx and that every status, content type and JSON body is one the schema
declares. Bounded: a few dozen examples per operation, derandomised (``TFPORT_FUZZ_EXAMPLES``
raises the count and draws new examples).

The schema is the one the server serves at /openapi.json, with one narrowing: ``model`` names a
served model (any other name is a 404, which would leave little for the rest of a request to
exercise)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")
schemathesis = pytest.importorskip("schemathesis", reason="needs schemathesis (extra 'dev')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance, response_schema_conformance, status_code_conformance)

EXAMPLES = int(os.environ.get("TFPORT_FUZZ_EXAMPLES", "0")) or 20
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
REQUESTS = {"CompletionRequest": ("dec-ort", "dec-portable"), "ChatRequest": ("dec-ort", "dec-portable"),
            "EmbeddingRequest": ("enc",)}


@pytest.fixture(scope="module")
def api_schema(server):
    """The live server's OpenAPI schema, each request's ``model`` narrowed to the models that
    serve it."""
    document = httpx.get(server[0] + "/openapi.json", timeout=30).json()
    for name, models in REQUESTS.items():
        document["components"]["schemas"][name]["properties"]["model"] = {"type": "string",
                                                                           "enum": list(models)}
    return schemathesis.openapi.from_dict(document)


OPERATIONS = [("POST", "/v1/completions", "positive"), ("POST", "/v1/completions", "negative"),
              ("POST", "/v1/chat/completions", "positive"), ("POST", "/v1/chat/completions", "negative"),
              ("POST", "/v1/embeddings", "positive"), ("POST", "/v1/embeddings", "negative"),
              ("GET", "/v1/models", "positive"), ("GET", "/health", "positive"),
              ("GET", "/metrics", "positive")]  # a GET takes nothing that could be made invalid


@pytest.mark.parametrize("method, path, mode", OPERATIONS, ids=lambda v: str(v).strip("/"))
def test_every_answer_is_declared_and_none_is_a_server_error(api_schema, server, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(GenerationMode(mode)))
    @settings(max_examples=EXAMPLES if method == "POST" else 3, deadline=None, database=None,
              derandomize="TFPORT_FUZZ_EXAMPLES" not in os.environ,
              suppress_health_check=list(HealthCheck))
    def answers(case):
        case.call_and_validate(base_url=server[0], checks=CHECKS, timeout=60)

    answers()
