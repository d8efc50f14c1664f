"""`thunderpool serve` for real: 2 TP ranks on the embedded model behind the HTTP API.

Continuous batching must not change greedy outputs: 8 concurrent requests get exactly the
text they get one at a time. A client that disconnects stops its generation.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.reference

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Which planet is known as the red planet?",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "thunderpool",
        "serve",
        "--nodes",
        "2",
        "--parallel",
        "tp",
        "--port",
        str(port),
        "--max-context",
        "1024",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
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


def chat(url: str, question: str, stream: bool = False, max_tokens: int = 16) -> str:
    body = {
        "model": "SmolLM2-135M-Instruct-f32",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": question}],
        "stream": stream,
    }
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices:
                    text += choices[0]["delta"].get("content") or ""
    return text


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_eight_concurrent_requests_equal_one_at_a_time(server):
    alone = [chat(server, q) for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda iq: chat(server, iq[1], stream=iq[0] % 2 == 0), enumerate(QUESTIONS))
        )
    assert together == alone
    assert "Paris" in alone[0]


def test_official_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    plain = client.chat.completions.create(
        model="SmolLM2-135M-Instruct-f32",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
    )
    chunks = client.chat.completions.create(
        model="SmolLM2-135M-Instruct-f32",
        max_tokens=12,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert plain.choices[0].message.content == streamed == chat(server, QUESTIONS[0], max_tokens=12)
    assert plain.usage.completion_tokens == 12 or plain.choices[0].finish_reason == "stop"


def test_disconnect_stops_generation(server):
    before = metric(server, "thunderpool_tokens_generated_total")
    body = {
        "model": "SmolLM2-135M-Instruct-f32",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 60
    while metric(server, "thunderpool_active_requests") > 0:
        assert time.monotonic() < deadline, "the cancelled request kept running"
        time.sleep(0.2)
    assert metric(server, "thunderpool_tokens_generated_total") - before < 100
    # The cluster still answers correctly afterwards.
    assert "Paris" in chat(server, QUESTIONS[0])


def test_cluster_view_and_errors(server):
    cluster = httpx.get(f"{server}/v1/cluster", timeout=10).json()
    assert len(cluster["nodes"]) == 2
    assert cluster["placement"]["parallel"] == "tp"
    heads = [r["heads"]["q"] for r in cluster["placement"]["ranks"]]
    assert heads == [[0, 6], [6, 9]]  # SmolLM2's 9 heads split as 3 KV groups: 2 + 1
    too_long = {
        "model": "SmolLM2-135M-Instruct-f32",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "word " * 2000}],
    }
    r = httpx.post(f"{server}/v1/chat/completions", json=too_long, timeout=30)
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/chat/completions", json={**too_long, "model": "nope"}, timeout=30)
    assert r.status_code == 404
