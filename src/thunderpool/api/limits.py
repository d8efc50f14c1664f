"""How many generation requests one client may have running at once.

A client is its API key (`Authorization` or Anthropic's `x-api-key`), or its address where it
sends none. The middleware counts a client's requests while they run (a stream until its last
event); `admit` (api/conversation.py), which every API's generation path goes through, answers
a request past the limit with a 429 and Retry-After in that API's own error format.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections import Counter

from thunderpool.api.errors import APIError

DEFAULT_PER_KEY = 64  # --max-concurrent-per-key: well above any batch a rank set decodes
RETRY_S = 1  # a running request of the same client ends within seconds
GENERATING = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat",
     "/api/generate"}
)  # fmt: skip

_running: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "running", default=None
)


def client_key(scope) -> str:
    headers = dict(scope["headers"])
    secret = headers.get(b"authorization") or headers.get(b"x-api-key")
    if secret:  # kept as a digest: the counter never holds a key
        return "key:" + hashlib.sha256(secret).hexdigest()[:16]
    client = scope.get("client")
    return f"addr:{client[0] if client else '?'}"


class PerKeyLimit:
    """ASGI middleware: counts each client's running generation requests."""

    def __init__(self, app, per_key: int = DEFAULT_PER_KEY):
        self.app, self.per_key = app, per_key
        self.running: Counter[str] = Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATING:
            return await self.app(scope, receive, send)
        key = client_key(scope)
        self.running[key] += 1
        token = _running.set((self.running[key], self.per_key))
        try:
            await self.app(scope, receive, send)
        finally:
            _running.reset(token)
            self.running[key] -= 1
            if not self.running[key]:
                del self.running[key]


def check_running() -> None:
    """A 429 for a request its client's limit does not leave room for."""
    seen = _running.get()
    if seen is not None and seen[0] > seen[1]:
        raise APIError(
            429,
            f"this client already has {seen[1]} requests running (the server's "
            "--max-concurrent-per-key); retry when one has finished",
            type="rate_limit_error",
            code="too_many_requests",
            headers={"Retry-After": str(RETRY_S)},
        )
