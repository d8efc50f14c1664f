"""The cluster token: generated on a node's first start, then required on every control message.

Each request carries an HMAC-SHA256 under the token of its method, path (with the query),
timestamp, a random nonce and its body. A message without it, with a wrong one, older than the
replay window, or whose nonce was already seen is refused, so a request captured on the LAN can
neither be replayed nor re-aimed at another path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from thunderpool.config import TOKEN_ENV, state_dir, token_from_env
from thunderpool.errors import ThunderpoolError

SIG_HEADER = "X-Thunderpool-Signature"
TS_HEADER = "X-Thunderpool-Timestamp"
NONCE_HEADER = "X-Thunderpool-Nonce"
WINDOW_S = 120.0


class AuthError(ThunderpoolError):
    """A control message that is not signed with this cluster's token."""


@dataclass(frozen=True, slots=True)
class Identity:
    node_id: str
    token: str
    created: bool  # True when the token was generated just now (print it once)


def load_identity(token: str | None = None, home: Path | None = None) -> Identity:
    """This node's id and the cluster token: --token, else $THUNDERPOOL_TOKEN, else the
    stored one, else a new one (stored with mode 0600)."""
    home = home or state_dir()
    path = home / "identity.json"
    stored = json.loads(path.read_text()) if path.is_file() else {}
    node_id = stored.get("node_id") or uuid.uuid4().hex[:12]
    chosen = token or token_from_env() or stored.get("token")
    created = chosen is None
    chosen = chosen or secrets.token_urlsafe(24)
    if stored != {"node_id": node_id, "token": chosen}:
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"node_id": node_id, "token": chosen}))
        path.chmod(0o600)
    return Identity(node_id, chosen, created)


class NonceCache:
    """Nonces seen within the replay window; older ones are refused by their timestamp."""

    def __init__(self, window: float = WINDOW_S):
        self.window = window
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._next_prune = 0.0

    def first_use(self, nonce: str, now: float) -> bool:
        with self._lock:
            # Pruned every few seconds, not per request: weights move hundreds of chunks a second.
            if now >= self._next_prune:
                cutoff = now - 2 * self.window
                self._seen = {n: t for n, t in self._seen.items() if t > cutoff}
                self._next_prune = now + 10.0
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


def _mac(token: str, method: str, path: str, ts: str, nonce: str, body: bytes) -> str:
    head = "\n".join((method.upper(), path, ts, nonce)).encode()
    return hmac.new(token.encode(), head + b"\n" + body, hashlib.sha256).hexdigest()


def sign(
    token: str,
    method: str,
    path: str,
    body: bytes = b"",
    ts: float | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """Headers that sign one request; `path` includes the query string as sent."""
    ts_text = f"{time.time() if ts is None else ts:.3f}"
    nonce = nonce or secrets.token_hex(16)
    mac = _mac(token, method, path, ts_text, nonce, body)
    return {TS_HEADER: ts_text, NONCE_HEADER: nonce, SIG_HEADER: mac}


def verify(
    token: str,
    method: str,
    path: str,
    body: bytes,
    headers,
    nonces: NonceCache | None = None,
    now: float | None = None,
) -> None:
    """Raise AuthError unless `headers` carry a fresh, valid, unused signature of this request."""
    ts_text, mac = headers.get(TS_HEADER), headers.get(SIG_HEADER)
    nonce = headers.get(NONCE_HEADER)
    if not ts_text or not mac or not nonce:
        raise AuthError(
            f"unsigned control message; every node needs the cluster token "
            f"(--token or ${TOKEN_ENV}) and the same thunderpool version"
        )
    try:
        ts = float(ts_text)
    except ValueError:
        raise AuthError(f"bad timestamp {ts_text!r}") from None
    now = time.time() if now is None else now
    if abs(now - ts) > WINDOW_S:
        raise AuthError("stale control message (clocks more than 2 minutes apart?)")
    want = _mac(token, method, path, ts_text, nonce, body)
    if not hmac.compare_digest(want, mac):
        raise AuthError(
            f"wrong cluster token; pass the token printed by the first node "
            f"(--token or ${TOKEN_ENV})"
        )
    # Checked after the MAC, so a forger cannot burn the nonces of real requests.
    if nonces is not None and not nonces.first_use(nonce, now):
        raise AuthError(f"replayed control message (nonce {nonce[:8]}... seen before)")
