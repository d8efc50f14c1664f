"""The dashboard in headless Chromium against a fake API: rendered DOM and a screenshot."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from html import unescape
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from thunderpool.api.dashboard import mount_dashboard

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
GIB = 1024**3

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's headless browser: apt-get install -y chromium",
)

CLUSTER = {
    "model": "tiny-model",
    "nodes": [
        {
            "name": f"node-{i}",
            "rank": i,
            "host": f"10.0.0.{i + 1}",
            "memory_total_bytes": total * GIB,
            "memory_used_bytes": used * GIB,
            "rss_bytes": used * GIB,
            "param_bytes": params * GIB,
            "peak_rss_bytes": peak * GIB,
            "speed": {"mem_bw_gbps": bw},
            "blas": blas,
            "backend": "ring" if blas else None,
        }
        for i, (total, used, params, peak, bw, blas) in enumerate(
            [
                (128, 61, 48, 58, 546.0, "BLIS"),
                (64, 30, 24, 29, 273.0, "reference"),
                (64, 29, 24, 28, None, None),
            ]
        )
    ],
    "links": [
        {
            "a": "node-0",
            "b": "node-1",
            "a_address": "10.0.0.1",
            "b_address": "10.0.0.2",
            "rtt_ms": 0.05,
            "bandwidth_gbps": 7.5,
            "kind": "rdma",
        },
        {
            "a": "node-0",
            "b": "node-2",
            "rtt_ms": 0.9,
            "bandwidth_gbps": 4.1,
            "kind": "thunderbolt",
        },
        {
            "a": "node-1",
            "b": "node-2",
            "rtt_ms": 2.3,
            "bandwidth_gbps": 0.1,
            "kind": "ethernet",
        },
    ],
    "placement": {
        "parallel": "tp",
        "ranks": [
            {"rank": 0, "layers": [0, 30], "heads": {"q": [0, 5], "kv": [0, 2]}},
            {"rank": 1, "layers": [0, 30], "heads": {"q": [5, 7], "kv": [2, 3]}},
            {"rank": 2, "layers": [0, 30], "heads": {"q": [7, 9], "kv": [2, 3]}},
        ],
    },
}

METRICS = """\
# HELP thunderpool_decode_tokens_per_second Aggregate decode throughput.
# TYPE thunderpool_decode_tokens_per_second gauge
thunderpool_decode_tokens_per_second 42.5
thunderpool_queue_depth 2
thunderpool_active_requests 3
thunderpool_requests_total 17
thunderpool_tokens_generated_total 5120
thunderpool_prompt_tokens_total 4096
thunderpool_prefix_cache_hit_tokens_total 1024
thunderpool_rank_memory_bytes{rank="0"} 5.1e10
thunderpool_rank_memory_bytes{rank="1"} 2.6e10
thunderpool_rank_memory_bytes{rank="2"} 2.6e10
"""

# The server's history: an idle point, then two with requests in their intervals.
HISTORY = [
    {"t": 1000.0, "tok_s": 10.0, "ttft_s": None, "ttft_p95_s": None, "latency_s": None},
    {
        "t": 1002.0,
        "tok_s": 20.0,
        "ttft_s": 0.3,
        "ttft_p95_s": 0.45,
        "latency_s": 1.5,
        "latency_p95_s": 1.9,
        "itl_s": 0.05,
        "queue_s": 0.01,
    },
    {
        "t": 1004.0,
        "tok_s": 30.0,
        "ttft_s": 0.25,
        "ttft_p95_s": 0.4,
        "latency_s": 2.25,
        "latency_p95_s": 2.5,
        "itl_s": 0.04,
        "queue_s": 0.003,
    },
]


class FakeApi:
    """Serves the three documents the dashboard polls, plus the dashboard itself."""

    def __init__(self) -> None:
        self.loading: float | None = None  # a progress in [0, 1] while the model loads
        self.app = FastAPI()
        self.app.get("/v1/cluster")(self.cluster)
        self.app.get("/metrics")(self.metrics)
        self.app.get("/health")(self.health)
        self.app.get("/v1/stats/history")(self.history)
        self.history_reads: list[str | None] = []
        mount_dashboard(self.app)

    async def cluster(self) -> dict:
        return CLUSTER

    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(METRICS)

    async def history(self, since: float | None = None) -> dict:
        self.history_reads.append(since)
        points = [p for p in HISTORY if since is None or p["t"] > since]
        return {"every_s": 2.0, "points": points}

    async def health(self) -> JSONResponse:
        if self.loading is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading", "progress": self.loading}, status_code=503)


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[FakeApi, str]]:
    fake = FakeApi()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake API did not start"
        time.sleep(0.02)
    yield fake, f"http://127.0.0.1:{port}/"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def chromium(tmp_path: Path, *args: str) -> str:
    """Run headless Chromium once with a throwaway profile; returns its stdout."""
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
        # Virtual time runs the 1 s polls several times without waiting for them in real time.
        "--virtual-time-budget=5000",
    ]
    done = subprocess.run(
        [str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def text_of(dom: str, element_id: str) -> str:
    """The text inside the element with this id (elements with text children only)."""
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match, f"#{element_id} not in the rendered DOM"
    return unescape(match.group(1)).strip()


def test_dashboard_renders_cluster_and_metrics(api, tmp_path):
    fake, url = api
    fake.loading = None
    dom = chromium(tmp_path, "--dump-dom", url)

    assert text_of(dom, "model-name") == "tiny-model"
    assert text_of(dom, "node-count") == "3"
    assert 'data-count="3"' in dom
    cards = re.findall(r'class="node-card" data-name="([^"]*)" data-rank="(\d+)"', dom)
    assert cards == [("node-0", "0"), ("node-1", "1"), ("node-2", "2")]
    assert text_of(dom, "cluster-state") == "ready"
    assert text_of(dom, "tok-s") == "42.5"
    assert text_of(dom, "queue-depth") == "2"
    assert text_of(dom, "active-requests") == "3"
    assert text_of(dom, "tokens-total") == "5,120"

    placement = dom[dom.index('id="placement"') : dom.index('id="links"')]
    assert 'data-parallel="tp"' in placement
    assert re.findall(r'class="prow" data-rank="(\d+)"', placement) == ["0", "1", "2"]
    assert "q heads 0–4 (5)" in placement and "kv head 2" in placement
    assert re.findall(r'<tr data-kind="(\w+)">', dom) == ["rdma", "thunderbolt", "ethernet"]
    assert ">RDMA<" in dom


def cells(html: str) -> list[str]:
    """The text of every leaf element, in document order."""
    return [unescape(t).strip() for t in re.findall(r">([^<>]+)<", html) if t.strip()]


def test_dashboard_shows_each_ranks_host_memory_and_links(api, tmp_path):
    fake, url = api
    fake.loading = None
    dom = chromium(tmp_path, "--dump-dom", url)
    start = dom.index('id="nodes"')
    cards = dom[start : dom.index("</section>", start)].split('class="node-card"')[1:]
    assert len(cards) == 3
    for i, (card, node) in enumerate(zip(cards, CLUSTER["nodes"], strict=True)):
        text = cells(card)
        assert node["host"] in text, text
        start = text.index("params")  # then label, value pairs to the card's end
        rows = dict(zip(text[start::2], text[start + 1 :: 2], strict=True))
        params, used, peak = (node[k] / GIB for k in ("param_bytes", "rss_bytes", "peak_rss_bytes"))
        assert rows["params"] == f"{params:.1f} GiB", (i, rows)
        assert rows["RSS"] == f"{used:.1f} GiB", (i, rows)
        assert rows["peak RSS"] == f"{peak:.1f} GiB", (i, rows)
        assert (rows["BLAS"], rows["backend"]) == [
            ("BLIS", "ring"),
            ("reference", "ring"),
            ("—", "—"),
        ][i]
    table = dom[dom.index('id="links"') : dom.index('id="links-empty"')]
    rows = re.findall(r"<tr data-kind=.*?</tr>", table)
    assert [cells(r) for r in rows] == [
        ["node-0 ↔ node-1", "RDMA", "50 µs", "7.5 GB/s"],
        ["node-0 ↔ node-2", "thunderbolt", "900 µs", "4.1 GB/s"],
        ["node-1 ↔ node-2", "ethernet", "2.30 ms", "0.1 GB/s"],
    ]
    assert 'title="10.0.0.1 ↔ 10.0.0.2"' in rows[0]


def test_dashboard_shows_the_servers_history_and_latency_panels(api, tmp_path):
    fake, url = api
    fake.loading = None
    fake.history_reads.clear()
    dom = chromium(tmp_path, "--dump-dom", url)
    # The latest interval that saw requests, not the page's own polls.
    assert text_of(dom, "ttft-now") == "250 ms" and text_of(dom, "ttft-p95") == "400 ms"
    assert text_of(dom, "latency-now") == "2.25 s" and text_of(dom, "latency-p95") == "2.50 s"
    assert text_of(dom, "itl-now") == "40 ms" and text_of(dom, "queue-now") == "3.0 ms"
    assert text_of(dom, "cache-hits") == "25%"
    assert text_of(dom, "tok-s") == "42.5"  # the engine's figure; history draws the line
    # The page reads the whole history once, then only what is new.
    assert fake.history_reads[0] is None and set(fake.history_reads[1:]) == {1004.0}

    def points(svg: str, cls: str) -> list[tuple[float, float]]:
        m = re.search(rf'<polyline class="{cls}" points="([^"]*)"', svg)
        return [tuple(map(float, xy.split(","))) for xy in m.group(1).split()]

    ttft = dom[dom.index('id="ttft-panel"') : dom.index('id="latency-panel"')]
    # Two points with a TTFT (the idle one has none), 2 s apart on a 600 s, 240-wide axis.
    assert [x for x, _ in points(ttft, "mean")] == [239.2, 240.0]
    top = 0.45 * 1.25
    assert [y for _, y in points(ttft, "p95")] == [round(47 - v / top * 45, 1) for v in (0.45, 0.4)]
    spark = re.search(r'<svg id="sparkline".*?</svg>', dom, re.S).group(0)
    line = re.search(r'<polyline points="([^"]*)"', spark).group(1).split()
    assert [float(xy.split(",")[0]) for xy in line] == [238.4, 239.2, 240.0]


def test_dashboard_shows_load_progress(api, tmp_path):
    fake, url = api
    fake.loading = 0.4
    try:
        dom = chromium(tmp_path, "--dump-dom", url)
    finally:
        fake.loading = None
    assert text_of(dom, "cluster-state") == "loading 40%"
    assert re.search(r'id="loading-bar" style="width: 40%;"', dom)
    assert '<div id="loading">' in dom  # the hidden attribute is gone while loading


def test_dashboard_screenshot(api, tmp_path):
    fake, url = api
    fake.loading = None
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,900", url)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000, f"{shot} is only {len(data)} bytes: the page looks blank"
