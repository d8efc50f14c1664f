"""The leader's per-step command, broadcast to followers as JSON bytes over an all_sum.

Followers contribute zeros, so the sum is the leader's bytes. A fixed header of HEADER bytes
carries short commands (every decode step) in one collective; a longer command (a prefill
chunk) takes a second collective of its exact padded length. No pickle ever crosses the wire.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

HEADER = 512
_LEN = 4  # little-endian uint32 payload length at the start of the header


class Control:
    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.size, self.rank = group.size(), group.rank()

    def send(self, command: dict) -> None:
        """Leader: broadcast `command` (no-op on a single rank)."""
        if self.size > 1:
            self._exchange(json.dumps(command, separators=(",", ":")).encode())

    def receive(self) -> dict:
        """Follower: block until the leader's next command arrives."""
        return json.loads(self._exchange(None))

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
        out = mx.distributed.all_sum(mx.array(data), group=self.group, stream=mx.cpu)
        return np.array(out)
