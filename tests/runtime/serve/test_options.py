"""``ServeOptions`` and its flags: ``tfport serve`` and ``bench-serve`` take one flag per option
field (``tfport.flags``), with the field's default, and a server that bench-serve starts gets its
options back from the flags it is given."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")

from tfport.flags import flags, to_args  # noqa: E402

# Every flag a user may type, as it is spelt, and the options it gives: one case or more per
# option field (checked below, so a new option needs its case here).
CASES = [
    (("--max-rows", "4"), {"max_rows": 4}),
    (("--max-queue", "8"), {"max_queue": 8}),
    (("--max-tokens", "100"), {"max_tokens": 100}),
    (("--max-length", "300"), {"max_length": 300}),
    (("--timeout", "30.5"), {"timeout": 30.5}),
    (("--provider", "auto"), {"provider": "auto"}),
    (("--threads", "2"), {"threads": 2}),
    (("--max-body-bytes", "1000"), {"max_body_bytes": 1000}),
    (("--max-embedding-inputs", "7"), {"max_inputs": 7}),
    (("--embedding-batch-ms", "0"), {"embedding_batch_ms": 0.0}),
    (("--embedding-batch-tokens", "512"), {"embedding_batch_tokens": 512}),
    (("--max-messages", "9"), {"max_messages": 9}),
    (("--max-prompt-chars", "100"), {"max_prompt_chars": 100}),
    (("--max-prompt-tokens", "20"), {"max_prompt_tokens": 20}),
    (("--max-request-tokens", "300"), {"max_request_tokens": 300}),
    (("--speculative", "lookup"), {"speculative": "lookup"}),
    (("--draft-tokens", "3"), {"draft_tokens": 3}),
    (("--speculative-inexact",), {"speculative_inexact": True}),
    (("--batch-export", "out/w8"), {"batch_export": "out/w8"}),
    (("--batch-export", "out/w8", "--batch-rows", "5"), {"batch_export": "out/w8", "batch_rows": 5}),
    (("--prefix-cache-mb", "0"), {"prefix_cache_mb": 0}),
    (("--prefill-chunk", "64"), {"prefill_chunk": 64}),
    (("--prefill-chunk", "0"), {"prefill_chunk": None}),  # 0: whole prompts
    (("--no-ui",), {"ui": False}),
    (("--header-timeout", "2"), {"header_timeout": 2.0}),
    (("--body-timeout", "3"), {"body_timeout": 3.0}),
    (("--keep-alive-timeout", "1.5"), {"keep_alive_timeout": 1.5}),
    (("--limit-concurrency", "5"), {"limit_concurrency": 5}),
    (("--shutdown-timeout", "0.5"), {"shutdown_timeout": 0.5}),
    (("--cors-origin", "https://app.example.com", "--cors-origin", "http://localhost:3000"),
     {"cors_origins": ("https://app.example.com", "http://localhost:3000")}),
    (("--no-docs",), {"docs": False}),
    (("--no-metrics",), {"metrics": False}),
]


def parser(command: str) -> argparse.ArgumentParser:
    """``tfport COMMAND``'s own parser."""
    from tfport.cli import build_parser

    parser = build_parser(command)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def options(command: str, *argv: str):
    """The ``ServeOptions`` of ``tfport COMMAND DIR *argv``."""
    from tfport.runtime.serve.cli import serve_options as options_of

    return options_of(parser(command).parse_args(["some-export", *argv]))


def serve_options():
    from tfport.runtime.serve.options import SERVER, ServeOptions

    return ServeOptions, SERVER


def test_every_option_has_a_flag_with_its_default_and_help():
    ServeOptions, SERVER = serve_options()
    default = ServeOptions()
    for command in ("serve", "bench-serve"):
        actions = {a.dest: a for a in parser(command)._actions}
        for flag in flags(ServeOptions):
            if command == "bench-serve" and flag.group == SERVER:  # the server's own: not bench-serve's
                assert flag.field not in actions, flag
                continue
            action = actions[flag.field]
            assert tuple(action.option_strings) == flag.names, flag
            assert action.default == (None if flag.kind == "append" else getattr(default, flag.field))
            assert action.help and "{" not in action.help, flag  # said, and its default filled in


def test_the_cases_cover_every_flag():
    ServeOptions, _ = serve_options()
    spelt = {a for argv, _ in CASES for a in argv if a.startswith("--")}
    assert spelt == {name for flag in flags(ServeOptions) for name in flag.names}
    assert {name for _, want in CASES for name in want} == {flag.field for flag in flags(ServeOptions)}
    # api_key and allowed_hosts come from --api-key(-file) and --allowed-hosts with --host (cli.py)
    assert {f.name for f in dataclasses.fields(ServeOptions)} - {f.field for f in flags(ServeOptions)} \
        == {"api_key", "allowed_hosts"}


@pytest.mark.parametrize("command", ["serve", "bench-serve"])
def test_no_flags_give_the_default_options(command):
    ServeOptions, _ = serve_options()
    assert options(command) == ServeOptions()


@pytest.mark.parametrize("argv, want", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_each_flag_gives_its_option_and_is_written_back(argv, want):
    ServeOptions, SERVER = serve_options()
    wanted = ServeOptions(**want)
    assert options("serve", *argv) == wanted
    if not any(f.group == SERVER for f in flags(ServeOptions) if f.field in want):
        assert options("bench-serve", *argv) == wanted
    assert options("serve", *to_args(wanted)) == wanted  # how bench-serve starts its server


def test_bench_serve_gives_a_started_server_its_options():
    """Every option bench-serve takes, none at its default, reaches the server it starts
    (``bench.start_server`` gives ``tfport serve`` the flags ``to_args`` writes)."""
    ServeOptions, SERVER = serve_options()
    shared = [(argv, want) for argv, want in CASES
              if not any(f.group == SERVER for f in flags(ServeOptions) if f.field in want)]
    merged = {}
    for _, want in shared:  # later cases win, as later flags do
        merged.update(want)
    wanted = options("bench-serve", *[a for argv, _ in shared for a in argv])
    assert wanted == ServeOptions(**merged)
    assert options("serve", *to_args(wanted)) == wanted
    assert to_args(ServeOptions()) == []
