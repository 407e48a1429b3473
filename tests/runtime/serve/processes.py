"""``tfport serve`` in a child process on 127.0.0.1, for the tests that need a real one: signals
reach only a process's main thread, and connection handling is the CLI's uvicorn set-up.

``step_s`` slows the served model down (a test stand-in for a large one): every scheduler step
sleeps that long first, so a row takes ``step_s`` per token and a stream can still be running
when the test signals the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

START_S = 60  # a loaded 2-core machine starts a server in about 3 s

# The CLI with every scheduler step (one token per row) taking argv[1] seconds longer.
SLOW_MODEL = """
import sys, time
from tfport.runtime.serve.scheduler import Scheduler
step, seconds = Scheduler.run_once, float(sys.argv[1])
def slow_step(self):
    time.sleep(seconds)
    step(self)
Scheduler.run_once = slow_step
from tfport.cli import main
sys.exit(main(sys.argv[2:]))
"""


@dataclass
class ServeProcess:
    process: subprocess.Popen
    url: str
    port: int
    log: Path

    def signal(self, number: int = signal.SIGTERM) -> None:
        self.process.send_signal(number)

    def output(self) -> str:
        """The server's log so far (for assertion messages)."""
        return self.log.read_text(errors="replace")[-4000:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_process(directory: Path, *argv: str, step_s: float | None = None):
    """``tfport serve DIRECTORY --host 127.0.0.1 --port <free> --threads 1 ARGV`` -> a
    ``ServeProcess`` once ``/health`` answers 200; killed on exit if still running."""
    port = _free_port()
    serve = ["serve", str(directory), "--host", "127.0.0.1", "--port", str(port), "--threads", "1", *argv]
    if step_s is None:
        command = [sys.executable, "-m", "tfport.cli", *serve]
    else:
        command = [sys.executable, "-c", SLOW_MODEL, str(step_s), *serve]
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "serve.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
        server = ServeProcess(process, f"http://127.0.0.1:{port}", port, log)
        try:
            deadline = time.monotonic() + START_S
            while not _healthy(server.url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tfport serve did not start: {server.output()}")
                time.sleep(0.1)
            yield server
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
