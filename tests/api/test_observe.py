"""Observability at the API: latency histograms from the leader's timing, one access-log line
per request (the prompt only with --log-prompts), and the dashboard's server-side history."""

from __future__ import annotations

import logging
import re

import pytest
from fake_engine import TIMING, FakeEngine, chat_text
from fastapi.testclient import TestClient

from thunderpool.api import create_app, routes
from thunderpool.api.metrics import Histogram, quantile

SECRET = "my secret plan"


def chat(client: TestClient, content: str = SECRET, **body):
    messages = [{"role": "user", "content": content}]
    return client.post(
        "/v1/chat/completions", json={"model": "fake-model", "messages": messages, **body}
    )


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_histograms_count_each_request_in_its_buckets():
    client = TestClient(create_app(FakeEngine()))
    assert chat(client).status_code == 200
    assert chat(client, stream=True).status_code == 200
    assert chat(client, n=17).status_code == 400  # refused before the engine: not observed
    m = samples(client.get("/metrics").text)
    p = "thunderpool_"
    # TTFT 0.3 s twice: not within 0.25, within 0.5 and everything above.
    assert m[f'{p}time_to_first_token_seconds_bucket{{le="0.25"}}'] == 0
    assert m[f'{p}time_to_first_token_seconds_bucket{{le="0.5"}}'] == 2
    assert m[f'{p}time_to_first_token_seconds_bucket{{le="+Inf"}}'] == 2
    assert m[f"{p}time_to_first_token_seconds_count"] == 2
    assert m[f"{p}time_to_first_token_seconds_sum"] == pytest.approx(2 * TIMING["ttft_s"])
    # One 40 ms gap per request ("Hello", " world").
    assert m[f'{p}inter_token_latency_seconds_bucket{{le="0.02"}}'] == 0
    assert m[f'{p}inter_token_latency_seconds_bucket{{le="0.05"}}'] == 2
    assert m[f"{p}inter_token_latency_seconds_sum"] == pytest.approx(2 * TIMING["gap_s"])
    assert m[f'{p}request_latency_seconds_bucket{{le="0.25"}}'] == 0
    assert m[f'{p}request_latency_seconds_bucket{{le="0.5"}}'] == 2
    assert m[f"{p}request_latency_seconds_sum"] == pytest.approx(2 * TIMING["elapsed_s"])
    assert m[f'{p}queue_time_seconds_bucket{{le="0.001"}}'] == 0
    assert m[f'{p}queue_time_seconds_bucket{{le="0.005"}}'] == 2
    assert m[f"{p}queue_time_seconds_count"] == 2
    # The engine's own gauges keep their names.
    assert m[f"{p}ttft_seconds"] == 0.25 and m[f"{p}decode_tokens_per_second"] == 41.5


def test_histogram_exposition_is_cumulative_and_quantiles_interpolate():
    h = Histogram("x_seconds", "x", (0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 7.0):
        h.observe(v)
    assert h.lines()[2:] == [
        'thunderpool_x_seconds_bucket{le="0.1"} 1',
        'thunderpool_x_seconds_bucket{le="1"} 3',
        'thunderpool_x_seconds_bucket{le="+Inf"} 4',
        "thunderpool_x_seconds_sum 8.05",
        "thunderpool_x_seconds_count 4",
    ]
    assert quantile(h.bounds, h.counts, 0.5) == pytest.approx(0.1 + 0.9 * 1 / 2)
    assert quantile(h.bounds, h.counts, 1.0) == 1.0  # the +Inf bucket answers its lower bound
    assert quantile(h.bounds, [0, 0, 0], 0.5) is None


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "thunderpool.access"]


LINE = re.compile(
    r"POST /v1/chat/completions 200 prompt_tokens=(\d+) completion_tokens=2 ttft_s=0\.300 "
    r"finish=stop duration_s=\d+\.\d{3}"
)


