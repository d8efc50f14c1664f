"""How a plan becomes MLX configuration: ring hostfiles over the measured links, and jaccl's
RDMA device matrix where every pair of Macs has an RDMA link."""

from __future__ import annotations

import json

from thunderpool.cluster.control.coordinator import ring_hostfile, ring_port_base
from thunderpool.cluster.control.jaccl import jaccl_config
from thunderpool.cluster.control.messages import Hello, Interface, LinkMeasured, NodeInfo
from thunderpool.cluster.control.state import ClusterState, apply
from thunderpool.launch.local import free_ports


def mac(node_id: str, links: dict[str, tuple[str, str]], rdma: bool = True) -> NodeInfo:
    """links: peer -> (my address towards it, my interface)."""
    ifaces = tuple(
        Interface(
            name=ifname,
            address=addr,
            kind="rdma" if rdma else "thunderbolt",
            rdma_device=f"rdma_{ifname}" if rdma else None,
            prefix=30,
        )
        for addr, ifname in links.values()
    )
    return NodeInfo(
        node_id=node_id,
        name=node_id,
        port=7070,
        version="0.1.0",
        mlx_version="0.32",
        python_version="3.12",
        os="macOS 26.2",
        chip="Apple M3 Ultra",
        cpu_count=32,
        memory_total_bytes=512 << 30,
        memory_available_bytes=480 << 30,
        backends=("ring", "jaccl") if rdma else ("ring",),
        rdma=rdma,
        interfaces=ifaces,
        rdma_devices=tuple(f"rdma_{ifname}" for _, ifname in links.values()) if rdma else (),
    )


# Three Macs wired pairwise by Thunderbolt: each pair on its own /30 network.
WIRING = {
    ("a", "b"): (("169.254.1.1", "en2"), ("169.254.1.2", "en2")),
    ("a", "c"): (("169.254.2.1", "en3"), ("169.254.2.2", "en2")),
    ("b", "c"): (("169.254.3.1", "en3"), ("169.254.3.2", "en3")),
}


def cluster(rdma: bool = True) -> ClusterState:
    mine: dict[str, dict] = {"a": {}, "b": {}, "c": {}}
    for (x, y), (ax, ay) in WIRING.items():
        mine[x][y], mine[y][x] = ax, ay
    state = ClusterState()
    for n in "abc":
        state = apply(state, Hello(node=mac(n, mine[n], rdma), contact=f"10.0.0.{ord(n)}:7070"))
    for (x, y), (ax, ay) in WIRING.items():
        state = apply(
            state,
            LinkMeasured(
                a=x,
                b=y,
                a_address=ax[0],
                b_address=ay[0],
                rtt_s=10e-6,
                bandwidth_Bps=8e9,
                link="rdma" if rdma else "thunderbolt",
            ),
        )
    return state


def test_ring_hostfile_uses_each_ranks_address_on_the_link_from_its_predecessor():
    hosts = json.loads(ring_hostfile(cluster(), ["a", "b", "c"], 29500))
    # rank 0 (a) is reached from c over a-c, rank 1 (b) from a over a-b, rank 2 (c) from b.
    assert hosts == [["169.254.2.1:29500"], ["169.254.1.2:29501"], ["169.254.3.2:29502"]]


def test_jaccl_device_matrix_and_coordinator():
    # These agents did not report their Thunderbolt ports: each pair's device is the RDMA
    # interface whose /30 holds the peer's address.
    cfg = jaccl_config(cluster(), ["a", "b", "c"], 29600)
    assert json.loads(cfg.files()["MLX_IBV_DEVICES"]) == [
        [None, "rdma_en2", "rdma_en3"],
        ["rdma_en2", None, "rdma_en3"],
        ["rdma_en2", "rdma_en3", None],
    ]
    # Rank 0's agent address (its LAN), which every rank reaches; not its cable to rank 1.
    assert cfg.coordinator == "10.0.0.97:29600"
    assert cfg.env() == {"MLX_JACCL_COORDINATOR": "10.0.0.97:29600"}


def test_no_jaccl_without_rdma_on_every_pair():
    assert jaccl_config(cluster(rdma=False), ["a", "b", "c"], 29600) is None
    assert jaccl_config(cluster(), ["a"], 29600) is None


def test_ranks_sharing_a_machine_get_their_own_cores():
    from thunderpool.cluster.control.coordinator import core_assignment

    state = cluster()
    boxes = {"a": "box1", "b": "box1", "c": "box2"}
    nodes = {
        k: v.model_copy(update={"host_id": boxes[k], "cpu_count": 2})
        for k, v in state.nodes.items()
    }
    state = state.model_copy(update={"nodes": nodes})
    # a and b share box1: one core each; c is alone on box2, so it is left to the OS.
    assert core_assignment(state, ["a", "b", "c"]) == {0: 0, 1: 1}
    # Three ranks on a two-core box cannot each have a core: none is pinned.
    crowded = state.model_copy(
        update={"nodes": {k: v.model_copy(update={"host_id": "box1"}) for k, v in nodes.items()}}
    )
    assert core_assignment(crowded, ["a", "b", "c"]) == {}


def test_ring_ports_stay_below_the_ephemeral_range_and_differ_from_recent_launches():
    # An outgoing connection takes ports from 32768 up (Linux) and a previous instance's ports
    # may sit in TIME_WAIT: either would make a rank's bind fail with EADDRINUSE.
    bases = [ring_port_base(4) for _ in range(32)]
    assert len(set(bases)) == 32
    assert all(29500 <= b and b + 4 <= 32768 for b in bases)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p < 32768 for p in ports)
