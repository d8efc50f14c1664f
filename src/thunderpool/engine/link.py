"""The engine link: the serve process's gateway and the leader rank, over one TCP connection.

Frames are a 4-byte big-endian length and one JSON message that pydantic validates (never
pickle). The leader opens with a random nonce; the gateway must answer HMAC-SHA256(token,
nonce) within a few seconds or is dropped. A garbage, truncated or oversized frame closes that
connection only, with one log line; the listener keeps serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import queue
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
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


# The leader rank's end: requests in, deltas and metrics out. Each connection gets a writer
# thread, so a slow gateway never stalls the scheduler's thread; a connection that closes
# cancels its requests, which leave the batch at the next step.
METRICS_EVERY_S = 1.0


class _Connection(socketserver.BaseRequestHandler):
    server: LeaderServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = self.client_address[0]
        try:
            challenge(sock, self.server.token)
        except (FrameError, OSError) as e:
            log.warning("engine link: refused a connection from %s: %s", peer, e)
            return
        out: queue.Queue = queue.Queue()
        sids: dict[int, int] = {}  # gateway id -> scheduler id
        writer = threading.Thread(target=self._write, args=(sock, out), daemon=True)
        out.put(Info(max_context=self.server.max_context))
        writer.start()
        try:
            while (msg := recv(sock, ToLeader)) is not None:
                self._apply(msg, sids, out)
        except FrameError as e:
            log.warning("engine link: dropped %s after a bad frame: %s", peer, e)
        except OSError:
            pass
        finally:
            for sid in sids.values():
                self.server.scheduler.cancel(sid)
            out.put(None)

    def _apply(self, msg, sids: dict[int, int], out: queue.Queue) -> None:
        scheduler = self.server.scheduler
        if isinstance(msg, Cancel):
            if (sid := sids.pop(msg.id, None)) is not None:
                scheduler.cancel(sid)
            return
        if not isinstance(msg, Submit):
            return

        def emit(d: Delta, rid: int = msg.id) -> None:
            if d.finish_reason is not None:
                sids.pop(rid, None)
            out.put(DeltaMsg(id=rid, delta=d))

        sids[msg.id] = scheduler.submit(msg.prompt, msg.params, emit)

    def _write(self, sock: socket.socket, out: queue.Queue) -> None:
        due = time.monotonic() + METRICS_EVERY_S  # Info goes first: the gateway waits for it
        try:
            while True:
                if time.monotonic() >= due:
                    send(sock, Metrics(values=self.server.metrics()))
                    due = time.monotonic() + METRICS_EVERY_S
                try:
                    msg = out.get(timeout=max(due - time.monotonic(), 0.0))
                except queue.Empty:
                    continue
                if msg is None:
                    return
                send(sock, msg)
        except OSError:
            pass  # the gateway went away; the reader sees it too and cancels
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class LeaderServer(socketserver.ThreadingTCPServer):
    """Listens for the gateway; `port` is the one the OS chose when asked for 0."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        host: str,
        token: str,
        scheduler,  # submit(prompt, params, emit) and cancel(id): sequence.TextRequests
        max_context: int,
        metrics: Callable[[], dict[str, float]],
    ):
        super().__init__((host, 0), _Connection)
        self.token, self.scheduler = token, scheduler
        self.max_context, self.metrics = max_context, metrics
        self.port = self.server_address[1]

    def start(self) -> LeaderServer:
        threading.Thread(target=self.serve_forever, name="engine-link", daemon=True).start()
        return self
