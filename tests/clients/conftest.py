"""The client libraries' tests: one ``tfport serve`` app on 127.0.0.1 for the session, serving a
tiny random decoder with a byte-level tokenizer (any text encodes, so a grammar can make it write
JSON) and a Qwen-style template that teaches Hermes tool calls (``tools-hermes``,
tests/runtime/tool_cases.py), and a tiny text encoder (``enc``); and the Pydantic models the
structured-output tests ask for, nested as users write them, their fields bounded and no extra
ones allowed, so a random model finishes them within a few dozen tokens."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="structured output and forced tool calls need llguidance (extra 'text')")

from tests.runtime.serve.conftest import _export, running_server  # noqa: E402
from tests.runtime.tool_cases import tool_decoder, tool_exports  # noqa: E402

CHAT = "tools-hermes"  # the decoder's model id
ENCODER = "enc"


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false: a random model adds none

    city: str = Field(max_length=6)
    zip: int = Field(ge=0, le=99)


class Person(BaseModel):
    """A person and where they live."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=6)
    home: Address
    work: Address | None = None


class SavePerson(BaseModel):
    """Save a person to the address book."""

    model_config = ConfigDict(extra="forbid")

    person: Person
    notify: bool


@pytest.fixture(scope="session")
def client_exports(tmp_path_factory) -> dict[str, object]:
    encoder = _export(tmp_path_factory.mktemp("clients"), ENCODER, "tiny-encoder", "portable", {}, chat=False)
    return {CHAT: tool_exports(tmp_path_factory)["hermes"], ENCODER: encoder}


@pytest.fixture(scope="session")
def server_url(client_exports) -> str:
    with running_server(client_exports.values(), max_rows=8) as (url, _):
        yield url


@pytest.fixture
def client(server_url):
    openai = pytest.importorskip("openai", reason="the openai SDK (extra 'dev')")
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def decoder_module():
    """The PyTorch module the decoder was exported from."""
    return tool_decoder().eval()
