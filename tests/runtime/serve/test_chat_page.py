"""The chat page ``tfport serve`` shows at ``/`` (``runtime/serve/page.py``, ``static/``).

Over plain HTTP: the page and every file it links are served with their content types and
without the API key (the API itself still needs it), the package data ships every static file,
and ``--no-ui`` leaves the routes out. In headless Chromium driven by Selenium: the page lists the
models once given the key, streams a reply whose text is the server's own non-streamed answer
(chat, and text completion for a decoder without a chat template), shows a refused request's
error, stops a generation (the server cancels the row), and shows the cosine similarity of two
texts as numpy computes it from ``/v1/embeddings``. The browser tests skip, saying why, where
Chromium or chromedriver is missing (``make test`` installs them when run as root with apt-get).

Run as a script, it takes the screenshot of docs/img/chat-page.png from a running server:
``python -m tests.runtime.serve.test_chat_page http://127.0.0.1:8000 MODEL docs/img/chat-page.png``.
"""

from __future__ import annotations

import fnmatch
import http.client
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from .conftest import _export, running_server  # noqa: E402

KEY = "chat-page-key-5d1c"
ROOT = Path(__file__).resolve().parents[3]
STEP_S = 0.05  # each decode step of the browser tests' chat decoder waits this long: 50 tokens
# take 2.5 s, slow enough to watch a reply grow and stop it midway, as with a real model
BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


# ---------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def page_server(serve_exports, tmp_path_factory):
    """Behind an API key: the chat decoder (each step slowed by STEP_S), a decoder without a chat
    template (``dec-plain``) and the encoder."""
    plain = _export(tmp_path_factory.mktemp("page"), "dec-plain", "tiny-decoder", "ort",
                    {"d_model": 64, "tie_embeddings": False}, chat=False)
    with running_server([serve_exports["dec-ort"], plain, serve_exports["enc"]], api_key=KEY) \
            as (url, state):
        scheduler = state.models["dec-ort"].scheduler
        step = scheduler.run_once

        def slow_step():
            time.sleep(STEP_S)
            step()

        scheduler.run_once = slow_step  # the scheduler thread looks it up at every step
        yield url, state


# ------------------------------------------------------------------------------- plain HTTP
def test_the_page_and_its_files_are_served_without_the_key(page_server):
    url, _ = page_server
    page = httpx.get(url + "/")
    assert page.status_code == 200, page.text
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    linked = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(linked) == ["static/app.js", "static/style.css"]
    for path in linked:
        response = httpx.get(f"{url}/{path}")
        assert response.status_code == 200, path
        assert response.headers["content-type"].startswith(CONTENT_TYPES[Path(path).suffix]), path
        assert "http://" not in response.text and "https://" not in response.text, \
            f"{path}: the page must work offline (no CDN)"
    assert httpx.get(url + "/v1/models").status_code == 401  # the API still needs the key
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("GET", "/static/../v1/models")  # as sent: httpx would normalise it
    assert connection.getresponse().status == 404  # the open prefix reaches no API route
    connection.close()


def test_the_package_ships_every_static_file():
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["tfport.runtime.serve"]
    static = ROOT / "runtime" / "serve" / "static"
    files = sorted(p.relative_to(static.parent).as_posix() for p in static.rglob("*") if p.is_file())
    assert {"static/index.html", "static/app.js", "static/style.css"} <= set(files)
    for name in files:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), (name, patterns)


def serve_options(*argv: str):
    """The ``ServeOptions`` ``tfport serve *argv`` loads its exports with."""
    from tfport.cli import build_parser
    from tfport.runtime.serve.app import ServerState

    class Loaded(Exception):
        pass

    def load(directories, options, names=None):
        raise Loaded(options)

    args = build_parser("serve").parse_args(["serve", *argv])
    with pytest.MonkeyPatch.context() as patch, pytest.raises(Loaded) as loaded:
        patch.setattr(ServerState, "load", load)
        args.func(args)
    return loaded.value.args[0]


@pytest.mark.parametrize("argv, page_status", [((), 200), (("--no-ui",), 404)])
def test_no_ui_leaves_the_page_out(serve_exports, argv, page_status):
    options = serve_options(str(serve_exports["enc"]), *argv)
    with running_server([serve_exports["enc"]], ui=options.ui) as (url, _):
        for path in ("/", "/static/app.js", "/static/style.css"):
            response = httpx.get(url + path)
            assert response.status_code == page_status, (path, response.text)
        assert httpx.get(url + "/v1/models").status_code == 200


