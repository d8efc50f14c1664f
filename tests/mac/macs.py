"""Recorded-format outputs of the macOS 26 tools for a box of identical Mac Studios cabled by
Thunderbolt 5, one scene per wiring: what `system_profiler SPThunderboltDataType -json`,
`networksetup -listallhardwareports`, `ifconfig`, `ibv_devices`, `ipconfig getifaddr en0`,
`ioreg -rd1 -c IOPlatformExpertDevice`, `sysctl` and friends print on each Mac.

The formats follow captures of those tools (tests/cluster/recorded/macos26_rdma_tb5 for
ifconfig, networksetup and ibv_devices; public `system_profiler -json` captures of cabled Macs
for the JSON: a bus per port, `_items` holding the peer Mac's domain UUID). Every Mac runs the
same macOS build, so `sysctl kern.uuid` is the same on all of them; only the hardware's
IOPlatformUUID tells them apart. Cable addresses are the per-cable /30s that
`mlx.distributed_config --auto-setup` assigns, unless a scene gives its own (the testbed).

`python3 tests/mac/macs.py` rewrites tests/mac/recorded/ from SCENES.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mac_rdma_use import Holder, ioreg_rdma, ps, rank_command
from mac_tools import ibv_devinfo, netstat, thunderbolt_text

from thunderpool.cluster.control.messages import ThunderboltPort
from thunderpool.cluster.node.thunderbolt import Cable, cable_addresses, cables

RECORDED = Path(__file__).with_name("recorded")
PORTS = 6  # Mac Studio (M3 Ultra): six Thunderbolt 5 receptacles, "Thunderbolt 1".."6"
KERNEL_BUILD_UUID = "C61F7E9A-2B3D-3C4E-9F5A-1B2C3D4E5F60"  # `sysctl kern.uuid`: one per build


def iface(port: int) -> str:
    """Thunderbolt k is en(k+1): en0 is Ethernet, en1 Wi-Fi."""
    return f"en{port + 1}"


def domain_uuid(mac: int, port: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"thunderpool-mac{mac}-port{port}")).upper()


def platform_uuid(mac: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"thunderpool-mac{mac}-platform")).upper()


@dataclass
class Scene:
    """n Macs; wires: (mac, port, mac, port) per cable; lan: each Mac's en0 address/prefix."""

    n: int
    wires: list[tuple[int, int, int, int]]
    lan: list[tuple[str, int]] = field(default_factory=list)
    addresses: dict[tuple[int, str], tuple[str, int]] | None = None  # (mac, iface) -> (ip, /)
    bridge_on: bool = False
    # Failure knobs (tests/mac/test_doctor_mac.py, test_doctor_fix_mac.py); the defaults render
    # the scenes above as before.
    rdma_off: bool = False  # `rdma_ctl status` says disabled; `ibv_devices` lists nothing
    wired_limit_mb: int | None = None  # `sysctl -n iogpu.wired_limit_mb` (0: Metal's default)
    tb4: frozenset[int] = frozenset()  # wires (by index) that link at 40 Gb/s (a TB4 cable)
    down: frozenset[int] = frozenset()  # wires whose RDMA ports `ibv_devinfo` shows PORT_DOWN
    wifi: list[tuple[str, int]] = field(default_factory=list)  # each Mac's en1 (Wi-Fi), if on
    cables_first: bool = False  # `ifconfig` lists the Thunderbolt ports before en0
    holders: tuple[Holder, ...] = ()  # processes holding RDMA devices (tests/mac/mac_rdma_use.py)
    stale: frozenset[tuple[int, int]] = frozenset()  # (mac, port): queue pairs no process holds

    def __post_init__(self) -> None:
        self.lan = self.lan or [(f"192.168.1.{20 + m}", 24) for m in range(self.n)]

    def peer(self, mac: int, port: int) -> tuple[int, int] | None:
        return self.wire(mac, port)[1]

    def wire(self, mac: int, port: int) -> tuple[int | None, tuple[int, int] | None]:
        """(the index of the wire in this port, the Mac and port at its other end)."""
        for k, (a, p, b, q) in enumerate(self.wires):
            if (a, p) == (mac, port):
                return k, (b, q)
            if (b, q) == (mac, port):
                return k, (a, p)
        return None, None

    def speed(self, mac: int, port: int) -> int | None:
        """The link's Gb/s on a cabled port (TB5 80, TB4 40); None: no cable."""
        k, _ = self.wire(mac, port)
        return None if k is None else 40 if k in self.tb4 else 80

    def cable_ips(self) -> dict[tuple[int, str], tuple[str, int]]:
        """(mac, iface) -> (address, prefix) on each cable end: the scene's own, else MLX's."""
        if self.addresses is not None:
            return self.addresses
        return {k: (ip, 30) for k, ip in cable_addresses(self.cables()).items()}

    def cables(self) -> list[Cable]:
        """The cables as cluster/node/thunderbolt.py finds them from the ports alone."""

        class _Node:  # just the ports, which is all cables() reads
            def __init__(self, ports):
                self.thunderbolt = ports

        nodes = []
        for m in range(self.n):
            ports = []
            for p in range(1, PORTS + 1):
                peer = self.peer(m, p)
                to = domain_uuid(*peer) if peer else None
                ports.append(
                    ThunderboltPort(iface=iface(p), uuid=domain_uuid(m, p), connected_to=to)
                )
            nodes.append(_Node(tuple(sorted(ports, key=lambda x: x.iface))))
        return cables(nodes)


