"""/v1/cluster on a real local `serve`: each rank's own memory, not the leader's for all.

Two PP ranks of the tiny chat model with a 3:1 layer split hold different weights. Each
rank's parameter bytes must equal what that rank reported loading (the same layout run as a
trace instance), its RSS must be its own process's, and the one loopback link listed once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import run_trace
from procs import workers_under

SPLIT = (3, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"MLX_RANK=")).split(b"=", 1)[1])


def status_kib(pid: int, field: str) -> int:
    line = next(
        ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(field)
    )
    return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def served(tiny_chat, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("view") / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "thunderpool", "serve", "--model", str(tiny_chat)]
        + ["--nodes", "2", "--parallel", "pp", "--layer-split", ",".join(map(str, SPLIT))]
        + ["--backend", "ring", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env={**os.environ, "COLUMNS": "200"},  # the startup lines unwrapped
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url, proc, log
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_each_rank_shows_its_own_memory(served, tiny_chat, tmp_path):
    url, proc, _ = served
    cluster = httpx.get(f"{url}/v1/cluster", timeout=10).json()
    nodes = cluster["nodes"]
    assert [n["rank"] for n in nodes] == [0, 1]
    assert [n["host"] for n in nodes] == ["127.0.0.1", "127.0.0.1"]
    assert cluster["links"] == [
        {"a": "rank0", "b": "rank1", "rtt_ms": None, "bandwidth_gbps": None, "kind": "loopback"}
    ]
    assert cluster["placement"]["parallel"] == "pp"
    assert [r["layers"] for r in cluster["placement"]["ranks"]] == [[0, 3], [3, 4]]

    # The same layout, loaded by a separate instance: each rank's "loaded" event.
    events = run_trace(tiny_chat, tmp_path / "t.npz", 2, "pp", max_tokens=1, layer_split=SPLIT)[
        "events"
    ]
    loaded = {e.rank: e.event["param_bytes"] for e in events if e.event["kind"] == "loaded"}
    assert [n["param_bytes"] for n in nodes] == [loaded[0], loaded[1]]
    assert loaded[0] != loaded[1]

    # RSS and peak are each rank's own: its process's, read from /proc. A rank reports its RSS
    # again when it moves, so wait for the reports to catch up with the last growth.
    pids = {rank_of(p): p for p in workers_under(proc.pid, deep=True)}
    assert sorted(pids) == [0, 1]

    def own(n: dict) -> bool:
        rss = status_kib(pids[n["rank"]], "VmRSS:")
        return n["rss_bytes"] is not None and abs(n["rss_bytes"] - rss) <= 0.1 * rss

    deadline = time.monotonic() + 60
    while not all(own(n) for n in nodes):
        assert time.monotonic() < deadline, nodes
        time.sleep(1)
        nodes = httpx.get(f"{url}/v1/cluster", timeout=10).json()["nodes"]
    for n in nodes:
        assert n["memory_used_bytes"] == n["rss_bytes"]
        assert n["rss_bytes"] <= n["peak_rss_bytes"] <= status_kib(pids[n["rank"]], "VmHWM:")


def test_each_rank_says_which_blas_and_backend_it_runs(served):
    """What a rank preloads is what fast_blas_env picked in this process; both ranks say so in
    /v1/cluster and in serve's startup lines, and an API request gets one access-log line."""
    from thunderpool.engine.blas import REFERENCE, kind_of
    from thunderpool.launch.blas import fast_blas_env

    url, _, log = served
    preload = fast_blas_env().get("LD_PRELOAD", "").split()[:1]
    blas = kind_of(preload[0]) if preload else REFERENCE
    nodes = httpx.get(f"{url}/v1/cluster", timeout=10).json()["nodes"]
    assert [(n["blas"], n["backend"]) for n in nodes] == [(blas, "ring")] * 2
    if preload:
        assert [n["blas_path"] for n in nodes] == [os.path.realpath(preload[0])] * 2
    text = log.read_text()
    for rank in (0, 1):
        assert f"rank {rank}: BLAS {blas}" in text and "ring backend" in text
    body = {"model": "tiny-chat", "prompt": "a private prompt", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while "POST /v1/completions 200" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    assert "completion_tokens=2" in log.read_text()
    assert "a private prompt" not in log.read_text()
