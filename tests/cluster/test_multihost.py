"""Several hosts as network namespaces: agents join with the token, the coordinator measures
links, plans, and runs TP and PP across hosts with the same greedy tokens as one process.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import tiny_prompts
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, node_cmd, wait_until

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import Coordinator, node_specs
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.engine.job import RankJob, TraceTask
from thunderpool.planner.placement import place
from thunderpool.planner.spec import model_spec

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

TOKEN = "testbed-token-123"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nodes")
    with Testbed(4) as bed:
        first = bed.host(1).ip
        bed.popen(1, node_cmd(bed, 1, tmp, "--token", TOKEN), stderr=subprocess.DEVNULL)
        coord = Coordinator([f"{first}:{PORT}"], TOKEN)
        assert wait_until(lambda: _count(coord) == 1, timeout=60)
        for i in (2, 3):
            bed.popen(
                i,
                node_cmd(bed, i, tmp, "--token", TOKEN, "--join", f"{first}:{PORT}"),
                stderr=subprocess.DEVNULL,
            )
        assert wait_until(lambda: _count(coord) == 3, timeout=60)
        yield bed, coord, tmp


def _count(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


def by_ip(state) -> dict[str, str]:
    return {state.contacts[n].split(":")[0]: n for n in state.nodes}


def test_three_nodes_join_with_the_token(cluster):
    bed, coord, _ = cluster
    state = coord.discover()
    assert sorted(by_ip(state)) == [bed.host(i).ip for i in (1, 2, 3)]
    # Every agent knows every other one (full mesh of hellos).
    for i in (2, 3):
        other = Coordinator([f"{bed.host(i).ip}:{PORT}"], TOKEN).discover()
        assert sorted(other.nodes) == sorted(state.nodes)


def test_a_node_without_the_token_is_refused(cluster):
    bed, coord, tmp = cluster
    cmd = node_cmd(bed, 4, tmp, "--token", "not-the-token", "--join", f"{bed.host(1).ip}:{PORT}")
    proc = subprocess.run(bed.exec_cmd(4, cmd), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "wrong cluster token" in proc.stderr
    assert len(coord.discover().nodes) == 3
    with pytest.raises(Exception, match="wrong cluster token"):
        Coordinator([f"{bed.host(1).ip}:{PORT}"], "not-the-token").discover()


def test_planner_places_the_embedded_model(cluster):
    bed, coord, _ = cluster
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "thunderpool",
            "plan",
            "--join",
            f"{bed.host(1).ip}:{PORT}",
            "--token",
            TOKEN,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "winner:" in proc.stdout
    state = coord.probe(coord.discover())
    nodes, links = node_specs(state)
    plans = place(model_spec(_models_dir()), nodes, links)
    assert plans and all(set(p.nodes) <= set(state.nodes) for p in plans)
    assert {p.kind for p in plans} >= {"single", "tp", "pp"}
    assert all(free >= 0 for p in plans for free in p.memory_free.values())


@pytest.mark.parametrize("parallel,hosts", [("tp", (1, 2)), ("pp", (1, 2, 3))])
def test_generation_across_hosts_matches_one_process(
    cluster, tiny_models, tmp_path, parallel, hosts, one_rank_trace
):
    bed, coord, _ = cluster
    prompts = tiny_prompts(2)
    expected = one_rank_trace(tiny_models["llama"], prompts)
    state = coord.probe(coord.discover())
    ids = by_ip(state)
    order = [ids[bed.host(i).ip] for i in hosts]
    out = tmp_path / "cluster.npz"  # one filesystem: the leader in host 1 writes it here
    task = TraceTask(prompts=tuple(map(tuple, prompts)), max_tokens=32, out=str(out))
    job = RankJob(
        model_dir=str(tiny_models["llama"]), world_size=len(order), parallel=parallel, task=task
    )
    with ClusterInstance(coord, state, order, job, timeout=120) as inst:
        events = list(inst.events())
    loaded = [e for e in events if e.event["kind"] == "loaded"]
    assert len(loaded) == len(order)
    np.testing.assert_array_equal(np.load(out)["tokens"], expected["tokens"])
    np.testing.assert_allclose(np.load(out)["logits"], expected["logits"], atol=1e-4, rtol=1e-4)


def test_a_slow_link_shows_in_status_and_the_planner_keeps_tp_off_it(cluster):
    bed, coord, _ = cluster
    bed.add_delay(3, 10)  # host 3's RTT grows by 20 ms
    time.sleep(0.5)
    state = coord.probe(coord.discover())
    ids = by_ip(state)
    h1, h2, h3 = (ids[bed.host(i).ip] for i in (1, 2, 3))
    fast, slow = state.link(h1, h2).rtt_s, state.link(h1, h3).rtt_s
    assert slow > fast + 0.015 and state.link(h2, h3).rtt_s > fast + 0.015
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "thunderpool",
            "status",
            "--join",
            f"{bed.host(1).ip}:{PORT}",
            "--token",
            TOKEN,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {ln for ln in proc.stdout.splitlines() if bed.host(3).ip in ln and " ms" in ln}
    assert rows and all(float(r.split(" ms")[0].split()[-1]) > 15 for r in rows)
    # A model that needs TP to be fast: the best TP plans leave host 3 out.
    spec = model_spec(_models_dir())
    nodes, links = node_specs(state)
    plans = place(spec, nodes, links)
    tp = [p for p in plans if p.kind == "tp"]
    assert tp and h3 not in tp[0].nodes
    assert not (plans[0].kind == "tp" and h3 in plans[0].nodes)


def _models_dir():
    from thunderpool.models.source import resolve_model

    return resolve_model(None, progress=False)
