"""Macs cabled in a full mesh or a ring, as namespace hosts (tests/mac/mac_testbed.py): agents
that report recorded macOS facts join, the coordinator plans jaccl over the cables, and TP over
3 Macs and over a ring of 4 answers as one rank does. The ranks run `ring` over exactly the
addresses jaccl would use: each rank's end of the cable the device matrix names, and a
coordinator on rank 0's LAN address that every rank reaches (a cable's /30 reaches one peer
only: the test proves it). The 3 Macs' LAN sits where cable numbering starts (SPACE): their
cables are addressed by `doctor --fix`, clear of it, before the TP3 launch."""

from __future__ import annotations

import functools
import ipaddress
import subprocess
import sys

import numpy as np
import pytest
from conftest import tiny_prompts
from mac_testbed import MacTestbed
from macs import SCENES, Scene, platform_uuid
from testbed import AGENT_PORT as PORT  # tests/cluster, on the path once mac_testbed is in
from testbed import available, wait_until

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import Coordinator
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.cluster.control.jaccl import jaccl_config
from thunderpool.cluster.node import doctor_rdma
from thunderpool.cluster.node.doctor_rdma import cluster_nodes
from thunderpool.cluster.node.thunderbolt import cable_addresses, cables
from thunderpool.engine.job import RankJob, TraceTask

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.cluster,
    pytest.mark.timeout(300),
]

TOKEN = "mac-testbed-token"
# The 3 Macs' LAN, and the range cable /30s are numbered from (MLX's is 192.168.0.0/16 over a
# home LAN on 192.168.0.x): the LAN lies where the numbering starts, all inside the testbed.
LAN = "10.213.40"
SPACE = "10.213.40.0/23"
# Four Macs cabled in a ring 0-2-1-3-0: the hosts' order (Mac 0, 1, 2, 3) is no ring order.
RING = Scene(4, [(0, 1, 2, 1), (2, 2, 1, 1), (1, 2, 3, 1), (3, 2, 0, 2)])


