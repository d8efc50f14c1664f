"""Errors of the OpenAI API over a fake engine: every bad request is a 4xx naming the
field, engine failures are 5xx without tracebacks, mid-stream errors an error event."""

from __future__ import annotations

import json

import pytest
from fake_engine import MODEL, FakeEngine
from fastapi.testclient import TestClient
from openai_wire import HI, USAGE, chat, error, fixture_client, fixture_engine, sse, status_body  # noqa: F401 (fixtures)

from thunderpool.api import create_app
from thunderpool.engine.service import EngineStatus


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
