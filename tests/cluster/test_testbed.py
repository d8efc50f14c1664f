"""The namespace testbed itself: reachability, exact data, added delay, rate limits, teardown."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from testbed import Testbed, available, down

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.timeout(180),
]

ECHO, SINK = 7000, 7001

# Runs inside the namespaces: servers print "ready"; clients verify data and print one JSON line.
PEER = r"""
import hashlib, json, os, socket, statistics, sys, threading, time

def read_exact(c, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = c.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            raise EOFError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)

def serve(port, handle):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()

def echo(c):
    with c:
        while data := c.recv(1 << 16):
            c.sendall(data)

def sink(c):
    with c:
        n = int.from_bytes(read_exact(c, 8), "big")
        c.sendall(hashlib.sha256(read_exact(c, n)).digest())

def connect(host, port):
    c = socket.create_connection((host, int(port)), timeout=15)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c

mode, args = sys.argv[1], sys.argv[2:]
if mode == "echo":
    serve(int(args[0]), echo)
elif mode == "sink":
    serve(int(args[0]), sink)
elif mode == "rtt":  # HOST PORT N: N round trips of 64 bytes, each checked
    c, rtts = connect(args[0], args[1]), []
    for k in range(int(args[2])):
        msg = os.urandom(64)
        t = time.perf_counter()
        c.sendall(msg)
        assert read_exact(c, 64) == msg, "echo returned different bytes"
        rtts.append((time.perf_counter() - t) * 1000)
    print(json.dumps({"median_ms": statistics.median(rtts)}))
elif mode == "roundtrip":  # HOST PORT NBYTES: bulk data through an echo server, compared exactly
    c, data = connect(args[0], args[1]), os.urandom(int(args[2]))
    threading.Thread(target=c.sendall, args=(data,), daemon=True).start()
    print(json.dumps({"equal": read_exact(c, len(data)) == data}))
elif mode == "send":  # HOST PORT NBYTES: timed one-way transfer, checked by the sink's digest
    c, data = connect(args[0], args[1]), os.urandom(int(args[2]))
    t = time.perf_counter()
    c.sendall(len(data).to_bytes(8, "big") + data)
    ok = read_exact(c, 32) == hashlib.sha256(data).digest()
    dt = time.perf_counter() - t
    print(json.dumps({"equal": ok, "seconds": dt, "mb_per_s": len(data) / dt / 1e6}))
