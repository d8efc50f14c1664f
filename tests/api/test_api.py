"""The OpenAI-compatible API over a fake engine: exact bodies, SSE framing, errors, auth,
metrics, cancellation, and the official `openai` client against a real uvicorn server."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fake_engine import CLUSTER, MODEL, FakeEngine, chat_text
from fastapi.testclient import TestClient
from openai import OpenAI

from thunderpool.api import create_app
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import EngineStatus

KEY = "sk-test-key"
HI = [{"role": "user", "content": "Hi"}]
HI_TOKENS = len(chat_text(("user", "Hi")))  # 19: one token per character
NOT_CACHED = {"prompt_tokens_details": {"cached_tokens": 0}}  # the fake engine has no cache
USAGE = {"prompt_tokens": HI_TOKENS, "completion_tokens": 2, "total_tokens": HI_TOKENS + 2}
USAGE |= NOT_CACHED


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine) -> TestClient:
    return TestClient(create_app(engine))


def chat(client: TestClient, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, **body})


def sse(text: str) -> list[str]:
    """The payloads of an SSE body, checking every event is exactly `data: ...\\n\\n`."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") for e in events]


def chunks(text: str) -> list[dict]:
    payloads = sse(text)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def error(status: int, message: str, param=None, code=None, type="invalid_request_error"):
    return status, {"error": {"message": message, "type": type, "param": param, "code": code}}


def status_body(r: httpx.Response):
    return r.status_code, r.json()


# --- completions ------------------------------------------------------------------------


def test_chat_non_streamed(client, engine):
    r = chat(client)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    del body["id"], body["created"]
    assert body == {
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": USAGE,
        "system_fingerprint": None,
    }
    prompt, params = engine.calls[0]
    assert prompt == [ord(c) for c in chat_text(("user", "Hi"))]
    # Default max_tokens is the rest of the context; OpenAI's sampling defaults apply.
    assert params == SamplingParams(max_tokens=256 - HI_TOKENS, temperature=1.0, top_p=1.0)


def test_chat_template_gets_system_developer_and_text_parts(client, engine):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "No jokes."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Hi"},
    ]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    expected = chat_text(
        ("system", "Be brief."),
        ("system", "No jokes."),
        ("user", "a\nb"),
        ("assistant", "ok"),
        ("user", "Hi"),
    )
    assert engine.tokenizer.decode(engine.calls[0][0]) == expected
    assert r.json()["usage"]["prompt_tokens"] == len(expected)


def test_sampling_fields_pass_through(client, engine):
    r = chat(client, max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, seed=11, stop="\n")
    assert r.status_code == 200, r.text
    r = chat(client, max_completion_tokens=6, max_tokens=99, stop=["END", "###"], n=1)
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["a"]})
    assert r.status_code == 200, r.text
    assert [p for _, p in engine.calls] == [
        SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, seed=11, stop=("\n",)),
        SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0, stop=("END", "###")),
        SamplingParams(max_tokens=255, temperature=1.0, top_p=1.0, stop=("a",)),
    ]


def test_sampling_surface_passes_through(client, engine):
    r = chat(
        client,
        max_tokens=5,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        repetition_penalty=1.1,
        min_p=0.05,
        logit_bias={"12": -100, "3": 2},
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_object"},
    )
    assert r.status_code == 200, r.text
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 4}
    )
    assert r.status_code == 200, r.text
    assert [p for _, p in engine.calls] == [
        SamplingParams(
            max_tokens=5,
            temperature=1.0,
            frequency_penalty=0.5,
            presence_penalty=-0.25,
            repetition_penalty=1.1,
            min_p=0.05,
            logit_bias=((3, 2.0), (12, -100.0)),
            logprobs=True,
            top_logprobs=2,
            json_schema='{"type": "object"}',
        ),
        SamplingParams(max_tokens=3, temperature=1.0, logprobs=True, top_logprobs=4),
    ]


def test_unknown_fields_are_refused_and_annotations_accepted(client):
    r = chat(client, user="u1", metadata={"k": "v"}, store=False, response_format={"type": "text"})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"
    for field, value in (("reasoning_effort", "high"), ("functions", []), ("store", True)):
        r = chat(client, **{field: value})
        assert r.status_code == 400, field
        assert field in r.json()["error"]["message"]


