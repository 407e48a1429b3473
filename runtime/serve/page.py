"""The chat page ``tfport serve`` shows at ``/``: static HTML, CSS and JavaScript in ``static/``
(no framework, no CDN, no build step; shipped as package data, so it works offline).

The page asks the server it came from, as any OpenAI client would: ``/v1/models`` for the list,
``/v1/chat/completions`` streamed for a decoder with a chat template (``/v1/completions`` for one
without), ``/v1/embeddings`` for an encoder, with the API key the user types as
``Authorization: Bearer``. The page and its files need no key themselves (``guards.OPEN_PATHS``):
they hold nothing but this code. ``--no-ui`` (``ServeOptions.ui`` False) leaves both routes out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
# The page runs its own files only (no inline script, nothing from another origin) and is never
# framed by another site.
CONTENT_SECURITY_POLICY = ("default-src 'self'; object-src 'none'; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")


def mount_page(app: FastAPI) -> None:
    """Route ``GET /`` to the page and ``/static/...`` to its files."""

    async def chat_page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                     "X-Content-Type-Options": "nosniff"})

    app.add_api_route("/", chat_page, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
