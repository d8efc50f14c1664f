"""`thunderpool doctor` on recorded Mac meshes (tests/mac/macs.py scenes): for each thing that
stops RDMA the exact status and a fix that names the right command and value (`--fix` itself:
test_doctor_fix_mac.py)."""

from __future__ import annotations

import pytest
from doctor_scenes import (
    FULL_LIMIT,
    MEMORY,
    doctor,
    macs,
    mlx_addresses,
    rdma_statuses,
)
from macs import KERNEL_BUILD_UUID, SCENES, Scene, mesh

from thunderpool import __version__
from thunderpool.cluster.node.doctor_rdma import (
    check_host_ids,
    check_jaccl,
    check_mesh,
)

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
