"""A node's self-report (NodeInfo): hardware, versions, MLX backends and network interfaces.

Each probe is a small parser over one command's text output, so tests feed recorded outputs from
macOS and Linux through a fake `run`. Nothing is cached and nothing is sent over the network.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from thunderpool import __version__
from thunderpool.cluster.control.messages import NodeInfo, ThunderboltPort
from thunderpool.cluster.node import metal
from thunderpool.cluster.node.facts import (
    RDMA_MIN_MACOS,
    backends,
    cgroup_memory,
    linux_interfaces,
    linux_routes,
    macos_interfaces,
    parse_cpuinfo,
    parse_hardware_ports,
    parse_ibv_devices,
    parse_ibv_devinfo,
    parse_macos_version,
    parse_meminfo,
    parse_memsize,
    parse_netstat_routes,
    parse_platform_uuid,
    parse_rdma_ctl,
    parse_vm_stat,
    version_text,
)
from thunderpool.cluster.node.measure import (
    _copy_size,
    measure_host_bandwidth,
    measure_rank_speed,
    measuring_alone,
    usable_cores,
)
from thunderpool.cluster.node.thunderbolt import parse_thunderbolt
from thunderpool.cores import work_cores

Runner = Callable[[Sequence[str]], tuple[int, str]]
NETSTAT = ("netstat", "-rn", "-f", "inet")  # macOS's IPv4 routing table


def subprocess_runner(argv: Sequence[str]) -> tuple[int, str]:
    """Run argv and return (returncode, stdout); a missing command is 127, a hung one 124."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=15, check=False)
    except FileNotFoundError:
        return 127, ""
    except subprocess.TimeoutExpired:
        return 124, ""
    return done.returncode, done.stdout


def _output(run: Runner, *argv: str) -> str | None:
    code, out = run(argv)
    return out if code == 0 else None


# ---- versions and hardware ------------------------------------------------------------------


# ---- RDMA and backends ----------------------------------------------------------------------


# ---- interfaces -----------------------------------------------------------------------------


# ---- quick measurements ---------------------------------------------------------------------


