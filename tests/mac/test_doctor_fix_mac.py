"""`thunderpool doctor --fix` on every Mac of recorded meshes: MLX's per-cable /30s where
they are clear of every network, both ends of a cable on one /30, the same whichever Mac
computes them, and the commands MLX's own --auto-setup would run."""

from __future__ import annotations

import ipaddress
import re

import pytest
from cluster.recorded.replay import Replay
from doctor_scenes import (
    FULL_LIMIT,
    Recorder,
    args_of,
    doctor,
    macs,
    mlx_addresses,
    node_id,
    rdma_statuses,
)
from macs import SCENES, Scene, mesh

from thunderpool.cli.doctor import run_doctor
from thunderpool.cluster.node.checks import Check
from thunderpool.cluster.node.doctor_fix import apply_fixes
from thunderpool.cluster.node.doctor_rdma import (
    cluster_nodes,
    planned_ends,
)
from thunderpool.cluster.node.thunderbolt import cable_addresses, cables

# ---- --fix on every Mac ------------------------------------------------------------------------


def ran_addresses(ran: dict[int, list[tuple[str, ...]]]) -> dict[tuple[int, str], str]:
    return {
        (mac, c[2]): c[4]
        for mac, cmds in ran.items()
        for c in cmds
        if c[:2] == ("sudo", "ifconfig") and c[3] == "inet"
    }


@pytest.mark.parametrize("n", [3, 4])
def test_fix_on_every_mac_agrees_with_itself_and_with_mlx(n, tmp_path, monkeypatch):
    from test_conformance import mlx_hostfile

    scene = Scene(n, mesh(n), addresses={}, bridge_on=True, wired_limit_mb=FULL_LIMIT)
    dirs, nodes = macs(scene, tmp_path / "before")
    ran = {}
    for mac in range(n):
        checks, ran[mac], code, said = doctor(dirs, nodes, mac, "--fix")
        assert code == 0
        assert checks["cable addresses"].status == "FAIL"
        assert ran[mac][0] == ("sudo", "ifconfig", "bridge0", "down")
        assert "run `thunderpool doctor --fix` on every other Mac too" in said[-1]
    addresses = ran_addresses(ran)

    # (a) MLX's scheme: MLX's own --auto-setup, given the Macs in node-id order, runs exactly
    # these commands on each Mac, in this order (the bridge first).
    order = sorted(range(n), key=node_id)
    _, setup = mlx_hostfile([dirs[m] for m in order], monkeypatch, tmp_path)
    assert len(setup) == n
    for line in setup:
        host, _, script = line.partition(": ")
        mac = order[int(host[3:])]
        assert ran[mac] == [tuple(c.split()) for c in script.split(" ; ")]
    # (b) both ends of every cable on one /30, each Mac routing its peer by that cable.
    for a, p, b, q in scene.wires:
        ip_a, ip_b = addresses[a, f"en{p + 1}"], addresses[b, f"en{q + 1}"]
        net = ipaddress.ip_network(f"{ip_a}/30", strict=False)
        assert ipaddress.ip_address(ip_b) in net and ip_a != ip_b
        assert ("sudo", "route", "change", ip_b, "-interface", f"en{p + 1}") in ran[a]
        assert ("sudo", "route", "change", ip_a, "-interface", f"en{q + 1}") in ran[b]
    assert len(set(addresses.values())) == 2 * len(scene.wires)
    # (c) the same plan whichever Mac computes it, from its fresh report and its peers' stale
    # ones (a Mac that already ran --fix reports other addresses than its agent does).
    set_up = Scene(n, mesh(n), addresses={k: (ip, 30) for k, ip in addresses.items()})
    set_up.wired_limit_mb = FULL_LIMIT
    done = macs(set_up, tmp_path / "after")[1]
    for mac in range(n):
        view = cluster_nodes(done[mac], [x for m, x in enumerate(nodes) if m != mac])
        plans = {(view[i].name, e[0]): e[1] for i in range(n) for e in planned_ends(view, i)}
        assert plans == {(f"studio-{m}", iface): ip for (m, iface), ip in addresses.items()}

    # Once every Mac is set up (and its agent has re-read it), doctor passes and --fix runs nothing.
    dirs = [tmp_path / "after" / f"mac{m}" for m in range(n)]
    nodes = done
    for mac in range(n):
        checks, again, code, _ = doctor(dirs, nodes, mac, "--fix")
        assert set(rdma_statuses(checks).values()) == {"PASS"}
        assert (again, code) == ([], 0)


def test_fix_off_macos_runs_nothing():
    said, fixer = [], Recorder()
    bridge = Check("Thunderbolt Bridge", "FAIL", "", "", (("sudo", "ifconfig", "bridge0", "down"),))
    assert apply_fixes([bridge], "Linux", fixer, said.append) == 2
    assert fixer.calls == []
    assert said == [
        "doctor --fix sets up a Mac's Thunderbolt cables, Thunderbolt Bridge and GPU wired "
        "limit; on Linux it runs nothing: follow each check's fix by hand"
    ]


