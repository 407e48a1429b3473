"""``tfport serve --ray``: the app as a Ray Serve deployment with 2 replicas on a local Ray
instance, through Ray Serve's HTTP proxy on 127.0.0.1 with the openai client: answers equal the
runtime's, requests spread over both replicas, a replica killed mid-run leaves every later
request answered (Serve replaces it), and ``--min-replicas/--max-replicas`` reach Serve's
autoscaler.

Ray runs only where loopback is the only network: Ray turns 127.0.0.1 into the machine's own
address for its internal gRPC servers, which then listen on every interface. A normal run (as
root, as in CI) re-runs this file in a fresh network namespace (``unshare -n``, with only ``lo``
up) and checks that every Ray test passed there (``test_ray_tests_pass_in_a_private_network``);
inside that namespace the Ray tests run directly. The re-run took 90-150 s on 2 cores shared with
other jobs (load average 10-15), most of it Ray starting; little of it is CPU time.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")

from tfport.runtime.serve.ray_serve import REPLICA_HEADER, Replicas  # noqa: E402

NAMESPACE_TIMEOUT = 300  # seconds for the re-run in the namespace: a guard against a hang (90-150 measured)


def _loopback_only() -> bool:
    """True where the network namespace has no interface but ``lo`` (Ray cannot escape it)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


in_private_network = pytest.mark.skipif(
    not _loopback_only(), reason="Ray runs only where loopback is the only network: "
    "test_ray_tests_pass_in_a_private_network runs these inside `unshare -n`")


# --- Without Ray: the replica options --------------------------------------------------------

@pytest.mark.parametrize("given, expected", [
    ((None, None, None), {"num_replicas": 1}),
    ((3, None, None), {"num_replicas": 3}),
    ((None, 2, 2), {"num_replicas": 2}),
    ((None, 0, 4), {"autoscaling_config": {"min_replicas": 0, "max_replicas": 4,
                                           "target_ongoing_requests": 16}}),
])
def test_replica_options_become_serve_deployment_options(given, expected):
    from tfport.runtime.serve.options import ServeOptions
    assert Replicas.from_options(*given).deployment_options(ServeOptions(max_rows=16)) == expected


