"""Idle ranks sleep: after a "park" plan followers block on a TCP socket, not in a collective.

MLX's ring backend busy-polls inside a collective, so a follower that waited for the next plan
there would burn a core while the instance is idle. Instead the leader parks the followers:
the first park plan carries the leader's wake address, each follower connects once (and says
its rank; the leader acknowledges it), and from then on a parked follower sleeps in `recv`
until the leader writes one byte to it, just before the leader's next plan. The collectives'
order is unchanged. A follower that cannot reach the address, or is not acknowledged, keeps
waiting in the collective, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import time

from thunderpool.engine.control import Control

CONNECT_TIMEOUT_S = 2.0
ACCEPT_TIMEOUT_S = 10.0


class Waker:
    def __init__(self, control: Control):
        self.control = control
        self.listener: socket.socket | None = None
        self.peers: list[socket.socket] = []  # leader: one per follower that connected
        self.sock: socket.socket | None = None  # follower: its connection to the leader
        self.tried = False

    def address(self) -> tuple:
        """Leader: the park plan's args; the listener opens on the first park."""
        if self.control.size == 1:
            return ()
        if self.listener is None:
            # Only on the address the ranks already talk over, where one is configured.
            fabric = fabric_host()
            self.listener = socket.create_server((fabric or "0.0.0.0", 0))
            hosts = [fabric] if fabric else leader_hosts()
            return (self.listener.getsockname()[1], hosts)
        return ()

    def park(self, args: tuple) -> None:
        """Runs the park plan: the leader takes the followers' first connections; a follower
        sleeps until woken."""
        if self.control.size == 1:
            return
        if self.control.rank == 0:
            if args:
                self._accept()
            return
        if self.sock is None and args and not self.tried:
            self.tried = True
            self.sock = _connect(*args, rank=self.control.rank)
        if self.sock is not None and self.sock.recv(1) == b"":
            raise RuntimeError("the leader closed its wake connection")

    def wake(self) -> None:
        """Leader: wakes every parked follower (call before the next plan)."""
        for peer in self.peers:
            with contextlib.suppress(OSError):  # a follower that died ends the instance anyway
                peer.sendall(b"w")

    def _accept(self) -> None:
        assert self.listener is not None
        deadline, ranks = time.monotonic() + ACCEPT_TIMEOUT_S, set()
        while len(self.peers) < self.control.size - 1:
            self.listener.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                peer, _ = self.listener.accept()
            except TimeoutError:
                break  # those that did not connect wait in the collective
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer.settimeout(CONNECT_TIMEOUT_S)
            try:
                (rank,) = struct.unpack(">I", _recv_exact(peer, 4))
                if not 0 < rank < self.control.size or rank in ranks:
                    raise OSError(f"rank {rank} is not a follower still to connect")
                peer.sendall(b"a")
            except (OSError, struct.error):
                peer.close()
                continue
            peer.settimeout(None)
            ranks.add(rank)
            self.peers.append(peer)
        self.listener.close()


def _connect(port: int, hosts: list[str], rank: int) -> socket.socket | None:
    for host in hosts:
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(struct.pack(">I", rank))
            sock.settimeout(ACCEPT_TIMEOUT_S + CONNECT_TIMEOUT_S)
            if sock.recv(1) != b"a":  # not accepted: wait in the collective instead
                raise OSError("the leader did not acknowledge")
        except OSError:
            sock.close()
            return None
        sock.settimeout(None)
        return sock
    return None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def fabric_host() -> str | None:
    """Rank 0's address on the ranks' own fabric: its ring address, or jaccl's coordinator."""
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError):
        ring = json.loads(open(os.environ["MLX_HOSTFILE"]).read())  # noqa: SIM115
        return ring[0][0].rsplit(":", 1)[0] or None
    with contextlib.suppress(KeyError, ValueError):
        return os.environ["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0] or None
    return None


def leader_hosts() -> list[str]:
    """Addresses the followers may reach the leader at when no fabric address is known."""
    hosts: list[str] = []
    with contextlib.suppress(OSError):
        hosts += socket.gethostbyname_ex(socket.gethostname())[2]
    hosts.append("127.0.0.1")
    return list(dict.fromkeys(h for h in hosts if h))
