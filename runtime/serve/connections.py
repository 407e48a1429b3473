"""Connection hygiene for ``tfport serve``: read deadlines uvicorn does not have, and the
uvicorn settings that bound connections.

uvicorn closes an idle keep-alive connection (``--keep-alive-timeout``) and answers 503 past
``--limit-concurrency`` open connections or running requests, but it waits for ever for a request
head or body that never completes: a slowloris client dripping a byte a second, or one that
connects and says nothing, holds its connection (and a slot of the limit) indefinitely.
``ReadDeadlines`` is uvicorn's HTTP/1.1 protocol (h11) with two deadlines:

- a request head must be complete within ``header_timeout`` seconds of the connection opening,
  or of its first byte when it follows an earlier request on a kept-alive connection (the idle
  time between requests is the keep-alive timeout's);
- a request body must be complete within ``body_timeout`` seconds of its head.

A connection past its deadline is closed (a body's handler sees the client go away). Reading
the response has no deadline here: a long stream is the point of the server.

Past ``--limit-concurrency`` it answers uvicorn's 503, but as every other error of the API is
answered (``{"error": {"message", "type", ...}}`` with ``Retry-After``), not uvicorn's plain text.

    uvicorn.Config(app, **connection_settings(ServeOptions(header_timeout=10)))
"""

from __future__ import annotations

import asyncio
import functools
import logging

import h11
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import RETRY_AFTER_S
from .options import ServeOptions
from .errors import ApiError

logger = logging.getLogger(__name__)


class ReadDeadlines(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose request head is not complete within
    ``header_timeout`` seconds, or whose body is not complete within ``body_timeout`` seconds of
    its head, and answers past ``limit_concurrency`` with a JSON 503 (see the module docstring)."""

    def __init__(self, *args, header_timeout: float, body_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self._waiting_for = None  # the client's h11 state the deadline is for
        self._deadline: asyncio.TimerHandle | None = None
        # uvicorn's own check would answer in plain text: the limit is applied by ``_admit``.
        self.limit, self.limit_concurrency = self.limit_concurrency, None
        self._app, self.app = self.app, self._admit

    async def _admit(self, scope, receive, send) -> None:
        """The app, or past the limit uvicorn's 503 (connection closed) as an ``ApiError``.
        uvicorn counts before this request's task joins ``tasks``; here it has joined."""
        limit = self.limit
        if limit is None or (len(self.connections) < limit and len(self.tasks) <= limit):
            return await self._app(scope, receive, send)
        logger.warning("Exceeded concurrency limit (--limit-concurrency %d).", limit)
        err = ApiError(503, f"the server is at its limit of {limit} open connections or running "
                            "requests (--limit-concurrency); retry later")
        await JSONResponse(err.body(), status_code=503, headers={
            "Retry-After": str(RETRY_AFTER_S), "Connection": "close"})(scope, receive, send)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Arm the deadline of what the connection now waits for from its client: a head (on a
        new connection, or once the next one has started), a body, or nothing."""
        state = self.conn.their_state
        if state is not self._waiting_for:
            self._disarm()
            self._waiting_for = state
        if self._deadline is not None:
            return
        if state is h11.SEND_BODY:
            self._arm(self.body_timeout, "request body", "--body-timeout")
        elif state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            self._arm(self.header_timeout, "request head", "--header-timeout")

    def _arm(self, seconds: float, what: str, option: str) -> None:
        self._deadline = self.loop.call_later(seconds, self._expire, what, seconds, option)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, what: str, seconds: float, option: str) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            logger.debug("closing a connection from %s: its %s took over %g s (%s)",
                         self.client, what, seconds, option)
            self.transport.close()


def connection_settings(options: ServeOptions) -> dict:
    """``uvicorn.Config`` keyword arguments for ``options``' connection limits: the protocol with
    read deadlines, the keep-alive timeout and the concurrency limit."""
    return {"http": functools.partial(ReadDeadlines, header_timeout=options.header_timeout,
                                      body_timeout=options.body_timeout),
            "timeout_keep_alive": options.keep_alive_timeout,
            "limit_concurrency": options.limit_concurrency}
