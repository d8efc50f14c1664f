"""What a node's own tools say about it, parsed: recorded outputs of sysctl, vm_stat, ifconfig,
networksetup, rdma_ctl, ibv_devices, /proc and ip (tests/mac holds them in their exact formats).
Pure functions; gathering them and measuring the machine is capabilities.py's."""

from __future__ import annotations

import contextlib
import json
import platform
import re
from collections.abc import Sequence
from pathlib import Path

from thunderpool.cluster.control.messages import Interface, LinkKind, Route

# jaccl (RDMA over Thunderbolt) ships with macOS 26.2.
RDMA_MIN_MACOS = (26, 2)


def parse_macos_version(text: str | None) -> tuple[int, ...] | None:
    """`sw_vers -productVersion` ("26.2\\n") -> (26, 2); None when unreadable."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in version)


def parse_cpuinfo(text: str) -> str:
    """/proc/cpuinfo -> the CPU model; ARM boards without "model name" fall back to others."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    for key in ("model name", "Hardware", "Model", "cpu model"):
        if fields.get(key):
            return fields[key]
    return platform.machine() or "unknown"


def parse_meminfo(text: str) -> tuple[int, int]:
    """/proc/meminfo -> (MemTotal, MemAvailable) in bytes (the file counts in KiB)."""
    values = {}
    for line in text.splitlines():
        match = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    if "MemTotal" not in values:
        raise ValueError("/proc/meminfo has no MemTotal line; is /proc mounted?")
    # MemAvailable exists since Linux 3.14; older kernels only report MemFree.
    return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", 0))


# (limit, usage, memory.stat's reclaimable page-cache key) of cgroup v2, then v1.
CGROUP_MEMORY = (
    ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current", "inactive_file"),
    (
        "sys/fs/cgroup/memory/memory.limit_in_bytes",
        "sys/fs/cgroup/memory/memory.usage_in_bytes",
        "total_inactive_file",
    ),
)


def cgroup_memory(root: Path, total: int, available: int) -> tuple[int, int]:
    """(total, available) within this process's cgroup memory limit (a container's `--memory`),
    which /proc/meminfo does not show; unchanged without a limit below `total`."""
    for limit_file, usage_file, cache_key in CGROUP_MEMORY:
        try:
            limit = int((root / limit_file).read_text().strip())  # v2 writes "max": no limit
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= total:
            return total, available
        cache = 0
        with contextlib.suppress(OSError, ValueError):
            stat = (root / limit_file).with_name("memory.stat")
            for line in stat.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = int(value)
        return limit, max(0, min(available, limit - usage + cache))
    return total, available


def parse_memsize(text: str) -> int:
    """`sysctl hw.memsize` ("hw.memsize: 68719476736") or `sysctl -n hw.memsize` -> bytes."""
    return int(text.rsplit(":", 1)[-1].strip())


def parse_vm_stat(text: str) -> int:
    """`vm_stat` -> available bytes: free + inactive (+ speculative, which vm_stat keeps apart
    from free) pages times the page size from its header."""
    page = re.search(r"page size of (\d+) bytes", text)
    page_size = int(page.group(1)) if page else 4096
    pages = {k.strip(): int(v) for k, v in re.findall(r"^Pages ([\w ]+):\s+(\d+)\.", text, re.M)}
    return page_size * sum(pages.get(k, 0) for k in ("free", "inactive", "speculative"))


def parse_rdma_ctl(text: str | None) -> bool:
    """`rdma_ctl status` prints "enabled" or "disabled"."""
    words = re.findall(r"[a-z]+", (text or "").lower())
    return "enabled" in words and "disabled" not in words and "not" not in words


def parse_ibv_devices(text: str | None) -> tuple[str, ...]:
    """`ibv_devices` -> the device names under its two header lines, e.g. ("rdma_en2",)."""
    devices = []
    for line in (text or "").splitlines():
        fields = line.split()
        if fields and fields[0] not in ("device", "------"):
            devices.append(fields[0])
    return tuple(devices)


