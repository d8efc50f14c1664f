"""`serve --cluster` runs a family the planner had no table for (OLMo 2: planner/spec.py's
SUPPORTED does not list it), priced from the model's own structure (planner/structure.py),
across two namespace hosts, and answers as one rank does."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from conftest import make_tiny_chat
from test_view_testbed import TOKEN, _known, free_port
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, cluster_serve, node_cmd, wait_until

from thunderpool.cluster.control.coordinator import Coordinator
from thunderpool.models.families import proven
from thunderpool.planner.spec import SUPPORTED

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]
FAMILY = "olmo2"
PROMPT = "A family the planner never listed"


def test_the_family_was_unknown_to_the_planner_and_is_verified():
    assert FAMILY not in SUPPORTED
    assert proven()[FAMILY]["pp"] == "ok"


@pytest.mark.timeout(900)
def test_cluster_serves_a_family_the_planner_did_not_know(tmp_path):
    model = make_tiny_chat(tmp_path / "olmo2", model_type=FAMILY)
    cmd = [sys.executable, "-m", "thunderpool", "generate", "--model", str(model),
           "--nodes", "1", "--raw", "--max-tokens", "8", "--prompt", PROMPT]
    one = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ)
    assert one.returncode == 0, one.stderr
    url = f"http://127.0.0.1:{free_port()}"
    with Testbed(2) as bed:
        first = f"{bed.host(1).ip}:{PORT}"
        bed.popen(1, node_cmd(bed, 1, tmp_path, "--token", TOKEN), stderr=subprocess.DEVNULL)
        coord = Coordinator([first], TOKEN)
        assert wait_until(lambda: _known(coord) == 1, timeout=60, interval=0.5)
        join = ("--token", TOKEN, "--join", first)
        bed.popen(2, node_cmd(bed, 2, tmp_path, *join), stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _known(coord) == 2, timeout=60, interval=0.5)
        args = ("--join", first, "--token", TOKEN, "--model", str(model), "--parallel", "pp")
        with cluster_serve(tmp_path, url, *args, "--nodes", "2", timeout=300):
            body = {"model": "olmo2", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["text"]
            ranks = httpx.get(f"{url}/v1/cluster", timeout=30).json()
    assert one.stdout.startswith(got) or got == one.stdout.strip(), (got, one.stdout)
    assert len({n["host"] for n in ranks["nodes"]}) == 2, ranks