def test_fix_on_linux_through_the_command_line(monkeypatch):
    said, fixer = [], Recorder()
    probes = {
        "bind": lambda port: None,
        "mlx": lambda: ("0.32.4", True, ""),
        "blas": lambda: {"LD_PRELOAD": "/x/libblis.so.4"},
    }
    checks, code = run_doctor(
        args_of("--fix"), "Linux", Replay("linux"), fixer, None, [], said.append, **probes
    )
    assert (code, fixer.calls) == (2, [])
    assert said[-1].startswith("doctor --fix sets up a Mac's")


def test_a_failed_fix_stops_the_rest():
    said = []
    cmds = (("sudo", "ifconfig", "bridge0", "down"), ("sudo", "sysctl", "iogpu.wired_limit_mb=1"))
    checks = [Check("a", "FAIL", "", "", cmds)]
    assert (
        apply_fixes(
            checks, "Darwin", lambda argv: (1, "sudo: a password is required\n"), said.append
        )
        == 1
    )
    assert said == [
        "doctor --fix runs 2 command(s):",
        "  $ sudo ifconfig bridge0 down",
        "  failed with exit code 1: sudo: a password is required; the rest were not run",
    ]


def test_cable_plan_is_mlx_numbering_in_node_id_order(tmp_path):
    _, nodes = macs(SCENES["mesh4"], tmp_path)
    view = sorted(nodes, key=lambda x: x.node_id)
    assert [x.name for x in view] == ["studio-2", "studio-1", "studio-0", "studio-3"]
    found = cables(view)
    assert re.fullmatch(r"192\.168\.0\.1", cable_addresses(found)[0, found[0].a])


def test_a_mac_alone_checks_its_own_cable_ends(tmp_path):
    """Before the agents run, doctor checks each cable end by itself; it cannot plan addresses
    without the other Macs' reports, and says how to get them."""
    wires = mesh(3)
    addresses = mlx_addresses(Scene(3, wires))
    del addresses[0, "en3"]
    dirs, nodes = macs(Scene(3, wires, addresses=addresses), tmp_path)
    checks, ran, code, _ = doctor(dirs[:1], nodes[:1], 0, "--fix")
    assert checks["cable en2"].status == "PASS"
    assert checks["cable en2"].detail == "192.168.0.1/30 to a Mac that is not in the cluster"
    end = checks["cable en3"]
    assert (end.status, end.detail) == (
        "FAIL",
        "studio-0's en3 has no IPv4 address (cable to a Mac that is not in the cluster)",
    )
    assert end.fix.startswith("start `thunderpool node` on every Mac (joined over the LAN)")
    assert {k: checks[k].status for k in ("RDMA mesh", "cable addresses", "host ids")} == {
        "RDMA mesh": "SKIP",
        "cable addresses": "SKIP",
        "host ids": "SKIP",
    }
    assert (ran, code) == ([], 1)


def test_a_mac_already_set_up_waits_for_the_others(tmp_path):
    """Mac 0 ran --fix (its own report is fresh); its peers' agents still report no cable
    addresses: the cables fail, this Mac has nothing left to run, the others must run --fix."""
    n = 3
    plan = {}
    _, stale = macs(Scene(n, mesh(n), addresses={}), tmp_path / "stale")
    view = sorted(stale, key=lambda x: x.node_id)
    for i, node in enumerate(view):
        m = int(node.name[-1])
        plan |= {(m, iface): (ip, 30) for iface, ip, _ in planned_ends(view, i)}
    mine = {k: v for k, v in plan.items() if k[0] == 0}
    dirs, fresh = macs(Scene(n, mesh(n), addresses=mine, wired_limit_mb=FULL_LIMIT), tmp_path)
    checks, ran, code, _ = doctor(dirs, [fresh[0], *stale[1:]], 0, "--fix")
    cabling = checks["cable addresses"]
    assert cabling.status == "FAIL"
    assert cabling.fix.startswith(
        "this Mac's ends are set; run `thunderpool doctor --fix` on the other Macs; peers' "
        "addresses are as their agents last read them"
    )
    assert checks["cable en2"].detail == "studio-1's en2 has no IPv4 address"
    assert (ran, code) == ([], 1)


def test_a_route_change_without_a_route_to_change_goes_on():
    """`route change PEER` exits 1 where no other route to the peer exists ("not in table"):
    the cable's /30 routes it, so --fix goes on, as MLX's --auto-setup does."""
    said, ran = [], []
    cmds = (
        ("sudo", "ifconfig", "en2", "inet", "192.168.0.1", "netmask", "255.255.255.252"),
        ("sudo", "route", "change", "192.168.0.2", "-interface", "en2"),
        ("sudo", "ifconfig", "en3", "inet", "192.168.0.5", "netmask", "255.255.255.252"),
    )

    def run(argv):
        ran.append(tuple(argv))
        return (1, "") if argv[1] == "route" else (0, "")

    assert (
        apply_fixes([Check("cable addresses", "FAIL", "", "", cmds)], "Darwin", run, said.append)
        == 0
    )
    assert ran == list(cmds)
    assert said[3] == (
        "  (exit code 1: no other route to 192.168.0.2; the cable's network routes it)"
    )