def thunderbolt_json(scene: Scene, mac: int) -> str:
    buses = []
    for p in range(PORTS, 0, -1):  # system_profiler lists the highest bus first
        peer = scene.peer(mac, p)
        bus = {
            "_name": f"thunderboltusb4_bus_{p - 1}",
            "device_name_key": "Mac Studio",
            "domain_uuid_key": domain_uuid(mac, p),
            "receptacle_1_tag": {
                "current_speed_key": f"{scene.speed(mac, p)} Gb/s" if peer else "Up to 120 Gb/s",
                "link_status_key": "0x2" if peer else "0x100",
                "micro_version_key": "0.0.0",
                "receptacle_id_key": str(p),
                "receptacle_status_key": "receptacle_connected"
                if peer
                else "receptacle_no_devices_connected",
            },
            "route_string_key": "0",
            "switch_uid_key": f"0x05AC{mac:04X}{0x9810 + p:08X}",
            "vendor_name_key": "Apple Inc.",
        }
        if peer:
            service = str(uuid.uuid5(uuid.NAMESPACE_URL, f"svc{mac}{p}")).upper()
            item = {
                "_name": "Mac Studio",
                "device_id_key": "0xA",
                "device_name_key": "Mac15,14",
                "domain_uuid_key": domain_uuid(*peer),
                "services_title": [
                    {
                        "_name": "service_ip",
                        "protocol_id_key": 1,
                        "protocol_revision_key": 1,
                        "protocol_version_key": 1,
                        "service_uuid_key": service,
                    }
                ],
                "vendor_id_key": "0x0A27",
                "vendor_name_key": "Apple Inc.",
            }
            bus = {"_items": [item], **bus}
        buses.append(bus)
    return json.dumps({"SPThunderboltDataType": buses}, indent=2, separators=(",", " : ")) + "\n"


def hardware_ports(mac: int) -> str:
    mac_hex = f"6a:3e:55:8c:{mac:02x}"
    out = f"\nHardware Port: Ethernet\nDevice: en0\nEthernet Address: {mac_hex}:00\n"
    out += f"\nHardware Port: Wi-Fi\nDevice: en1\nEthernet Address: {mac_hex}:01\n"
    bridge = f"36:e5:a2:{mac:02x}:10:80"
    out += f"\nHardware Port: Thunderbolt Bridge\nDevice: bridge0\nEthernet Address: {bridge}\n"
    for p in range(1, PORTS + 1):
        out += f"\nHardware Port: Thunderbolt {p}\nDevice: {iface(p)}\n"
        out += f"Ethernet Address: 36:e5:a2:{mac:02x}:10:{0x80 + 4 * (p - 1):02x}\n"
    return out + "\nVLAN Configurations\n===================\n"


def _mask(prefix: int) -> str:
    return f"0x{(0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF:08x}"


def _broadcast(ip: str, prefix: int) -> str:
    import ipaddress

    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False).broadcast_address)


