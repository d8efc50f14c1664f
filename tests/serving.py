"""A real `thunderpool serve` for the tests that talk HTTP to it (test_serve, test_structured,
test_idle)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Served:
    url: str
    proc: subprocess.Popen
    log: Path  # serve's stderr


@contextlib.contextmanager
def serving(*args: str, ready_s: float = 300, env: dict | None = None) -> Iterator[Served]:
    """`thunderpool serve ARGS` on a free loopback port (with `env` added to this process's),
    its stderr in a file: yields once /health answers 200, and stops it on exit (Ctrl-C, then
    SIGKILL after 30 s) unless the test stopped it already."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="serve-") as tmp:
        log = Path(tmp) / "serve.log"
        cmd = [sys.executable, "-m", "thunderpool", "serve", *args, "--port", str(port)]
        with log.open("w") as err:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        served = Served(f"http://127.0.0.1:{port}", proc, log)
        try:
            deadline = time.monotonic() + ready_s
            while True:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                try:
                    if httpx.get(f"{served.url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield served
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
