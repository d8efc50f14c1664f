"""node_info on recorded Linux and macOS outputs (exact values), and once for real on this box."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from recorded.replay import RECORDED, Replay

from thunderpool import __version__
from thunderpool.cluster.control.messages import Interface
from thunderpool.cluster.node.capabilities import node_info
from thunderpool.cluster.node.facts import (
    backends,
    parse_cpuinfo,
    parse_hardware_ports,
    parse_ibv_devices,
    parse_macos_version,
    parse_meminfo,
    parse_rdma_ctl,
    parse_vm_stat,
)

LINUX = RECORDED / "linux"


def iface(
    name: str, address: str, kind: str, rdma: str | None = None, prefix: int = 24
) -> Interface:
    return Interface(name=name, address=address, kind=kind, rdma_device=rdma, prefix=prefix)


def test_linux_recorded_node_info():
    run = Replay("linux")
    info = node_info(7070, "n1", measure=False, run=run, system="Linux", root=LINUX)
    # lo is loopback, docker0 is down, enp6s0 has only IPv6: none of them is reported.
    assert info.interfaces == (
        iface("enp5s0", "192.168.1.30", "ethernet"),
        iface("wlp3s0", "192.168.1.31", "wifi"),
        iface("veth-tp1", "10.77.0.1", "ethernet"),
        iface("wg0", "10.8.0.2", "other"),
    )
    assert info.memory_total_bytes == 65776532 * 1024 == 67355168768
    assert info.memory_available_bytes == 58114316 * 1024 == 59509059584
    assert info.chip == "AMD Ryzen 9 7950X 16-Core Processor"
    assert info.os == f"Linux {platform.release()}"
    assert (info.node_id, info.port, info.name) == ("n1", 7070, socket.gethostname())
    assert (info.version, info.mlx_version) == (__version__, mx.__version__)
    assert info.python_version == platform.python_version()
    assert info.backends == ("ring",) and info.rdma is False
    assert (info.mem_bw_Bps, info.flops) == (0.0, 0.0)
    # Nothing Mac-only was asked on Linux.
    assert set(run.calls) == {
        ("ip", "-j", "addr"),
        ("ip", "-j", "-4", "route"),
        ("mpirun", "--version"),
    }


def test_macos_26_rdma_tb5_node_info():
    info = node_info(7070, "m1", measure=False, run=Replay("macos26_rdma_tb5"), system="Darwin")
    # en2 has no IPv4 address; en3/en4 carry the RDMA links ibv_devices lists; bridge0 is down.
    assert info.interfaces == (
        iface("en0", "192.168.1.20", "ethernet"),
        iface("en1", "192.168.1.21", "wifi"),
        iface("en3", "192.168.0.1", "rdma", "rdma_en3", 30),
        iface("en4", "192.168.0.5", "rdma", "rdma_en4", 30),
    )
    assert info.os == "macOS 26.2"
    assert info.chip == "Apple M3 Ultra"
    assert info.memory_total_bytes == 549755813888
    # free + inactive + speculative pages of 16 KiB.
    assert info.memory_available_bytes == (20185311 + 5011722 + 93417) * 16384 == 414358732800
    assert info.rdma is True
    assert info.backends == ("ring", "jaccl")


def test_macos_15_node_info_has_no_rdma():
    info = node_info(7070, "m2", measure=False, run=Replay("macos15"), system="Darwin")
    # The bridge (default on) holds the only Thunderbolt address.
    assert info.interfaces == (
        iface("en0", "10.0.0.42", "wifi"),
        iface("bridge0", "169.254.118.9", "thunderbolt", prefix=16),
    )
    assert (info.os, info.chip) == ("macOS 15.5", "Apple M2 Max")
    assert info.memory_total_bytes == 34359738368
    assert info.memory_available_bytes == (31207 + 772960 + 12014) * 16384 == 13372309504
    assert (info.rdma, info.backends) == (False, ("ring",))


def test_macos_26_rdma_disabled_has_no_jaccl():
    info = node_info(7070, "m3", measure=False, run=Replay("macos26_rdma_off_tb4"), system="Darwin")
    assert (info.rdma, info.backends) == (False, ("ring",))


def test_mpirun_on_path_adds_mpi():
    def run(argv):
        return (0, "mpirun (Open MPI) 5.0.6\n") if argv[0] == "mpirun" else Replay("linux")(argv)

    info = node_info(1, "n", measure=False, run=run, system="Linux", root=LINUX)
    assert info.backends == ("ring", "mpi")


def test_parsers_edge_cases():
    assert parse_macos_version("26.2\n") == (26, 2)
    assert parse_macos_version("15.7.1") == (15, 7, 1)
    assert parse_macos_version("") is None and parse_macos_version(None) is None
    assert parse_rdma_ctl("enabled\n") is True
    assert parse_rdma_ctl("disabled\n") is False
    assert parse_rdma_ctl("RDMA is not enabled") is False
    assert parse_rdma_ctl(None) is False
    assert parse_ibv_devices((RECORDED / "macos26_rdma_tb5/ibv_devices.txt").read_text()) == (
        "rdma_en3",
        "rdma_en4",
    )
    assert parse_ibv_devices((RECORDED / "macos26_rdma_off_tb4/ibv_devices.txt").read_text()) == ()
    ports = parse_hardware_ports(
        (RECORDED / "macos15/networksetup_listallhardwareports.txt").read_text()
    )
    assert ports == {
        "en0": "Wi-Fi",
        "bridge0": "Thunderbolt Bridge",
        "en1": "Thunderbolt 1",
        "en2": "Thunderbolt 2",
    }
    assert parse_vm_stat("Pages free: 10.\nPages inactive: 5.\n") == 15 * 4096  # no header
    assert parse_cpuinfo("processor\t: 0\nHardware\t: BCM2835\n") == "BCM2835"
    assert backends((26, 1), True, False) == ("ring",)
    assert backends((26, 2), True, False) == ("ring", "jaccl")


def test_meminfo_without_memtotal_names_the_file():
    with pytest.raises(ValueError, match="MemTotal"):
        parse_meminfo("MemFree: 1 kB\n")


def test_real_node_info_on_this_machine():
    """Unfaked: real commands, real /proc and real measurements on this Linux box."""
    if platform.system() != "Linux":
        pytest.skip("compares against /proc/meminfo")
    info = node_info(7070, "real")
    total_kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert info.memory_total_bytes == total_kib * 1024
    assert 0 < info.memory_available_bytes <= info.memory_total_bytes
    assert info.mem_bw_Bps > 0 and info.flops > 0
    if len(os.sched_getaffinity(0)) > 1:
        assert info.core_mem_bw_Bps > 0 and info.core_flops > 0
    assert info.op_latency_s > 0  # MLX's CPU backend: measured, not calibrated
    assert info.short_row_mem_bw_Bps > 0
    assert "ring" in info.backends
    assert all(i.kind != "loopback" and not i.address.startswith("127.") for i in info.interfaces)


def test_agents_on_one_machine_measure_one_at_a_time(tmp_path):
    """While one agent process holds the measurement lock, another waits for it."""
    import subprocess
    import sys
    import threading

    from thunderpool.cluster.node.measure import measuring_alone

    lock = tmp_path / "measure.lock"
    code = (
        "import sys; from pathlib import Path; "
        "from thunderpool.cluster.node.capabilities import measuring_alone\n"
        f"with measuring_alone(Path({str(lock)!r})):\n"
        "    print('held', flush=True); sys.stdin.readline()\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "held"
        got = threading.Event()

        def measure():
            with measuring_alone(lock):
                got.set()

        threading.Thread(target=measure, daemon=True).start()
        assert not got.wait(0.5)  # blocked while the other process measures
        other.stdin.write("done\n")
        other.stdin.flush()
        assert got.wait(10)
    finally:
        other.kill()
        other.wait()


def test_pinned_speed_is_measured_as_a_pinned_rank_runs(monkeypatch):
    """The child runs on the given core with one BLAS thread and the ranks' fast BLAS."""
    from thunderpool.cluster.node import capabilities
    from thunderpool.launch.blas import fast_blas_env

    seen = {}

    def fake_run(argv, env, **kw):
        seen.update(argv=argv, env=env)
        return subprocess.CompletedProcess(argv, 0, stdout="4e9 2e9 6e10 3e-05 0\n")

    monkeypatch.setattr(capabilities.subprocess, "run", fake_run)
    assert capabilities.measure_rank_speed(2**24, core=1) == (4e9, 2e9, 6e10, 3e-05, 0)
    assert seen["argv"][-2:] == [str(2**24), "1"]
    env = seen["env"]
    assert env["OPENBLAS_NUM_THREADS"] == env["BLIS_NUM_THREADS"] == "1"
    assert env.get("LD_PRELOAD") == fast_blas_env().get("LD_PRELOAD")

    def failing(argv, env, **kw):
        raise subprocess.TimeoutExpired(argv, 120)

    monkeypatch.setattr(capabilities.subprocess, "run", failing)
    assert capabilities.measure_rank_speed(2**24, core=1) == (
        0,
        0,
        0,
        0,
        0,
    )  # planner keeps its rates