def ifconfig(scene: Scene, mac: int) -> str:
    lan_ip, lan_prefix = scene.lan[mac]
    ips = scene.cable_ips()
    out = [
        "lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384",
        "\toptions=1203<RXCSUM,TXCSUM,TXSTATUS,SW_TIMESTAMP>",
        "\tinet 127.0.0.1 netmask 0xff000000",
        "\tinet6 ::1 prefixlen 128 ",
        "\tinet6 fe80::1%lo0 prefixlen 64 scopeid 0x1 ",
        "\tnd6 options=201<PERFORMNUD,DAD>",
        "gif0: flags=8010<POINTOPOINT,MULTICAST> mtu 1280",
        "stf0: flags=0<> mtu 1280",
        "en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500",
        "\toptions=50b<RXCSUM,TXCSUM,VLAN_HWTAGGING,AV,CHANNEL_IO>",
        f"\tether 6a:3e:55:8c:{mac:02x}:00",
        f"\tinet6 fe80::14b1:2c7e:9a3d:{mac:04x}%en0 prefixlen 64 secured scopeid 0xb ",
        f"\tinet {lan_ip} netmask {_mask(lan_prefix)} broadcast {_broadcast(lan_ip, lan_prefix)}",
        "\tnd6 options=201<PERFORMNUD,DAD>",
        "\tmedia: autoselect (10GbaseT <full-duplex>)",
        "\tstatus: active",
        "en1: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500",
        "\toptions=6460<TSO4,TSO6,CHANNEL_IO,PARTIAL_CSUM,ZEROINVERT_CSUM>",
        f"\tether 6a:3e:55:8c:{mac:02x}:01",
    ]
    if scene.wifi:
        ip, prefix = scene.wifi[mac]
        out += [
            f"\tinet6 fe80::8c2:5aff:fe11:{mac:04x}%en1 prefixlen 64 secured scopeid 0xc ",
            f"\tinet {ip} netmask {_mask(prefix)} broadcast {_broadcast(ip, prefix)}",
        ]
    out += [
        "\tnd6 options=201<PERFORMNUD,DAD>",
        "\tmedia: autoselect",
        f"\tstatus: {'active' if scene.wifi else 'inactive'}",
    ]
    ports: list[str] = []
    for p in range(1, PORTS + 1):
        name, cabled = iface(p), scene.peer(mac, p) is not None
        ports += [
            f"{name}: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500",
            "\toptions=460<TSO4,TSO6,CHANNEL_IO>",
            f"\tether 36:e5:a2:{mac:02x}:10:{0x80 + 4 * (p - 1):02x}",
        ]
        if cabled:
            ports.append(
                f"\tinet6 fe80::34e5:a2ff:fe{mac:02x}:10{p:02x}%{name} prefixlen 64 "
                f"scopeid 0x{0xD + p:x} "
            )
        if (mac, name) in ips:
            ip, prefix = ips[mac, name]
            ports.append(f"\tinet {ip} netmask {_mask(prefix)} broadcast {_broadcast(ip, prefix)}")
        ports += [
            "\tnd6 options=201<PERFORMNUD,DAD>",
            "\tmedia: autoselect <full-duplex>",
            f"\tstatus: {'active' if cabled else 'inactive'}",
        ]
    # As a Mac whose Thunderbolt ports came up first prints them: before en0.
    first = out.index("en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500")
    out = out[:first] + ports + out[first:] if scene.cables_first else out + ports
    bridge_flags = (
        "8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST>"
        if scene.bridge_on
        else "8822<BROADCAST,SMART,SIMPLEX,MULTICAST>"
    )
    out += [
        f"bridge0: flags={bridge_flags} mtu 1500",
        "\toptions=63<RXCSUM,TXCSUM,TSO4,TSO6>",
        f"\tether 36:e5:a2:{mac:02x}:10:80",
        "\tConfiguration:",
        "\t\tid 0:0:0:0:0:0 priority 0 hellotime 0 fwddelay 0",
        "\t\tmaxage 0 holdcnt 0 proto stp maxaddr 100 timeout 1200",
        "\t\troot id 0:0:0:0:0:0 priority 0 ifcost 0 port 0",
        "\t\tipfilter disabled flags 0x0",
    ]
    if scene.bridge_on:
        out += [f"\tmember: {iface(p)} flags=3<LEARNING,DISCOVER>" for p in range(1, PORTS + 1)]
    out += [
        "\tnd6 options=201<PERFORMNUD,DAD>",
        "\tmedia: <unknown type>",
        f"\tstatus: {'active' if scene.bridge_on else 'inactive'}",
        "utun0: flags=8051<UP,POINTOPOINT,RUNNING,MULTICAST> mtu 1380",
        f"\tinet6 fe80::5c1e:9b7a:44d0:{mac:04x}%utun0 prefixlen 64 scopeid 0x14 ",
        "\tnd6 options=201<PERFORMNUD,DAD>",
    ]
    return "\n".join(out) + "\n"


def ibv_devices(mac: int, rdma_off: bool = False) -> str:
    # One device per Thunderbolt port once RDMA is enabled, cabled or not; none while disabled.
    out = "    device          \t   node GUID\n    ------          \t----------------\n"
    if rdma_off:
        return out
    for p in range(1, PORTS + 1):
        out += f"    rdma_{iface(p):<12}\t6a3e55fffe{mac:02x}{p:04x}\n"
    return out


def ioreg(mac: int) -> str:
    return (
        "+-o Mac15,14  <class IOPlatformExpertDevice, id 0x100000110, registered, matched, "
        "active, busy 0 (119 ms), retain 31>\n"
        "    {\n"
        '      "IOPolledInterface" = "AppleARMWatchdogTimerHibernateHandler is not serializable"\n'
        '      "#address-cells" = <02000000>\n'
        '      "clock-frequency" = <00366e01>\n'
        f'      "IOPlatformSerialNumber" = "H7XK2L9Q{mac:02d}"\n'
        '      "compatible" = <"Mac15,14","AppleARM">\n'
        f'      "IOPlatformUUID" = "{platform_uuid(mac)}"\n'
        '      "model" = <"Mac15,14">\n'
        '      "manufacturer" = <"Apple Inc.">\n'
        "    }\n"
        "    \n"
    )


