"""/v1/cluster on `serve --cluster` across namespace hosts tells the truth: each rank on its
host's address, each measured link once, with the kind and numbers `thunderpool status` shows.

Host 2's link is slowed (5 ms each way) and rate-limited, so its RTT and bandwidth are
distinctive: a view that invented loopback links or copied one rank's figures cannot match.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, cluster_serve, node_cmd, wait_until

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import Coordinator

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

TOKEN = "view-token-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _known(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_chat):
    home = tmp_path_factory.mktemp("view")
    url = f"http://127.0.0.1:{free_port()}"
    with Testbed(2) as bed:
        first = f"{bed.host(1).ip}:{PORT}"
        bed.popen(1, node_cmd(bed, 1, home, "--token", TOKEN), stderr=subprocess.DEVNULL)
        coord = Coordinator([first], TOKEN)
        assert wait_until(lambda: _known(coord) == 1, timeout=60, interval=0.5)
        bed.popen(
            2, node_cmd(bed, 2, home, "--token", TOKEN, "--join", first), stderr=subprocess.DEVNULL
        )
        assert wait_until(lambda: _known(coord) == 2, timeout=60, interval=0.5)
        bed.rate_limit(2, "200mbit")
        bed.add_delay(2, 5)
        args = ("--join", first, "--token", TOKEN, "--model", str(tiny_chat), "--parallel", "pp")
        with cluster_serve(home, url, *args, "--nodes", "2", timeout=300):
            yield bed, coord, url, first


def status_links(first: str) -> list[dict]:
    """The links table of `thunderpool status`, row by row."""
    done = subprocess.run(
        [sys.executable, "-m", "thunderpool", "status", "--join", first, "--token", TOKEN],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "240"},
    )
    assert done.returncode == 0, done.stderr
    rows = []
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 5 and cells[2].endswith(" ms"):
            rows.append(
                {
                    "addresses": set(cells[1].split(" - ")),
                    "rtt_ms": float(cells[2].removesuffix(" ms")),
                    "bandwidth_gbps": float(cells[3].removesuffix(" GB/s")),
                    "kind": cells[4],
                }
            )
    return rows


def test_cluster_view_matches_the_namespaces_and_status(served):
    bed, coord, url, first = served
    cluster = httpx.get(f"{url}/v1/cluster", timeout=10).json()
    nodes, links = cluster["nodes"], cluster["links"]
    ips = {bed.host(1).ip, bed.host(2).ip}
    assert [n["rank"] for n in nodes] == [0, 1]
    assert {n["host"] for n in nodes} == ips
    assert len({n["name"] for n in nodes}) == 2  # the namespaces share a hostname
    assert cluster["instance"]["hosts"] == [n["host"] for n in nodes]

    # Each rank's memory: the node's total as its agent reported it, the rank's own figures.
    state = coord.discover()
    for n in nodes:
        assert n["memory_total_bytes"] == state.nodes[n["node_id"]].memory_total_bytes
        assert n["param_bytes"] > 0 and n["rss_bytes"] > n["param_bytes"]
        assert n["peak_rss_bytes"] >= n["rss_bytes"]

    # The one link, once, measured: the same kind and numbers as `thunderpool status`.
    (link,) = links
    assert {link["a_address"], link["b_address"]} == ips
    assert {link["a"], link["b"]} == {n["name"] for n in nodes}
    (row,) = [r for r in status_links(first) if r["addresses"] == ips]
    assert link["kind"] == row["kind"] != "loopback"
    assert link["rtt_ms"] > 9 and row["rtt_ms"] > 9  # 2 x 5 ms added
    assert abs(link["rtt_ms"] - row["rtt_ms"]) < 5, (link, row)
    assert link["bandwidth_gbps"] < 0.05 and row["bandwidth_gbps"] < 0.05  # 200 Mbit/s = 0.025
    assert abs(link["bandwidth_gbps"] - row["bandwidth_gbps"]) <= 0.5 * max(
        link["bandwidth_gbps"], row["bandwidth_gbps"]
    ), (link, row)