def test_host_id_is_the_boot_id_unless_overridden(tmp_path):
    """Containers on one machine share its boot id; --host-id tells them apart."""
    boot = tmp_path / "proc/sys/kernel/random/boot_id"
    boot.parent.mkdir(parents=True)
    boot.write_text("0b5c3e2a-boot\n")
    (tmp_path / "proc/cpuinfo").write_text((LINUX / "proc/cpuinfo").read_text())
    (tmp_path / "proc/meminfo").write_text((LINUX / "proc/meminfo").read_text())
    run = Replay("linux")
    kw = {"measure": False, "run": run, "system": "Linux", "root": tmp_path}
    assert node_info(7070, "a", **kw).host_id == "0b5c3e2a-boot"
    assert node_info(7070, "a", host="box-a", **kw).host_id == "box-a"


def test_cpu_count_is_the_cores_the_agent_may_use(monkeypatch):
    """A container pinned to cores 4-5 of a 16-core machine reports 2, and pins its ranks there."""
    from thunderpool.launch.local import own_core

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this OS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 4})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    info = node_info(7070, "c", measure=False, run=Replay("linux"), system="Linux", root=LINUX)
    assert info.cpu_count == 2
    # The coordinator numbers a machine's ranks 0, 1, ...: the agent maps them onto its cores.
    assert [own_core(i) for i in (0, 1, None)] == [4, 5, None]


