"""``tfport serve --ray``: the app as a Ray Serve deployment with 2 replicas on a local Ray
instance, through Ray Serve's HTTP proxy (bound to 127.0.0.1) and the openai client.

Opt-in: Ray's own gRPC servers (GCS, raylet, workers) listen on every interface whatever
``_node_ip_address`` says (Ray turns 127.0.0.1 into the node's reachable address), so this test
does not run by default. Run it with ``pip install -e '.[serve-ray]'`` and ``TFPORT_TEST_RAY=1``
(about 45 s on 2 cores).
"""

from __future__ import annotations

import concurrent.futures
import os
import socket

import pytest

if os.environ.get("TFPORT_TEST_RAY") != "1":
    pytest.skip("opt-in: Ray's gRPC servers listen on all interfaces; set TFPORT_TEST_RAY=1 (with "
                "the 'serve-ray' extra) to run it", allow_module_level=True)
pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="needs the 'dev' extra's openai client")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")
pytest.importorskip("ray.serve", reason="needs the 'serve-ray' extra: pip install -e '.[serve-ray]'")

from tfport.runtime import load_model  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(serve_exports):
    import ray
    from ray import serve

    from tfport.runtime.serve.ray_serve import deploy
    from tfport.runtime.serve.served import ServeOptions

    patch = pytest.MonkeyPatch()
    patch.delenv("RAY_ADDRESS", raising=False)  # a local instance, never a cluster from the env
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
             configure_logging=False, log_to_driver=False)
    port = _free_port()
    try:
        deploy([serve_exports["dec-ort"], serve_exports["enc"]], ServeOptions(threads=1),
               port=port, replicas=2, cpus_per_replica=0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        patch.undo()


def test_two_replicas_answer_like_the_runtime(ray_server, serve_exports):
    client = openai.OpenAI(base_url=ray_server + "/v1", api_key="-", max_retries=0, timeout=60)
    assert sorted(m.id for m in client.models.list().data) == ["dec-ort", "enc"]
    model = load_model(serve_exports["dec-ort"], intra_op_threads=1)
    prompts = [[1, 5 + i, 30 + i] for i in range(12)]
    expected = [model.generate([p], max_new_tokens=6, stop_token_ids=())[0].tolist() for p in prompts]

    def ask(i):
        out = client.completions.create(model="dec-ort", prompt=prompts[i], max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert list(pool.map(ask, range(12))) == expected
    assert len(client.embeddings.create(model="enc", input="w5 w6").data[0].embedding) == 32
    pids = set()
    with httpx.Client(timeout=10) as http:
        for _ in range(40):
            health = http.get(ray_server + "/health")
            assert health.status_code == 200
            pids.add(health.json()["pid"])
            if len(pids) == 2:
                break
    assert len(pids) == 2  # both replicas are up and routed to
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="dec-ort", prompt="w5", max_tokens=0)
