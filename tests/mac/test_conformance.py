"""Our reading of a Thunderbolt mesh against MLX's own: the same recorded macOS outputs go to
`mlx.distributed_config` (mlx/_distributed_utils/config.py, from the installed wheel; its ssh
calls answered from the recordings) and to our agents' self-report plus the coordinator's
jaccl settings. Every ordered pair of ranks must get the same RDMA device(s), every cable end
the address MLX's --auto-setup gives it, and the coordinator must be an address every rank
reaches (MLX's launcher takes rank 0's en0)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from cluster.recorded.replay import Replay
from macs import SCENES, Scene, platform_uuid, write

from thunderpool.cluster.control.jaccl import jaccl_config, pick_coordinator
from thunderpool.cluster.control.messages import Hello, NodeInfo
from thunderpool.cluster.control.state import ClusterState, apply
from thunderpool.cluster.node.capabilities import node_info
from thunderpool.cluster.node.thunderbolt import cable_addresses, cables, reaches, route
from thunderpool.errors import LaunchError

config = pytest.importorskip("mlx._distributed_utils.config")
common = pytest.importorskip("mlx._distributed_utils.common")


def mlx_hostfile(dirs: list[Path], monkeypatch, tmp_path: Path) -> tuple[dict, list[str]]:
    """MLX's hostfile for hosts mac0..macN (ssh answered from `dirs`) and the setup commands
    its --auto-setup would run on each."""
    by_host = {f"mac{i}": Replay(d) for i, d in enumerate(dirs)}
    setup: list[str] = []

    def fake_run(argv, capture_output=False, text=False, **kw):
        assert argv[0] == "ssh", argv
        host, rest = argv[1], argv[2:]
        if rest[0].startswith("sudo "):  # the --auto-setup commands, joined by " ; "
            setup.append(f"{host}: {rest[0]}")
            code, out = 0, ""
        else:
            code, out = by_host[host](rest)
            assert code == 0, f"no recording for {rest}"
        return subprocess.CompletedProcess(argv, code, out if text else out.encode(), b"")

    monkeypatch.setattr(config, "run", fake_run)
    out = tmp_path / "hostfile.json"
    args = argparse.Namespace(
        verbose=False, dot=False, backend=None, auto_setup=True, output_hostfile=str(out), env=[]
    )
    hosts = common.Hostfile.from_list(",".join(by_host)).hosts
    config.prepare_tb_hostfile(args, hosts, [config.SSHInfo(True, True)] * len(hosts))
    return json.loads(out.read_text()), setup


def our_nodes(dirs: list[Path]) -> list[NodeInfo]:
    return [
        node_info(7070, f"mac{i}", measure=False, run=Replay(d), system="Darwin").model_copy(
            update={"name": f"mac{i}"}
        )
        for i, d in enumerate(dirs)
    ]


def state_of(nodes: list[NodeInfo]) -> ClusterState:
    state = ClusterState()
    for node in nodes:
        lan = next(x.address for x in node.interfaces if x.name == "en0")
        state = apply(state, Hello(node=node, contact=f"{lan}:7070"))
    return state


def setup_addresses(commands: list[str]) -> dict[tuple[int, str], tuple[str, int]]:
    """(mac, iface) -> (address, prefix) from MLX's `sudo ifconfig IFACE inet IP netmask M`."""
    found = {}
    for line in commands:
        host, _, script = line.partition(": ")
        for m in re.finditer(r"ifconfig (en\d+) inet (\S+) netmask (\S+)", script):
            mask = sum(bin(int(o)).count("1") for o in m.group(3).split("."))
            found[(int(host[3:]), m.group(1))] = (m.group(2), mask)
    return found


@pytest.mark.parametrize("name", [s for s in SCENES if s != "ring4"])
def test_mesh_matches_mlx(name, tmp_path, monkeypatch):
    scene: Scene = SCENES[name]
    dirs = write(scene, tmp_path / name)
    mlx, setup = mlx_hostfile(dirs, monkeypatch, tmp_path)
    nodes = our_nodes(dirs)
    order = [n.node_id for n in nodes]
    cfg = jaccl_config(state_of(nodes), order, 32000)

    assert mlx["backend"] == "jaccl"
    assert cfg is not None and not cfg.ring
    # The same device (or devices, with two cables per pair) for every ordered pair of ranks.
    assert cfg.devices == [h["rdma"] for h in mlx["hosts"]]
    # MLX's coordinator is rank 0's en0; ours is rank 0's agent address, the same LAN address.
    assert cfg.candidates[0] == mlx["hosts"][0]["ips"][0]
    assert all(reaches(node, cfg.candidates[0]) for node in nodes[1:])
    # The addresses the recordings carry are those MLX's --auto-setup assigns, cable by cable.
    assert scene.cable_ips() == setup_addresses(setup)
    assert {k: (v, 30) for k, v in cable_addresses(cables(nodes)).items()} == setup_addresses(setup)
    # Two Macs of one model and build: one kernel build UUID, two machines.
    assert len({n.host_id for n in nodes}) == len(nodes)
    assert [n.host_id for n in nodes] == [platform_uuid(i) for i in range(len(nodes))]