def host_id(macos: bool, run: Runner, root: Path, override: str | None = None) -> str:
    """Same for every agent on one machine and different between machines: the kernel's boot
    id (Linux), the hardware's IOPlatformUUID (macOS; `kern.uuid` is the kernel *build*'s,
    equal on every Mac of one macOS build), else that boot's session UUID.
    `override` (`node --host-id`) tells apart agents that share the kernel but not their cores
    and memory (containers with their own cpusets), which the boot id cannot."""
    if override:
        return override
    if macos:
        found = parse_platform_uuid(_output(run, "ioreg", "-rd1", "-c", "IOPlatformExpertDevice"))
        return found or (_output(run, "sysctl", "-n", "kern.bootsessionuuid") or "").strip()
    try:
        return (root / "proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def mlx_version() -> str:
    try:
        import mlx.core as mx
    except ImportError:
        return "not installed"
    return mx.__version__


# ---- the report -----------------------------------------------------------------------------


def node_info(
    port: int,
    node_id: str,
    measure: bool = True,
    run: Runner = subprocess_runner,
    *,
    system: str | None = None,
    root: Path = Path("/"),
    host: str | None = None,
    metal_info: Callable[[], dict | None] = metal.device_info,
) -> NodeInfo:
    """This node's NodeInfo. `system` ("Darwin"/"Linux") and `root` (where /proc and /sys are)
    exist so tests can replay another machine's recorded outputs; `host` overrides host_id."""
    system = system or platform.system()
    rdma_devices: tuple[str, ...] = ()
    rdma_active: tuple[str, ...] | None = None
    thunderbolt: tuple[ThunderboltPort, ...] = ()
    gpu = None
    rdma_enabled = False
    macos = None
    if system == "Darwin":
        macos = parse_macos_version(_output(run, "sw_vers", "-productVersion"))
        os_name = f"macOS {version_text(macos)}" if macos else f"macOS {platform.mac_ver()[0]}"
        chip = (_output(run, "sysctl", "-n", "machdep.cpu.brand_string") or "").strip()
        total = parse_memsize(_output(run, "sysctl", "-n", "hw.memsize") or "0")
        available = parse_vm_stat(_output(run, "vm_stat") or "")
        # The planner's budget is what Metal will wire, less a reserve (cluster/node/metal.py).
        gpu = metal.budget(total, metal_info(), _output(run, *metal.WIRED_LIMIT))
        available = min(available, gpu.bytes) if gpu else available
        rdma_enabled = parse_rdma_ctl(_output(run, "rdma_ctl", "status"))
        rdma_devices = parse_ibv_devices(_output(run, "ibv_devices"))
        ports_state = _output(run, "ibv_devinfo")
        if ports_state is not None:  # a port listed by ibv_devices may be down (no live cable)
            states = parse_ibv_devinfo(ports_state)
            rdma_active = tuple(d for d, (s, _) in states.items() if s == "PORT_ACTIVE")
        routes = parse_netstat_routes(_output(run, *NETSTAT))
        ports = parse_hardware_ports(_output(run, "networksetup", "-listallhardwareports") or "")
        interfaces = macos_interfaces(_output(run, "ifconfig") or "", ports, rdma_devices)
        thunderbolt = parse_thunderbolt(
            _output(run, "system_profiler", "SPThunderboltDataType", "-json"), ports
        )
    else:
        os_name = f"{system} {platform.release()}"
        chip = parse_cpuinfo((root / "proc/cpuinfo").read_text())
        total, available = parse_meminfo((root / "proc/meminfo").read_text())
        total, available = cgroup_memory(root, total, available)
        interfaces = linux_interfaces(
            _output(run, "ip", "-j", "addr") or "[]", root / "sys/class/net"
        )
        routes = linux_routes(_output(run, "ip", "-j", "-4", "route"))
    rdma = macos is not None and macos >= RDMA_MIN_MACOS and rdma_enabled
    speeds = _speeds(available) if measure else {}
    has_mpirun = run(("mpirun", "--version"))[0] == 0
    return NodeInfo(
        node_id=node_id,
        name=socket.gethostname(),
        port=port,
        version=__version__,
        mlx_version=mlx_version(),
        python_version=platform.python_version(),
        os=os_name,
        chip=chip or platform.processor() or platform.machine(),
        # A Mac counts its performance cores: work split over efficiency cores waits on them.
        cpu_count=work_cores("darwin", run) if system == "Darwin" else len(usable_cores()),
        memory_total_bytes=total,
        memory_available_bytes=available,
        **speeds,
        host_id=host_id(system == "Darwin", run, root, host),
        backends=backends(macos, rdma, has_mpirun),
        rdma=rdma,
        interfaces=interfaces,
        rdma_devices=rdma_devices,
        rdma_active=rdma_active,
        routes=routes,
        thunderbolt=thunderbolt,
        gpu_wired_limit_bytes=gpu.wired_limit_bytes if gpu else 0,
        memory_budget=gpu.describe() if gpu else "",
    )


def _speeds(available: int) -> dict[str, float]:
    """NodeInfo's measured fields: a rank's speed on all cores and on one pinned core, and
    the host's bandwidth across processes; timed alone on this machine."""
    with measuring_alone():
        mem_bw, short_bw, flops, op_latency, split_bw = measure_rank_speed(_copy_size(available))
        host_bw = measure_host_bandwidth(len(usable_cores()))
        cores = usable_cores() if hasattr(os, "sched_getaffinity") else []
        core_bw = core_flops = core_op = 0.0
        if len(cores) > 1:  # ranks are pinned only where the OS lets us (Linux)
            pinned = measure_rank_speed(_copy_size(available), cores[0])
            core_bw, _, core_flops, core_op, _ = pinned
    return {
        "mem_bw_Bps": mem_bw,
        "host_mem_bw_Bps": host_bw,
        "core_mem_bw_Bps": core_bw,
        "core_flops": core_flops,
        "core_op_latency_s": core_op,
        "op_latency_s": op_latency,
        "short_row_mem_bw_Bps": short_bw,
        "split_mem_bw_Bps": split_bw,
        "flops": flops,
    }


if __name__ == "__main__":  # a quick look: python -m thunderpool.cluster.node.capabilities
    print(node_info(0, "local").model_dump_json(indent=2))
