"""`thunderpool doctor` on recorded macOS/Linux outputs: exact statuses and the fix for each one."""

from __future__ import annotations

import argparse
import errno
import socket

import mlx.core as mx
import pytest
from recorded.replay import Replay

from thunderpool import __version__
from thunderpool.cli.doctor import add_doctor_parser, doctor_main
from thunderpool.cluster.control.messages import NodeInfo
from thunderpool.cluster.node.doctor import (
    Check,
    check_thunderbolt,
    parse_peer,
    run_checks,
)
from thunderpool.cluster.node.facts import parse_thunderbolt_text
from thunderpool.cluster.node.probes import probe_jaccl, probe_working_set, try_bind, try_connect

MLX_OK = ("0.32.4", True, "")
BLIS_PATH = "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4"
BLIS = {"LD_PRELOAD": BLIS_PATH, "BLIS_NUM_THREADS": "2"}


def bind_ok(port: int) -> OSError | None:
    return None


def connect_ok(host: str, port: int, timeout: float) -> OSError | None:
    assert timeout == 2.0
    return None


def checks_for(scene: str, system: str = "Darwin", **kw) -> dict[str, Check]:
    kw = {
        "bind": bind_ok,
        "connect": connect_ok,
        "mlx": lambda: MLX_OK,
        "blas": lambda: BLIS,
        "jaccl": lambda: True,
        "working_set": lambda: None,
    } | kw
    checks = run_checks(system, Replay(scene), **kw)
    by_name = {c.name: c for c in checks}
    assert len(by_name) == len(checks), "check names must be unique"
    return by_name


def statuses(checks: dict[str, Check]) -> dict[str, str]:
    return {name: c.status for name, c in checks.items()}


def test_macos_26_rdma_tb5_all_pass():
    checks = checks_for("macos26_rdma_tb5", peers=["192.168.0.2:7070"])
    assert statuses(checks) == {
        "macOS version": "PASS",
        "RDMA enabled": "PASS",
        "Thunderbolt 5": "PASS",
        "Thunderbolt Bridge": "PASS",
        "RDMA devices": "PASS",
        "RDMA links": "SKIP",
        "RDMA in use": "SKIP",
        "MLX": "PASS",
        "ring backend": "PASS",
        "jaccl backend": "PASS",
        "GPU wired limit": "PASS",
        "agent port": "PASS",
        "probe port": "PASS",
        "ring ports": "PASS",
        "firewall": "PASS",
        "peer 192.168.0.2:7070": "PASS",
        "same versions": "SKIP",
        "RDMA mesh": "SKIP",
        "cable addresses": "SKIP",
        "host ids": "SKIP",
    }
    assert checks["RDMA devices"].detail == "`ibv_devices`: rdma_en3, rdma_en4"
    assert checks["Thunderbolt 5"].detail == "2 Thunderbolt 5 link(s): 80 Gb/s, 80 Gb/s"
    assert checks["macOS version"].detail == "macOS 26.2"
    # Every check that does not pass says what to do, except notes (SKIP).
    assert all(c.fix == "" for c in checks.values() if c.status == "PASS")


def test_macos_15_without_rdma():
    checks = checks_for("macos15", jaccl=lambda: False)
    assert statuses(checks) == {
        "macOS version": "FAIL",
        "RDMA enabled": "SKIP",
        "Thunderbolt 5": "WARN",
        "Thunderbolt Bridge": "FAIL",
        "RDMA devices": "SKIP",
        "RDMA links": "SKIP",
        "RDMA in use": "SKIP",
        "MLX": "PASS",
        "ring backend": "PASS",
        "jaccl backend": "FAIL",
        "GPU wired limit": "WARN",
        "agent port": "PASS",
        "probe port": "PASS",
        "ring ports": "PASS",
        "firewall": "WARN",
        "same versions": "SKIP",
        "RDMA mesh": "SKIP",
        "cable addresses": "SKIP",
        "host ids": "SKIP",
    }
    assert checks["macOS version"].detail == "macOS 15.5 < 26.2"
    assert (
        "26.2" in checks["macOS version"].fix and "Software Update" in checks["macOS version"].fix
    )
    assert checks["Thunderbolt 5"].detail == "Thunderbolt 4 link(s): 40 Gb/s"
    assert (
        "TB5" in checks["Thunderbolt 5"].fix and "half the bandwidth" in checks["Thunderbolt 5"].fix
    )
    bridge = checks["Thunderbolt Bridge"]
    assert bridge.detail == "the Thunderbolt Bridge service is enabled"
    assert 'networksetup -setnetworkserviceenabled "Thunderbolt Bridge" off' in bridge.fix
    assert "its own network" in bridge.fix
    assert bridge.commands == (
        ("sudo", "networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"),
        ("sudo", "ifconfig", "bridge0", "down"),
    )
    assert "socketfilterfw --add" in checks["firewall"].fix
    jaccl = checks["jaccl backend"]
    assert jaccl.detail == "mx.distributed.is_available('jaccl') is False (mlx 0.32.4)"
    assert 'pip install -U "mlx>=0.30"' in jaccl.fix and "macOS 26.2" in jaccl.fix
    wired = checks["GPU wired limit"]
    assert (wired.detail, wired.commands) == ("cannot read `sysctl -n iogpu.wired_limit_mb`", ())