def test_max_tokens_reached_is_length(client):
    r = chat(client, max_tokens=1)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"] == "Hello"
    assert (
        r.json()["usage"]
        == {
            "prompt_tokens": HI_TOKENS,
            "completion_tokens": 1,
            "total_tokens": HI_TOKENS + 1,
        }
        | NOT_CACHED
    )


@pytest.mark.parametrize("prompt", ["Say hi", ["Say hi"]])
def test_completion_non_streamed(client, engine, prompt):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-")
    del body["id"], body["created"]
    assert body == {
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "Hello world", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8} | NOT_CACHED,
        "system_fingerprint": None,
    }
    assert engine.calls[0][0] == [ord(c) for c in "Say hi"]


def test_chat_streamed_sse_framing(client):
    r = chat(client, stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    got = chunks(r.text)
    ids = {c.pop("id") for c in got}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert len({c.pop("created") for c in got}) == 1
    head = {"object": "chat.completion.chunk", "model": MODEL, "system_fingerprint": None}

    def chunk(delta, finish=None):
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**head, "choices": [choice], "usage": None}

    assert got == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hello"}),
        chunk({"content": " world"}),
        chunk({}, "stop"),
    ]


def test_stream_include_usage_adds_a_final_usage_chunk(client):
    r = chat(client, stream=True, stream_options={"include_usage": True})
    got = chunks(r.text)
    assert [c["usage"] for c in got[:-1]] == [None] * 4
    assert got[-1]["choices"] == [] and got[-1]["usage"] == USAGE
    assert got[-2]["choices"][0]["finish_reason"] == "stop"


def test_completion_streamed(client):
    r = client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Say hi",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    got = chunks(r.text)
    assert {c["object"] for c in got} == {"text_completion"}
    assert [c["choices"] for c in got] == [
        [{"index": 0, "text": "Hello", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": " world", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}],
        [],
    ]
    usage = {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    assert got[-1]["usage"] == usage | NOT_CACHED


# --- errors -----------------------------------------------------------------------------


def test_malformed_json_is_400(client):
    r = client.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "json_invalid"
    assert err["message"].startswith("the request body is not valid JSON: ")


def test_non_object_body_is_400(client):
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("the request body must be a JSON object")


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("max_tokens", "5", "max_tokens"),
        ("temperature", "hot", "temperature"),
        ("stream", "yes", "stream"),
        ("messages", "Hi", "messages"),
        ("messages", [{"role": "robot", "content": "x"}], "messages.0.role"),
        ("seed", 1.5, "seed"),
    ],
)
def test_wrong_types_are_400_naming_the_field(client, field, value, param):
    r = chat(client, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error",
        param,
        "invalid_type",
    )
    assert err["message"].startswith(f"invalid '{param}': ")


def test_missing_messages_is_400(client):
    r = client.post("/v1/chat/completions", json={"model": MODEL})
    assert status_body(r) == error(
        400, "invalid 'messages': Field required", "messages", "invalid_type"
    )


def test_missing_model_is_400(client):
    r = client.post("/v1/chat/completions", json={"messages": HI})
    assert status_body(r) == error(
        400, f"'model' is required; this server serves '{MODEL}'", "model"
    )


def test_unknown_model_is_404(client, engine):
    r = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": HI})
    assert status_body(r) == error(
        404,
        f"the model 'gpt-9' does not exist; this server serves '{MODEL}'",
        "model",
        "model_not_found",
    )
    assert client.get("/v1/models/gpt-9").status_code == 404
    assert engine.calls == []


def test_n_out_of_range_is_400(client):
    assert status_body(chat(client, n=17)) == error(400, "n=17 must be in [1, 16]", "n")
    assert status_body(chat(client, n=0)) == error(400, "n=0 must be in [1, 16]", "n")


def test_n_choices_are_n_requests(client, engine):
    r = chat(client, n=3, seed=5, temperature=0.7)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello world" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 3 * USAGE["completion_tokens"]
    assert body["usage"]["prompt_tokens"] == USAGE["prompt_tokens"]
    assert [p.seed for _, p in engine.calls] == [5, 6, 7]  # each choice its own draw


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs needs logprobs: true", "top_logprobs"),
        (
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs=21 must be in [0, 20]",
            "top_logprobs",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "'tools' is not supported by the served model 'fake-model': its chat template has no "
            "tool-call format that mlx-lm's tool parsers know (for example Qwen, Llama 3.1+, "
            "Mistral, GLM, Kimi, Gemma); serve such a model to use tools",
            "tools",
        ),
        (
            {"frequency_penalty": 2.5},
            "frequency_penalty=2.5 must be in [-2, 2]",
            "frequency_penalty",
        ),
        ({"min_p": 1.5}, "min_p=1.5 must be in [0, 1]", "min_p"),
        (
            {"logit_bias": {"x": 1}},
            "logit_bias key 'x' is not a token id; use integers",
            "logit_bias",
        ),
        (
            {"logit_bias": {"5": 101}},
            "logit_bias={5: 101.0} needs a token id >= 0 and a bias in [-100, 100]",
            "logit_bias",
        ),
        ({"messages": []}, "'messages' must contain at least one message", "messages"),
        ({"stop": ["a", ""]}, "stop strings must not be empty", "stop"),
        ({"top_p": 1.5}, "top_p=1.5 must be in (0, 1]", "top_p"),
        ({"temperature": -1}, "temperature=-1.0 must be >= 0", "temperature"),
        ({"max_tokens": 0}, "max_tokens=0 must be at least 1", "max_tokens"),
    ],
)
def test_unsupported_or_out_of_range_is_400(client, body, message, param):
    assert status_body(chat(client, **body)) == error(400, message, param)


