"""``/v1/responses`` (OpenAI's Responses API) and ``GET /v1/models/{id}`` over HTTP, on a tiny
random decoder with a byte-level tokenizer and a Qwen-style (Hermes) template: a response's text
is the chat endpoint's reply to the same messages, its stream's events add up to it, a
``previous_response_id`` turn's prompt is the whole conversation rendered by the template (read
from the prefix cache), and malformed requests are 400s naming the Responses API's field. The
openai SDK, LangChain and instructor drive the same endpoint in tests/clients."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from tests.runtime.tool_cases import tool_exports  # noqa: E402

from .conftest import running_server  # noqa: E402

MODEL = "tools-hermes"
LONG = "Tell me about the weather in Paris and in Lyon, please, in a few words. " * 2  # > one 32-token block


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server([tool_exports(tmp_path_factory)["hermes"]], max_rows=4) as (url, state):
        yield url, state


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)


def events(url: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed response's (event name, data) pairs."""
    out, name = [], None
    with httpx.stream("POST", url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out


def test_model_retrieve(server):
    url, _ = server
    card = httpx.get(url + f"/v1/models/{MODEL}").json()
    assert (card["id"], card["object"], card["family"], card["chat_template"]) == (MODEL, "model", "decoder", True)
    missing = httpx.get(url + "/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_text_equals_the_chat_reply_and_the_stream_adds_up(server):
    url, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                          "max_tokens": 12, "temperature": 0}).json()
    body = {"instructions": "Be brief.", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                   "text": "Hello"}]}],
            "max_output_tokens": 12, "temperature": 0}
    answer = post(url, body).json()
    reply = chat["choices"][0]
    assert answer["object"] == "response" and answer["model"] == MODEL
    assert answer["status"] == ("incomplete" if reply["finish_reason"] == "length" else "completed")
    message, = answer["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == reply["message"]["content"]
    assert answer["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert answer["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]

    streamed = events(url, body)
    names = [name for name, _ in streamed]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-1] == f"response.{answer['status']}" and "[DONE]" not in names
    assert [data["sequence_number"] for _, data in streamed] == list(range(len(streamed)))
    deltas = "".join(data["delta"] for name, data in streamed if name == "response.output_text.delta")
    assert deltas == reply["message"]["content"]
    assert streamed[-1][1]["response"]["output"][0]["content"][0]["text"] == deltas


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(server):
    from tfport.runtime.chat import chat_format

    url, state = server
    first = post(url, {"input": LONG, "max_output_tokens": 6, "temperature": 0}).json()
    reply = first["output"][0]["content"][0]["text"]
    second = post(url, {"input": "And tomorrow?", "previous_response_id": first["id"],
                        "max_output_tokens": 4, "temperature": 0}).json()
    conversation = [{"role": "user", "content": LONG}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "And tomorrow?"}]
    prompt = chat_format(state.models[MODEL].model).prompt_ids(conversation)
    assert second["usage"]["input_tokens"] == len(prompt)  # the whole conversation, as rendered
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= 32  # the first turn's blocks
    assert second["previous_response_id"] == first["id"]
    assert httpx.get(url + f"/v1/responses/{second['id']}").json() == second


def test_store_false_is_not_kept(server):
    url, _ = server
    answer = post(url, {"input": "Hi", "max_output_tokens": 2, "store": False}).json()
    assert httpx.get(url + f"/v1/responses/{answer['id']}").status_code == 404
    refused = post(url, {"input": "Hi", "previous_response_id": answer["id"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": "Hi", "temperature": 2.5}, "temperature"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
     "text.format"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": [{"type": "message", "role": "robot", "content": "Hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": "Hi", "background": True}, "background"),
])
def test_bad_requests_name_the_responses_field(server, body, param):
    response = post(server[0], body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
