"""A userspace L2 delay line: a bump in the wire between two interfaces, because netem is absent.

Design: `Testbed.add_delay(i, ms)` cuts host i's veth out of the bridge and puts a delay namespace
(`tp-di`) in the path:

    tp-hi [tp-hi-v] <-veth-> [tp-hi-br] tp-di [tp-hi-dx] <-veth-> [tp-hi-dl] tp-br0 (bridge)

This process runs in `tp-di` with one AF_PACKET socket per side. Every frame read on one side is
written to the other side `ms` milliseconds later, in both directions, so the RTT to host i grows
by 2 * ms and nothing about IP addressing changes (ARP, TCP, ICMP all pass untouched).
PACKET_VNET_HDR carries GSO and checksum-offload state across, since `ethtool` is not at hand to
turn offloads off: a 64 KB TSO frame is forwarded as one frame and re-segmented by the kernel.

The delay is constant, so each direction is a FIFO (a deque ordered by due time); one select()
loop sleeps until the earliest due frame or the next arrival, so no frame blocks another.
The process exits when stdin reaches EOF (the parent died or closed the pipe) unless run with
`--detach`, and asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG).

Usage: python delayline.py --ms 20 IFACE_A IFACE_B   (prints "ready" once both sockets are bound)
"""

from __future__ import annotations

import argparse
import ctypes
import selectors
import signal
import socket
import sys
import time
from collections import deque

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
PACKET_OUTGOING = 4
PR_SET_PDEATHSIG = 1
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # not exported by the socket module
MAX_QUEUED = 20_000  # frames per direction; beyond this we drop like a full NIC queue would
DRAIN_BATCH = 256  # frames read per wakeup before due frames get a turn


def open_side(ifname: str) -> socket.socket:
    # Protocol 0 until bind, so no frame from another interface sneaks in before the bind.
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    try:
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    except OSError:
        pass  # older kernels: the pkttype check in relay() filters our own frames instead
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
    sock.bind((ifname, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def relay(a: socket.socket, b: socket.socket, delay: float, watch_stdin: bool) -> None:
    queues = {a: deque(), b: deque()}  # frames waiting to be *sent* on that socket
    other = {a: b, b: a}
    sel = selectors.PollSelector()  # poll, unlike epoll, also accepts a stdin of /dev/null
    sel.register(a, selectors.EVENT_READ)
    sel.register(b, selectors.EVENT_READ)
    if watch_stdin:
        sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        heads = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(heads) - time.monotonic()) if heads else None
        for key, _ in sel.select(timeout):
            if key.fileobj is sys.stdin:
                if not sys.stdin.buffer.read1(4096):
                    return  # parent is gone
                continue
            sock = key.fileobj
            out = queues[other[sock]]
            for _ in range(DRAIN_BATCH):
                try:
                    frame, addr = sock.recvfrom(1 << 17)
                except BlockingIOError:
                    break
                except OSError:
                    break  # e.g. ENETDOWN while a link flaps; the error is cleared by reading it
                if addr[2] != PACKET_OUTGOING and len(out) < MAX_QUEUED:
                    out.append((time.monotonic() + delay, frame))
        now = time.monotonic()
        for sock, q in queues.items():
            while q and q[0][0] <= now:
                try:
                    sock.send(q.popleft()[1])
                except OSError:
                    pass  # a frame the kernel refuses (e.g. ENOBUFS) is a lost frame, as on a wire


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", type=float, required=True, help="one-way delay, each direction")
    p.add_argument("--detach", action="store_true", help="do not exit on stdin EOF")
    p.add_argument("iface_a")
    p.add_argument("iface_b")
    args = p.parse_args(argv)
    if not args.detach:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    a, b = open_side(args.iface_a), open_side(args.iface_b)
    print("ready", flush=True)
    try:
        relay(a, b, args.ms / 1000.0, watch_stdin=not args.detach)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
