"""How ``tfport serve`` runs and stops: uvicorn with the connection limits of ``connections``
and a graceful shutdown.

On SIGTERM (or SIGINT, Ctrl-C):

1. the server stops admitting: ``/health`` answers 503 ``"shutting down"`` (a balancer takes it
   out of rotation) and a new completion, chat or embedding request gets a 503 with
   ``Retry-After``; the socket keeps listening, so both are answered rather than refused;
2. running requests, streams included, get ``shutdown_timeout`` seconds to finish;
3. then the requests still running end at once, without waiting for the step under way: each
   stream with a last chunk whose ``finish_reason`` is "abort" (vLLM's; a Responses stream with
   ``response.incomplete``) and ``data: [DONE]``, so a client's stream ends cleanly; a request
   waiting for a JSON answer gets a 503 (code ``shutting_down``); the schedulers stop;
4. uvicorn closes the connections (waiting at most ``CLOSE_S`` for answers being written) and
   the process exits with status 0.

A second signal, at any point, exits at once: nothing more is awaited, open streams are cut.
uvicorn's own handling waits for every response however long it takes, and ignores a second
SIGTERM.

    serve(ServerState.load(["out/dec"], ServeOptions(shutdown_timeout=30)), "127.0.0.1", 8000)
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from .app import ServerState, create_app
from .connections import connection_settings

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often the drain looks at the running requests
CLOSE_S = 5  # after the drain: seconds uvicorn waits for answers still being written


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains ``state`` on the first signal and exits on the second (see
    the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.signalled = False
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal handler: the first signal starts the drain (at the next tick of uvicorn's
        main loop), a second one exits at once."""
        if self.signalled:
            self.should_exit = self.force_exit = True
        self.signalled = True

    async def on_tick(self, counter: int) -> bool:
        if self.signalled and self._drain is None:
            self._drain = asyncio.create_task(self.drain())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        """Stop admitting, wait up to ``shutdown_timeout`` for the running requests, end the
        rest, then let uvicorn shut down."""
        timeout = self.state.options.shutdown_timeout
        self.state.shutting_down = True
        logger.info("shutting down: no new requests; %d running get up to %g s to finish "
                    "(--shutdown-timeout; a second signal exits at once)",
                    len(self.server_state.tasks), timeout)
        deadline = time.monotonic() + timeout
        while self.server_state.tasks and not self.force_exit:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(POLL_S, left))
        if self.server_state.tasks and not self.force_exit:
            logger.warning("%d requests still running after %g s: ending them",
                           len(self.server_state.tasks), timeout)
            self.state.end_requests()  # their last events now, not after the step under way
            await asyncio.to_thread(self.state.stop)  # joins the scheduler threads
        self.should_exit = True


def serve(state: ServerState, host: str, port: int) -> None:
    """Serve ``state``'s models on ``host``:``port`` until a signal stops the server (see the
    module docstring); its options bound the connections (``connections``) and the shutdown."""
    config = uvicorn.Config(create_app(lambda: state), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=CLOSE_S, **connection_settings(state.options))
    GracefulServer(config, state).run()
