"""The dashboard's fetch.js in headless Chromium: one bar per node while weights move."""

from __future__ import annotations

import socket
import subprocess
import threading
from html import unescape
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from thunderpool.api.dashboard import mount_dashboard
from thunderpool.cli.cache import health_listener
from thunderpool.cluster.weights.fabric import NodeFetch

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")


class Gateway:
    """What health_listener drives, serving /health the way the API does while loading."""

    state, progress, detail, fetch = "loading", 0.0, "", ()

    def loading(self, progress, detail, state="loading", fetch=()):
        self.progress, self.detail, self.state, self.fetch = progress, detail, state, fetch


def test_the_dashboard_draws_a_bar_per_fetching_node(tmp_path):
    gw = Gateway()
    mib = 1 << 20
    health_listener(gw)(
        [
            NodeFetch("b", "mac-2", {"total_bytes": 400 * mib, "done_bytes": 100 * mib,
                                     "rate_Bps": 50 * mib, "eta_s": 6.0}),
            NodeFetch("c", "mac-3", {"total_bytes": 400 * mib, "done_bytes": 300 * mib,
                                     "rate_Bps": 25 * mib, "eta_s": 4.0}),
        ]
    )  # fmt: skip
    app = FastAPI()

    @app.get("/health")
    async def health():
        body = {"status": gw.state, "progress": gw.progress, "detail": gw.detail}
        body["fetch"] = list(gw.fetch)
        return JSONResponse(body, status_code=503)

    for path in ("/v1/cluster", "/metrics"):
        app.get(path)(lambda: JSONResponse({}))
    mount_dashboard(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    try:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
                 "--virtual-time-budget=5000", "--dump-dom"]  # fmt: skip
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        done = subprocess.run(
            [str(CHROMIUM), *flags, url], capture_output=True, text=True, timeout=120
        )
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert done.returncode == 0, done.stderr[-2000:]
    dom = unescape(done.stdout)
    assert 'id="fetches"' in dom
    assert "weights → mac-2" in dom and "100.0 / 400.0 MiB · 50.0 MiB/s · ETA 6 s" in dom
    assert "weights → mac-3" in dom and "300.0 / 400.0 MiB · 25.0 MiB/s · ETA 4 s" in dom
    assert "width:25%" in dom.replace(" ", "") and "width:75%" in dom.replace(" ", "")
