"""`thunderpool doctor` on recorded Mac meshes (tests/mac/macs.py scenes): for each thing that
stops RDMA the exact status and a fix that names the right command and value; `--fix` on every
Mac of a 3- and 4-Mac mesh assigns MLX's per-cable /30s, both ends of every cable on one /30,
the same whichever Mac computes them, and the commands MLX's own --auto-setup would run."""

from __future__ import annotations

import argparse
import ipaddress
import re
from pathlib import Path

import pytest
from cluster.recorded.replay import Replay
from macs import KERNEL_BUILD_UUID, SCENES, Scene, mesh, write

from thunderpool import __version__
from thunderpool.cli.doctor import add_doctor_parser, run_doctor
from thunderpool.cluster.control.messages import NodeInfo
from thunderpool.cluster.node.capabilities import node_info
from thunderpool.cluster.node.checks import Check
from thunderpool.cluster.node.doctor_fix import apply_fixes
from thunderpool.cluster.node.doctor_rdma import (
    check_host_ids,
    check_jaccl,
    check_mesh,
    cluster_nodes,
    planned_ends,
)
from thunderpool.cluster.node.thunderbolt import cable_addresses, cables

MEMORY = 549755813888  # the scenes' Mac Studios: 512 GiB
FULL_LIMIT = (MEMORY - 8 * 10**9) // 2**20  # what --fix sets: memory less the OS reserve


def node_id(mac: int) -> str:
    """Ids whose order is not the Macs' (mac0 -> "7", mac1 -> "4", mac2 -> "1", mac3 -> "8"),
    so the plan's node-id order is tested, not the recordings' order."""
    return f"{7 * (mac + 1) % 10}-studio"


def macs(scene: Scene, where: Path) -> tuple[list[Path], list[NodeInfo]]:
    dirs = write(scene, where)
    nodes = [
        node_info(7070, node_id(m), measure=False, run=Replay(d), system="Darwin").model_copy(
            update={"name": f"studio-{m}"}
        )
        for m, d in enumerate(dirs)
    ]
    return dirs, nodes


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="thunderpool")
    add_doctor_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["doctor", *argv])


class Recorder:
    """The sudo runner for --fix: remembers each command, runs nothing."""

    def __init__(self):
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv):
        self.calls.append(tuple(argv))
        return 0, ""


def doctor(
    dirs: list[Path], nodes: list[NodeInfo], mac: int, *argv: str, **probes
) -> tuple[dict[str, Check], list[tuple[str, ...]], int, list[str]]:
    """`thunderpool doctor ARGV` on Mac `mac`, its peers as their agents report them:
    (checks by name, the commands --fix ran, the exit code, what it said)."""
    probes = {
        "bind": lambda port: None,
        "connect": lambda host, port, timeout: None,
        "mlx": lambda: ("0.32.4", True, ""),
        "jaccl": lambda: True,
        "working_set": lambda: None,
    } | probes
    fixer, said = Recorder(), []
    peers = [n for m, n in enumerate(nodes) if m != mac]
    checks, code = run_doctor(
        args_of(*argv),
        "Darwin",
        Replay(dirs[mac]),
        fixer,
        nodes[mac],
        peers,
        said.append,
        **probes,
    )
    by_name = {c.name: c for c in checks}
    assert len(by_name) == len(checks), "check names must be unique"
    return by_name, fixer.calls, code, said


def rdma_statuses(checks: dict[str, Check]) -> dict[str, str]:
    keep = ("RDMA", "cable", "Thunderbolt Bridge", "jaccl", "GPU", "host ids")
    return {k: c.status for k, c in checks.items() if k.startswith(keep)}


# ---- a healthy mesh ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mesh2", "mesh3", "mesh4", "mesh3_double"])
def test_meshes_set_up_by_mlx_pass(name, tmp_path):
    """MLX's --auto-setup addresses (in the recordings' order, not ours) pass: --fix would
    renumber nothing, and with the wired limit raised every RDMA check passes."""
    scene = SCENES[name]
    dirs, nodes = macs(Scene(scene.n, scene.wires, scene.lan, wired_limit_mb=FULL_LIMIT), tmp_path)
    for mac in range(scene.n):
        checks, ran, code, _ = doctor(dirs, nodes, mac, "--fix")
        assert set(rdma_statuses(checks).values()) == {"PASS"}, rdma_statuses(checks)
        assert (ran, code) == ([], 0)
    ends = [k for k in checks if k.startswith("cable en")]
    assert len(ends) == sum(mac == scene.n - 1 for w in scene.wires for mac in (w[0], w[2]))
    full = f"a full mesh: {len(scene.wires)} cable(s) join all {scene.n} Macs"
    assert checks["RDMA mesh"].detail == full