# ---------------------------------------------------------------------------------- browser
def chrome():
    """Headless Chromium under Selenium (the system's chromedriver: nothing is downloaded)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=960,900", "--force-prefers-reduced-motion"):
        options.add_argument(argument)
    return webdriver.Chrome(options=options, service=Service(DRIVER))


@pytest.fixture(scope="module")
def driver():
    pytest.importorskip("selenium", reason="selenium is not installed: pip install -e '.[dev]'")
    if BROWSER is None or DRIVER is None:
        pytest.skip(f"no headless browser (chromium: {BROWSER}, chromedriver: {DRIVER}): install "
                    "Debian's chromium and chromium-driver (make test does as root with apt-get)")
    browser = chrome()
    browser.set_script_timeout(30)
    yield browser
    browser.quit()


def wait(condition, what: str, timeout: float = 20.0, every: float = 0.01):
    """``condition()``'s first truthy value, polled; fails saying ``what`` was not seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"{what}: not seen within {timeout} s")


def open_page(driver, url: str, model: str) -> None:
    """Load the page, give it the key, pick ``model``."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    driver.get(url + "/")
    notice = driver.find_element(By.ID, "notice")
    wait(notice.is_displayed, "the notice that the models could not be listed without the key")
    assert "API key" in notice.text, notice.text
    driver.find_element(By.ID, "api-key").send_keys(KEY, Keys.TAB)  # change: lists the models
    select = driver.find_element(By.ID, "model")
    wait(lambda: select.find_elements(By.CSS_SELECTOR, f"option[value='{model}']"), f"model {model}")
    assert not notice.is_displayed(), notice.text
    Select(select).select_by_value(model)


def send(driver, text: str, temperature: str = "0", max_tokens: str = "") -> object:
    """Send ``text`` with those settings -> the assistant's message element."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    for field, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    before = len(driver.find_elements(By.CSS_SELECTOR, "#log .message.assistant"))
    driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)
    return wait(lambda: driver.find_elements(By.CSS_SELECTOR, "#log .message.assistant")[before:],
                "the assistant's message")[0]


def growth(message, stop_after: int | None = None) -> list[str]:
    """The texts ``message`` shows as it streams, until it finishes (or, with ``stop_after``,
    once that many longer texts have been seen)."""
    from selenium.webdriver.common.by import By

    content = message.find_element(By.CLASS_NAME, "content")
    seen = [""]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = content.text
        if len(text) > len(seen[-1]):
            assert text.startswith(seen[-1]), (seen[-1], text)  # text only grows
            seen.append(text)
            if stop_after is not None and len(seen) > stop_after:
                return seen
        if stop_after is None and message.get_attribute("data-finish"):
            seen.append(content.text)
            return seen
        time.sleep(0.005)
    pytest.fail(f"the reply did not finish within 30 s (seen {seen[-1]!r})")


def test_a_reply_streams_in_as_the_server_generates_it(driver, page_server):
    from selenium.webdriver.common.by import By

    url, _ = page_server
    open_page(driver, url, "dec-ort")
    assert driver.find_element(By.ID, "mode").text == "chat"
    assert not driver.find_element(By.ID, "embed-panel").is_displayed()
    message = send(driver, "w5 w6", max_tokens="20")
    seen = growth(message)
    assert len(set(seen)) >= 4, f"the text grew {len(set(seen)) - 1} times: {seen}"
    assert message.get_attribute("data-finish") == "length"  # the tiny model never says [EOS] here

    expected = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "dec-ort", "temperature": 0, "max_tokens": 20,
                                "messages": [{"role": "user", "content": "w5 w6"}]}).json()["choices"][0]
    assert seen[-1] == expected["message"]["content"].strip()  # (the DOM's text drops edge space)
    speed = driver.find_element(By.ID, "speed").text
    assert re.fullmatch(rf"{len(expected['token_ids'])} tokens · [\d.]+ tokens/s · first token after "
                        r"[\d.]+ s", speed), speed


