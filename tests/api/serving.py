"""A real `thunderpool serve` for the tests that talk HTTP to it (test_serve, test_structured)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(*args: str, ready_s: float = 300) -> Iterator[str]:
    """`thunderpool serve ARGS` on a free loopback port: yields its URL once /health answers
    200, and stops it (Ctrl-C, then SIGKILL after 20 s) on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "thunderpool", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "server did not become ready"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