def outputs(scene: Scene, mac: int) -> dict[str, str]:
    """File name (as tests/cluster/recorded/replay.py names them) -> what the tool printed."""
    found = {
        "sw_vers.txt": "26.2\n",
        "sysctl_brand.txt": "Apple M3 Ultra\n",
        "sysctl_memsize.txt": "549755813888\n",
        "sysctl_kern_uuid.txt": KERNEL_BUILD_UUID + "\n",
        "ioreg_platform.txt": ioreg(mac),
        "vm_stat.txt": (
            RECORDED.parent.parent / "cluster/recorded/macos26_rdma_tb5/vm_stat.txt"
        ).read_text(),
        "rdma_ctl_status.txt": "disabled\n" if scene.rdma_off else "enabled\n",
        "ibv_devices.txt": ibv_devices(mac, scene.rdma_off),
        "ibv_devinfo.txt": ibv_devinfo(scene, mac),
        "system_profiler_thunderbolt.txt": thunderbolt_text(scene, mac),
        "netstat_rn.txt": netstat(scene, mac),
        "ifconfig.txt": ifconfig(scene, mac),
        "networksetup_listallhardwareports.txt": hardware_ports(mac),
        "system_profiler_thunderbolt.json": thunderbolt_json(scene, mac),
        "ipconfig_getifaddr_en0.txt": scene.lan[mac][0] + "\n",
        "socketfilterfw.txt": "Firewall is disabled. (State = 0)\n",
        "ioreg_thunderbolt_ip.plist": ioreg_rdma(scene, mac),
        "ps_axo.txt": ps(scene, mac),
    }
    if scene.wired_limit_mb is not None:
        found["sysctl_iogpu_wired_limit_mb.txt"] = f"{scene.wired_limit_mb}\n"
    return found


def write(scene: Scene, where: Path) -> list[Path]:
    """The scene's outputs under where/mac<i>/, one directory per Mac."""
    dirs = []
    for mac in range(scene.n):
        d = where / f"mac{mac}"
        d.mkdir(parents=True, exist_ok=True)
        for name, text in outputs(scene, mac).items():
            (d / name).write_text(text)
        dirs.append(d)
    return dirs


# Full meshes use ports 1..n-1 in the order a user plugs them: Mac i's k-th cable in port k.
def mesh(n: int) -> list[tuple[int, int, int, int]]:
    used = [0] * n
    wires = []
    for i in range(n):
        for j in range(i + 1, n):
            used[i] += 1
            used[j] += 1
            wires.append((i, used[i], j, used[j]))
    return wires


SCENES = {
    "mesh2": Scene(2, mesh(2)),
    "mesh3": Scene(3, mesh(3)),
    "mesh4": Scene(4, mesh(4)),
    # Crossed ports: Mac 0's cable to Mac 2 is in its port 4, Mac 2's in its port 1.
    "mesh3_crossed": Scene(3, [(0, 3, 1, 2), (0, 4, 2, 1), (1, 5, 2, 6)]),
    # Two cables between Macs 0 and 1 (and one to each other Mac).
    "mesh3_double": Scene(3, [(0, 1, 1, 1), (0, 2, 1, 2), (0, 3, 2, 1), (1, 3, 2, 2)]),
    "pair_double": Scene(2, [(0, 1, 1, 2), (0, 2, 1, 1)]),
    # The home LAN is also on 192.168.0.x (a /24 that holds every cable's /30).
    "mesh4_lan192": Scene(4, mesh(4), lan=[(f"192.168.0.{100 + m}", 24) for m in range(4)]),
    # Four Macs in a ring (0-1-2-3-0): jaccl's ring mode.
    "ring4": Scene(4, [(0, 1, 1, 1), (1, 2, 2, 1), (2, 2, 3, 1), (3, 2, 0, 2)]),
    # After a crash: on Mac 0 a rank whose agent is gone still holds rdma_en2; on Mac 1 another
    # program holds rdma_en2 and rdma_en3 keeps queue pairs no process holds.
    "pair_leftovers": Scene(
        2,
        mesh(2),
        holders=(
            Holder(0, 1, 5123, 1, rank_command(0)),
            Holder(1, 1, 2290, 2214, "/Users/studio/.venv/bin/python3 train_tp.py", "Python", 4),
        ),
        stale=frozenset({(1, 2)}),
    ),
}


if __name__ == "__main__":
    shutil.rmtree(RECORDED, ignore_errors=True)
    for name, scene in SCENES.items():
        write(scene, RECORDED / name)
        print(name, scene.n, "Macs,", len(scene.wires), "cables")
