"""The server's error shape, ``{"error": {"message", "type", "param", "code"}}`` (``ApiError``),
and how a request's values appear in it.

Text is checked at the edge (``check_text``): a str that is not Unicode text (a lone surrogate,
which JSON can carry as ``"\\ud800"``) is a 400 naming its field, e.g. ``messages[1].content``. An
error message shows a request value through ``quote`` (a short prefix), and every message and
param is shortened again in ``ApiError``, so a rejected megabyte is never echoed back. A body
pydantic refuses is a 400 naming the field as the client wrote it (``ApiError.from_validation``).
"""

from __future__ import annotations

import logging
import reprlib
import uuid
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

QUOTE_CHARS = 40  # of a request value shown in an error message
MESSAGE_CHARS = 1000  # of an error message (which may carry a library's words)
PARAM_CHARS = 100  # of an error's param (a field path may carry a client's dict key)

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = QUOTE_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxset = 8
_repr.maxdict = 4
_repr.maxlevel = 3


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters (saying how many were left out), as UTF-8-safe text
    (a lone surrogate becomes its escape)."""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit:,} more characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def quote(value: Any) -> str:
    """A request ``value`` as an error message shows it: its repr, a str cut to its first
    ``QUOTE_CHARS`` characters (with its length), a list to its first items."""
    if isinstance(value, str) and len(value) > QUOTE_CHARS:
        return f"{value[:QUOTE_CHARS]!r}... ({len(value):,} characters)"
    return shorten(_repr.repr(value), 4 * QUOTE_CHARS)


def check_text(value: Any, param: str) -> None:
    """``ApiError`` 400 naming the field (``param``, ``param[i]``, ``param.key``) when a str in
    ``value`` (a request model, list or dict, nested) is not Unicode text that UTF-8 can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(400, f"{param}: not Unicode text (a lone surrogate {value[err.start]!r} at "
                                f"character {err.start}); expected text that UTF-8 can encode",
                           param) from None
    elif isinstance(value, BaseModel):
        for name, item in {**value.__dict__, **(value.model_extra or {})}.items():
            check_text(item, f"{param}.{name}" if param else name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if not isinstance(item, (int, float)):  # token ids: nothing to check, fast
                check_text(item, f"{param}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, param)
            check_text(item, f"{param}.{key}")


# The forms of ``protocol.Prompt`` (its union's tags): pydantic puts them in an error's location,
# and a client's field path leaves them out.
PROMPT_FORMS = ("text", "texts", "ids", "id_lists")


def field_path(loc: tuple | list) -> str:
    """A pydantic error location as the client wrote the field: ``messages[0].content``
    (a ``Prompt``'s form name left out: ``prompt[3]``)."""
    path, previous = "", None
    for part in loc:
        skip = (part == "body" and not path) or (previous in ("prompt", "input") and part in PROMPT_FORMS)
        previous = part
        if skip:
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``; ``message`` and
    ``param`` are shortened (``MESSAGE_CHARS``, ``PARAM_CHARS``)."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_exceeded", 500: "internal_error",
             503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        message = shorten(message, MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else shorten(param, PARAM_CHARS)
        self.code = code

    @classmethod
    def internal(cls, err: BaseException, what: str) -> "ApiError":
        """A 500 for ``err``, which ``what`` (a request, a stream) ran into: the body shows a
        request id, never the exception; the log has it under that id."""
        request_id = uuid.uuid4().hex[:16]
        logger.error("%s failed (request id %s)", what, request_id, exc_info=err)
        return cls(500, f"internal error (request id {request_id}); the server's log has the details",
                   code="internal_error")

    @classmethod
    def refusal(cls, message: str) -> "ApiError":
        """A 400 for the library's refusal ``message``, which names its argument first
        (``name=value: expected ...`` or ``name: ...``): that argument is the ``param``."""
        return cls(400, message, message.split("=")[0].split(":")[0])

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_validation(cls, errors: list[dict]) -> "ApiError":
        """A 400 for pydantic's validation ``errors`` of a body: the first one, naming its field
        as the client wrote it (malformed JSON, or a union none of whose forms fits, said so)."""
        if not errors:
            return cls(400, "invalid request")
        first = errors[0]
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", first.get("msg"))
            return cls(400, f"the body is not valid JSON ({reason})")
        locs = [tuple(e.get("loc", ())) for e in errors]
        common = 0  # a union whose forms all failed: the errors part at the forms' names
        while all(len(loc) > common and loc[common] == locs[0][common] for loc in locs):
            common += 1
        if len(errors) > 1 and all(len(loc) > common and isinstance(loc[common], str) for loc in locs):
            field = field_path(locs[0][:common])
            if field:
                reasons = list(dict.fromkeys(e.get("msg") for e in errors))
                return cls(400, f"{field}: none of its accepted forms fits ({'; '.join(reasons)})",
                           field)
        param = field_path(locs[0]) or None
        return cls(400, f"{param or 'body'}: {first.get('msg')}", param)
