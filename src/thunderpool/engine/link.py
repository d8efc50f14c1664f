"""The engine link: the serve process's gateway and the leader rank, over one TCP connection.

Frames are a 4-byte big-endian length and one JSON message that pydantic validates (never
pickle). The leader opens with a random nonce; the gateway must answer HMAC-SHA256(token,
nonce) within a few seconds or is dropped. A garbage, truncated or oversized frame closes that
connection only, with one log line; the listener keeps serving.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import struct
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import Delta

MAX_FRAME = 8 << 20  # a 128k-token prompt is ~1 MB of JSON
AUTH_TIMEOUT_S = 5.0
log = logging.getLogger("thunderpool.link")


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Challenge(_Msg):
    kind: Literal["challenge"] = "challenge"
    nonce: str = Field(min_length=32, max_length=64)


class Auth(_Msg):
    kind: Literal["auth"] = "auth"
    mac: str = Field(max_length=128)


class Submit(_Msg):
    kind: Literal["submit"] = "submit"
    id: int = Field(ge=0)
    prompt: list[int] = Field(min_length=1)
    params: SamplingParams  # validated here, once, by its own checks


class Cancel(_Msg):
    kind: Literal["cancel"] = "cancel"
    id: int = Field(ge=0)


class DeltaMsg(_Msg):
    kind: Literal["delta"] = "delta"
    id: int
    delta: Delta


class Info(_Msg):
    """Sent once after the handshake: the leader is ready for requests."""

    kind: Literal["info"] = "info"
    max_context: int


class Metrics(_Msg):
    kind: Literal["metrics"] = "metrics"
    values: dict[str, float]


ToLeader = TypeAdapter(Annotated[Auth | Submit | Cancel, Field(discriminator="kind")])
ToGateway = TypeAdapter(
    Annotated[Challenge | DeltaMsg | Info | Metrics, Field(discriminator="kind")]
)


class FrameError(Exception):
    """A frame that is not a valid message of this protocol."""


def send(sock: socket.socket, msg: BaseModel) -> None:
    data = msg.model_dump_json().encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv(sock: socket.socket, adapter: TypeAdapter):
    """The next message, or None when the peer closed cleanly between frames."""
    head = _recv_exact(sock, 4, eof_ok=True)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise FrameError(f"frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    body = _recv_exact(sock, n, eof_ok=False)
    try:
        return adapter.validate_json(body)
    except ValidationError as e:
        raise FrameError(f"invalid message: {e.errors(include_url=False)[0]['msg']}") from None


def _recv_exact(sock: socket.socket, n: int, eof_ok: bool) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if eof_ok and not buf:
                return None
            raise FrameError(f"truncated frame: {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def mac_of(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def challenge(sock: socket.socket, token: str) -> None:
    """Leader side of the handshake; raises FrameError unless the peer knows the token."""
    nonce = secrets.token_hex(16)
    send(sock, Challenge(nonce=nonce))
    sock.settimeout(AUTH_TIMEOUT_S)
    reply = recv(sock, ToLeader)
    if not isinstance(reply, Auth) or not hmac.compare_digest(reply.mac, mac_of(token, nonce)):
        raise FrameError("the peer did not answer the challenge with the link token")
    sock.settimeout(None)


def answer(sock: socket.socket, token: str) -> None:
    """Gateway side of the handshake."""
    msg = recv(sock, ToGateway)
    if not isinstance(msg, Challenge):
        raise FrameError("the leader did not open with a challenge")
    send(sock, Auth(mac=mac_of(token, msg.nonce)))