@pytest.mark.parametrize("name", ["mesh3", "mesh4_lan192", "mesh3_crossed"])
def test_each_peer_address_leaves_by_its_own_cable(name, tmp_path):
    """A packet to a peer's cable address leaves by the cable to that peer (longest prefix):
    never the other cable's device, nor the LAN that also holds 192.168.0.x."""
    scene = SCENES[name]
    nodes = our_nodes(write(scene, tmp_path / name))
    found = cables(nodes)
    for c in found:
        peer_ip = next(x.address for x in nodes[c.j].interfaces if x.name == c.b)
        via = route(nodes[c.i].interfaces, peer_ip)
        assert (via.name, via.rdma_device, via.kind) == (c.a, f"rdma_{c.a}", "rdma")


def test_ring_matches_mlx_jaccl_ring(tmp_path, monkeypatch):
    """Four Macs cabled in a ring (no mesh): MLX writes a jaccl-ring hostfile; given the same
    rank order, our devices are MLX's and jaccl runs in ring mode."""
    dirs = write(SCENES["ring4"], tmp_path / "ring4")
    mlx, _ = mlx_hostfile(dirs, monkeypatch, tmp_path)
    assert mlx["backend"] == "jaccl-ring"
    rank_of = [int(h["ssh"][3:]) for h in mlx["hosts"]]  # MLX orders ranks along the ring
    nodes = our_nodes(dirs)
    order = [nodes[m].node_id for m in rank_of]
    cfg = jaccl_config(state_of(nodes), order, 32000)
    assert cfg is not None and cfg.ring and cfg.env()["MLX_JACCL_RING"] == "1"
    assert cfg.devices == [h["rdma"] for h in mlx["hosts"]]


def test_an_incomplete_mesh_runs_ring_over_tcp(tmp_path):
    """Three Macs, one cable missing and no ring through all: no jaccl (it would hang)."""
    scene = Scene(3, [(0, 1, 1, 1), (1, 2, 2, 1)])
    nodes = our_nodes(write(scene, tmp_path / "path3"))
    assert jaccl_config(state_of(nodes), [n.node_id for n in nodes], 32000) is None


def test_mlx_recordings_are_what_the_commands_print():
    """The recorded scenes in the repo are what macs.py renders (re-run it after a change)."""
    from macs import RECORDED, outputs

    for name, scene in SCENES.items():
        for mac in range(scene.n):
            for file, text in outputs(scene, mac).items():
                assert (RECORDED / name / f"mac{mac}" / file).read_text() == text, (name, file)


def test_mlx_setup_quotes(tmp_path, monkeypatch):
    """MLX's --auto-setup turns the bridge off and routes each peer by its cable."""
    _, setup = mlx_hostfile(write(SCENES["mesh2"], tmp_path / "m2"), monkeypatch, tmp_path)
    first = shlex.split(setup[0].partition(": ")[2].replace(" ; ", " && "))
    assert first[:4] == ["sudo", "ifconfig", "bridge0", "down"]


def test_the_coordinator_is_the_first_address_every_rank_reaches(tmp_path):
    """Checked live before launch: an address some rank cannot connect to is passed over,
    and none at all is a clear error, not a hang in jaccl's handshake."""
    nodes = our_nodes(write(SCENES["mesh3"], tmp_path / "m3"))
    state = state_of(nodes)
    order = [n.node_id for n in nodes]
    cfg = jaccl_config(state, order, 32000)
    lan, *cabled = cfg.candidates
    assert lan == "192.168.1.20" and set(cabled) == {"192.168.0.1", "192.168.0.5"}
    asked = []

    def reach(node, address, port):
        asked.append((node, address, port))
        # Mac 2 has no route to the LAN address; elsewhere Mac 0 answers.
        return None if address == lan and node == order[2] else order[0]

    assert pick_coordinator(state, order, cfg, reach).rsplit(":", 1)[0] in cabled
    assert {(n, p) for n, _, p in asked} == {(order[1], 7071), (order[2], 7071)}
    with pytest.raises(LaunchError, match=r"no address of mac0 .* reachable from every other"):
        pick_coordinator(state, order, cfg, lambda *_: None)


