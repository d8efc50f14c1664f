"""What the OpenAI API tests over the fake engine share: its `engine` and `client` fixtures
(imported by their function names, so a test's `engine` argument shadows no import), the
request they send, and readers of SSE bodies and error bodies."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_engine import MODEL, FakeEngine, chat_text
from fastapi.testclient import TestClient

from thunderpool.api import create_app

KEY = "sk-test-key"
HI = [{"role": "user", "content": "Hi"}]
HI_TOKENS = len(chat_text(("user", "Hi")))  # 19: one token per character
NOT_CACHED = {"prompt_tokens_details": {"cached_tokens": 0}}  # the fake engine has no cache
USAGE = {"prompt_tokens": HI_TOKENS, "completion_tokens": 2, "total_tokens": HI_TOKENS + 2}
USAGE |= NOT_CACHED


@pytest.fixture(name="engine")
def fixture_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(name="client")
def fixture_client(engine) -> TestClient:
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