def test_image_content_is_400(client):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert status_body(r) == error(
        400, "only 'text' content parts are supported, got 'image_url'", "messages.0.content.0"
    )


def test_prompt_longer_than_context_is_400_naming_the_limit(engine):
    client = TestClient(create_app(FakeEngine(max_context=10)))
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 12})
    assert status_body(r) == error(
        400,
        "this model's maximum context length is 10 tokens, however your prompt is 12 tokens, "
        "which leaves no room for the completion; shorten the prompt",
        "prompt",
        "context_length_exceeded",
    )
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 6, "max_tokens": 5})
    assert status_body(r) == error(
        400,
        "this model's maximum context length is 10 tokens, however you requested 11 tokens "
        "(6 in the prompt, 5 for the completion); shorten the prompt or lower max_tokens",
        "max_tokens",
        "context_length_exceeded",
    )
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 6, "max_tokens": 4})
    assert r.status_code == 200


def test_not_ready_is_503_with_retry_after(client, engine):
    engine.state = EngineStatus("loading", 0.42, "loading shard 3/7")
    r = chat(client)
    assert r.headers["retry-after"] == "5"
    assert status_body(r) == error(
        503,
        "the model is not ready (state loading: loading shard 3/7); retry in 5 s",
        code="model_not_ready",
        type="server_error",
    )
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert engine.calls == []


def test_engine_error_delta_is_500_without_traceback(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "fail"})
    assert status_body(r) == error(500, "generation failed: out of KV cache", type="server_error")


def test_engine_exception_is_500_without_traceback(client, engine):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "explode"})
    assert status_body(r) == error(
        500, "generation failed: rank 1 lost its link", type="server_error"
    )
    assert engine.cancelled.is_set()


def test_unexpected_exception_is_plain_500(client, engine, caplog):
    def broken():
        raise KeyError("secret internals")

    engine.metrics = broken
    r = client.get("/metrics")
    assert status_body(r) == error(
        500, "internal server error; see the server log", type="server_error"
    )
    assert "Traceback" not in r.text and "secret" not in r.text
    assert "unhandled error serving GET /metrics" in caplog.text


def test_errors_mid_stream_are_an_error_event_then_the_end(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "fail", "stream": True})
    payloads = sse(r.text)
    assert (
        json.loads(payloads[-1])
        == error(500, "generation failed: out of KV cache", type="server_error")[1]
    )
    assert "[DONE]" not in payloads
    r = chat(client, stream=True, messages=[{"role": "user", "content": "explode"}])
    payloads = sse(r.text)
    assert [json.loads(p)["choices"][0]["delta"] for p in payloads[:2]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
    ]
    assert (
        json.loads(payloads[2])
        == error(500, "generation failed: rank 1 lost its link", type="server_error")[1]
    )
    assert len(payloads) == 3


def test_unknown_route_and_method_use_the_error_body(client):
    assert status_body(client.get("/v1/nope")) == error(404, "Not Found", code="not_found")
    r = client.get("/v1/chat/completions")
    assert status_body(r) == error(405, "Method Not Allowed", code="method_not_allowed")


# --- models, health, cluster, metrics, auth ---------------------------------------------


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