def test_node_host_id_flag_then_environment(monkeypatch):
    from thunderpool.cli import build_parser
    from thunderpool.cli.node import host_override

    monkeypatch.delenv("THUNDERPOOL_HOST_ID", raising=False)
    assert host_override(build_parser().parse_args(["node"])) is None
    monkeypatch.setenv("THUNDERPOOL_HOST_ID", " box-env ")
    assert host_override(build_parser().parse_args(["node"])) == "box-env"
    flagged = build_parser().parse_args(["node", "--host-id", "box-flag"])
    assert host_override(flagged) == "box-flag"


def test_memory_is_capped_by_the_cgroup_limit(tmp_path):
    """A container started with --memory 8g on a 64 GiB machine reports 8 GiB, and as free
    what its cgroup has left (page cache it can drop counts as free); no limit: /proc/meminfo."""
    from thunderpool.cluster.node.facts import cgroup_memory

    total, free = 64 * 2**30, 50 * 2**30
    assert cgroup_memory(tmp_path, total, free) == (total, free)  # no cgroup files
    v2 = tmp_path / "sys/fs/cgroup"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text(f"{2**30}\n")
    assert cgroup_memory(tmp_path, total, free) == (total, free)
    (v2 / "memory.max").write_text(f"{8 * 2**30}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {2**29}\nactive_file 7\n")
    assert cgroup_memory(tmp_path, total, free) == (8 * 2**30, 7 * 2**30 + 2**29)
    # cgroup v1: "unlimited" is a huge number.
    for f in ("memory.max", "memory.current", "memory.stat"):
        (v2 / f).unlink()
    v1 = v2 / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    assert cgroup_memory(tmp_path, total, free) == (total, free)
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * 2**30}\n")
    assert cgroup_memory(tmp_path, total, free) == (4 * 2**30, 3 * 2**30)