def test_a_coordinator_address_another_mac_answers_at_is_a_launch_error(tmp_path):
    """Two Macs hold rank 0's address (a cable numbered into the LAN): a connect succeeds
    from every rank, but from Mac 2 it is Mac 1 that answers; the launch stops, naming both."""
    nodes = our_nodes(write(SCENES["mesh3"], tmp_path / "m3"))
    state, order = state_of(nodes), [n.node_id for n in nodes]
    cfg = jaccl_config(state, order, 32000)
    reach = lambda node, address, port: order[1] if node == order[2] else order[0]  # noqa: E731
    with pytest.raises(LaunchError) as e:
        pick_coordinator(state, order, cfg, reach)
    assert str(e.value) == (
        "192.168.1.20 is mac0 (mac0)'s (rank 0), but from mac2 (mac2) it is mac1 (mac1) that "
        "answers there: two machines hold 192.168.1.20, likely a Thunderbolt cable numbered "
        "into the LAN; run `thunderpool doctor --fix` on every Mac (it moves each cable's /30 "
        "clear of every network), then launch again"
    )


def test_two_identical_macs_pool_their_memory_for_a_model_larger_than_one(tmp_path):
    """Two Mac Studios of one model and one macOS build (equal `sysctl kern.uuid`): with the
    hardware's UUIDs they are two machines and Kimi K2 at 4 bits (538 GiB, more than one Mac
    holds) is placed on both; were they one machine, as the build UUID said, nothing fits."""
    from macs import KERNEL_BUILD_UUID

    from thunderpool.cluster.control.coordinator import node_specs
    from thunderpool.cluster.control.messages import LinkMeasured
    from thunderpool.planner.placement import PlacementError, place
    from thunderpool.planner.simulate import load_model

    nodes = our_nodes(write(SCENES["mesh2"], tmp_path / "m2"))
    a, b = nodes

    def with_link(state):
        link = LinkMeasured(
            a=a.node_id, b=b.node_id, a_address="192.168.0.1", b_address="192.168.0.2",
            rtt_s=20e-6, bandwidth_Bps=8e9, link="rdma",
        )  # fmt: skip
        return apply(state, link)

    spec = load_model("kimi-k2:q4")
    plans = place(spec, *node_specs(with_link(state_of(nodes))))
    assert plans and all(set(p.nodes) == {a.node_id, b.node_id} for p in plans)
    one_box = [n.model_copy(update={"host_id": KERNEL_BUILD_UUID}) for n in nodes]
    with pytest.raises(PlacementError):
        place(spec, *node_specs(with_link(state_of(one_box))))


@pytest.mark.parametrize("name", ["mesh4", "mesh3_double", "ring4"])
def test_rank_environment_matches_mlx_launch(name, tmp_path, monkeypatch):
    """What `mlx.launch --backend jaccl[-ring] --hostfile H` hands every rank (its files and
    environment, from mlx/_distributed_utils/launch.py) is what our agents hand ours, the
    coordinator's port aside."""
    launch = pytest.importorskip("mlx._distributed_utils.launch")
    dirs = write(SCENES[name], tmp_path / name)
    hostfile, _ = mlx_hostfile(dirs, monkeypatch, tmp_path)
    (tmp_path / "h.json").write_text(json.dumps(hostfile))
    hosts = common.Hostfile.from_file(tmp_path / "h.json").hosts
    started = []
    monkeypatch.setattr(
        launch, "_launch_with_io", lambda cls, arguments, v: started.extend(arguments)
    )
    args = argparse.Namespace(
        backend=hostfile["backend"],
        env=[],
        cwd=None,
        verbose=False,
        starting_port=32000,
        python=None,
    )
    launch.launch_jaccl(argparse.ArgumentParser(), hosts, args, ["python", "-m", "x"])
    (_, _, _, _, files, env, _), _ = started[0]
    assert all(a[0][4] == files and a[0][5] == env for a in started)

    nodes = our_nodes(dirs)
    by_name = {n.name: n.node_id for n in nodes}
    order = [by_name[h.ssh_hostname] for h in hosts]
    cfg = jaccl_config(state_of(nodes), order, 32000)
    assert cfg.files() == files
    assert sorted(f"{k}={v}" for k, v in cfg.env().items()) == sorted(env)
