"""Hybrid TP×PP's hand-off between MLX worlds: arrays over plain TCP, one frame at a time.

Each TP group is its own MLX world (ring/jaccl worlds cannot be split), so stages talk over a
transport of ours. Rank r of stage s feeds rank r' of the next stage for every r' with
r' % size(s) == r, and the last stage feeds stage 0 the same way: each rank has exactly one
predecessor (one inbound connection) and zero or more successors. Every rank of a group holds
the whole hidden state after its stage (TP's all_sum replicates it), so no rank needs a
broadcast inside its group.

A frame is a fixed header (magic, dtype code, ndim, up to 6 dims) and the array's raw bytes;
no pickle. Waits have timeouts, except a follower's wait for the next plan (an idle server
may be quiet for hours; TCP keepalive and the launcher's kill-all cover a dead peer there).
A closed or silent peer raises HandoffError, so the rank exits non-zero and the launcher
stops every world.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from thunderpool.errors import ThunderpoolError

MAGIC = b"TPH1"
_HEADER = struct.Struct("<4sBB2x6q")
_DTYPES: tuple[mx.Dtype, ...] = (mx.uint8, mx.int32, mx.float32, mx.float16, mx.bfloat16)
# numpy has no bfloat16: its bytes travel as uint16 and are viewed back on arrival.
_NP = {mx.uint8: np.uint8, mx.int32: np.int32, mx.float32: np.float32, mx.float16: np.float16}
CONNECT_S = 120.0  # ranks start (and import MLX) at different speeds
STEP_S = 600.0  # the longest a stage waits for its peer inside a step (a large prefill chunk)


class HandoffError(ThunderpoolError):
    """A peer of another stage closed its connection, went silent, or sent a bad frame."""


@dataclass(frozen=True, slots=True)
class Topology:
    """Stages of TP groups: `groups[s]` ranks in stage s; this rank is `rank` of `stage`."""

    groups: tuple[int, ...]
    stage: int
    rank: int

    def index(self, stage: int, rank: int) -> int:
        """The global rank of (stage, rank): stages in order, ranks in order within each."""
        return sum(self.groups[:stage]) + rank

    @property
    def me(self) -> int:
        return self.index(self.stage, self.rank)

    @property
    def last(self) -> bool:
        return self.stage == len(self.groups) - 1

    def predecessor(self) -> int:
        prev = (self.stage - 1) % len(self.groups)
        return self.index(prev, self.rank % self.groups[prev])

    def successors(self) -> list[int]:
        nxt = (self.stage + 1) % len(self.groups)
        mine = self.groups[self.stage]
        return [self.index(nxt, r) for r in range(self.groups[nxt]) if r % mine == self.rank]


def check_groups(groups: tuple[int, ...] | list[int], world: int | None = None) -> None:
    """Raise a ThunderpoolError for groups that cannot form a hybrid layout."""
    if len(groups) < 2 or any(g < 1 for g in groups):
        raise ThunderpoolError(
            f"--groups {','.join(map(str, groups))} must name at least two TP groups of one or "
            "more ranks each, e.g. --groups 2,2; one group is plain --parallel tp"
        )
    if world is not None and sum(groups) != world:
        raise ThunderpoolError(
            f"--groups {','.join(map(str, groups))} adds up to {sum(groups)} ranks, not "
            f"--nodes {world}; make them agree (or leave --nodes out)"
        )


def send_array(sock: socket.socket, x: mx.array | np.ndarray) -> None:
    """One frame: the header, then the array's bytes (C order)."""
    if isinstance(x, mx.array):
        dtype = x.dtype
        data = np.array(x.view(mx.uint16) if dtype == mx.bfloat16 else x)
    else:
        data = x
        dtype = next(d for d, n in _NP.items() if np.dtype(n) == x.dtype)
    if data.ndim > 6:
        raise HandoffError(f"cannot send a {data.ndim}-d array (6 at most)")
    dims = [*data.shape, *[0] * (6 - data.ndim)]
    header = _HEADER.pack(MAGIC, _DTYPES.index(dtype), data.ndim, *dims)
    sock.sendall(header)
    if data.nbytes:
        sock.sendall(memoryview(np.ascontiguousarray(data)).cast("B"))