def test_macos_26_rdma_disabled_tb4_bridge_on():
    checks = checks_for("macos26_rdma_off_tb4", jaccl=lambda: False)
    assert statuses(checks) == {
        "macOS version": "PASS",
        "RDMA enabled": "FAIL",
        "Thunderbolt 5": "WARN",
        "Thunderbolt Bridge": "FAIL",
        "RDMA devices": "SKIP",
        "RDMA links": "SKIP",
        "RDMA in use": "SKIP",
        "MLX": "PASS",
        "ring backend": "PASS",
        "jaccl backend": "FAIL",
        "GPU wired limit": "WARN",
        "agent port": "PASS",
        "probe port": "PASS",
        "ring ports": "PASS",
        "firewall": "PASS",
        "same versions": "SKIP",
        "RDMA mesh": "SKIP",
        "cable addresses": "SKIP",
        "host ids": "SKIP",
    }
    rdma = checks["RDMA enabled"]
    assert rdma.detail == "`rdma_ctl status`: disabled"
    for step in ("Recovery", "hold the power button", "Options → Terminal", "rdma_ctl enable"):
        assert step in rdma.fix
    assert "Thunderbolt Bridge" in checks["Thunderbolt Bridge"].fix
    # 32 GB on the default limit (0): Metal wires about 2/3 of it, less than a shard may need.
    wired = checks["GPU wired limit"]
    assert wired.detail == (
        "iogpu.wired_limit_mb is 0: Metal's default, estimated, ≈ 23 GB of 34 GB: below a "
        "shard of up to 26 GB (memory less the 8 GB OS reserve; --shard-gb checks the planned one)"
    )
    assert wired.commands == (("sudo", "sysctl", "iogpu.wired_limit_mb=25138"),)


def test_linux_skips_mac_checks():
    run = Replay("linux")
    checks = run_checks(
        "Linux", run, bind=bind_ok, connect=connect_ok, mlx=lambda: MLX_OK, blas=lambda: BLIS
    )
    assert [(c.name, c.status, c.detail) for c in checks] == [
        ("macOS version", "SKIP", "not macOS"),
        ("RDMA enabled", "SKIP", "not macOS"),
        ("Thunderbolt 5", "SKIP", "not macOS"),
        ("Thunderbolt Bridge", "SKIP", "not macOS"),
        ("RDMA devices", "SKIP", "not macOS"),
        ("MLX", "PASS", "mlx 0.32.4 imports"),
        ("ring backend", "PASS", "mx.distributed ring is available"),
        ("jaccl backend", "SKIP", "not macOS"),
        ("GPU wired limit", "SKIP", "not macOS"),
        ("ip command", "PASS", "`ip` (iproute2) is installed"),
        ("BLAS", "PASS", f"ranks preload BLIS: {BLIS_PATH}"),
        ("agent port", "PASS", "7070 can be bound"),
        ("probe port", "PASS", "7071 can be bound"),
        ("ring ports", "PASS", "29500-29531 can be bound"),
        ("firewall", "SKIP", "not macOS"),
        ("same versions", "SKIP", checks[-4].detail),
        ("RDMA mesh", "SKIP", "not macOS"),
        ("cable addresses", "SKIP", "not macOS"),
        ("host ids", "SKIP", "no peer reports to compare"),
    ]
    assert "running cluster" in checks[-4].detail
    assert run.calls == [("ip", "-V")]  # no Mac command was run


def test_linux_without_mlx_or_ip():
    checks = checks_for(
        "nowhere", system="Linux", mlx=lambda: (None, False, "ImportError: libmlx.so missing")
    )
    assert checks["MLX"].status == "FAIL"
    assert checks["MLX"].detail == "`import mlx.core` failed: ImportError: libmlx.so missing"
    assert checks["MLX"].fix == 'pip install "mlx[cpu]"'
    assert checks["ring backend"].status == "SKIP"
    assert checks["ip command"].status == "FAIL" and "iproute2" in checks["ip command"].fix
    no_ring = checks_for("linux", system="Linux", mlx=lambda: ("0.32.4", False, ""))
    assert no_ring["ring backend"].status == "FAIL"