def parse_ibv_devinfo(text: str | None) -> dict[str, tuple[str, int | None]]:
    """`ibv_devinfo` -> {device: (its port's state, active MTU)}, e.g. {"rdma_en2":
    ("PORT_ACTIVE", 1024)}; one port per device, as macOS has (the first port counts)."""
    found: dict[str, tuple[str, int | None]] = {}
    device = None
    for line in (text or "").splitlines():
        key, _, value = line.strip().partition(":")
        value = value.strip()
        if key == "hca_id":
            device = value
        elif device and key == "state" and device not in found:
            found[device] = (value.split()[0] if value else "", None)
        elif device and key == "active_mtu" and device in found and found[device][1] is None:
            mtu = value.split()[0] if value else ""
            found[device] = (found[device][0], int(mtu) if mtu.isdigit() else None)
    return found


def parse_thunderbolt_text(text: str) -> list[tuple[bool, int, bool]]:
    """`system_profiler SPThunderboltDataType` -> (device connected, Gb/s, whether that is the
    live link's speed) for each port of this Mac. A connected port prints its link's speed
    ("Speed: 80 Gb/s"), an idle one what it could do ("Speed: Up to 120 Gb/s"); a connected
    device's "Port (Upstream)" is the same link seen from the far end and is skipped."""
    ports: list[tuple[bool, int, bool]] = []
    host_port = connected = False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Port"):
            host_port = line == "Port:"
        elif line.startswith("Status:"):
            connected = line.split(":", 1)[1].strip().lower() == "device connected"
        speed = re.match(r"Speed: (Up to )?(\d+) Gb/s", line)
        if speed and host_port:
            ports.append((connected, int(speed.group(2)), speed.group(1) is None))
    return ports


def _netstat_network(text: str) -> str | None:
    """netstat's destination -> a network: "default" is 0.0.0.0/0; "192.168.0" (octets left
    out) is 192.168.0.0/24; "10.8/16" keeps its prefix; a full address is a host (/32)."""
    if text == "default":
        return "0.0.0.0/0"
    head, _, prefix = text.partition("/")
    octets = head.split(".")
    if not all(o.isdigit() for o in octets) or len(octets) > 4:
        return None  # IPv6 or a link-layer name
    bits = prefix if prefix.isdigit() else str(8 * len(octets))
    return ".".join([*octets, *["0"] * (4 - len(octets))]) + f"/{bits}"


def parse_netstat_routes(text: str | None) -> tuple[Route, ...]:
    """macOS `netstat -rn -f inet` -> the IPv4 routes (destination, interface, gateway)."""
    found = []
    for line in (text or "").splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[0] == "Destination":
            continue
        network = _netstat_network(fields[0])
        if network is not None:
            gateway = "" if fields[1].startswith("link#") or ":" in fields[1] else fields[1]
            found.append(Route(destination=network, interface=fields[3], gateway=gateway))
    return tuple(found)


def linux_routes(ip_json: str | None) -> tuple[Route, ...]:
    """`ip -j -4 route` -> the IPv4 routes (the main table)."""
    found = []
    for r in json.loads(ip_json or "[]"):
        dst = r.get("dst", "")
        network = "0.0.0.0/0" if dst == "default" else dst if "/" in dst else f"{dst}/32"
        if r.get("dev") and dst:
            found.append(
                Route(destination=network, interface=r["dev"], gateway=r.get("gateway", ""))
            )
    return tuple(found)


def backends(
    macos: tuple[int, ...] | None, rdma_enabled: bool, has_mpirun: bool
) -> tuple[str, ...]:
    found = ["ring"]
    if macos is not None and macos >= RDMA_MIN_MACOS and rdma_enabled:
        found.append("jaccl")
    if has_mpirun:
        found.append("mpi")
    return tuple(found)


