"""Link probes: round-trip latency and bandwidth between two agents, over a plain TCP port.

Frames are a 4-byte big-endian length, then a 1-byte op and the payload: op E echoes the
payload back (latency), op S swallows it and answers 8 bytes (bandwidth), op I answers which
node this is: its node id and an HMAC of the asker's nonce and that id under the cluster token,
so an asker knows which node holds an address, not only that one does. A frame over
MAX_FRAME, with an unknown op, or cut short is refused with one log line and its connection
closed; the server keeps serving others.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import socketserver
import statistics
import struct
import threading
import time

MAX_FRAME = 64 << 20
log = logging.getLogger("thunderpool.probe")


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = self.client_address[0]
        try:
            while head := _recv_upto(sock, 5):  # empty: the peer closed between frames
                if len(head) < 5:
                    log.warning(
                        "probe: refused a truncated header (%d bytes) from %s", len(head), peer
                    )
                    return
                n, op = struct.unpack(">IB", head)
                if n > MAX_FRAME or op not in (ord("E"), ord("S"), ord("I")):
                    log.warning("probe: refused a frame (length %d, op %d) from %s", n, op, peer)
                    return
                payload = _recv_upto(sock, n)
                if len(payload) < n:
                    log.warning(
                        "probe: refused a truncated frame (%d of %d bytes) from %s",
                        len(payload),
                        n,
                        peer,
                    )
                    return
                if op == ord("I"):
                    who = self.server.identity
                    if who is None or n > NONCE_MAX:
                        log.warning("probe: refused an identity request from %s", peer)
                        return
                    reply = f"{who[0]} {_sign(who[1], payload, who[0])}".encode()
                else:
                    reply = payload if op == ord("E") else struct.pack(">Q", n)
                sock.sendall(struct.pack(">I", len(reply)) + reply)
        except OSError as e:
            log.warning("probe: dropped %s: %s", peer, e)


class ProbeServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, identity: tuple[str, str] | None = None):
        self.identity = identity  # (node id, cluster token): answers op I
        super().__init__((host, port), _Handler)

    def start(self) -> ProbeServer:
        threading.Thread(target=self.serve_forever, name="probe", daemon=True).start()
        return self


def _recv_upto(sock: socket.socket, n: int) -> bytes:
    """`n` bytes, or fewer if the peer closed first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    data = _recv_upto(sock, n)
    return data if len(data) == n else None


def _frame(op: str, payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload), ord(op)) + payload


NONCE_MAX = 64


def _sign(token: str, nonce: bytes, node_id: str) -> str:
    return hmac.new(
        token.encode(), b"probe-identity\n" + nonce + node_id.encode(), hashlib.sha256
    ).hexdigest()


def identify(sock: socket.socket, token: str) -> str:
    """The node id of the ProbeServer at the other end of `sock`, proven by its HMAC of a fresh
    nonce under `token`; ConnectionError if it does not answer, or not with this cluster's."""
    nonce = secrets.token_hex(16).encode()
    sock.sendall(_frame("I", nonce))
    head = _recv_exact(sock, 4)
    body = _recv_exact(sock, struct.unpack(">I", head)[0]) if head else None
    node_id, _, mac = (body or b"").decode(errors="replace").partition(" ")
    if not node_id or not hmac.compare_digest(mac, _sign(token, nonce, node_id)):
        raise ConnectionError("the node that answered is not one of this cluster's (wrong token)")
    return node_id


def measure(
    host: str, port: int, rounds: int = 20, blob_bytes: int = 4 << 20, timeout: float = 10.0
) -> tuple[float, float, str]:
    """(median RTT seconds, bandwidth bytes/s, the local address the connection left from)
    to a ProbeServer at host:port."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        local = sock.getsockname()[0]
        rtts = []
        ping = _frame("E", b"x" * 64)
        for _ in range(rounds + 2):
            t = time.perf_counter()
            sock.sendall(ping)
            head = _recv_exact(sock, 4)
            if head is None or _recv_exact(sock, struct.unpack(">I", head)[0]) is None:
                raise ConnectionError(f"probe server {host}:{port} closed the connection")
            rtts.append(time.perf_counter() - t)
        blob = _frame("S", bytes(blob_bytes))
        t = time.perf_counter()
        sock.sendall(blob)
        if _recv_exact(sock, 12) is None:
            raise ConnectionError(f"probe server {host}:{port} closed the connection")
        seconds = time.perf_counter() - t
    # The first rounds warm up the connection; the median resists scheduler noise.
    return statistics.median(rtts[2:]), blob_bytes / max(seconds, 1e-9), local
