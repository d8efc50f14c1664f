"""Macs as users wire them (issue 37), on recorded captures (tests/mac/mac_tools.py shapes): a
home LAN where cable numbering starts, Wi-Fi beside Ethernet, cable ports listed before en0,
connected and idle Thunderbolt 5 ports, a Thunderbolt 4 cable, a dead RDMA port; which node
answers at an address; one Metal reserve; ranks started without a fork."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

import pytest
from doctor_scenes import FULL_LIMIT, MEMORY, doctor, macs
from macs import SCENES, Scene, mesh, write
from test_conformance import our_nodes, state_of

from thunderpool.cluster.control.jaccl import jaccl_config
from thunderpool.cluster.control.messages import Route
from thunderpool.cluster.control.probe import ProbeServer, identify
from thunderpool.cluster.control.spawn import spawn
from thunderpool.cluster.node import metal
from thunderpool.cluster.node.doctor import check_thunderbolt
from thunderpool.cluster.node.doctor_rdma import cluster_nodes, planned_ends
from thunderpool.cluster.node.facts import (
    parse_ibv_devinfo,
    parse_netstat_routes,
    parse_thunderbolt_text,
)
from thunderpool.cluster.node.thunderbolt import own_address
from thunderpool.launch.lifeline import Lifeline


def nth_30(space: str, k: int) -> ipaddress.IPv4Network:
    return list(ipaddress.ip_network(space).subnets(new_prefix=30))[k]


# ---- the captures, read ----------------------------------------------------------------------


def test_connected_and_idle_ports_read_as_real_macs_print_them(tmp_path):
    scene = Scene(2, mesh(2), tb4=frozenset())
    d = write(scene, tmp_path)[0]
    text = (d / "system_profiler_thunderbolt.txt").read_text()
    assert "          Speed: 80 Gb/s\n" in text and "          Speed: Up to 120 Gb/s\n" in text
    # Bus 5..0 (ports 6..1): only port 1 is cabled; its speed is the live link's.
    assert parse_thunderbolt_text(text) == [(False, 120, False)] * 5 + [(True, 80, True)]
    check = check_thunderbolt(0, text)
    assert (check.status, check.detail) == ("PASS", "1 Thunderbolt 5 link(s): 80 Gb/s")


def test_ibv_devinfo_and_netstat_parse_to_what_they_print(tmp_path):
    d = write(SCENES["mesh2"], tmp_path)[0]
    states = parse_ibv_devinfo((d / "ibv_devinfo.txt").read_text())
    assert states == {
        "rdma_en2": ("PORT_ACTIVE", 1024),
        **{f"rdma_en{p}": ("PORT_DOWN", 1024) for p in range(3, 8)},
    }
    routes = parse_netstat_routes((d / "netstat_rn.txt").read_text())
    assert [(r.destination, r.interface, r.gateway) for r in routes] == [
        ("0.0.0.0/0", "en0", "192.168.1.1"),
        ("127.0.0.0/8", "lo0", "127.0.0.1"),
        ("127.0.0.1/32", "lo0", "127.0.0.1"),
        ("192.168.1.0/24", "en0", ""),
        ("192.168.1.1/32", "en0", ""),
        ("192.168.1.1/32", "en0", ""),
        ("192.168.1.20/32", "en0", ""),
        ("192.168.0.0/30", "en2", ""),
        ("192.168.0.1/32", "en2", ""),
        ("169.254.0.0/16", "en0", ""),
        ("224.0.0.0/4", "en0", ""),
        ("255.255.255.255/32", "en0", ""),
    ]


def test_a_tb4_cable_and_a_down_port_are_named_and_never_planned_for_jaccl(tmp_path):
    """Three Macs, every pair cabled; the 0-1 cable is Thunderbolt 4 (40 Gb/s), then instead
    the 1-2 cable's RDMA ports are down: both are named with the fix, and jaccl is planned
    over neither (a listed rdma_enX is no live link)."""
    scene = Scene(3, mesh(3), tb4=frozenset({0}), wired_limit_mb=FULL_LIMIT)
    dirs, nodes = macs(scene, tmp_path / "tb4")
    checks, *_ = doctor(dirs, nodes, 0)
    assert (checks["Thunderbolt 5"].status, checks["Thunderbolt 5"].detail) == (
        "WARN",
        "Thunderbolt 4 link(s): 80 Gb/s, 40 Gb/s",
    )
    links = checks["RDMA links"]
    assert (links.status, links.detail) == (
        "FAIL",
        "rdma_en2 is a Thunderbolt 4 link (40 Gb/s)",
    )
    assert "Thunderbolt 5 cable straight between two TB5 ports" in links.fix
    tb4_nodes = our_nodes(dirs)
    assert jaccl_config(state_of(tb4_nodes), [n.node_id for n in tb4_nodes], 1) is None

    down = Scene(3, mesh(3), down=frozenset({2}), wired_limit_mb=FULL_LIMIT)
    dirs, nodes = macs(down, tmp_path / "down")
    links = doctor(dirs, nodes, 1)[0]["RDMA links"]
    assert (links.status, links.detail) == ("FAIL", "rdma_en3 is PORT_DOWN")
    down_nodes = our_nodes(dirs)
    assert down_nodes[1].rdma_active == ("rdma_en2",)
    assert jaccl_config(state_of(down_nodes), [n.node_id for n in down_nodes], 1) is None
    # The same Macs with live links: jaccl, every port of theirs active.
    live = our_nodes(write(Scene(3, mesh(3)), tmp_path / "live"))
    assert jaccl_config(state_of(live), [n.node_id for n in live], 1) is not None


# ---- cable subnets clear of every network ------------------------------------------------------


@pytest.mark.parametrize(
    ("lan", "wifi", "first"),
    [
        ("192.168.0.{}", None, "192.168.1.0/24"),  # a home router on 192.168.0.1
        ("192.168.1.{}", "192.168.0.{}", "192.168.2.0/24"),  # Wi-Fi on the numbering's start
    ],
)
def test_fix_numbers_cables_clear_of_every_lan_and_doctor_then_passes(lan, wifi, first, tmp_path):
    n = 3
    wifi_ips = [(wifi.format(50 + m), 24) for m in range(n)] if wifi else []
    before = Scene(n, mesh(n), [(lan.format(100 + m), 24) for m in range(n)], {}, wifi=wifi_ips)
    before.wired_limit_mb = FULL_LIMIT
    dirs, nodes = macs(before, tmp_path / "before")
    ran = {m: doctor(dirs, nodes, m, "--fix")[1] for m in range(n)}
    given = {
        (m, c[2]): c[4] for m, cmds in ran.items() for c in cmds if c[1] == "ifconfig" and c[3]
    }
    # The reference: MLX's numbering (the k-th cable on the k-th /30) moved past the LANs.
    view = cluster_nodes(nodes[0], nodes[1:])
    plan = {(int(view[i].name[-1]), e[0]): e[1] for i in range(n) for e in planned_ends(view, i)}
    assert given == plan
    nets = sorted({ipaddress.ip_network(f"{ip}/30", strict=False) for ip in plan.values()})
    assert nets == [nth_30(first, k) for k in range(3)]
    after = Scene(n, mesh(n), before.lan, {k: (ip, 30) for k, ip in given.items()}, wifi=wifi_ips)
    after.wired_limit_mb = FULL_LIMIT
    dirs, nodes = macs(after, tmp_path / "after")
    for m in range(n):
        checks, again, code, _ = doctor(dirs, nodes, m, "--fix")
        assert {k: c.status for k, c in checks.items() if k.startswith("cable")} == {
            "cable en2": "PASS",
            "cable en3": "PASS",
            "cable addresses": "PASS",
        }
        assert (again, code) == ([], 0)


def test_a_route_elsewhere_is_kept_clear_too(tmp_path):
    """A VPN's route to 192.168.0.0/22 on one Mac only: every Mac's plan skips it alike."""
    _, nodes = macs(Scene(2, mesh(2), addresses={}), tmp_path)
    vpn = Route(destination="192.168.0.0/22", interface="utun3", gateway="10.8.0.1")
    nodes[1] = nodes[1].model_copy(update={"routes": (*nodes[1].routes, vpn)})
    for me in range(2):
        view = cluster_nodes(nodes[me], [nodes[1 - me]])
        ends = [e for i in range(2) for e in planned_ends(view, i)]
        assert sorted(ip for _, ip, _ in ends) == ["192.168.4.1", "192.168.4.2"]


# ---- the agent's own address -------------------------------------------------------------------


def test_the_agent_advertises_its_default_routes_address_not_a_cables(tmp_path):
    scene = Scene(2, mesh(2), cables_first=True, wifi=[("10.0.7.50", 24), ("10.0.7.51", 24)])
    node = our_nodes(write(scene, tmp_path))[0]
    # ifconfig lists en2 (the cable) first: the first address would be the cable's.
    assert [x.name for x in node.interfaces][:2] == ["en2", "en0"]
    assert own_address(node) == "192.168.1.20"  # en0 carries the default route
    by_wifi = node.model_copy(
        update={"routes": (Route(destination="0.0.0.0/0", interface="en1"), *node.routes)}
    )
    assert own_address(by_wifi) == "10.0.7.50"
    no_route = node.model_copy(update={"routes": ()})
    assert own_address(no_route) == "192.168.1.20"  # the first Ethernet address


# ---- one Metal reserve -------------------------------------------------------------------------


def test_planner_doctor_and_fix_keep_one_reserve(tmp_path):
    """--fix raises the wired limit to RAM less the reserve; the planner's budget is then
    exactly the shard doctor says fits (sysctl counts whole MiB)."""
    dirs, nodes = macs(Scene(2, mesh(2), wired_limit_mb=0), tmp_path)
    checks, ran, *_ = doctor(dirs, nodes, 0, "--fix", working_set=lambda: MEMORY * 3 // 4)
    assert ran == [("sudo", "sysctl", f"iogpu.wired_limit_mb={FULL_LIMIT}")]
    assert FULL_LIMIT == (MEMORY - metal.OS_RESERVE_BYTES) // 2**20
    info = {"max_recommended_working_set_size": MEMORY * 3 // 4}
    budget = metal.budget(MEMORY, info, str(FULL_LIMIT))
    assert budget.bytes == FULL_LIMIT * 2**20
    shard = f"{budget.bytes / 1e9:.3f}"
    dirs, nodes = macs(Scene(2, mesh(2), wired_limit_mb=FULL_LIMIT), tmp_path / "set")
    wired = doctor(dirs, nodes, 0, "--shard-gb", shard)[0]["GPU wired limit"]
    assert wired.status == "PASS"


# ---- which node answers; ranks without a fork --------------------------------------------------


def test_the_probe_server_proves_which_node_it_is():
    server = ProbeServer("127.0.0.1", 0, ("node-a", "cluster-token")).start()
    port = server.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert identify(s, "cluster-token") == "node-a"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            with pytest.raises(ConnectionError, match="wrong token"):
                identify(s, "another-token")
    finally:
        server.shutdown()
        server.server_close()


def test_a_rank_started_by_posix_spawn_keeps_its_session_output_and_lifeline(tmp_path):
    """What RankManager gets on macOS: its own session, stdout and stderr, the exit code,
    and death when the lifeline closes (the rank's own watch, launch/lifeline.py)."""
    line = Lifeline()
    code = (
        "import os, sys, time; from thunderpool.launch.lifeline import hold, LIFELINE_ENV;"
        "print(os.getsid(0) == os.getpid(), flush=True); print('err', file=sys.stderr);"
        "hold(int(os.environ[LIFELINE_ENV])); time.sleep(60)"
    )
    proc = spawn([sys.executable, "-c", code], {**os.environ, **line.env()}, line.pass_fds)
    try:
        assert proc.stdout.readline() == "True\n"
        assert proc.stderr.readline() == "err\n"
        assert proc.poll() is None
        line.close()
        assert proc.wait(30) == -9  # SIGKILLed itself once the lifeline broke
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
    done = spawn([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    assert done.wait(30) == 3 and done.stdout.read() == ""


# ---- ring order --------------------------------------------------------------------------------


@pytest.mark.parametrize("lan_fastest", [False, True], ids=["cables-fastest", "lan-fastest"])
def test_the_planner_orders_a_cabled_ring_of_four_as_mlx_finds_it(lan_fastest, tmp_path):
    """ring4 (0-1-2-3-0, no diagonals), the nodes listed 0, 2, 1, 3: the planner's TP over all
    four puts the ranks along the ring, the ring MLX's own extract_rings finds, so jaccl runs
    in ring mode; in the listed order it could not. So too where every pair's fastest
    measured TCP path is the LAN: the ranks still run jaccl over the cables."""
    from mlx._distributed_utils.config import extract_rings

    from thunderpool.cluster.control.coordinator import node_specs
    from thunderpool.cluster.control.messages import LinkMeasured
    from thunderpool.cluster.control.state import apply
    from thunderpool.planner.placement import place
    from thunderpool.planner.simulate import load_model

    scene = SCENES["ring4"]
    nodes = our_nodes(write(scene, tmp_path))
    listed = [nodes[m] for m in (0, 2, 1, 3)]
    state = state_of(listed)
    cabled = {frozenset((a, b)) for a, _, b, _ in scene.wires}
    for i in range(4):
        for j in range(i + 1, 4):
            rdma = frozenset((i, j)) in cabled and not lan_fastest
            state = apply(
                state,
                LinkMeasured(
                    a=f"mac{i}", b=f"mac{j}", a_address="x", b_address="y",
                    rtt_s=20e-6 if rdma else 400e-6, bandwidth_Bps=8e9 if rdma else 1e9,
                    link="rdma" if rdma else "ethernet",
                ),
            )  # fmt: skip
    listed_ids = [n.node_id for n in listed]
    assert jaccl_config(state, listed_ids, 1) is None  # 0-2 is no cable
    plans = place(load_model("llama-3.3-70b:q4"), *node_specs(state))
    tp4 = next(p for p in plans if p.kind == "tp" and len(p.nodes) == 4)
    assert tp4.nodes[0] == "mac0"
    connectivity = [[int(frozenset((i, j)) in cabled) for j in range(4)] for i in range(4)]
    (mlx_ring, _), *_ = extract_rings(connectivity)
    ring = [int(x[3:]) for x in tp4.nodes]
    assert ring in (mlx_ring, [mlx_ring[0], *mlx_ring[:0:-1]])  # either way round
    cfg = jaccl_config(state, list(tp4.nodes), 1)
    assert cfg is not None and cfg.ring and cfg.env()["MLX_JACCL_RING"] == "1"
