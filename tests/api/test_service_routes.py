"""The service routes over a fake engine (models, health, cluster, metrics, the API key),
and a real uvicorn server: the official `openai` client, and clients that disconnect."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fake_engine import CLUSTER, MODEL, FakeEngine
from fastapi.testclient import TestClient
from openai import OpenAI
from openai_wire import (  # noqa: F401 (fixtures)
    HI,
    HI_TOKENS,
    KEY,
    NOT_CACHED,
    USAGE,
    chat,
    error,
    fixture_client,
    fixture_engine,
    status_body,
)

from thunderpool.api import create_app
from thunderpool.engine.service import EngineStatus


def test_models(client):
    card = {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "thunderpool"}
    assert status_body(client.get("/v1/models")) == (200, {"object": "list", "data": [card]})
    assert status_body(client.get(f"/v1/models/{MODEL}")) == (200, card)


def test_health_reports_progress(client, engine):
    assert status_body(client.get("/health")) == (200, {"status": "ok"})
    engine.state = EngineStatus("loading", 0.42, "loading shard 3/7")
    r = client.get("/health")
    assert r.headers["retry-after"] == "5"
    assert status_body(r) == (
        503,
        {"status": "loading", "progress": 0.42, "detail": "loading shard 3/7"},
    )
    engine.state = EngineStatus("failed", 0.5, "rank 1 exited with code 1")
    r = client.get("/health")
    assert status_body(r) == (
        503,
        {"status": "failed", "progress": 0.5, "detail": "rank 1 exited with code 1"},
    )


def test_cluster_echoes_engine_info(client):
    assert status_body(client.get("/v1/cluster")) == (200, CLUSTER)


def test_metrics_exposition(client):
    chat(client)
    chat(client, n=17)
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    # The latency histograms have their own test (test_observe.py).
    histogram = ("_bucket{", "_seconds_sum ", "_seconds_count ")
    samples = [
        ln
        for ln in r.text.splitlines()
        if not ln.startswith("#") and not any(h in ln for h in histogram)
    ]
    assert samples == [
        "thunderpool_requests_total 7",
        "thunderpool_tokens_generated_total 123",
        "thunderpool_prompt_tokens_total 456",
        "thunderpool_ttft_seconds 0.25",
        "thunderpool_decode_tokens_per_second 41.5",
        "thunderpool_queue_depth 2",
        "thunderpool_active_requests 3",
        'thunderpool_rank_memory_bytes{rank="0"} 1000',
        'thunderpool_rank_memory_bytes{rank="1"} 2000',
        'thunderpool_http_responses_total{path="/v1/chat/completions",status="200"} 1',
        'thunderpool_http_responses_total{path="/v1/chat/completions",status="400"} 1',
    ]
    assert "# TYPE thunderpool_requests_total counter" in r.text
    assert "# TYPE thunderpool_queue_depth gauge" in r.text


def test_api_key_guards_v1_and_metrics():
    client = TestClient(create_app(FakeEngine(), api_key=KEY))
    denied = error(
        401,
        "missing or incorrect API key; send 'Authorization: Bearer <key>'",
        code="invalid_api_key",
    )
    for path in ("/v1/models", "/v1/cluster", "/metrics"):
        assert status_body(client.get(path)) == denied
        assert status_body(client.get(path, headers={"Authorization": "Bearer nope"})) == denied
    # Auth comes before the body is read: a bad body without a key is still a 401.
    assert status_body(client.post("/v1/chat/completions", content=b"{")) == denied
    assert client.get("/health").status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert client.get("/metrics", headers=auth).status_code == 200
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI}, headers=auth)
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"


# --- a real server: the official client, and a client that disconnects ------------------


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, api_key=KEY), log_level="warning", lifespan="off")
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(500):  # hang guard only; it starts in milliseconds
            if server.started:
                break
            thread.join(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_official_openai_client(live):
    url, _ = live
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=16)
    assert out.choices[0].message.content == "Hello world"
    assert out.choices[0].finish_reason == "stop"
    counts = {k: v for k, v in USAGE.items() if k not in NOT_CACHED}
    assert out.usage.model_dump(include=set(counts)) == counts
    assert out.usage.prompt_tokens_details.cached_tokens == 0

    events = list(
        client.chat.completions.create(
            model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == "Hello world"
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "stop"
    assert events[-1].choices == []
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (HI_TOKENS, 2)

    text = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=4)
    assert (text.choices[0].text, text.usage.total_tokens) == ("Hello world", 8)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_client_disconnect_cancels_the_generation(live):
    url, engine = live
    engine.cancelled.clear()
    engine.started.clear()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "forever"}], "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = [ln for ln, _ in zip(lines, range(6), strict=False) if ln]
            assert json.loads(seen[-1].removeprefix("data: "))["choices"][0]["delta"] == {
                "content": "tick "
            }
            assert engine.started.is_set() and not engine.cancelled.is_set()
    # Closing the response closed the connection; the engine's iterator must be closed too.
    assert engine.cancelled.wait(10), "the engine iterator was not closed after the disconnect"


def test_client_disconnect_cancels_a_non_streamed_generation(live):
    url, engine = live
    engine.cancelled.clear()
    engine.started.clear()
    body = {"model": MODEL, "prompt": "forever"}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/completions", json=body, headers=headers)
    assert engine.started.is_set()
    assert engine.cancelled.wait(10), "the engine iterator was not closed after the disconnect"
