"""The dashboard's Models table in headless Chromium, over the real API (create_app) of a
registry with three models: one serving, one loading, one not loaded."""

from __future__ import annotations

import re
import socket
import threading
import time
from html import unescape

import pytest
import uvicorn
from fake_engine import FakeEngine
from test_dashboard import CHROMIUM, CLUSTER, chromium

from thunderpool.api.dashboard import mount_dashboard
from thunderpool.api.routes import create_app
from thunderpool.engine.service import EngineInfo, ModelEntry

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")
MIB = 2**20


class Three:
    """A ModelRegistry whose models' states are set by the test."""

    def __init__(self):
        self.engines = {}
        for name in ("big", "small", "spare"):
            e = FakeEngine()
            e.info = EngineInfo(name, 256, cluster={**CLUSTER, "model": name})
            self.engines[name] = e

    def names(self):
        return list(self.engines)

    def client(self, name):
        return self.engines[name]

    async def acquire(self, name, keep_alive=None):
        return self.engines[name]

    def keep(self, name, keep_alive):
        pass

    def entries(self):
        big = self.engines["big"].info.cluster
        return [
            ModelEntry("big", "ready", 1.0, in_flight=2, memory_bytes=1536 * MIB, cluster=big),
            ModelEntry("small", "loading", 0.4, "loading model shards"),
            ModelEntry("spare", "unloaded", detail="not loaded; a request for it loads it"),
        ]


def test_the_dashboard_lists_every_model_with_state_placement_and_memory(tmp_path):
    app = create_app(Three())  # type: ignore[arg-type]
    mount_dashboard(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        dom = chromium(tmp_path, "--dump-dom", f"http://127.0.0.1:{sock.getsockname()[1]}/")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
    rows = re.findall(r'<tr data-model="([^"]+)" data-state="([^"]+)">(.*?)</tr>', dom, re.S)
    cells = {
        m: [unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", body)] for m, _, body in rows
    }
    assert [(m, s) for m, s, _ in rows] == [
        ("big", "ready"),
        ("small", "loading"),
        ("spare", "unloaded"),
    ]
    # model, state, placement, memory, tok/s, queue, in flight (FakeEngine's metrics)
    assert cells["big"] == [
        "big",
        "ready",
        "tp on node-0, node-1, node-2",
        "1536.0 MiB",
        "41.5",
        "2",
        "2",
    ]
    assert cells["small"][:4] == ["small", "loading 40%", "—", "—"]
    assert cells["spare"][:4] == ["spare", "unloaded", "—", "—"]