def test_rdma_enabled_but_no_devices_fails():
    def run(argv):
        if tuple(argv) == ("ibv_devices",):
            return Replay("macos26_rdma_off_tb4")(argv)  # headers only
        return Replay("macos26_rdma_tb5")(argv)

    checks = run_checks("Darwin", run, bind=bind_ok, connect=connect_ok, mlx=lambda: MLX_OK)
    ibv = next(c for c in checks if c.name == "RDMA devices")
    assert (ibv.status, ibv.detail) == ("FAIL", "`ibv_devices` lists no device")
    assert "Thunderbolt 5 cable" in ibv.fix


def test_firewall_blocking_everything_fails():
    def run(argv):
        if argv[0].endswith("socketfilterfw"):
            return 0, "Firewall is blocking all non-essential incoming connections. (State = 2)\n"
        return Replay("macos26_rdma_tb5")(argv)

    checks = run_checks("Darwin", run, bind=bind_ok, connect=connect_ok, mlx=lambda: MLX_OK)
    firewall = next(c for c in checks if c.name == "firewall")
    assert firewall.status == "FAIL" and "Block all incoming connections" in firewall.fix


def test_bridge_falls_back_to_ifconfig_members():
    def run(argv):
        if tuple(argv) == ("networksetup", "-listallnetworkservices"):
            return 1, ""
        return Replay("macos15")(argv)

    checks = run_checks("Darwin", run, bind=bind_ok, connect=connect_ok, mlx=lambda: MLX_OK)
    bridge = next(c for c in checks if c.name == "Thunderbolt Bridge")
    assert (bridge.status, bridge.detail) == ("FAIL", "bridge0 is active and bridges en1, en2")


def test_thunderbolt_ports_parse_host_and_device_ports():
    text = (Replay("macos15").dir / "system_profiler_thunderbolt.txt").read_text()
    # This capture prints "Up to" on its connected port too: the speed, not a live reading.
    assert parse_thunderbolt_text(text) == [(True, 40, False), (False, 40, False)]


def test_port_bind_failures():
    def bind(port: int) -> OSError | None:
        if port == 7070:
            return OSError(errno.EADDRINUSE, "Address already in use")
        if port in (29501, 29502):
            return OSError(errno.EACCES, "Permission denied")
        return None

    checks = checks_for("linux", system="Linux", bind=bind)
    assert checks["agent port"].status == "WARN"
    assert checks["agent port"].detail == "cannot bind 7070: [Errno 98] Address already in use"
    assert "--port" in checks["agent port"].fix
    assert checks["probe port"].status == "PASS"
    assert checks["ring ports"].status == "FAIL"
    assert checks["ring ports"].detail == "2 of 29500-29531 cannot be bound: 29501, 29502"


def test_peers_unreachable_and_malformed():
    def connect(host: str, port: int, timeout: float) -> OSError | None:
        return None if host == "10.0.0.2" else TimeoutError("timed out")

    checks = checks_for(
        "linux",
        system="Linux",
        connect=connect,
        peers=["10.0.0.2:7070", "10.0.0.3:7070", "nope"],
    )
    assert checks["peer 10.0.0.2:7070"].status == "PASS"
    bad = checks["peer 10.0.0.3:7070"]
    assert bad.status == "FAIL"
    assert bad.detail == "cannot connect to 10.0.0.3:7070 within 2 s: timed out"
    assert "thunderpool node --port 7070" in bad.fix
    assert checks["peer nope"].status == "FAIL"
    assert checks["peer nope"].detail == "peer 'nope' is not host:port, e.g. 192.168.1.20:7070"


def peer(name: str, version: str, mlx_version: str) -> NodeInfo:
    return NodeInfo(
        node_id=name,
        name=name,
        port=7070,
        version=version,
        mlx_version=mlx_version,
        python_version="3.12.8",
        os="macOS 26.2",
        chip="Apple M3 Ultra",
        cpu_count=32,
        memory_total_bytes=2**39,
        memory_available_bytes=2**38,
    )


def test_versions_compared_with_peers():
    same = [peer("studio-b", __version__, "0.32.4")]
    checks = checks_for("linux", system="Linux", peer_infos=same)
    assert checks["same versions"].status == "PASS"

    odd = [peer("studio-b", __version__, "0.32.4"), peer("studio-c", "0.0.9", "0.30.1")]
    check = checks_for("linux", system="Linux", peer_infos=odd)["same versions"]
    assert check.status == "FAIL"
    assert check.detail == (
        f"this node has thunderpool {__version__} / mlx 0.32.4; "
        "studio-c has thunderpool 0.0.9 / mlx 0.30.1"
    )
    assert check.fix == f"on every node: pip install thunderpool=={__version__} mlx==0.32.4"


def test_parse_peer():
    assert parse_peer("192.168.1.20:7070") == ("192.168.1.20", 7070)
    assert parse_peer("[fd00::2]:7070") == ("fd00::2", 7070)
    for bad in ("host", ":7070", "host:0", "host:70000", "host:x"):
        with pytest.raises(ValueError, match="is not host:port"):
            parse_peer(bad)


