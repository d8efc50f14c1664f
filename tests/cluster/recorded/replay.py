"""A fake `run` that answers commands from recorded outputs (tests/cluster/recorded/<scene>/)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

RECORDED = Path(__file__).parent

# argv -> the file holding that command's recorded stdout; a missing file means "not found".
FILES = {
    ("sw_vers", "-productVersion"): "sw_vers.txt",
    ("rdma_ctl", "status"): "rdma_ctl_status.txt",
    ("ibv_devices",): "ibv_devices.txt",
    ("ibv_devinfo",): "ibv_devinfo.txt",
    ("netstat", "-rn", "-f", "inet"): "netstat_rn.txt",
    ("system_profiler", "SPThunderboltDataType"): "system_profiler_thunderbolt.txt",
    ("networksetup", "-listallnetworkservices"): "networksetup_listallnetworkservices.txt",
    ("networksetup", "-listallhardwareports"): "networksetup_listallhardwareports.txt",
    ("ifconfig",): "ifconfig.txt",
    ("/usr/libexec/ApplicationFirewall/socketfilterfw", "--getglobalstate"): "socketfilterfw.txt",
    ("sysctl", "-n", "machdep.cpu.brand_string"): "sysctl_brand.txt",
    ("sysctl", "-n", "hw.memsize"): "sysctl_memsize.txt",
    ("vm_stat",): "vm_stat.txt",
    ("ip", "-j", "addr"): "ip_j_addr.json",
    ("ip", "-V"): "ip_V.txt",
    ("system_profiler", "SPThunderboltDataType", "-json"): "system_profiler_thunderbolt.json",
    ("ioreg", "-rd1", "-c", "IOPlatformExpertDevice"): "ioreg_platform.txt",
    ("sysctl", "-n", "kern.uuid"): "sysctl_kern_uuid.txt",
    ("ipconfig", "getifaddr", "en0"): "ipconfig_getifaddr_en0.txt",
    ("sysctl", "-n", "iogpu.wired_limit_mb"): "sysctl_iogpu_wired_limit_mb.txt",
    ("sysctl", "-n", "hw.perflevel0.physicalcpu"): "sysctl_perflevel0_physicalcpu.txt",
    ("ioreg", "-a", "-l", "-r", "-c", "AppleThunderboltIPPort"): "ioreg_thunderbolt_ip.plist",
    ("ps", "-axo", "pid=,ppid=,command="): "ps_axo.txt",
}


class Replay:
    """Replays one scene and remembers every argv it was asked."""

    def __init__(self, scene: str | Path):
        self.dir = RECORDED / scene  # an absolute path stays as it is
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> tuple[int, str]:
        argv = tuple(argv)
        self.calls.append(argv)
        name = FILES.get(argv)
        if name is None or not (self.dir / name).exists():
            return 127, ""
        return 0, (self.dir / name).read_text()