@pytest.mark.parametrize("stream", [False, True])
def test_access_log_has_one_line_per_request_without_the_prompt(caplog, stream):
    caplog.set_level(logging.INFO, logger="thunderpool.access")
    client = TestClient(create_app(FakeEngine()))
    assert chat(client, stream=stream).status_code == 200
    client.get("/health")  # a poll: DEBUG, not INFO
    assert chat(client, "x", max_tokens=0).status_code == 400
    lines = access_lines(caplog)
    assert len(lines) == 2, lines
    m = LINE.fullmatch(lines[0])
    assert m, lines[0]
    assert int(m.group(1)) == len(chat_text(("user", SECRET)))
    assert re.fullmatch(r"POST /v1/chat/completions 400 duration_s=\d+\.\d{3}", lines[1])
    assert SECRET not in caplog.text


def test_access_log_shows_the_prompt_with_log_prompts(caplog):
    caplog.set_level(logging.INFO, logger="thunderpool.access")
    client = TestClient(create_app(FakeEngine(), log_prompts=True))
    assert chat(client).status_code == 200
    (line,) = access_lines(caplog)
    assert LINE.match(line), line
    # The prompt as the model saw it (chat template applied), JSON-quoted on one line.
    assert line.endswith(' prompt="<user>my secret plan\\n<assistant>"'), line


def test_access_log_counts_a_stream_cut_off_by_the_client(caplog):
    caplog.set_level(logging.INFO, logger="thunderpool.access")
    engine = FakeEngine()
    client = TestClient(create_app(engine))
    with client.stream(
        "POST", "/v1/completions", json={"model": "fake-model", "prompt": "forever", "stream": True}
    ) as r:
        for line in r.iter_lines():
            if "tick" in line:
                break
    assert engine.cancelled.wait(10)
    (line,) = access_lines(caplog)
    assert re.fullmatch(
        r"POST /v1/completions 200 prompt_tokens=7 completion_tokens=0 ttft_s=- finish=- "
        r"duration_s=\d+\.\d{3}",
        line,
    ), line


def test_history_keeps_points_with_latencies_of_their_interval(monkeypatch):
    monkeypatch.setattr(routes, "EVERY_S", 0.0)  # every read takes a point
    client = TestClient(create_app(FakeEngine()))
    (p0,) = client.get("/v1/stats/history").json()["points"]
    assert p0["tok_s"] == 41.5 and p0["queue"] == 2 and p0["requests"] == 7
    assert p0["ttft_s"] is None and p0["latency_s"] is None
    assert chat(client).status_code == 200
    assert chat(client, stream=True).status_code == 200
    body = client.get("/v1/stats/history", params={"since": p0["t"]}).json()
    (p1,) = [p for p in body["points"] if p["t"] > p0["t"]]
    assert p1["ttft_s"] == pytest.approx(TIMING["ttft_s"])
    assert p1["latency_s"] == pytest.approx(TIMING["elapsed_s"])
    assert p1["itl_s"] == pytest.approx(TIMING["gap_s"])
    assert p1["queue_s"] == pytest.approx(TIMING["queued_s"])
    # Both in the (0.25, 0.5] bucket: p95 interpolates to 0.25 + 0.25 * 0.95.
    assert p1["ttft_p95_s"] == pytest.approx(0.4875)
    # The next interval saw no request; the whole history is still there for a new page.
    p2 = client.get("/v1/stats/history").json()["points"][-1]
    assert p2["ttft_s"] is None and p2["latency_p95_s"] is None
    assert len(client.get("/v1/stats/history").json()["points"]) == 4
    assert client.get("/v1/stats/history", params={"since": "soon"}).status_code == 400


def test_history_is_sampled_while_the_app_runs_without_anyone_reading_it():
    import time

    app = create_app(FakeEngine())
    with TestClient(app):  # runs the lifespan, as uvicorn does
        deadline = time.monotonic() + 30
        while not app.state.history.points:
            assert time.monotonic() < deadline, "the sampler never took a point"
            time.sleep(0.05)
    assert app.state.history.points[0]["tok_s"] == 41.5
