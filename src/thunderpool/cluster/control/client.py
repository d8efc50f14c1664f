"""Signed HTTP calls to a node agent (every control message carries the cluster token's HMAC)."""

from __future__ import annotations

import threading

import httpx
from pydantic import BaseModel

from thunderpool.cluster.control.auth import AuthError, sign
from thunderpool.errors import ThunderpoolError

_shared: httpx.Client | None = None
_shared_lock = threading.Lock()


def _client() -> httpx.Client:
    """One client for every call: each new httpx client loads the CA bundle (~20 ms of CPU),
    and serve's polls made that a burst that stole the cores from the ranks mid-step."""
    global _shared
    with _shared_lock:
        if _shared is None:
            # No keep-alive: each call still opens its own connection, as before.
            _shared = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        return _shared


class AgentError(ThunderpoolError):
    """An agent refused a request or could not be reached."""


class AgentUnreachable(AgentError):
    """No answer at the transport level: nothing listening, no route, a timeout."""


class AgentClient:
    def __init__(self, address: str, token: str, timeout: float = 30.0):
        self.address, self.token, self.timeout = address, token, timeout

    def call(
        self, method: str, path: str, body: BaseModel | None = None, timeout: float | None = None
    ) -> dict:
        data = body.model_dump_json().encode() if body is not None else b""
        headers = {**sign(self.token, method, path, data), "Content-Type": "application/json"}
        url = f"http://{self.address}{path}"
        try:
            r = _client().request(
                method, url, content=data, headers=headers, timeout=timeout or self.timeout
            )
        except httpx.HTTPError as e:
            raise AgentUnreachable(
                f"cannot reach the agent at {self.address} ({e}); is "
                "`thunderpool node` running there and the port open?"
            ) from None
        if r.status_code == 401:
            raise AuthError(f"{self.address} refused: {_detail(r)}")
        if r.status_code >= 400:
            raise AgentError(f"{self.address}: {_detail(r)}")
        return r.json()


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except ValueError:
        return r.text or f"HTTP {r.status_code}"
