"""The OpenAI API request bodies this server takes, and its error shape.

Fields the server does not implement are refused with a 400 that names them when they ask for
something (``suffix``, ``best_of`` > ``n``, ``functions``, a message role other than
system, user, assistant, developer or tool); unknown fields are ignored, as OpenAI-compatible servers
do. ``response_format`` (text, ``json_object``, ``json_schema``; extensions ``regex`` and
``grammar``, Lark) constrains the output (``decoding.grammar``); a malformed one is a 400 with
param ``response_format``. Token ids and counts are strict integers (``true`` is
not 1). Extensions, as vLLM names them: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``. Sampling options are checked against OpenAI's ranges
(``temperature`` in [0, 2], penalties in [-2, 2], ``logit_bias`` values in [-100, 100], completions' ``logprobs`` 0-5,
chat's ``top_logprobs`` 0-20 with ``logprobs: true``). Chat's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` are OpenAI's (``tfport.runtime.tools``; a malformed one is a 400 naming it).

Errors are ``errors.ApiError`` (OpenAI's error shape), text is checked at the edge
(``errors.check_text``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, FailFast, Field, StrictInt, Tag
from typing_extensions import TypeAliasType

from ..decoding.grammar import constraint_arguments
from ..request import Request
from .errors import ApiError, quote

def _prompt_form(value: Any) -> str | None:
    """Which form of ``Prompt`` a value is, read from its first item (None: none)."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"


# A prompt (completions) or an input (embeddings): a text, texts, token ids or token-id lists.
# The first item picks the form, and pydantic checks that form only, stopping at its first wrong
# item: a plain union is checked form by form with an error per item, which took 5 s on the
# event loop for 100k strings and one int (a 1 MB body).
_Texts = TypeAliasType("Texts", Annotated[list[str], FailFast()])
_Ids = TypeAliasType("TokenIds", Annotated[list[StrictInt], FailFast()])
_IdLists = TypeAliasType("TokenIdLists", Annotated[list[_Ids], FailFast()])
Prompt = Annotated[
    Union[Annotated[str, Tag("text")], Annotated[_Texts, Tag("texts")], Annotated[_Ids, Tag("ids")],
          Annotated[_IdLists, Tag("id_lists")]],
    Discriminator(_prompt_form, custom_error_type="prompt_type",
                  custom_error_message="expected a string, a list of strings, a list of token ids "
                                       "or a list of token-id lists")]


