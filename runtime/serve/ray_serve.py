"""``tfport serve DIR --ray``: the same app as a Ray Serve deployment.

Ray Serve's HTTP proxy takes the requests and routes each to one of ``replicas`` copies of the
app; each replica loads the exports and runs its own continuous-batching schedulers, so replicas
on several machines add up. Export directories must exist at the same absolute path on every
node that runs a replica (a shared filesystem, or the same copy everywhere).

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
from pathlib import Path

from .served import ServeOptions

logger = logging.getLogger(__name__)

APP_NAME = "tfport"


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ImportError("tfport serve --ray needs Ray Serve: pip install 'tfport[serve-ray]'") from None
    return ray, serve


def build_deployment(directories: Sequence[str | Path], options: ServeOptions,
                     names: Sequence[str] | None = None, replicas: int = 1,
                     cpus_per_replica: float = 1.0):
    """A bound Ray Serve application: ``replicas`` replicas of ``create_app`` over
    ``directories`` (absolute paths); each admits up to max_rows + max_queue requests."""
    _, serve = _ray()
    directories = [str(Path(d).resolve()) for d in directories]
    names = list(names) if names else None

    @serve.deployment(name="tfport", num_replicas=replicas,
                      max_ongoing_requests=options.max_rows + options.max_queue,
                      ray_actor_options={"num_cpus": cpus_per_replica})
    @serve.ingress()
    class TfportServer:
        def __init__(self, directories: list[str], options: ServeOptions, names):
            self.directories, self.options, self.names = directories, options, names

        def __serve_build_asgi_app__(self):
            from tfport.runtime.serve.app import ServerState, create_app
            return create_app(lambda: ServerState.load(self.directories, self.options, self.names))

    return TfportServer.bind(directories, options, names)


def deploy(directories: Sequence[str | Path], options: ServeOptions,
           names: Sequence[str] | None = None, host: str = "127.0.0.1", port: int = 8000,
           replicas: int = 1, cpus_per_replica: float = 1.0):
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
            replicas: int = 1) -> int:
    """``tfport serve --ray``: deploy, then serve until interrupted."""
    import time

    ray, serve = _ray()
    deploy(directories, options, names, host, port, replicas)
    print(f"tfport: serving on http://{host}:{port} with {replicas} Ray Serve replica(s); "
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