def recv_array(sock: socket.socket, timeout: float | None, peer: str) -> mx.array:
    """The next frame from `peer` as an mx.array; raises HandoffError on timeout or EOF."""
    sock.settimeout(timeout)
    magic, code, ndim, *dims = _HEADER.unpack(_recv_exact(sock, _HEADER.size, peer, timeout))
    if magic != MAGIC or code >= len(_DTYPES) or ndim > 6:
        raise HandoffError(f"{peer} sent a frame that is not a hand-off frame ({magic!r})")
    dtype, shape = _DTYPES[code], tuple(dims[:ndim])
    wire = np.uint16 if dtype == mx.bfloat16 else _NP[dtype]
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(wire).itemsize
    data = np.frombuffer(_recv_exact(sock, n, peer, timeout), wire).reshape(shape)
    out = mx.array(data)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _recv_exact(sock: socket.socket, n: int, peer: str, timeout: float | None) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise HandoffError(f"no data from {peer} for {timeout:.0f} s; stopping") from None
        except OSError as e:
            raise HandoffError(f"the hand-off from {peer} broke: {e}") from None
        if k == 0:
            raise HandoffError(f"{peer} closed its hand-off connection (it exited)")
        got += k
    return buf


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


class Link:
    """This rank's hand-off connections: one from its predecessor, one to each successor."""

    def __init__(self, topo: Topology, addresses: tuple[str, ...], connect_s: float = CONNECT_S):
        if len(addresses) != sum(topo.groups):
            raise HandoffError(f"{len(addresses)} hand-off addresses for {sum(topo.groups)} ranks")
        self.topo = topo
        self.pred_name = self._name(topo.predecessor())
        host, port = _split(addresses[topo.me])
        listener = socket.create_server((host, port), reuse_port=False)
        deadline = time.monotonic() + connect_s
        try:
            self.out = [self._connect(addresses[g], g, deadline) for g in topo.successors()]
            self.inbound = self._accept(listener, deadline)
        finally:
            listener.close()

    def _name(self, g: int) -> str:
        groups, s = self.topo.groups, 0
        while g >= groups[s]:
            g, s = g - groups[s], s + 1
        return f"stage {s} rank {g}"

    def _connect(self, address: str, g: int, deadline: float) -> socket.socket:
        while True:
            try:
                sock = socket.create_connection(_split(address), timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise HandoffError(
                        f"cannot reach {self._name(g)} at {address} for the hand-off: {e}"
                    ) from None
                time.sleep(0.05)
        _keepalive(sock)
        sock.sendall(struct.pack("<I", self.topo.me))  # says who is calling
        return sock

    def _accept(self, listener: socket.socket, deadline: float) -> socket.socket:
        listener.settimeout(max(deadline - time.monotonic(), 0.1))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            raise HandoffError(f"{self.pred_name} never connected its hand-off") from None
        _keepalive(sock)
        (who,) = struct.unpack("<I", _recv_exact(sock, 4, self.pred_name, 10.0))
        if who != self.topo.predecessor():
            sock.close()
            raise HandoffError(f"global rank {who} connected, expected {self.pred_name}")
        return sock

    def send(self, x: mx.array | np.ndarray) -> None:
        """To every successor (the next stage; the last stage's go to stage 0)."""
        for sock in self.out:
            try:
                send_array(sock, x)
            except OSError as e:
                raise HandoffError(f"the hand-off to the next stage broke: {e}") from None

    def recv(self, timeout: float | None = STEP_S) -> mx.array:
        return recv_array(self.inbound, timeout, self.pred_name)

    def close(self) -> None:
        for sock in [*self.out, self.inbound]:
            with contextlib.suppress(OSError):
                sock.close()