def test_a_decoder_without_a_chat_template_continues_the_text(driver, page_server):
    from selenium.webdriver.common.by import By

    url, _ = page_server
    auth = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(url + "/v1/models", headers=auth).json()["data"]
    assert {m["id"]: m["chat_template"] for m in models} == {"dec-ort": True, "dec-plain": False,
                                                             "enc": False}
    open_page(driver, url, "dec-plain")
    assert driver.find_element(By.ID, "mode").text == "text completion (no chat template)"
    driver.find_element(By.ID, "system").send_keys("w9")
    message = send(driver, "w5 w6", max_tokens="8")
    seen = growth(message)
    assert message.get_attribute("data-finish") == "length"
    expected = httpx.post(url + "/v1/completions", headers=auth, json={
        "model": "dec-plain", "prompt": "w9\nw5 w6", "max_tokens": 8, "temperature": 0}).json()
    assert seen[-1] == expected["choices"][0]["text"].strip()


def test_a_refused_request_shows_the_servers_message(driver, page_server):
    from selenium.webdriver.common.by import By

    url, _ = page_server
    open_page(driver, url, "dec-plain")
    message = send(driver, "w5 w6", max_tokens="100000")
    wait(lambda: message.get_attribute("data-finish") == "error", "the reply marked failed")
    error = message.find_element(By.CLASS_NAME, "error").text
    assert "max_tokens=100000" in error and "--max-tokens" in error, error  # the server's 400
    assert driver.find_element(By.ID, "send").is_enabled()


def finished_cancelled(url: str) -> float:
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    found = re.search(r'^tfport_sequences_finished_total\{model="dec-ort",reason="cancelled"\} (\S+)$',
                      metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_stop_ends_a_generation_and_frees_its_row(driver, page_server):
    from selenium.webdriver.common.by import By

    url, state = page_server
    open_page(driver, url, "dec-ort")
    cancelled = finished_cancelled(url)
    stop = driver.find_element(By.ID, "stop")
    assert not stop.is_enabled()
    message = send(driver, "w5 w6", max_tokens="50")  # 50 tokens: 2.5 s
    growth(message, stop_after=2)
    stop.click()
    wait(lambda: message.get_attribute("data-finish") == "stopped", "the reply marked stopped", 5)
    shown = message.find_element(By.CLASS_NAME, "content").text
    wait(lambda: state.models["dec-ort"].scheduler.running == 0, "no running row", 5)
    health = httpx.get(url + "/health").json()["models"]["dec-ort"]
    assert health["running"] == 0 and health["waiting"] == 0, health
    wait(lambda: finished_cancelled(url) > cancelled, "the row counted as cancelled", 5)
    assert finished_cancelled(url) == cancelled + 1  # cancelled, not run to its 50 tokens
    time.sleep(5 * STEP_S)
    assert message.find_element(By.CLASS_NAME, "content").text == shown  # no token after stop
    assert not stop.is_enabled() and driver.find_element(By.ID, "send").is_enabled()


def test_the_similarity_panel_shows_the_cosine_of_the_embeddings(driver, page_server):
    from selenium.webdriver.common.by import By

    url, _ = page_server
    open_page(driver, url, "enc")
    assert not driver.find_element(By.ID, "chat-panel").is_displayed()
    texts = ["w3 w7 w9 w11", "w3 w8 w20"]
    for field, text in zip(("text-a", "text-b"), texts):
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(text)
    driver.find_element(By.ID, "compare").click()
    output = driver.find_element(By.ID, "similarity")
    shown = wait(lambda: re.fullmatch(r"-?\d\.\d{4}", output.text), "a similarity").group(0)

    data = httpx.post(url + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "enc", "input": texts}).json()["data"]
    a, b = (np.asarray(item["embedding"], dtype=np.float64) for item in data)
    cosine = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    assert abs(float(shown) - cosine) <= 5e-5, (shown, cosine)  # shown to 4 decimals
    assert abs(cosine) < 0.9999, "the texts should not embed alike (the check would be weak)"


# --------------------------------------------------------------------------------- screenshot
def screenshot(url: str, model: str, out: Path,
               messages: tuple[str, ...] = ("What is the capital of France?", "And of Italy?")) -> None:
    """The page after ``messages`` to ``model`` of the server at ``url``, saved to ``out``."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser = chrome()
    try:
        browser.get(url + "/")
        select = browser.find_element(By.ID, "model")
        wait(lambda: select.find_elements(By.CSS_SELECTOR, f"option[value='{model}']"), model)
        Select(select).select_by_value(model)
        browser.find_element(By.ID, "system").send_keys("You are a helpful assistant.")
        for message in messages:
            reply = send(browser, message, temperature="0", max_tokens="64")
            wait(lambda: reply.get_attribute("data-finish"), "the reply", 120)
        browser.save_screenshot(str(out))
    finally:
        browser.quit()


if __name__ == "__main__":
    screenshot(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