def test_mlx_numbering_on_a_192_168_0_lan_is_flagged_with_the_fix(tmp_path):
    """MLX's --auto-setup puts the cables on the LAN's 192.168.0.x: the kernel still routes
    each peer by its cable (longest prefix), but the LAN's hosts there (the router at .1)
    are cut off: doctor names the overlap and --fix moves the cables off the LAN."""
    dirs, nodes = macs(SCENES["mesh4_lan192"], tmp_path)
    checks, ran, *_ = doctor(dirs, nodes, 0, "--fix")
    assert checks["cable en2"].status == "FAIL"
    assert checks["cable en2"].detail.startswith(
        "studio-0's en2 (192.168.0.0/30) overlaps en0 (192.168.0.0/24): a cable's subnet must "
        "be clear of every other network the Mac is on; studio-1's en2 (192.168.0.0/30) "
        "overlaps en0 (192.168.0.0/24)"
    )
    assert "sudo ifconfig en2 inet 192.168.1.14 netmask 255.255.255.252" in checks["cable en2"].fix
    moved = [c[4] for c in ran if c[1] == "ifconfig" and c[3] == "inet"]
    assert moved == ["192.168.1.2", "192.168.1.14", "192.168.1.21"]


# ---- each failure, its status and its fix --------------------------------------------------


def test_rdma_disabled(tmp_path):
    scene = Scene(2, mesh(2), rdma_off=True, wired_limit_mb=FULL_LIMIT)
    dirs, nodes = macs(scene, tmp_path)
    checks, ran, code, _ = doctor(dirs, nodes, 0, "--fix", jaccl=lambda: False)
    assert rdma_statuses(checks) == {
        "RDMA enabled": "FAIL",
        "Thunderbolt Bridge": "PASS",
        "RDMA devices": "SKIP",
        "RDMA links": "SKIP",
        "RDMA in use": "SKIP",
        "cable en2": "PASS",
        "jaccl backend": "FAIL",
        "GPU wired limit": "PASS",
        "RDMA mesh": "FAIL",
        "cable addresses": "PASS",
        "host ids": "PASS",
    }
    assert "rdma_ctl enable" in checks["RDMA enabled"].fix
    assert "Recovery" in checks["RDMA enabled"].fix
    mesh_check = checks["RDMA mesh"]
    assert mesh_check.detail == (
        "studio-1, studio-0 cannot run jaccl: the cluster's ranks run ring over TCP"
    )
    assert mesh_check.fix.startswith("run `thunderpool doctor` on studio-1, studio-0")
    # Nothing --fix can run: RDMA is switched on from Recovery only.
    assert (ran, code) == ([], 1)


def test_a_linux_node_among_the_macs_warns(tmp_path):
    _, nodes = macs(SCENES["mesh2"], tmp_path)
    linux = nodes[1].model_copy(
        update={"node_id": "9-box", "name": "box", "os": "Linux 6.1", "thunderbolt": ()}
    )
    check = check_mesh([*nodes, linux])
    assert (check.status, check.detail) == (
        "WARN",
        "box: not macOS, so ranks that span them run ring over TCP",
    )


def test_jaccl_missing_from_mlx():
    assert check_jaccl(False, "0.29.0").status == "FAIL"
    old = check_jaccl(None, "0.25.2")
    assert (old.status, old.detail) == (
        "FAIL",
        "mlx 0.25.2 cannot be asked for one backend: it predates jaccl",
    )
    assert old.fix.startswith('pip install -U "mlx>=0.30"')
    assert check_jaccl(True, "0.32.4").status == "PASS"
    assert check_jaccl(None, None).status == "SKIP"


def mlx_addresses(scene: Scene) -> dict[tuple[int, str], tuple[str, int]]:
    return {k: (ip, 30) for k, ip in cable_addresses(scene.cables()).items()}


def test_a_cable_end_without_an_address(tmp_path):
    """Mac 1's end of its cable to Mac 2 has no address: both Macs of that cable fail it, the
    fix names this Mac's command, and --fix re-addresses every cable end of each Mac."""
    wires = mesh(3)
    addresses = mlx_addresses(Scene(3, wires))
    del addresses[1, "en3"]
    dirs, nodes = macs(Scene(3, wires, addresses=addresses), tmp_path)
    checks, ran, code, said = doctor(dirs, nodes, 1)
    end = checks["cable en3"]
    assert (end.status, end.detail) == ("FAIL", "studio-1's en3 has no IPv4 address")
    # Node-id order is mac2, mac1, mac0; mac2's ports in order: en2 to mac0 (192.168.0.0/30),
    # en3 to mac1 (192.168.0.4/30), where mac1 takes the second address.
    assert "sudo ifconfig en3 inet 192.168.0.6 netmask 255.255.255.252" in end.fix
    assert "sudo route change 192.168.0.5 -interface en3" in end.fix
    assert "on studio-1 and on studio-2" in end.fix
    assert checks["cable en2"].status == "PASS"
    plan = checks["cable addresses"]
    assert (plan.status, plan.detail) == (
        "FAIL",
        "1 of 3 cable(s) do not work: studio-2:en3-studio-1:en3",
    )
    assert ran == [] and code == 1  # no --fix: nothing runs
    assert said[-1] == "`thunderpool doctor --fix` runs the fixes that are commands (with sudo)"

    far, *_ = doctor(dirs, nodes, 2)
    assert far["cable en3"].detail == "studio-1's en3 has no IPv4 address"
    assert far["cable en3"].status == "FAIL"


