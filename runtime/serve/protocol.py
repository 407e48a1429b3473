"""The OpenAI API request bodies this server takes, and its error shape.

Fields the server does not implement are refused with a 400 that names them when they ask for
something (``logprobs``, ``top_logprobs``, penalties, ``logit_bias``, ``echo``, ``suffix``,
``best_of`` > ``n``, ``tools`` / ``functions``, a ``response_format`` other than text, a message
role other than system, user, assistant or developer); unknown fields are ignored, as
OpenAI-compatible servers do. Token ids and counts are strict integers (``true`` is not 1).
Extensions, as vLLM names them: ``top_k``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_exceeded",
             500: "internal_error", 503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_validation(cls, errors: list[dict]) -> "ApiError":
        """A 400 for pydantic's validation ``errors`` of a body: the first one, naming its field
        (malformed JSON, or a union none of whose forms fits, said so)."""
        if not errors:
            return cls(400, "invalid request")
        first = errors[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", first.get("msg"))
            return cls(400, f"the body is not valid JSON ({reason})")
        fields = {next((str(p) for p in e.get("loc", ()) if p != "body"), None) for e in errors}
        if len(errors) > 1 and len(fields) == 1 and None not in fields:  # a union: no form fits
            field = fields.pop()
            reasons = list(dict.fromkeys(e.get("msg") for e in errors))
            return cls(400, f"{field}: none of its accepted forms fits ({'; '.join(reasons)})", field)
        param = ".".join(loc) or None
        return cls(400, f"{param or 'body'}: {first.get('msg')}", param)


class DecodingRequest(BaseModel):
    """The fields completions and chat completions share: sampling, stops, ``n``, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=-1)  # extension; 0 or -1 keep all
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[StrictInt] = Field(default=None, ge=0)
    ignore_eos: bool = False  # extension
    stop_token_ids: Optional[list[StrictInt]] = None  # extension
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    user: Optional[str] = None

    def refuse_unsupported(self) -> None:
        """``ApiError`` 400 for a field that asks for what this server does not do, or an
        invalid ``stop`` (checked before anything is queued)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name}={getattr(self, name)!r}: penalties are not "
                                    "supported by this server (use 0)", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias: not supported by this server", "logit_bias")
        if self.top_logprobs is not None:
            raise ApiError(400, "top_logprobs: not supported by this server", "top_logprobs")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ApiError(400, f"response_format={self.response_format!r}: only text is supported by "
                                "this server", "response_format")
        self.stop_strings()

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, f"stop={self.stop!r}: expected up to 4 non-empty strings", "stop")
        return stops


class CompletionRequest(DecodingRequest):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo: not supported by this server", "echo")
        if self.logprobs is not None:
            raise ApiError(400, "logprobs: not supported by this server", "logprobs")
        if self.suffix:
            raise ApiError(400, "suffix: not supported by this server", "suffix")
        if self.best_of not in (None, self.n):
            raise ApiError(400, f"best_of={self.best_of}: only best_of == n is supported", "best_of")


ROLES = ("system", "user", "assistant", "developer")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self, index: int) -> str:
        """The content as one str (text parts joined; other parts refused); ``ApiError`` for a
        role the server does not take."""
        if self.role not in ROLES:
            raise ApiError(400, f"messages[{index}].role={self.role!r}: expected one of {list(ROLES)}",
                           f"messages[{index}].role")
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{index}].content: only text parts are supported, "
                                    f"got type {part.get('type')!r}", f"messages[{index}].content")
            pieces.append(part["text"])
        return "".join(pieces)


class ChatRequest(DecodingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = None
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[dict[str, Any]]] = None
    functions: Optional[list[dict[str, Any]]] = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise ApiError(400, "logprobs: not supported by this server", "logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise ApiError(400, f"{name}: not supported by this server", name)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
