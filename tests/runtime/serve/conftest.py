"""Exports and servers for the serving tests: tiny decoders (targets ort and portable) with a
word-level tokenizer and a chat template, and a tiny text encoder; a server on 127.0.0.1 with an
ephemeral port, run by uvicorn in a thread of the test process."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from tests.runtime.runtime_cases import write_tokenizer

# A template over the word-level vocabulary: each message is "[BOS] <content> [EOS]"; the
# assistant's turn starts with "[BOS] w4" (so the rendered prompt differs from a plain prompt).
CHAT_TEMPLATE = ("{% for m in messages %}[BOS] {{ m['content'] }} [EOS] {% endfor %}"
                 "{% if add_generation_prompt %}[BOS] w4{% endif %}")


def _export(root: Path, name: str, preset: str, target: str, overrides: dict,
            chat: bool) -> Path:
    from tfport.export import ExportOptions, export_model
    from tfport.models import build_model
    from tfport.presets import get_preset

    config = get_preset(preset).replace(**overrides)
    tokenizer = write_tokenizer(root / f"{name}-tokenizer.json", config)
    path = root / name
    export_model(build_model(config, seed=0), path, ExportOptions(target=target, tokenizer=tokenizer,
                                                                  chat_template=CHAT_TEMPLATE if chat else None))
    return path


@pytest.fixture(scope="session")
def serve_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> export directory: ``dec-ort`` (head dim 16 for the fused kernel), ``dec-portable``,
    ``enc``; the decoders untied (varied greedy tokens) with max_positions 64."""
    root = tmp_path_factory.mktemp("serve-exports")
    decoder = {"d_model": 64, "tie_embeddings": False}
    return {
        "dec-ort": _export(root, "dec-ort", "tiny-decoder", "ort", decoder, chat=True),
        "dec-portable": _export(root, "dec-portable", "tiny-decoder", "portable", decoder, chat=True),
        "enc": _export(root, "enc", "tiny-encoder", "portable", {}, chat=False),
    }


@contextlib.contextmanager
def running_server(directories, idle: bool = False, **options):
    """An app serving ``directories`` on 127.0.0.1:<free port> -> (base url, ServerState).

    ``idle``: the schedulers never start, so every request waits in the queue."""
    import uvicorn

    from tfport.runtime.serve.app import ServerState, create_app
    from tfport.runtime.serve.options import ServeOptions

    state = ServerState.load([str(d) for d in directories], ServeOptions(threads=1, **options))
    if idle:
        for served in state.models.values():
            served.start = lambda: None
    app = create_app(lambda: state)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def server(serve_exports):
    """One server for the session: both decoders and the encoder, 16 rows."""
    with running_server(serve_exports.values(), max_rows=16, max_queue=64) as (url, state):
        yield url, state


@pytest.fixture
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