"""


@pytest.fixture(scope="module")
def peer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("peer") / "peer.py"
    path.write_text(PEER)
    return path


@pytest.fixture
def bed():
    with Testbed(3) as tb:
        yield tb


def start_server(tb: Testbed, i: int, peer: Path, mode: str, port: int) -> None:
    proc = tb.popen(i, [sys.executable, str(peer), mode, str(port)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready", f"{mode} server on host {i} did not start"


def client(tb: Testbed, i: int, peer: Path, *args: object) -> dict:
    out = tb.run(i, [sys.executable, str(peer), *map(str, args)], timeout=60).stdout
    return json.loads(out.strip().splitlines()[-1])


def root_echo_server(ip: str) -> int:
    """An echo server in the root namespace on the bridge address; returns its port."""
    srv = socket.create_server((ip, 0))

    def loop() -> None:
        while True:
            c, _ = srv.accept()
            with c:
                while data := c.recv(1 << 16):
                    c.sendall(data)

    threading.Thread(target=loop, daemon=True).start()
    return srv.getsockname()[1]


def test_hosts_reach_each_other_and_root_with_exact_data(bed: Testbed, peer: Path) -> None:
    for i in (1, 2, 3):
        start_server(bed, i, peer, "echo", ECHO)
    root_port = root_echo_server(bed.gateway)
    for i in (1, 2, 3):
        for j in (1, 2, 3):
            if i != j:
                got = client(bed, i, peer, "roundtrip", bed.host(j).ip, ECHO, 300_000)
                assert got["equal"], f"host {i} -> host {j}: data changed"
        got = client(bed, i, peer, "roundtrip", bed.gateway, root_port, 100_000)
        assert got["equal"], f"host {i} -> root: data changed"
        # And the root namespace reaches the host directly.
        with socket.create_connection((bed.host(i).ip, ECHO), timeout=10) as c:
            msg = os.urandom(4096)
            c.sendall(msg)
            buf = b""
            while len(buf) < len(msg):
                buf += c.recv(len(msg) - len(buf))
            assert buf == msg


def test_added_delay_raises_rtt_of_that_host_only(bed: Testbed, peer: Path) -> None:
    for i in (2, 3):
        start_server(bed, i, peer, "echo", ECHO)
    before = client(bed, 1, peer, "rtt", bed.host(3).ip, ECHO, 20)["median_ms"]
    bed.add_delay(3, 20)
    fast = client(bed, 1, peer, "rtt", bed.host(2).ip, ECHO, 20)["median_ms"]
    slow = client(bed, 1, peer, "rtt", bed.host(3).ip, ECHO, 20)["median_ms"]
    print(
        f"rtt 1->3 before {before:.2f} ms; after add_delay(3, 20): 1->2 {fast:.2f}, 1->3 {slow:.2f}"
    )
    assert fast < 5, f"host 1 <-> 2 should be unaffected, median RTT {fast:.1f} ms"
    assert slow >= fast + 15, f"delay did not show: 1->3 {slow:.1f} ms vs 1->2 {fast:.1f} ms"
    assert slow < 200, f"delay line far too slow: {slow:.1f} ms for 2 x 20 ms"
    # Bulk TCP (GSO frames, offloaded checksums) crosses the delay line intact.
    assert client(bed, 1, peer, "roundtrip", bed.host(3).ip, ECHO, 2_000_000)["equal"]


def test_rate_limit_caps_bandwidth(bed: Testbed, peer: Path) -> None:
    start_server(bed, 2, peer, "sink", SINK)
    start_server(bed, 3, peer, "sink", SINK)
    bed.rate_limit(2, "8mbit")  # 1 MB/s
    limited = client(bed, 1, peer, "send", bed.host(2).ip, SINK, 2_000_000)
    free = client(bed, 1, peer, "send", bed.host(3).ip, SINK, 2_000_000)
    print(f"2 MB: limited {limited['mb_per_s']:.2f} MB/s, unlimited {free['mb_per_s']:.1f} MB/s")
    assert limited["equal"] and free["equal"]
    assert limited["mb_per_s"] < 1.2, f"8mbit limit not applied: {limited['mb_per_s']:.2f} MB/s"
    assert free["mb_per_s"] > 2 * limited["mb_per_s"], "the limit leaked onto host 3"


def test_rate_limit_survives_adding_delay(bed: Testbed, peer: Path) -> None:
    start_server(bed, 2, peer, "sink", SINK)
    bed.rate_limit(2, "8mbit")
    bed.add_delay(2, 1)
    got = client(bed, 1, peer, "send", bed.host(2).ip, SINK, 1_500_000)
    assert got["equal"] and got["mb_per_s"] < 1.2, got


def leftovers(prefix: str = "tp-") -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    names = [ln.split()[0].split("@")[0] for ln in (netns + links).splitlines() if ln.strip()]
    return [n for n in names if n.startswith(prefix)]


def test_teardown_leaves_nothing_and_cleans_a_crashed_run(peer: Path) -> None:
    # A stray namespace from an "earlier crashed run" is swept away when a testbed comes up.
    subprocess.run(["ip", "netns", "add", "tp-h42"], check=True)
    with Testbed(3) as tb:
        assert "tp-h42" not in leftovers()
        tb.add_delay(1, 5)
        tb.rate_limit(2, "10mbit")
        server = tb.popen(3, [sys.executable, str(peer), "echo", str(ECHO)], stdout=subprocess.PIPE)
        assert server.stdout.readline().strip() == b"ready"
        delay_proc = tb._delays[1]
    assert leftovers() == []
    assert server.poll() is not None and delay_proc.poll() is not None
    tb.down()  # idempotent
    down()
    assert leftovers() == []