def parse_hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` -> {device: port}, e.g. {"en2": "Thunderbolt 1"}."""
    ports: dict[str, str] = {}
    port = None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            port = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and port is not None:
            ports[line.split(":", 1)[1].strip()] = port
            port = None
    return ports


def parse_ifconfig(text: str) -> dict[str, dict]:
    """macOS `ifconfig` -> {name: {"flags", "inet" (IPv4 addresses), "members", "active"}}."""
    found: dict[str, dict] = {}
    current: dict | None = None
    for line in text.splitlines():
        head = re.match(r"^(\S+): flags=\w+<([^>]*)>", line)
        if head:
            current = {"flags": head.group(2).split(","), "inet": [], "members": []}
            current["active"] = True
            found[head.group(1)] = current
            continue
        if current is None:
            continue
        fields = line.split()
        if fields[:1] == ["inet"] and len(fields) > 1:
            current["inet"].append((fields[1], _netmask_prefix(fields)))
        elif fields[:1] == ["member:"] and len(fields) > 1:
            current["members"].append(fields[1])
        elif fields[:1] == ["status:"]:
            current["active"] = fields[1:2] == ["active"]
    return found


def _netmask_prefix(fields: list[str]) -> int | None:
    """ifconfig's "inet A netmask 0xfffffffc ..." -> 30."""
    if "netmask" not in fields[:-1]:
        return None
    mask = fields[fields.index("netmask") + 1]
    try:
        return bin(int(mask, 16) if mask.startswith("0x") else int(mask)).count("1")
    except ValueError:
        return None


def macos_kind(port: str | None) -> LinkKind:
    """Classify a networksetup hardware port name."""
    name = (port or "").lower()
    if "wi-fi" in name or "airport" in name:
        return "wifi"
    # "Thunderbolt Ethernet Slot 1" is an Ethernet adapter that happens to sit on Thunderbolt.
    if "ethernet" in name or "lan" in name:
        return "ethernet"
    if name.startswith("thunderbolt"):
        return "thunderbolt"
    return "other"


def macos_interfaces(
    ifconfig: str, hardware_ports: dict[str, str], rdma_devices: Sequence[str]
) -> tuple[Interface, ...]:
    found = []
    for name, info in parse_ifconfig(ifconfig).items():
        if "LOOPBACK" in info["flags"] or "UP" not in info["flags"]:
            continue
        kind = macos_kind(hardware_ports.get(name))
        rdma = f"rdma_{name}" if f"rdma_{name}" in rdma_devices else None
        if rdma is not None:
            kind = "rdma"
        for address, prefix in info["inet"]:
            found.append(
                Interface(name=name, address=address, kind=kind, rdma_device=rdma, prefix=prefix)
            )
    return tuple(found)


def linux_interfaces(ip_json: str, sys_net: Path) -> tuple[Interface, ...]:
    """`ip -j addr` -> the up, non-loopback interfaces with an IPv4 address."""
    found = []
    for link in json.loads(ip_json or "[]"):
        flags = link.get("flags", [])
        if "LOOPBACK" in flags or "UP" not in flags:
            continue
        name = link["ifname"]
        if (sys_net / name / "wireless").exists():
            kind: LinkKind = "wifi"
        elif link.get("link_type") == "ether":  # physical NICs, veth and bridges alike
            kind = "ethernet"
        else:  # tun, wireguard, infiniband...
            kind = "other"
        for addr in link.get("addr_info", []):
            if addr.get("family") == "inet":
                prefix = addr.get("prefixlen")
                found.append(Interface(name=name, address=addr["local"], kind=kind, prefix=prefix))
    return tuple(found)


def parse_platform_uuid(text: str | None) -> str:
    """`ioreg -rd1 -c IOPlatformExpertDevice` -> the hardware's IOPlatformUUID, or ""."""
    match = re.search(r'"IOPlatformUUID"\s*=\s*"([^"]+)"', text or "")
    return match.group(1) if match else ""
