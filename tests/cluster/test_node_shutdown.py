"""Ctrl-C on `thunderpool node` stops the ranks it runs and frees its ports (loopback only)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import listening, workers_under

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import Coordinator
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.engine.job import RankJob, ServeTask

TOKEN = "shutdown-token-123"


def free_port() -> int:
    # The agent takes port and port + 1 (the link probe): find a pair that is free.
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free pair of ports")


@pytest.mark.slow
def test_ctrl_c_on_a_node_stops_its_ranks_and_frees_its_ports(tmp_path, tiny_chat):
    port = free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "thunderpool", "node", "--host", "127.0.0.1"]
        + ["--port", str(port), "--no-mdns", "--no-measure", "--token", TOKEN],
        env={**os.environ, "THUNDERPOOL_HOME": str(tmp_path / "home")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        coord = Coordinator([f"127.0.0.1:{port}"], TOKEN)
        deadline = time.monotonic() + 60
        while True:
            assert node.poll() is None, node.stderr.read()
            try:
                state = coord.discover()
                break
            except AgentError:
                assert time.monotonic() < deadline
                time.sleep(0.3)
        job = RankJob(model_dir=str(tiny_chat), task=ServeTask(model_name="tiny-chat"))
        inst = ClusterInstance(coord, state, list(state.nodes), job, timeout=120)
        inst.start()
        events = inst.events()
        link_port = next(e.event["link_port"] for e in events if e.event["kind"] == "ready")
        events.close()
        ranks = workers_under(node.pid)
        assert len(ranks) == 1 and {port, port + 1, link_port} <= listening()
        start = time.monotonic()
        node.send_signal(signal.SIGINT)
        node.wait(timeout=30)
        print(f"node stopped {time.monotonic() - start:.1f} s after Ctrl-C")
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)
        assert not {port, port + 1, link_port} & listening()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