@pytest.mark.parametrize("given, message", [
    ((2, 1, 3), "--replicas=2: a fixed count"),
    ((None, 1, None), "expected both"),
    ((None, None, 3), "expected both"),
    ((None, -1, 3), "min_replicas=-1: expected an integer >= 0"),
    ((None, 3, 2), "max_replicas=2: expected an integer >= 1 and >= min_replicas=3"),
    ((None, 0, 0), "max_replicas=0"),
])
def test_bad_replica_options_are_refused(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Replicas.from_options(*given)


def test_the_cli_passes_the_autoscaling_range_to_ray(tmp_path, monkeypatch, capsys):
    from tfport.cli import main
    from tfport.runtime.serve import ray_serve

    calls = []
    monkeypatch.setattr(ray_serve, "run_ray", lambda *args, **kwargs: calls.append(kwargs) or 0)
    directory = str(tmp_path)  # run_ray is not called: no export is read
    assert main(["serve", directory, "--ray", "--min-replicas", "1", "--max-replicas", "3"]) == 0
    assert calls[-1]["replicas"] == Replicas(1, 3)
    assert main(["serve", directory, "--ray", "--replicas", "2"]) == 0
    assert calls[-1]["replicas"] == Replicas(2, 2)
    assert main(["serve", directory, "--max-replicas", "3"]) == 2  # without --ray
    assert "--max-replicas: need --ray" in capsys.readouterr().err
    assert main(["serve", directory, "--ray", "--replicas", "2", "--max-replicas", "3"]) == 2
    assert "--replicas=2: a fixed count, or --min-replicas" in capsys.readouterr().err
    assert len(calls) == 2


# --- The re-run in a private network namespace -----------------------------------------------

def _why_no_private_network() -> str | None:
    """None where ``unshare -n`` can make a loopback-only namespace here, else the reason."""
    if importlib.util.find_spec("ray") is None:
        return "needs the 'serve-ray' extra: pip install -e '.[serve-ray]'"
    if os.geteuid() != 0:
        return "needs root for `unshare -n` (a network namespace with only loopback), as in CI"
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (util-linux, iproute2) for a private network"
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"`unshare -n` failed here (a container without CAP_SYS_ADMIN?): {probe.stderr.strip()}"
    return None


def test_ray_tests_pass_in_a_private_network(tmp_path):
    if _loopback_only():
        pytest.skip("already where loopback is the only network: the Ray tests run here directly")
    reason = _why_no_private_network()
    if reason:
        pytest.skip(reason)
    report = tmp_path / "ray.xml"
    script = ('ip link set lo up && exec "$0" -m pytest -q -p no:cacheprovider '
              '--basetemp "$1" --junitxml "$2" "$3"')
    child = subprocess.Popen(
        ["unshare", "-n", "sh", "-c", script, sys.executable, str(tmp_path / "tmp"), str(report),
         __file__], cwd=Path(__file__).resolve().parents[3], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = child.communicate(timeout=NAMESPACE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # pytest there; Ray's processes die with it (fate sharing)
        output, _ = child.communicate(timeout=30)
        pytest.fail(f"the Ray tests took over {NAMESPACE_TIMEOUT} s:\n{output[-6000:]}")
    assert child.returncode == 0, output[-6000:]
    outcomes = {}  # test function -> how its cases ended there ({"passed"} when all passed)
    for case in ElementTree.parse(report).iter("testcase"):
        ended = [element.tag for element in case if element.tag in ("failure", "error", "skipped")]
        outcomes.setdefault(case.get("name").split("[")[0], set()).add(ended[0] if ended else "passed")
    tests = {name for name in globals() if name.startswith("test_")}
    tests.remove("test_ray_tests_pass_in_a_private_network")  # skips there: already inside
    assert {name: outcomes.get(name) for name in tests} == {name: {"passed"} for name in tests}, \
        output[-6000:]


# --- With Ray (in the private namespace) -----------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(serve_exports):
    """Serve's proxy on 127.0.0.1 in front of 2 replicas of the app (``dec-ort`` and ``enc``),
    on a local Ray instance with 2 CPUs -> the proxy's base URL."""
    pytest.importorskip("ray.serve", reason="needs the 'serve-ray' extra: pip install -e '.[serve-ray]'")
    import ray

    from tfport.runtime.serve.ray_serve import deploy
    from tfport.runtime.serve.options import ServeOptions

    patch = pytest.MonkeyPatch()
    patch.delenv("RAY_ADDRESS", raising=False)  # a local instance, never a cluster from the env
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
             configure_logging=False, log_to_driver=False)
    port = _free_port()
    try:
        deploy([serve_exports["dec-ort"], serve_exports["enc"]], ServeOptions(threads=1),
               port=port, replicas=Replicas(2, 2), cpus_per_replica=0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        ray.shutdown()  # the local instance, Serve with it
        patch.undo()


@pytest.fixture(scope="module")
def client(ray_server):
    import openai
    return openai.OpenAI(base_url=ray_server + "/v1", api_key="-", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(serve_exports):
    """prompt -> the runtime's greedy tokens, for 24 prompts of 3 tokens."""
    from tfport.runtime import load_model
    model = load_model(serve_exports["dec-ort"], intra_op_threads=1)
    prompts = [(1, 5 + i, 30 + i) for i in range(24)]
    return {p: model.generate([list(p)], max_new_tokens=6, stop_token_ids=())[0].tolist()
            for p in prompts}


def _complete(client, prompt) -> tuple[list[int], str]:
    """Greedy completion of 6 tokens through the proxy -> (tokens, the replica that answered)."""
    raw = client.completions.with_raw_response.create(
        model="dec-ort", prompt=list(prompt), max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})
    return raw.parse().choices[0].token_ids, raw.headers[REPLICA_HEADER]


def _replica_pids(ray_server, replicas: int, timeout: float = 60.0) -> dict[str, int]:
    """Replica -> pid of each replica /health reaches, once ``replicas`` distinct ones answered."""
    import httpx
    pids = {}
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10) as http:
        while len(pids) < replicas and time.monotonic() < deadline:
            health = http.get(ray_server + "/health")
            if health.status_code == 200:
                pids[health.headers[REPLICA_HEADER]] = health.json()["pid"]
    return pids


@in_private_network
def test_two_replicas_answer_like_the_runtime(client, expected):
    import openai
    assert sorted(m.id for m in client.models.list().data) == ["dec-ort", "enc"]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda p: _complete(client, p)[0], expected))
    assert answers == list(expected.values())
    assert len(client.embeddings.create(model="enc", input="w5 w6").data[0].embedding) == 32
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="dec-ort", prompt="w5", max_tokens=0)


