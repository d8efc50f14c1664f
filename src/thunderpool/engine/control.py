"""The leader's step plan, broadcast to followers as JSON bytes over an all_sum.

Followers contribute zeros, so the sum is the leader's bytes. A fixed header of HEADER bytes
carries short plans in one collective; a longer plan (a prefill chunk) takes a second
collective of its exact padded length. No pickle ever crosses the wire.

A decode step needs no JSON: `burst_step` sums one (B+1,) int32 inside the lazy graph ([last,
token of each row]), so no rank waits in Python for it and the next step's graph can be built
while the current one computes. Every sum here is padded to at least one element per rank
(`min_elements`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

HEADER = 512
_LEN = 4  # little-endian uint32 payload length at the start of the header


def burst_width(rows: int) -> int:
    """Ints of a plain decode step's command: [last, the token of each row]."""
    return 1 + rows


def verify_width(rows: int, k: int) -> int:
    """Ints of a speculative verify step's command: [go, n, trim of each row, t0 of each
    row, k drafts of each row] (verify.py)."""
    return 2 + rows * (2 + k)


class Control:
    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        self.collectives = 0  # issued so far: the benchmark counts them per decode step
        # MLX ring sums fewer elements than ranks on a slower path of its own: a 1-element
        # token exchange made a tiny TP2 llama's step 7.5 ms instead of 2.8 (benchmarks.md).
        # Every sum here is padded to one element per rank.
        self.min_elements = self.size

    def send(self, data: bytes) -> None:
        """Leader: broadcast `data` (no-op on a single rank)."""
        if self.size > 1:
            self._exchange(data)

    def receive(self) -> bytes:
        """Follower: block until the leader's next message arrives."""
        return self._exchange(None)

    def burst_step(self, tokens: mx.array | None, rows: int, last: bool = False) -> mx.array:
        """One batch decode step's command, lazily: the leader passes its sampled tokens (B,)
        and whether this is the burst's last step; followers pass None. Returns (B+1,) int32:
        [1 if last else 0, the token of each row]."""
        if tokens is None:
            mine = mx.zeros((burst_width(rows),), mx.int32)
        else:
            flag = mx.array([int(last)], mx.int32)
            mine = mx.concatenate([flag, tokens.astype(mx.int32).reshape(rows)])
        if self.size == 1:
            return mine  # alone: the same graph minus the collective
        return self._lazy_sum(mine)

    def verify_step(self, values: list[int] | None, rows: int, k: int) -> list[int]:
        """One speculative verify step's command, eagerly (verify.py; followers pass None):
        [go, n, trim of each row, t0 of each row, k drafts of each row]."""
        return self.share_ints(values, verify_width(rows, k))

    def share_ints(self, values: list[int] | None, n: int) -> list[int]:
        """The leader's n ints on every rank, eagerly (one int32 all_sum; followers pass
        None): a speculative verify step's drafts and accept decision (speculate.py)."""
        mine = mx.array(values if values is not None else [0] * n, mx.int32)
        if self.size == 1:
            return mine.tolist()
        return self._lazy_sum(mine).tolist()

    def _lazy_sum(self, mine: mx.array) -> mx.array:
        """Every rank's `mine` summed inside the graph (padded to min_elements, then cut)."""
        self.collectives += 1
        n = mine.size
        if n >= self.min_elements:
            return mx.distributed.all_sum(mine, group=self.group)
        padded = mx.concatenate([mine, mx.zeros((self.min_elements - n,), mine.dtype)])
        return mx.distributed.all_sum(padded, group=self.group)[:n]

    def _exchange(self, payload: bytes | None) -> bytes:
        header = np.zeros(HEADER, dtype=np.uint8)
        if payload is not None:
            header[:_LEN] = np.frombuffer(len(payload).to_bytes(_LEN, "little"), np.uint8)
            head = payload[: HEADER - _LEN]
            header[_LEN : _LEN + len(head)] = np.frombuffer(head, np.uint8)
        summed = self._sum(header)
        length = int.from_bytes(summed[:_LEN].tobytes(), "little")
        body = summed[_LEN : _LEN + min(length, HEADER - _LEN)].tobytes()
        rest = length - len(body)
        if rest > 0:
            tail = np.zeros(rest, dtype=np.uint8)
            if payload is not None:
                tail[:] = np.frombuffer(payload[len(body) :], np.uint8)
            body += self._sum(tail).tobytes()
        return body

    def _sum(self, data: np.ndarray) -> np.ndarray:
        self.collectives += 1
        padded = np.pad(data, (0, max(0, self.min_elements - data.size)))
        out = mx.distributed.all_sum(mx.array(padded), group=self.group, stream=mx.cpu)
        return np.array(out)[: data.size]


class HybridControl:
    """Control across the MLX worlds of hybrid TP×PP (parallel/hybrid.py).

    Stage 0's world shares the leader's plans and burst tokens through its Control as always;
    every rank then forwards them, in the order the leader emitted them, to its successors in
    the next stage over the hand-off link, where they arrive before that stage's hidden
    states. So every rank of every world runs the same plans, and issues the same collectives
    in the same order within its world. Burst exchanges are evaluated at once (eager steps).
    """

    def __init__(self, world: Control, link):
        self.world, self.link, self.topo = world, link, link.topo
        self.group = world.group
        self.rank, self.size = self.topo.me, sum(self.topo.groups)  # rank 0 leads
        # What Waker parks: stage 0's world, which would wait in a busy-polling collective;
        # later stages wait in a socket read already, so they park alone (a no-op).
        self.parks = world if self.topo.stage == 0 else _Alone()

    @property
    def collectives(self) -> int:
        return self.world.collectives

    def send(self, data: bytes) -> None:
        self.world.send(data)
        self._forward(np.frombuffer(data, np.uint8))

    def receive(self) -> bytes:
        if self.topo.stage == 0:
            data = self.world.receive()
        else:
            data = bytes(np.array(self.link.recv(timeout=None)))  # idle: as long as it takes
        self._forward(np.frombuffer(data, np.uint8))
        return data

    def burst_step(self, tokens: mx.array | None, rows: int, last: bool = False) -> mx.array:
        if self.topo.stage == 0:
            out = self.world.burst_step(tokens, rows, last)
            mx.eval(out)
        else:
            out = self.link.recv()
        self._forward(out)
        return out

    def verify_step(self, values: list[int] | None, rows: int, k: int) -> list[int]:
        return self.share_ints(values, verify_width(rows, k))

    def share_ints(self, values: list[int] | None, n: int) -> list[int]:
        from thunderpool.errors import ThunderpoolError

        raise ThunderpoolError(
            "speculative decoding does not run on hybrid TP×PP yet; drop --draft-model"
        )

    def _forward(self, x) -> None:
        if not self.topo.last:
            self.link.send(x)


class _Alone:
    size, rank = 1, 0


def control_for(runner) -> Control | HybridControl:
    """The control of this rank's runner: plain, or across worlds for a hybrid stage."""
    control = Control(runner.group)
    link = getattr(runner.stage, "link", None)
    return control if link is None else HybridControl(control, link)
