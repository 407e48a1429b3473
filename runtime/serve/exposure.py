"""What a server shows beyond its API: cross-origin access for browsers (CORS) and the
endpoints an operator can switch off.

CORS is off by default: the chat page is served from the API's own origin, and a page from any
other origin gets no ``Access-Control-Allow-Origin`` header, so a browser keeps the answers from
it. ``--cors-origin ORIGIN`` (repeatable; ``*``: any) lets the pages of ``ORIGIN`` call the API,
preflight included, with ``Authorization`` and ``Content-Type`` headers and no cookies (the API
key travels in a header, never as a credential the browser adds by itself).

``--no-docs`` answers 404 for ``/docs``, ``/redoc`` and ``/openapi.json`` (the schema tells a
stranger every endpoint and limit), ``--no-metrics`` for ``/metrics`` (with an API key both need
it anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware

from .guards import refuse
from .errors import ApiError, quote

DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
METRICS_PATHS = ("/metrics",)
CORS_MAX_AGE_S = 600  # how long a browser may cache a preflight's answer


def check_origins(origins: tuple[str, ...]) -> None:
    """``ValueError`` unless each of ``origins`` is ``*`` or an origin as a browser sends it:
    ``http(s)://host[:port]``, lower case, without a path or a trailing slash."""
    if not isinstance(origins, tuple):
        raise ValueError(f"cors_origins={origins!r}: expected a tuple of origins")
    for origin in origins:
        if origin == "*":
            continue
        parts = urlsplit(origin) if isinstance(origin, str) else None
        if (parts is None or parts.scheme not in ("http", "https") or not parts.netloc
                or origin != f"{parts.scheme}://{parts.netloc}" or origin != origin.lower()):
            raise ValueError(f"cors origin {quote(origin)}: expected '*' or an origin as a browser "
                             "sends it, e.g. 'https://app.example.com' or 'http://localhost:3000' "
                             "(lower case, no path, no trailing slash)")


class Cors:
    """Starlette's ``CORSMiddleware`` for the origins ``origins()`` gives (read once they are
    known, as the server's options load with its models); none: requests pass untouched."""

    def __init__(self, app, origins: Callable[[], tuple[str, ...]]):
        self.app = app
        self.origins = origins
        self._cors: CORSMiddleware | None = None

    async def __call__(self, scope, receive, send):
        origins = self.origins() if scope["type"] == "http" else ()
        if not origins:
            return await self.app(scope, receive, send)
        if self._cors is None:
            self._cors = CORSMiddleware(self.app, allow_origins=list(origins),
                                        allow_methods=["GET", "POST"],
                                        allow_headers=["Authorization", "Content-Type"],
                                        max_age=CORS_MAX_AGE_S)
        await self._cors(scope, receive, send)


class Switches:
    """404 for the paths of the endpoints switched off: ``hidden()`` gives them with the option
    that did it, e.g. ``{"/metrics": "--no-metrics"}``."""

    def __init__(self, app, hidden: Callable[[], dict[str, str]]):
        self.app = app
        self.hidden = hidden

    async def __call__(self, scope, receive, send):
        option = self.hidden().get(scope["path"]) if scope["type"] == "http" else None
        if option is None:
            return await self.app(scope, receive, send)
        await refuse(ApiError(404, f"{scope['path']} is switched off on this server ({option})",
                              code="not_found"), scope, receive, send)


def hidden_paths(docs: bool, metrics: bool) -> dict[str, str]:
    """The paths ``Switches`` answers 404 for, each with the option that switched it off."""
    return {**({} if docs else dict.fromkeys(DOCS_PATHS, "--no-docs")),
            **({} if metrics else dict.fromkeys(METRICS_PATHS, "--no-metrics"))}
