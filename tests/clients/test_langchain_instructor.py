"""LangChain (``ChatOpenAI`` on chat completions and on the Responses API, ``OpenAIEmbeddings``)
and instructor (``Mode.JSON_SCHEMA``, ``Mode.TOOLS``) against ``tfport serve``: replies equal the
openai SDK's, structured output and tool calls come back as validated nested Pydantic objects."""

from __future__ import annotations

import numpy as np
import pytest

from tfport.runtime import load_model

from .conftest import CHAT, ENCODER, Person, SavePerson

langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai (extra 'dev')")
instructor = pytest.importorskip("instructor", reason="instructor (extra 'dev')")

QUESTION = "Who lives where? Answer as JSON."


def chat_model(server_url: str, **kwargs):
    return langchain_openai.ChatOpenAI(model=CHAT, base_url=server_url + "/v1", api_key="unused", max_retries=0,
                                       timeout=120, **kwargs)


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_invoke_and_stream_equal_the_sdk(server_url, client, responses_api):
    llm = chat_model(server_url, temperature=0, max_tokens=10, use_responses_api=responses_api)
    expected = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=10, temperature=0).choices[0].message.content
    assert llm.invoke(QUESTION).text == expected
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == expected


@pytest.mark.parametrize("method, responses_api", [("json_schema", False), ("function_calling", False),
                                                   ("json_schema", True)])
def test_langchain_with_structured_output(server_url, method, responses_api):
    llm = chat_model(server_url, temperature=1.0, max_tokens=250, use_responses_api=responses_api,
                     extra_body={"seed": 1})  # the Responses API takes no seed: tfport's extension
    person = llm.with_structured_output(Person, method=method).invoke(QUESTION)
    assert isinstance(person, Person)


def test_langchain_bind_tools_with_a_nested_model(server_url):
    llm = chat_model(server_url, temperature=1.0, max_tokens=250, seed=2)
    message = llm.bind_tools([SavePerson], tool_choice="SavePerson", parallel_tool_calls=False).invoke(QUESTION)
    call, = message.tool_calls
    assert call["name"] == "SavePerson"
    SavePerson.model_validate(call["args"])


def test_langchain_embeddings_equal_the_library(server_url, client_exports):
    embeddings = langchain_openai.OpenAIEmbeddings(model=ENCODER, base_url=server_url + "/v1", api_key="unused",
                                                   check_embedding_ctx_length=False)  # no tiktoken download
    texts = ["w5 w6 w7", "w9"]
    expected = load_model(client_exports[ENCODER], intra_op_threads=1).embed_text(texts)
    np.testing.assert_allclose(np.array(embeddings.embed_documents(texts)), expected, atol=1e-6)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_returns_validated_nested_models(client, mode):
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    for seed in range(2):
        person = patched.chat.completions.create(model=CHAT, response_model=Person, max_retries=0,
                                                 messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=250, temperature=1.0, seed=seed)
        assert isinstance(person, Person) and isinstance(person.home, Person.model_fields["home"].annotation)
