"""The hybrid hand-off transport: frames round-trip exactly, a dead or silent peer raises, and
the stage topology pairs every rank with exactly one predecessor."""

from __future__ import annotations

import socket
import threading

import mlx.core as mx
import numpy as np
import pytest

from thunderpool.launch.local import free_ports
from thunderpool.parallel.handoff import (
    HandoffError,
    Link,
    Topology,
    check_groups,
    recv_array,
    send_array,
)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint8])
def test_frames_round_trip_bit_exact(dtype):
    a, b = socket.socketpair()
    x = (mx.random.normal((2, 3, 5)) * 100).astype(dtype)
    send_array(a, x)
    send_array(a, np.frombuffer(b"plan bytes", np.uint8))
    send_array(a, mx.zeros((0, 4)))  # an empty array is a frame too
    got = recv_array(b, 5.0, "peer")
    assert got.dtype == dtype and got.shape == x.shape
    assert mx.array_equal(got, x).item()
    assert bytes(np.array(recv_array(b, 5.0, "peer"))) == b"plan bytes"
    assert recv_array(b, 5.0, "peer").shape == (0, 4)


def test_a_closed_peer_a_silent_one_and_garbage_raise():
    a, b = socket.socketpair()
    a.sendall(b"\x00" * 3)
    a.close()
    with pytest.raises(HandoffError, match="closed its hand-off connection"):
        recv_array(b, 5.0, "stage 1 rank 0")
    a, b = socket.socketpair()
    with pytest.raises(HandoffError, match="no data from stage 0 rank 1 for 0 s"):
        recv_array(b, 0.2, "stage 0 rank 1")
    a, b = socket.socketpair()
    a.sendall(b"GET / HTTP/1.1\r\n" * 8)
    with pytest.raises(HandoffError, match="not a hand-off frame"):
        recv_array(b, 5.0, "x")


@pytest.mark.parametrize("groups", [(2, 2), (2, 1), (1, 3), (3, 2, 1)])
def test_every_rank_has_one_predecessor_and_feeds_the_next_stage(groups):
    ranks = [(s, r) for s, n in enumerate(groups) for r in range(n)]
    topos = {g: Topology(groups, s, r) for g, (s, r) in enumerate(ranks)}
    fed = {g: [] for g in topos}
    for g, t in topos.items():
        for succ in t.successors():
            fed[succ].append(g)
    assert all(fed[g] == [t.predecessor()] for g, t in topos.items())
    # TP2×PP2: pairwise, and the last stage's ranks return to stage 0's.
    if groups == (2, 2):
        assert [t.successors() for t in topos.values()] == [[2], [3], [0], [1]]


def test_links_connect_in_any_start_order_and_carry_frames():
    groups = (2, 1)
    addresses = tuple(f"127.0.0.1:{p}" for p in free_ports(3))
    links: dict[int, Link] = {}
    topos = [Topology(groups, 0, 0), Topology(groups, 0, 1), Topology(groups, 1, 0)]

    def open_link(t: Topology) -> None:
        links[t.me] = Link(t, addresses, connect_s=20.0)

    threads = [threading.Thread(target=open_link, args=(t,)) for t in reversed(topos)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(links) == [0, 1, 2]
    x = mx.arange(6, dtype=mx.float32).reshape(1, 2, 3)
    links[0].send(x)  # stage 0 rank 0 -> stage 1 rank 0
    assert mx.array_equal(links[2].recv(), x).item()
    links[2].send(x * 2)  # the last stage returns to both ranks of stage 0
    assert mx.array_equal(links[0].recv(), x * 2).item()
    assert mx.array_equal(links[1].recv(), x * 2).item()
    assert links[1].out == []  # stage 1 has one rank, fed by stage 0's rank 0 only
    for link in links.values():
        link.close()


def test_groups_are_checked():
    check_groups((2, 1), 3)
    with pytest.raises(Exception, match="at least two TP groups"):
        check_groups((4,))
    with pytest.raises(Exception, match="adds up to 3 ranks, not --nodes 4"):
        check_groups((2, 1), 4)
