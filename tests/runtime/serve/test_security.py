"""An API key (``--api-key`` / ``--api-key-file``: Bearer, compared in constant time; /health
open) and the refusal to bind beyond this machine without one, against servers on 127.0.0.1."""

from __future__ import annotations

import hmac

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="needs the 'dev' extra's openai client")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from .conftest import running_server  # noqa: E402

KEY = "tfport-test-key-7f3a"


def test_every_request_but_health_needs_the_key(serve_exports, monkeypatch):
    from tfport.runtime.serve import guards

    compared, compare = [], hmac.compare_digest

    def spy(a, b):  # the key is compared with hmac.compare_digest, not ==
        compared.append(1)
        return compare(a, b)

    monkeypatch.setattr(guards.hmac, "compare_digest", spy)
    with running_server([serve_exports["dec-ort"]], api_key=KEY) as (url, _):
        assert httpx.get(url + "/health").status_code == 200  # a probe has no key
        body = {"model": "dec-ort", "prompt": [1, 5], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            response = httpx.post(url + "/v1/completions", json=body, headers=headers)
            assert response.status_code == 401, (headers, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and KEY not in response.text, error
            assert response.headers["www-authenticate"] == "Bearer"
        for path in ("/metrics", "/v1/models", "/docs", "/openapi.json"):
            assert httpx.get(url + path).status_code == 401, path
        assert compared, "hmac.compare_digest was not used"

        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        out = client.completions.create(model="dec-ort", prompt=[1, 5], max_tokens=2, temperature=0)
        assert len(out.choices[0].token_ids) == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(url + "/metrics", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_the_key_is_not_in_the_options_repr():
    from tfport.runtime.serve.options import ServeOptions

    assert KEY not in repr(ServeOptions(api_key=KEY))
    with pytest.raises(ValueError, match="api_key"):
        ServeOptions(api_key=" ")


def serve_args(*argv: str):
    from tfport.cli import build_parser
    return build_parser("serve").parse_args(["serve", "does-not-exist", *argv])


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.7", "::", "example.com"])
def test_a_non_loopback_host_needs_a_key_or_insecure(host, tmp_path):
    from tfport.runtime.serve.cli import run_serve

    with pytest.raises(ValueError, match="--insecure"):  # refused before anything is loaded
        run_serve(serve_args("--host", host))
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")
    for argv in (("--insecure",), ("--api-key", KEY), ("--api-key-file", str(key_file))):
        with pytest.raises(Exception) as err:  # past the check: loading the missing export fails
            run_serve(serve_args("--host", host, *argv))
        assert "--insecure" not in str(err.value) and "does-not-exist" in str(err.value), err.value


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_a_loopback_host_needs_no_key(host):
    from tfport.runtime.serve.cli import run_serve

    with pytest.raises(Exception) as err:
        run_serve(serve_args("--host", host))
    assert "does-not-exist" in str(err.value), err.value


def test_an_api_key_file_is_read_and_an_empty_one_refused(tmp_path):
    from tfport.runtime.serve.cli import _api_key, run_serve

    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    assert _api_key(serve_args("--api-key-file", str(key_file))) == KEY
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        run_serve(serve_args("--api-key-file", str(key_file)))


def test_a_host_the_server_does_not_answer_to_is_refused(serve_exports):
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own name as Host."""
    from tfport.runtime.serve.guards import default_allowed_hosts

    with running_server([serve_exports["enc"]], allowed_hosts=default_allowed_hosts("127.0.0.1")) \
            as (url, _):
        port = url.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", ""):
            response = httpx.get(url + "/v1/models", headers={"Host": host})
            assert response.status_code == 400, (host, response.text)
            assert response.json()["error"]["code"] == "host_not_allowed"
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
            assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200, host


@pytest.mark.parametrize("argv, expected", [
    ((), ("127.0.0.1", "localhost", "::1")),
    (("--host", "10.1.2.3", "--insecure"), ("10.1.2.3", "127.0.0.1", "localhost", "::1")),
    (("--host", "0.0.0.0", "--insecure"), None),  # every interface: names it cannot know
    (("--allowed-hosts", "API.example, b.example"), ("api.example", "b.example")),
    (("--allowed-hosts", "*"), None),
])
def test_allowed_hosts_default_to_the_bound_address_and_loopback(argv, expected):
    from tfport.runtime.serve.cli import _allowed_hosts

    assert _allowed_hosts(serve_args(*argv)) == expected
