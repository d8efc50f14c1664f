"""The model registry without processes: instances that are ready at once, a clock the test
moves. A byte budget unloads the least recently used idle model; keep_alive strings parse as
Ollama's Go durations, and what is not one is refused by name."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine
from fastapi import FastAPI
from fastapi.testclient import TestClient
from rich.console import Console

from thunderpool.api.errors import APIError, install_error_handlers
from thunderpool.api.ollama_models import keep_alive
from thunderpool.serving.admin import mount_admin
from thunderpool.serving.gateway import Gateway
from thunderpool.serving.models import GRACE_S, Known, Models

GIB = 2**30


class Ready:
    """An instance that is ready at once and serves until interrupted."""

    leader_host = "127.0.0.1"

    def __init__(self):
        self._stop = threading.Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def interrupt(self):
        self._stop.set()

    def events(self):
        yield SimpleNamespace(rank=0, event={"kind": "ready", "link_port": 1})
        self._stop.wait(30)


def known(name: str, weight_bytes: int) -> Known:
    info = FakeEngine().info
    gateway = Gateway(type(info)(name, info.max_context), None, "t")
    gateway.attach = lambda host, port: gateway.loading(1.0, "", "ready")  # no leader to dial
    return Known(name, gateway, lambda first: Ready(), weight_bytes=weight_bytes)


def ready(models: Models) -> set[str]:
    return {e.name for e in models.entries() if e.state == "ready"}


def wait(ok) -> None:
    deadline = time.monotonic() + 10
    while not ok():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_byte_budget_unloads_the_least_recently_used_idle_model():
    now = [0.0]
    models = Models(
        [known("a", GIB), known("b", GIB), known("c", 2 * GIB)],
        Console(file=open("/dev/null", "w")),  # noqa: SIM115 - the registry's terminal
        clock=lambda: now[0],
        max_bytes=2 * GIB,
    )
    runner = threading.Thread(target=models.serve, args=(["a", "b"],), daemon=True)
    runner.start()
    try:
        wait(lambda: ready(models) == {"a", "b"})
        now[0] = 10.0
        asyncio.run(models.acquire("a"))  # b is now the least recently used
        now[0] = 10.0 + GRACE_S
        asyncio.run(models.acquire("b"))  # ... and now a; c needs both gone (2 GiB)
        now[0] = 20.0
        asyncio.run(models.acquire("c"))
        wait(lambda: ready(models) == {"c"})
        now[0] = 30.0
        asyncio.run(models.acquire("a"))  # c is idle and the only one: it goes
        wait(lambda: ready(models) == {"a"})
        assert [e.state for e in models.entries()] == ["ready", "unloaded", "unloaded"]
        # An admin's replan names the model whose instance moves; that one alone restarts.
        app = FastAPI()
        install_error_handlers(app)
        mount_admin(app, models.replanner(), "tok", None, models)
        ok = {"authorization": "Bearer tok"}
        r = TestClient(app).post("/v1/admin/replan", json={"model": "a"}, headers=ok)
        assert r.status_code == 202 and r.json()["instance"] == 1
        wait(lambda: models.replanner("a").generation == 2 and ready(models) == {"a"})
        r = TestClient(app).post("/v1/admin/replan", json={"model": "b"}, headers=ok)
        assert r.status_code == 409 and "'b' is not loaded" in r.text
    finally:
        models.stop()
    runner.join(10)
    assert not runner.is_alive()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), (0, 0.0), (300, 300.0), (-1, math.inf), ("5m", 300.0), ("1h30m", 5400.0),
     ("-1m", math.inf), ("300", 300.0), ("1.5s", 1.5), ("250ms", 0.25)],
)  # fmt: skip
def test_keep_alive_takes_seconds_and_go_durations(value, seconds):
    assert keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", "5 minutes", "m", "5d", "1h-3m"])
def test_a_keep_alive_that_is_no_duration_is_refused_by_name(value):
    with pytest.raises(APIError) as e:
        keep_alive(value)
    assert e.value.status == 400 and f"keep_alive={value!r} is not a duration" in e.value.message