def test_real_sockets_on_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        assert try_connect("127.0.0.1", port, 2.0) is None
        held = try_bind(port)
        assert held is not None and held.errno == errno.EADDRINUSE
    refused = try_connect("127.0.0.1", port, 2.0)
    assert isinstance(refused, ConnectionRefusedError)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="thunderpool")
    add_doctor_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_doctor_main_exit_codes(capsys, monkeypatch):
    """The real checks on this machine: 0 with no failure, 1 once a peer cannot be reached."""
    monkeypatch.setenv("COLUMNS", "300")  # so rich does not wrap the lines looked for below
    port = _free_port()
    args = _parse(["doctor", "--port", str(port), "--ring-ports", f"{port + 2}-{port + 3}"])
    assert args.peers == [] and args.ring_ports == (port + 2, port + 3)
    assert doctor_main(args) == 0
    out = capsys.readouterr().out
    assert "thunderpool doctor" in out and f"mlx {mx.__version__} imports" in out

    closed = _free_port()
    args = _parse(["doctor", "--port", str(port), "--peers", f"127.0.0.1:{closed}"])
    assert doctor_main(args) == 1
    assert f"127.0.0.1:{closed}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--peers", "nope"], ["--ring-ports", "5-3"]])
def test_doctor_parser_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(["doctor", *argv])
    assert exit_.value.code == 2
    assert argv[1] in capsys.readouterr().err


def test_thunderbolt_without_links_or_ports_warns():
    idle = "Port:\n  Status: No device connected\n  Speed: Up to 80 Gb/s\n"
    check = check_thunderbolt(0, idle)
    assert (check.status, check.detail) == (
        "WARN",
        "no Thunderbolt device connected (ports up to 80 Gb/s)",
    )
    assert check_thunderbolt(127, "").status == "WARN"


def test_linux_on_the_reference_blas_warns_with_the_install_line(monkeypatch):
    monkeypatch.delenv("THUNDERPOOL_BLAS", raising=False)
    checks = checks_for("linux", system="Linux", blas=lambda: {})
    blas = checks["BLAS"]
    assert blas.status == "WARN"
    assert blas.detail == (
        "ranks run mlx's bundled reference BLAS, ~30x slower at prefill: "
        "no BLIS or OpenBLAS is installed"
    )
    assert blas.fix == "sudo apt-get install -y libblis4-pthread"
    monkeypatch.setenv("THUNDERPOOL_BLAS", "reference")
    off = checks_for("linux", system="Linux", blas=lambda: {})["BLAS"]
    assert (off.status, off.fix) == ("WARN", "unset THUNDERPOOL_BLAS")
    assert "BLAS" not in checks_for("macos26_rdma_tb5")  # Accelerate: nothing to check


def test_doctor_main_asks_the_local_agent_for_the_peers(capsys, monkeypatch, tmp_path):
    """Without --join, doctor asks this machine's agent (127.0.0.1:PORT, the stored token) for
    the cluster and compares this node with the peers it reports: here one that claims this
    machine's host id under another name."""
    import json

    from thunderpool.cluster.control.coordinator import Coordinator
    from thunderpool.cluster.control.messages import Hello
    from thunderpool.cluster.control.state import ClusterState, apply
    from thunderpool.cluster.node.capabilities import node_info

    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setenv("THUNDERPOOL_HOME", str(tmp_path))
    monkeypatch.delenv("THUNDERPOOL_TOKEN", raising=False)
    (tmp_path / "identity.json").write_text(json.dumps({"node_id": "me", "token": "tok"}))
    here = node_info(7070, "me", measure=False)
    twin = peer("other-box", __version__, mx.__version__).model_copy(
        update={"host_id": here.host_id}
    )
    asked = []

    def discover(self):
        asked.append((self.seeds, self.token))
        state = apply(ClusterState(), Hello(node=here, contact="127.0.0.1:7070"))
        return apply(state, Hello(node=twin, contact="10.0.0.9:7070"))

    monkeypatch.setattr(Coordinator, "discover", discover)
    port = _free_port()
    args = _parse(["doctor", "--port", str(port), "--ring-ports", f"{port + 2}-{port + 3}"])
    assert doctor_main(args) == 1
    assert asked == [([f"127.0.0.1:{port}"], "tok")]
    out = capsys.readouterr().out
    assert f"{here.name}, other-box report one host id {here.host_id}" in out


def test_probes_ask_the_installed_mlx():
    """jaccl by name (`is_available(backend=...)`, never None on an MLX that takes it); no
    Metal working set off a Mac."""
    assert probe_jaccl() is mx.distributed.is_available(backend="jaccl")
    if mx.default_device() == mx.cpu:
        assert probe_working_set() is None