def _count(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


@pytest.fixture(scope="module")
def macs(tmp_path_factory):
    """start(scene) -> a MacTestbed of the scene's Macs with every agent joined, and its
    coordinator. One testbed at a time (they share the prefix): a test that asks for the
    scene the testbed up has (cables addressed or not) gets it again, so the cables test's
    three Macs, addressed by `doctor --fix` by then, run the TP3 test after it; any other ask
    takes it down and starts another. Down at the end of the module."""
    held: list[tuple[MacTestbed, Coordinator]] = []

    def start(scene: Scene, addressed: bool = True) -> tuple[MacTestbed, Coordinator]:
        if held and (held[0][0].scene.wires, held[0][0].addressed) == (scene.wires, addressed):
            return held[0]
        while held:
            held.pop()[0].down()
        bed = MacTestbed(scene, tmp_path_factory.mktemp("macs"), addressed, LAN)
        held.append((bed.__enter__(), Coordinator([f"{bed.host(1).ip}:{PORT}"], TOKEN)))
        first, coord = bed.host(1).ip, held[0][1]
        bed.popen(1, bed.node_cmd(0, "--token", TOKEN), stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _count(coord) == 1, timeout=60)
        for mac in range(1, scene.n):
            cmd = bed.node_cmd(mac, "--token", TOKEN, "--join", f"{first}:{PORT}")
            bed.popen(mac + 1, cmd, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _count(coord) == scene.n, timeout=60)
        return bed, coord

    yield start
    while held:
        held.pop()[0].down()


def check_ranks(bed: MacTestbed, n: int, ring: bool = False) -> None:
    """What the ranks were given is what jaccl on these cables needs, in the planner's rank
    order: every pair of ranks cabled, or in ring mode each rank to the next (ring order)."""
    seen = sorted(bed.ranks_seen(), key=lambda e: e["rank"])
    assert [e["rank"] for e in seen] == list(range(n))
    mac = [e["mac"] for e in seen]
    assert sorted(mac) == list(range(n))
    # Every rank got the same matrix: rank i's device on its cable to rank j.
    devices = seen[0]["devices"]
    assert all(e["devices"] == devices for e in seen)
    for i in range(n):
        for j in range(n):
            if i == j or (ring and (j - i) % n not in (1, n - 1)):
                assert devices[i][j] is None
                continue
            mine = devices[i][j].removeprefix("rdma_")
            peer = devices[j][i].removeprefix("rdma_")
            a = bed.scene.addresses[(mac[i], mine)][0]
            b = bed.scene.addresses[(mac[j], peer)][0]
            assert int(ipaddress.ip_address(a)) ^ 3 == int(ipaddress.ip_address(b))  # one /30
    # The coordinator is rank 0's LAN address, which every rank reached before starting.
    assert {e["coordinator"].rsplit(":", 1)[0] for e in seen} == {bed.host(mac[0] + 1).ip}
    assert [e["ring_mode"] for e in seen] == [ring] * n


def test_doctor_fix_numbers_cables_clear_of_the_lan_and_the_agents_pick_them_up(macs, monkeypatch):
    """The LAN lies where cable numbering starts (MLX's numbering would put Macs 0 and 1's
    LAN addresses on cables). Agents started before the cables had addresses (jaccl
    impossible) pick up what `doctor --fix` on each Mac sets, clear of the LAN, peers too."""
    bed, coord = macs(SCENES["mesh3"], addressed=False)
    state = coord.discover()
    by_ip = {state.contacts[x].split(":")[0]: x for x in state.nodes}
    order = [by_ip[bed.host(i).ip] for i in (1, 2, 3)]
    assert jaccl_config(state, order, 32000) is None
    nodes = cluster_nodes(state.nodes[order[0]], [state.nodes[x] for x in order[1:]])
    lan = {bed.host(i).ip for i in (1, 2, 3)}
    mlx = cable_addresses(cables(nodes), (), SPACE)  # as --auto-setup numbers: nothing taken
    assert lan & set(mlx.values()) == {f"{LAN}.1", f"{LAN}.2"}
    monkeypatch.setattr(
        doctor_rdma, "cable_addresses", functools.partial(cable_addresses, space=SPACE)
    )
    ran = bed.fix_cables(nodes, {x: order.index(x) for x in order})
    set_here = {
        mac: sorted(cmd[2:5:2] for cmd in cmds if cmd[1] == "ifconfig") for mac, cmds in ran.items()
    }
    # Each Mac set its own two cable ends; together the first three /30s clear of the LAN.
    assert {m: [name for name, _ in ends] for m, ends in set_here.items()} == {
        0: ["en2", "en3"],
        1: ["en2", "en3"],
        2: ["en2", "en3"],
    }
    numbered = sorted(ip for ends in set_here.values() for _, ip in ends)
    assert numbered == sorted(f"10.213.41.{4 * k + h}" for k in range(3) for h in (1, 2))
    assert wait_until(lambda: jaccl_config(coord.discover(), order, 32000) is not None, 30, 0.5)
    # Every agent, not only each Mac's own, now holds every Mac's addressed cables.
    for i in (1, 2, 3):
        view = Coordinator([f"{bed.host(i).ip}:{PORT}"], TOKEN)
        assert wait_until(lambda v=view: jaccl_config(v.discover(), order, 1) is not None, 10, 0.5)


def test_tp_over_three_macs_answers_like_one_rank(macs, tmp_path, tiny_models, one_rank_trace):
    prompts = tiny_prompts(2)
    expected = one_rank_trace(tiny_models["llama"], prompts, 16)
    # The test above's Macs, cabled by `doctor --fix` (run alone: addressed from the start).
    bed, coord = macs(SCENES["mesh3"])
    state = coord.probe(coord.discover())
    # Identical Macs of one macOS build are three machines.
    assert sorted(x.host_id for x in state.nodes.values()) == sorted(
        platform_uuid(m) for m in range(3)
    )
    by_ip = {state.contacts[x].split(":")[0]: x for x in state.nodes}
    order = [by_ip[bed.host(i).ip] for i in (1, 2, 3)]
    # A cable's address is no coordinator: from Mac 2, Mac 0's cable to Mac 1 is unreachable.
    cable01 = bed.scene.addresses[(0, "en2")][0]
    dial = f"import socket; socket.create_connection(('{cable01}', {PORT}), 2)"
    assert subprocess.run(bed.exec_cmd(3, ["python3", "-c", dial]), capture_output=True).returncode

    out = tmp_path / "tp.npz"
    task = TraceTask(prompts=tuple(map(tuple, prompts)), max_tokens=16, out=str(out))
    job = RankJob(model_dir=str(tiny_models["llama"]), world_size=3, parallel="tp", task=task)
    with ClusterInstance(coord, state, order, job, timeout=180) as inst:
        list(inst.events())
        assert inst.backend == "jaccl"
    np.testing.assert_array_equal(np.load(out)["tokens"], expected["tokens"])
    np.testing.assert_allclose(np.load(out)["logits"], expected["logits"], atol=1e-4, rtol=1e-4)
    check_ranks(bed, 3)


def test_generate_cluster_on_a_ring_of_four_macs_runs_jaccl_ring_mode_like_one_process(
    macs, tiny_chat
):
    """The user's command on four Macs cabled in a ring: the planner's TP4 with the ranks in
    ring order (jaccl's ring mode), the same text as one process; a brief run (4 ranks)."""
    bed, _ = macs(RING)
    common = ["--model", str(tiny_chat), "--prompt", "Hello", "--max-tokens", "6"]
    cli = [sys.executable, "-m", "thunderpool", "generate"]
    alone = subprocess.run(
        [*cli, *common, "--nodes", "1"], capture_output=True, text=True, timeout=120
    )
    assert alone.returncode == 0, alone.stderr
    join = ["--cluster", "--join", f"{bed.host(1).ip}:{PORT}", "--token", TOKEN]
    pooled = subprocess.run(
        [*cli, *common, *join, "--parallel", "tp", "--nodes", "4"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert pooled.returncode == 0, pooled.stderr
    assert pooled.stdout == alone.stdout and alone.stdout.strip()
    check_ranks(bed, 4, ring=True)