def test_two_cables_of_one_mac_on_one_subnet(tmp_path):
    wires = mesh(3)
    addresses = mlx_addresses(Scene(3, wires))
    addresses[0, "en2"] = ("192.168.0.1", 24)  # the cable to Mac 1 as a /24 ...
    addresses[1, "en2"] = ("192.168.0.2", 24)
    addresses[0, "en3"] = ("192.168.0.5", 24)  # ... and the cable to Mac 2 on the same /24
    addresses[2, "en2"] = ("192.168.0.6", 24)
    dirs, nodes = macs(Scene(3, wires, addresses=addresses), tmp_path)
    checks, ran, code, _ = doctor(dirs, nodes, 0, "--fix")
    end = checks["cable en2"]
    assert end.status == "FAIL"
    assert end.detail.startswith(
        "studio-0's en2 (192.168.0.0/24) and en3 (192.168.0.0/24) share a subnet: "
        "each cable needs its own; studio-1's en2 (192.168.0.0/24) and en3"
    )
    assert checks["cable en3"].status == "FAIL"
    assert checks["cable addresses"].status == "FAIL"
    # --fix gives each of Mac 0's ends its own /30. Node-id order is mac2, mac1, mac0: the
    # cables are mac2:en2-mac0:en3, mac2:en3-mac1:en3, mac1:en2-mac0:en2, Mac 0 walks its
    # peers in that order.
    assert [c for c in ran if c[1] in ("ifconfig", "route")] == [
        ("sudo", "ifconfig", "en3", "inet", "192.168.0.2", "netmask", "255.255.255.252"),
        ("sudo", "route", "change", "192.168.0.1", "-interface", "en3"),
        ("sudo", "ifconfig", "en2", "inet", "192.168.0.10", "netmask", "255.255.255.252"),
        ("sudo", "route", "change", "192.168.0.9", "-interface", "en2"),
    ]
    assert code == 0


def test_a_cable_subnet_that_routes_by_the_lan(tmp_path):
    """The LAN is 192.168.0.0/24 and the cables were given /24s on it too: traffic to the
    peer leaves by en0 (the first of two equal prefixes), not by the cable."""
    wires = mesh(2)
    lan = [(f"192.168.0.{100 + m}", 24) for m in range(2)]
    addresses = {(0, "en2"): ("192.168.0.1", 24), (1, "en2"): ("192.168.0.2", 24)}
    dirs, nodes = macs(Scene(2, wires, lan=lan, addresses=addresses), tmp_path)
    checks, ran, code, _ = doctor(dirs, nodes, 0, "--fix")
    end = checks["cable en2"]
    assert (end.status, end.detail) == (
        "FAIL",
        "studio-0's en2 (192.168.0.0/24) overlaps en0 (192.168.0.0/24): a cable's subnet must "
        "be clear of every other network the Mac is on; studio-1's en2 (192.168.0.0/24) "
        "overlaps en0 (192.168.0.0/24): a cable's subnet must be clear of every other network "
        "the Mac is on",
    )
    # Node-id order mac1 ("4-") then mac0 ("7-"): Mac 0 takes the cable's .2, of the first
    # /30 clear of the LAN.
    assert ran == [
        ("sudo", "ifconfig", "en2", "inet", "192.168.1.2", "netmask", "255.255.255.252"),
        ("sudo", "route", "change", "192.168.1.1", "-interface", "en2"),
    ]
    assert code == 0


def test_an_incomplete_mesh_names_the_missing_pairs(tmp_path):
    dirs, nodes = macs(Scene(3, [(0, 1, 1, 1), (1, 2, 2, 1)]), tmp_path)
    check = doctor(dirs, nodes, 0)[0]["RDMA mesh"]
    # Listed in node-id order (mac2, mac1, mac0).
    assert (check.status, check.detail) == (
        "FAIL",
        "no cable between studio-2-studio-0: jaccl needs one between every pair of Macs "
        "(or a ring)",
    )
    assert check.fix == (
        "connect a Thunderbolt 5 cable straight between studio-2-studio-0 (no dock or hub)"
    )


