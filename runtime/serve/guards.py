"""ASGI middleware that refuses a request before the app reads it: one addressed to a host name
the server does not answer to (400, ``--allowed-hosts``: a web page that rebinds its own name to
127.0.0.1 cannot reach a local server), one without the server's API key (401, ``--api-key``;
``/health`` and the chat page's files stay open) and a body over the server's limit (413,
``--max-body-bytes``).

The key is the ``Authorization: Bearer KEY`` header, compared in constant time
(``hmac.compare_digest``), as OpenAI's clients send their ``api_key``.

A body is counted as it arrives, whether it declares its ``Content-Length`` (refused at once when
that is over the limit, before a byte of it is read) or comes in chunks; it is held (at most the
limit) and handed to the app only once it is whole and within the limit, so no parser ever sees
an oversize body.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
from collections.abc import Callable

from fastapi.responses import JSONResponse

from .errors import ApiError, quote

OPEN_PATHS = ("/health", "/")  # answered without the key: a load balancer's probe has none;
OPEN_PREFIXES = ("/static/",)  # nor has a browser opening the chat page (its requests carry it)
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


async def refuse(err: ApiError, scope, receive, send, headers: dict | None = None) -> None:
    """Answer ``err`` as the app would (OpenAI's error shape)."""
    await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


class BodyLimit:
    """413 for a request body over ``limit()`` bytes (None: no limit, as while loading)."""

    def __init__(self, app, limit: Callable[[], int | None]):
        self.app = app
        self.limit = limit

    def _too_large(self, limit: int) -> ApiError:
        return ApiError(413, f"the request body is over this server's limit of {limit:,} bytes "
                             "(--max-body-bytes)", code="request_too_large")

    async def __call__(self, scope, receive, send):
        limit = self.limit() if scope["type"] == "http" else None
        if limit is None:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await refuse(self._too_large(limit), scope, receive, send)
        held: collections.deque = collections.deque()
        size = 0
        while True:
            message = await receive()
            held.append(message)
            if message["type"] != "http.request":  # the client went away: the app will see it
                break
            size += len(message.get("body", b""))
            if size > limit:
                return await refuse(self._too_large(limit), scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay():
            return held.popleft() if held else await receive()

        await self.app(scope, replay, send)


class ApiKey:
    """401 for a request (but to ``OPEN_PATHS`` and ``OPEN_PREFIXES``) without
    ``Authorization: Bearer <key()>``; ``key()`` None: every request passes."""

    def __init__(self, app, key: Callable[[], str | None]):
        self.app = app
        self.key = key

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        is_open = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        key = self.key() if scope["type"] == "http" and not is_open else None
        if key is None:
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode("ascii")):
            return await self.app(scope, receive, send)
        err = ApiError(401, "this server needs an API key: send the header 'Authorization: Bearer "
                            "KEY' with the key it was started with (--api-key)", code="invalid_api_key")
        await refuse(err, scope, receive, send, headers={"WWW-Authenticate": "Bearer"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def host_name(header: str) -> str:
    """The name in a ``Host`` header, port aside, lower-cased: ``[::1]:8000`` -> ``::1``."""
    if header.startswith("["):
        return header[1:].partition("]")[0].lower()
    return (header.rpartition(":")[0] if header.count(":") == 1 else header).lower()


class AllowedHosts:
    """400 for a request whose ``Host`` is not one of ``hosts()`` (None: any is answered)."""

    def __init__(self, app, hosts: Callable[[], tuple[str, ...] | None]):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send):
        hosts = self.hosts() if scope["type"] == "http" else None
        if hosts is None:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_name(header) in hosts:
            return await self.app(scope, receive, send)
        await refuse(ApiError(400, f"Host {quote(header)}: not a name this server answers to "
                                   f"(--allowed-hosts: {', '.join(hosts)})", code="host_not_allowed"),
                     scope, receive, send)


def default_allowed_hosts(host: str) -> tuple[str, ...] | None:
    """The ``Host`` names a server bound to ``host`` answers by default: that address and the
    loopback names; None (any) for every interface (0.0.0.0, ::), reached under names it
    cannot know (an API key guards it)."""
    if host in ("0.0.0.0", "::", ""):
        return None
    return tuple(dict.fromkeys([host.strip("[]").lower(), *LOOPBACK_NAMES]))
