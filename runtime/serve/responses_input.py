"""A Responses API request (``POST /v1/responses``) as the chat request it is served as
(``responses_api``): its ``input`` items as chat messages, its function tools and
``tool_choice`` as the chat's, its ``text.format`` as the chat's ``response_format``, and the
chat's errors renamed to the Responses fields the client sent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ApiError, quote
from .protocol import ROLES

PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    """A message item's content as one str: a str, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: expected a string or a list of text parts", f"{where}.content")
    pieces = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{index}]: only text parts ({', '.join(TEXT_PARTS)}) are "
                                f"supported, got type {quote(kind)}", f"{where}.content[{index}]")
        pieces.append(part["text"])
    return "".join(pieces)


def input_messages(items: str | list[dict]) -> list[dict]:
    """A request's ``input`` as chat messages: a text is one user message; message items keep
    their role, consecutive ``function_call`` items make one assistant message's ``tool_calls``,
    a ``function_call_output`` a tool message. ``ApiError`` 400 naming the item otherwise."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for index, item in enumerate(items):
        where, kind = f"input[{index}]", item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES[:4]:
                raise ApiError(400, f"{where}.role={quote(item.get('role'))}: expected one of "
                                    f"{list(ROLES[:4])}", f"{where}.role")
            messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
                raise ApiError(400, f"{where}: a function_call needs call_id, name and arguments (strings)", where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise ApiError(400, f"{where}: a function_call_output needs call_id and output", where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise ApiError(400, f"{where}.type={quote(kind)}: expected message, function_call or "
                                "function_call_output", f"{where}.type")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools (``{"type": "function", "name", "parameters", ...}``) as chat
    tools (``{"type": "function", "function": {...}}``); ``ApiError`` for other kinds."""
    if tools is None:
        return None
    out = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ApiError(400, f"tools[{index}].type={quote(tool.get('type'))}: only function tools are "
                                "served here (no built-in tools)", f"tools[{index}].type")
        out.append({"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                                      if key in tool}})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """``{"type": "function", "name": ...}`` as the chat's ``{"type": "function", "function":
    {"name": ...}}``; the strings as they are."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, f"tool_choice={quote(choice)}: expected auto, none, required or "
                                "{'type': 'function', 'name': ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict | None) -> dict | None:
    """``text.format`` as the chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None or not isinstance(fmt, dict):
        return None if fmt is None else {"type": fmt}  # a malformed one: the chat's check names it
    if fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {key: fmt[key] for key in keys if key in fmt}}
    return dict(fmt)


def rename(err: ApiError) -> ApiError:
    """A chat request's ``err`` naming the field as the Responses API names it (``PARAMS``)."""
    param = err.param
    for chat, field_name in PARAMS.items():
        if param is not None and (param == chat or param.startswith((chat + ".", chat + "["))):
            param = field_name + param[len(chat):]
    return ApiError(err.status, err.message, param, err.code)


def renamed(function: Callable, *args):
    """``function(*args)``, its ``ApiError`` renamed (``rename``)."""
    try:
        return function(*args)
    except ApiError as err:
        raise rename(err) from None
