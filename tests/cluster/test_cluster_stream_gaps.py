"""Tokens reach the client as they are made on `serve --cluster` too (issue 28 item 6): a
200-token greedy stream of the embedded model over two testbed hosts (the planner picks TP2),
with the gap rule of tests/stream_gaps.py. The ranks are pinned one per core, so whatever else
takes a core mid-step delays the step: serve's polls of the agents once built an httpx client
per call (~20 ms of CPU each, loading the CA bundle), and serve's full garbage collections held
the GIL for up to 0.17 s while the gateway's reader waited: gaps of up to 0.26 s.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest
from serving import free_port
from stream_gaps import assert_on_time, chunk_times
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, cluster_serve, node_cmd, wait_until

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import Coordinator

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

TOKEN = "stream-gaps-token"


def _known(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cluster_serve_streams_each_token_as_it_is_made(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with Testbed(2) as bed:  # its teardown kills every process in the namespaces
        first = f"{bed.host(1).ip}:{PORT}"
        join = ("--token", TOKEN, "--join", first)
        bed.popen(1, node_cmd(bed, 1, tmp_path, "--token", TOKEN), stderr=subprocess.DEVNULL)
        bed.popen(2, node_cmd(bed, 2, tmp_path, *join), stderr=subprocess.DEVNULL)
        coord = Coordinator([first], TOKEN)
        assert wait_until(lambda: _known(coord) == 2, timeout=60, interval=0.5)
        with cluster_serve(tmp_path, url, *join, "--nodes", "2", timeout=180):
            hosts = httpx.get(f"{url}/v1/cluster", timeout=10).json()["instance"]["hosts"]
            assert sorted(hosts) == [bed.host(1).ip, bed.host(2).ip]
            assert_on_time(chunk_times(url))