@in_private_network
def test_requests_spread_over_both_replicas(ray_server, client, expected):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answered = list(pool.map(lambda p: _complete(client, p), expected))
    assert [tokens for tokens, _ in answered] == list(expected.values())
    replicas = {replica for _, replica in answered}
    assert replicas == set(_replica_pids(ray_server, 2))  # the 2 replicas, and nothing else
    assert len(replicas) == 2


@in_private_network
def test_a_killed_replica_is_replaced_and_every_later_request_answered(ray_server, client, expected):
    pids = _replica_pids(ray_server, 2)
    assert len(pids) == 2
    victim, pid = next(iter(pids.items()))
    done = threading.Semaphore(0)

    def ask(prompt):
        started = time.monotonic()
        try:
            return started, _complete(client, prompt)
        except Exception as err:  # a request in flight on the killed replica may fail
            return started, err
        finally:
            done.release()

    prompts = list(expected) * 2
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = [pool.submit(ask, p) for p in prompts]
        for _ in range(8):  # mid-run: 8 answered, 4 in flight, 36 to come
            done.acquire()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = [r.result() for r in results]
    later = [(prompt, answer) for prompt, (started, answer) in zip(prompts, results)
             if started > killed_at]
    assert len(later) >= 24
    failed = [answer for _, answer in later if isinstance(answer, Exception)]
    assert not failed, f"{len(failed)} of {len(later)} requests after the kill failed: {failed[0]!r}"
    assert [tokens for _, (tokens, _) in later] == [expected[prompt] for prompt, _ in later]
    assert victim not in {replica for _, (_, replica) in later}
    replaced = _replica_pids(ray_server, 2)  # Serve starts a new replica in its place
    assert len(replaced) == 2 and victim not in replaced and pid not in replaced.values()


@in_private_network
def test_min_and_max_replicas_reach_serves_autoscaler(ray_server, serve_exports):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    from tfport.runtime.serve.ray_serve import build_deployment
    from tfport.runtime.serve.options import ServeOptions

    options = ServeOptions(threads=1, max_rows=4)
    # From zero: no replica starts (a request would start one), so the test stays short.
    serve.run(build_deployment([serve_exports["enc"]], options, replicas=Replicas(0, 2)),
              name="autoscaled", route_prefix="/autoscaled")
    try:
        # What the controller runs (serve.status() reads the same details, without the config).
        details = ServeInstanceDetails(**_get_global_client().get_serve_details())
        deployment = details.applications["autoscaled"].deployments["tfport"]
        autoscaling = deployment.deployment_config.autoscaling_config
        config = autoscaling if isinstance(autoscaling, dict) else autoscaling.dict()
        assert (config["min_replicas"], config["max_replicas"],
                config["target_ongoing_requests"]) == (0, 2, options.max_rows)
        assert deployment.replicas == []  # min_replicas: 0 (Serve's default is 1)
    finally:
        serve.delete("autoscaled")

