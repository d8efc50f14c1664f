"""The cluster token: generated on a node's first start, then required on every control message.

Each request carries an HMAC-SHA256 of its timestamp and body under the token; a message
without it, with a wrong one, or older than the replay window is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from thunderpool.config import TOKEN_ENV, state_dir, token_from_env
from thunderpool.errors import ThunderpoolError

SIG_HEADER = "X-Thunderpool-Signature"
TS_HEADER = "X-Thunderpool-Timestamp"
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


def sign(token: str, body: bytes, ts: float | None = None) -> dict[str, str]:
    ts_text = f"{time.time() if ts is None else ts:.3f}"
    mac = hmac.new(token.encode(), ts_text.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {TS_HEADER: ts_text, SIG_HEADER: mac}


def verify(token: str, body: bytes, headers, now: float | None = None) -> None:
    """Raise AuthError unless `headers` carry a fresh, valid signature of `body`."""
    ts_text, mac = headers.get(TS_HEADER), headers.get(SIG_HEADER)
    if not ts_text or not mac:
        raise AuthError(
            f"unsigned control message; every node needs the cluster token "
            f"(--token or ${TOKEN_ENV})"
        )
    try:
        ts = float(ts_text)
    except ValueError:
        raise AuthError(f"bad timestamp {ts_text!r}") from None
    if abs((time.time() if now is None else now) - ts) > WINDOW_S:
        raise AuthError("stale control message (clocks more than 2 minutes apart?)")
    want = hmac.new(token.encode(), ts_text.encode() + b"." + body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, mac):
        raise AuthError(
            f"wrong cluster token; pass the token printed by the first node "
            f"(--token or ${TOKEN_ENV})"
        )