class DecodingRequest(BaseModel):
    """The fields completions and chat completions share: sampling, stops, ``n``, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2, allow_inf_nan=False)  # OpenAI's range
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=-1)  # extension; 0 or -1 keep all
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[StrictInt] = Field(default=None, ge=0)
    ignore_eos: bool = False  # extension
    stop_token_ids: Optional[list[StrictInt]] = None  # extension
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)  # extension
    min_p: Optional[float] = Field(default=None, ge=0, le=1)  # extension
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]]] = None
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    response_format: Optional[dict[str, Any]] = None
    user: Optional[str] = None

    def refuse_unsupported(self) -> None:
        """``ApiError`` 400 for a field that asks for what this server does not do, or an
        invalid ``stop`` or ``response_format`` (checked before anything is queued)."""
        self.constraint()
        self.stop_strings()

    def constraint(self) -> dict[str, Any]:
        """What ``response_format`` asks of the output, as ``Model.generate``'s ``json_schema`` /
        ``regex`` / ``grammar`` ({} for text; ``decoding.grammar.constraint_arguments``);
        ``ApiError`` 400 naming the field when it is malformed."""
        try:
            return constraint_arguments(self.response_format)
        except ValueError as err:
            raise ApiError(400, str(err), "response_format") from None

    def token_budget(self) -> tuple[int | None, str]:
        """The new tokens asked per row (None: not said) and the field that asks them."""
        return self.max_tokens, "max_tokens"

    def logprobs_top(self) -> int | None:
        """The alternatives reported per generated token, None when no logprobs are asked."""
        raise NotImplementedError

    def request(self) -> Request:
        """This body's decoding as the library's ``Request``: the token budget asked (None: not
        said, or 0 for an echo that generates nothing), sampling (vLLM's ``top_k`` -1 is 0, keep
        all), penalties, bias, seed and logprobs; stops and what is left out are the server's to
        resolve (``ServedModel``). ``ApiError`` 400 naming the field that does not hold."""
        bias = None
        if self.logit_bias is not None:
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.strip().isdecimal():
                    raise ApiError(400, f"logit_bias: key {quote(key)} is not a token id (expected "
                                        "a decimal integer string such as \"50256\")", "logit_bias")
                bias[int(key)] = value
        asked, param = self.token_budget()
        try:
            return Request(max_new_tokens=asked or None, temperature=self.temperature,
                           top_k=0 if self.top_k == -1 else self.top_k, top_p=self.top_p,
                           min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                           presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                           logit_bias=bias, seed=self.seed, top_logprobs=self.logprobs_top())
        except (ValueError, TypeError) as err:
            raise ApiError.refusal(str(err).replace("max_new_tokens", param)) from None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, f"stop={quote(self.stop)}: expected up to 4 non-empty strings", "stop")
        return stops


class CompletionRequest(DecodingRequest):
    prompt: Prompt
    max_tokens: Optional[StrictInt] = Field(default=None, ge=0)  # 0: the prompt scored (echo) only
    echo: bool = False
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=5)
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def logprobs_top(self) -> int | None:
        return self.logprobs

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens=0: generates nothing; it is taken with echo: true only "
                                "(the prompt scored, as the legacy API and vLLM allow)", "max_tokens")
        if self.suffix:
            raise ApiError(400, "suffix: not supported by this server", "suffix")
        if self.best_of not in (None, self.n):
            raise ApiError(400, f"best_of={quote(self.best_of)}: only best_of == n is supported", "best_of")


ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self, index: int) -> str:
        """The content as one str (text parts joined; other parts refused); ``ApiError`` for a
        role the server does not take."""
        if self.role not in ROLES:
            raise ApiError(400, f"messages[{index}].role={quote(self.role)}: expected one of {list(ROLES)}",
                           f"messages[{index}].role")
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{index}].content: only text parts are supported, "
                                    f"got type {quote(part.get('type'))}", f"messages[{index}].content")
            pieces.append(part["text"])
        return "".join(pieces)


class ChatRequest(DecodingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = None
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    tools: Optional[list[dict[str, Any]]] = None  # checked by tfport.runtime.tools
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    functions: Optional[list[dict[str, Any]]] = None

    def token_budget(self) -> tuple[int | None, str]:
        """``max_completion_tokens`` (OpenAI's newer name) when sent, else ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return super().token_budget()

    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, f"top_logprobs={self.top_logprobs}: needs logprobs: true",
                           "top_logprobs")
        if self.functions:
            raise ApiError(400, "functions: not supported by this server (send tools)", "functions")


class ResponsesRequest(BaseModel):
    """/v1/responses: OpenAI's Responses API, served on the chat machinery (``responses_api``).
    Fields the server does not implement are ignored (``reasoning``, ``include``, ``truncation``,
    ``top_logprobs``); ``background`` and built-in tools are refused. ``seed``: an extension."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    seed: Optional[StrictInt] = Field(default=None, ge=0)
    stream: bool = False
    text: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    store: bool = True
    background: bool = False
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = Field(default=None, ge=1)  # Matryoshka exports only
    user: Optional[str] = None


class RerankRequest(BaseModel):
    """/v1/rerank: the Jina / Cohere shape llama-server takes."""

    model_config = ConfigDict(extra="ignore")

    model: str
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: Optional[StrictInt] = Field(default=None, ge=1)
    return_documents: bool = False


class ScoreRequest(BaseModel):
    """/v1/score: vLLM's shape; ``text_1`` is scored against each ``text_2`` (one text against
    several, or lists of the same length, pair by pair)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class ClassifyRequest(BaseModel):
    """/v1/classify: vLLM's shape."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: Union[str, list[str]]
