"""What the OpenAI API tests over the fake engine share: the request they send, and readers
of SSE bodies and error bodies."""

from __future__ import annotations

import json

import httpx
from fake_engine import MODEL, chat_text
from fastapi.testclient import TestClient

KEY = "sk-test-key"
HI = [{"role": "user", "content": "Hi"}]
HI_TOKENS = len(chat_text(("user", "Hi")))  # 19: one token per character
NOT_CACHED = {"prompt_tokens_details": {"cached_tokens": 0}}  # the fake engine has no cache
USAGE = {"prompt_tokens": HI_TOKENS, "completion_tokens": 2, "total_tokens": HI_TOKENS + 2}
USAGE |= NOT_CACHED


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
