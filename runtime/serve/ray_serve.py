"""``tfport serve DIR --ray``: the same app as a Ray Serve deployment.

Ray Serve's HTTP proxy takes the requests and routes each to one of the replicas of the app;
each replica loads the exports and runs its own continuous-batching schedulers, so replicas on
several machines add up. A fixed number of replicas (``--replicas N``), or between
``--min-replicas`` and ``--max-replicas`` chosen by Serve's autoscaler (``Replicas``). The app's
responses name the replica that made them (header ``x-tfport-replica``). Export directories must
exist at the same absolute path on every node that runs a replica (a shared filesystem, or the
same copy everywhere).

    ray start --head --port 6379                      # on the head node
    ray start --address HEAD:6379                     # on each other node
    RAY_ADDRESS=HEAD:6379 tfport serve /models/dec --ray --replicas 4 --host 0.0.0.0 --api-key-file key

Without ``RAY_ADDRESS`` a local Ray instance is started; Serve's HTTP proxy binds ``--host``
(default 127.0.0.1), but Ray's own gRPC servers listen on every interface (Ray resolves 127.0.0.1
to the node's reachable address), so firewall a single machine as you would a Ray node. Needs
the ``serve-ray`` extra (``ray[serve]``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tfport.config.checks import is_int

from .options import ServeOptions

logger = logging.getLogger(__name__)

APP_NAME = "tfport"
REPLICA_HEADER = "x-tfport-replica"


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ImportError("tfport serve --ray needs Ray Serve: pip install 'tfport[serve-ray]'") from None
    return ray, serve


@dataclass(frozen=True)
class Replicas:
    """How many replicas Serve runs: ``minimum == maximum``, that many; otherwise Serve's
    autoscaler keeps between ``minimum`` (0: none while idle, the next request waits for one to
    load) and ``maximum``, adding replicas while they hold more than ``max_rows`` requests each
    (their batches are full and requests queue)."""

    minimum: int = 1
    maximum: int = 1

    def __post_init__(self) -> None:
        if not is_int(self.minimum) or self.minimum < 0:
            raise ValueError(f"min_replicas={self.minimum!r}: expected an integer >= 0")
        if not is_int(self.maximum) or self.maximum < max(self.minimum, 1):
            raise ValueError(f"max_replicas={self.maximum!r}: expected an integer >= 1 and >= "
                             f"min_replicas={self.minimum}")

    @classmethod
    def from_options(cls, replicas: int | None = None, min_replicas: int | None = None,
                     max_replicas: int | None = None) -> Replicas:
        """From ``--replicas`` or ``--min-replicas`` with ``--max-replicas`` (None: not given;
        none given: one replica)."""
        autoscaled = (min_replicas, max_replicas) != (None, None)
        if replicas is not None and autoscaled:
            raise ValueError(f"--replicas={replicas}: a fixed count, or --min-replicas with "
                             "--max-replicas for autoscaling, not both")
        if replicas is not None:
            return cls(replicas, replicas)
        if not autoscaled:
            return cls()
        if min_replicas is None or max_replicas is None:
            raise ValueError(f"--min-replicas={min_replicas}, --max-replicas={max_replicas}: "
                             "expected both (the autoscaler's range)")
        return cls(min_replicas, max_replicas)

    def deployment_options(self, options: ServeOptions) -> dict:
        """``serve.deployment`` keyword arguments: ``num_replicas``, or ``autoscaling_config``."""
        if self.minimum == self.maximum:
            return {"num_replicas": self.minimum}
        return {"autoscaling_config": {"min_replicas": self.minimum, "max_replicas": self.maximum,
                                       "target_ongoing_requests": options.max_rows}}


class ReplicaHeader:
    """ASGI middleware: the app's HTTP responses carry ``x-tfport-replica: <replica>`` (Serve's
    replica tag), so a client (and the tests) can tell which replica answered."""

    def __init__(self, app: ASGIApp, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        return await self.app(scope, receive, send_named)


def build_deployment(directories: Sequence[str | Path], options: ServeOptions,
                     names: Sequence[str] | None = None, replicas: Replicas = Replicas(),
                     cpus_per_replica: float = 1.0):
    """A bound Ray Serve application: ``replicas`` of ``create_app`` over ``directories``
    (absolute paths); each admits up to max_rows + max_queue requests."""
    _, serve = _ray()
    directories = [str(Path(d).resolve()) for d in directories]
    names = list(names) if names else None

    @serve.deployment(name="tfport", **replicas.deployment_options(options),
                      max_ongoing_requests=options.max_rows + options.max_queue,
                      ray_actor_options={"num_cpus": cpus_per_replica})
    @serve.ingress()
    class TfportServer:
        def __init__(self, directories: list[str], options: ServeOptions, names):
            self.directories, self.options, self.names = directories, options, names

        def __serve_build_asgi_app__(self):
            from tfport.runtime.serve.app import ServerState, create_app
            app = create_app(lambda: ServerState.load(self.directories, self.options, self.names))
            app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_tag)
            return app  # the FastAPI app itself: Serve adds its exception handlers and docs path

    return TfportServer.bind(directories, options, names)


def deploy(directories: Sequence[str | Path], options: ServeOptions,
           names: Sequence[str] | None = None, host: str = "127.0.0.1", port: int = 8000,
           replicas: Replicas = Replicas(), cpus_per_replica: float = 1.0):
    """Connect to Ray (``RAY_ADDRESS``, else start a local instance), start Serve's proxy on
    ``host:port`` and deploy; returns once every replica is up."""
    ray, serve = _ray()
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False,
                     configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_deployment(directories, options, names, replicas, cpus_per_replica),
                     name=APP_NAME, route_prefix="/")


def run_ray(directories: Sequence[str | Path], options: ServeOptions,
            names: Sequence[str] | None = None, host: str = "127.0.0.1", port: int = 8000,
            replicas: Replicas = Replicas()) -> int:
    """``tfport serve --ray``: deploy, then serve until interrupted."""
    import time

    ray, serve = _ray()
    deploy(directories, options, names, host, port, replicas)
    scale = (f"{replicas.minimum}" if replicas.minimum == replicas.maximum
             else f"{replicas.minimum} to {replicas.maximum} (autoscaled)")
    print(f"tfport: serving on http://{host}:{port} with {scale} Ray Serve replica(s); "
          "Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
        ray.shutdown()
    return 0