def test_a_ring_warns_jaccl_ring_mode(tmp_path):
    dirs, nodes = macs(SCENES["ring4"], tmp_path)
    check = doctor(dirs, nodes, 0)[0]["RDMA mesh"]
    assert check.status == "WARN"
    # Node-id order mac2, mac1, mac0, mac3; the ring 0-1-2-3 seen from mac2.
    assert check.detail == (
        "a ring (studio-2-studio-1-studio-0-studio-3-studio-2), not a full mesh (no cable "
        "studio-2-studio-0, studio-1-studio-3): jaccl runs in ring mode where the ranks "
        "follow the ring, else ring over TCP"
    )
    assert check.fix == "for a full mesh, cable studio-2-studio-0, studio-1-studio-3"


def test_the_thunderbolt_bridge_on(tmp_path):
    dirs, nodes = macs(Scene(2, mesh(2), bridge_on=True, wired_limit_mb=FULL_LIMIT), tmp_path)
    checks, ran, code, _ = doctor(dirs, nodes, 1, "--fix")
    bridge = checks["Thunderbolt Bridge"]
    assert (bridge.status, bridge.detail) == (
        "FAIL",
        "bridge0 is active and bridges en2, en3, en4, en5, en6, en7",
    )
    assert bridge.fix.startswith("sudo ifconfig bridge0 down")
    assert (ran, code) == ([("sudo", "ifconfig", "bridge0", "down")], 0)


@pytest.mark.parametrize(
    ("limit_mb", "shard_gb", "status", "detail", "commands"),
    [
        (
            0,
            None,
            "WARN",
            "iogpu.wired_limit_mb is 0: Metal's recommended working set, ≈ 412 GB of 550 GB: "
            "below a shard of up to 542 GB (memory less the 8 GB OS reserve; --shard-gb "
            "checks the planned one)",
            [("sudo", "sysctl", f"iogpu.wired_limit_mb={FULL_LIMIT}")],
        ),
        (0, "300", "PASS", None, []),
        (
            0,
            "450",
            "FAIL",
            "iogpu.wired_limit_mb is 0: Metal's recommended working set, ≈ 412 GB of 550 GB: "
            "below the 450 GB shard (--shard-gb)",
            [("sudo", "sysctl", f"iogpu.wired_limit_mb={FULL_LIMIT}")],
        ),
        (
            500000,
            "600",
            "FAIL",
            "a 600 GB shard does not fit 550 GB less the 8 GB OS reserve",
            [],
        ),
        (FULL_LIMIT, "540", "PASS", None, []),
    ],
)
def test_the_gpu_wired_limit(tmp_path, limit_mb, shard_gb, status, detail, commands):
    dirs, nodes = macs(Scene(2, mesh(2), wired_limit_mb=limit_mb), tmp_path)
    argv = ["--fix"] + (["--shard-gb", shard_gb] if shard_gb else [])
    checks, ran, _, _ = doctor(dirs, nodes, 0, *argv, working_set=lambda: MEMORY * 3 // 4)
    wired = checks["GPU wired limit"]
    assert wired.status == status
    if detail:
        assert wired.detail == detail
    assert ran == commands
    if commands:
        assert f"sudo sysctl iogpu.wired_limit_mb={FULL_LIMIT}" in wired.fix
    if status == "FAIL" and not commands:
        assert wired.fix == "plan more nodes or a smaller model"


def test_identical_host_ids_are_named(tmp_path):
    """What thunderpool before per-machine ids reported on two Macs of one build."""
    _, nodes = macs(SCENES["mesh3"], tmp_path)
    old = [n.model_copy(update={"host_id": KERNEL_BUILD_UUID}) for n in nodes[:2]]
    check = check_host_ids([*old, nodes[2]])
    assert check.status == "FAIL"
    assert check.detail == (
        f"studio-0, studio-1 report one host id {KERNEL_BUILD_UUID}: the planner packs them "
        "into one machine's memory"
    )
    assert check.fix == "restart `thunderpool node --host-id NAME` on each with a name of its own"
    outdated = old[1].model_copy(update={"version": "0.0.9"})
    fix = check_host_ids([old[0], outdated, nodes[2]]).fix
    assert fix.startswith(f"update thunderpool to {__version__} on studio-1 (it reads each Mac's")
    # Agents sharing one machine (one name, the same ports) may share its id.
    twin = nodes[0].model_copy(update={"node_id": "0-twin"})
    assert check_host_ids([nodes[0], twin, nodes[1]]).status == "PASS"
    assert check_host_ids(nodes).detail == "3 machine(s) among 3 node(s)"


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
