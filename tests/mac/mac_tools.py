"""The text forms of three macOS tools for a scene's Mac (tests/mac/macs.py renders the rest):
`system_profiler SPThunderboltDataType`, `ibv_devinfo` and `netstat -rn -f inet`.

Shapes, from public captures (tests/mac/README.md says which): a connected Thunderbolt 5 port
prints the live link's speed (`Speed: 80 Gb/s`), an idle one what it could do (`Speed: Up to
120 Gb/s`), a Thunderbolt 4 cable links at 40 Gb/s; `ibv_devinfo` prints rdma-core's block per
device, `PORT_ACTIVE (4)` where a live cable is, `PORT_DOWN (1)` elsewhere; netstat abbreviates
networks ("192.168.1" is a /24) and lists the default route first.
"""

from __future__ import annotations

import ipaddress
import uuid


def thunderbolt_text(scene, mac: int) -> str:
    from macs import PORTS, domain_uuid

    out = ["Thunderbolt/USB4:", ""]
    for p in range(PORTS, 0, -1):  # the highest bus first, as the JSON form
        peer = scene.peer(mac, p)
        speed = f"{scene.speed(mac, p)} Gb/s" if peer else "Up to 120 Gb/s"
        out += [
            f"    Thunderbolt/USB4 Bus {p - 1}:",
            "",
            "      Vendor Name: Apple Inc.",
            "      Device Name: Mac Studio",
            f"      UID: 0x05AC{mac:04X}{0x9810 + p:08X}",
            "      Route String: 0",
            f"      Domain UUID: {domain_uuid(mac, p)}",
            "      Port:",
            f"          Status: {'Device connected' if peer else 'No device connected'}",
            f"          Link Status: {'0x2' if peer else '0x7'}",
            f"          Speed: {speed}",
            f"          Receptacle: {p}",
            "          Micro Firmware Version: 0.0.0",
            "",
        ]
        if peer:
            service = str(uuid.uuid5(uuid.NAMESPACE_URL, f"svc{mac}{p}")).upper()
            rdma = str(uuid.uuid5(uuid.NAMESPACE_URL, f"rdma{mac}{p}")).upper()
            out += [
                "        Mac Studio:",
                "",
                "          Vendor Name: Apple Inc.",
                "          Device Name: Mac15,14",
                "          Device ID: 0xA",
                "          Vendor ID: 0x0A27",
                f"          Domain UUID: {domain_uuid(*peer)}",
                "          Services:",
                "            Internet Protocol:",
                "              Protocol ID: 1",
                "              Protocol Version: 1",
                "              Protocol Revision: 1",
                f"              Service UUID: {service}",
                "            Service: Unknown:",
                "              Protocol ID: 64087",
                "              Protocol Version: 1",
                "              Protocol Revision: 0",
                "              Service Key: rdma",
                f"              Service UUID: {rdma}",
                "",
            ]
    return "\n".join(out) + "\n"


def ibv_devinfo(scene, mac: int) -> str:
    from macs import PORTS, iface

    if scene.rdma_off:
        return "No IB devices found\n"
    out = []
    for p in range(1, PORTS + 1):
        k, peer = scene.wire(mac, p)
        active = peer is not None and k not in scene.down
        state = "PORT_ACTIVE (4)" if active else "PORT_DOWN (1)"
        guid = f"6a3e:55ff:fe{mac:02x}:{p:04x}"
        out += [
            f"hca_id:\trdma_{iface(p)}",
            "\ttransport:\t\t\tInfiniBand (0)",
            "\tfw_ver:\t\t\t\t0.0.0",
            f"\tnode_guid:\t\t\t{guid}",
            f"\tsys_image_guid:\t\t\t{guid}",
            "\tvendor_id:\t\t\t0x05ac",
            "\tvendor_part_id:\t\t\t4098",
            "\thw_ver:\t\t\t\t0x0",
            "\tphys_port_cnt:\t\t\t1",
            "\t\tport:\t1",
            f"\t\t\tstate:\t\t\t{state}",
            "\t\t\tmax_mtu:\t\t4096 (5)",
            "\t\t\tactive_mtu:\t\t1024 (3)",
            "\t\t\tsm_lid:\t\t\t0",
            "\t\t\tport_lid:\t\t0",
            "\t\t\tport_lmc:\t\t0x00",
            "\t\t\tlink_layer:\t\tEthernet",
            "",
        ]
    return "\n".join(out) + "\n"


def _short(net: ipaddress.IPv4Network) -> str:
    """netstat's form of a network: trailing zero octets left out where the prefix says so."""
    octets = str(net.network_address).split(".")
    keep = net.prefixlen // 8
    if net.prefixlen % 8 == 0 and all(o == "0" for o in octets[keep:]) and keep:
        return ".".join(octets[:keep])
    return f"{net.network_address}/{net.prefixlen}"


def netstat(scene, mac: int) -> str:
    """`netstat -rn -f inet`: the default route by the LAN (en0, then Wi-Fi's), each attached
    network, the Mac's own addresses; what the cables' /30s add once they are addressed."""
    lan = [("en0", *scene.lan[mac], 11)]
    if scene.wifi:
        lan.append(("en1", *scene.wifi[mac], 12))
    rows = [("Destination", "Gateway", "Flags", "Netif Expire")]
    for k, (dev, ip, prefix, _) in enumerate(lan):
        net = ipaddress.ip_network(f"{ip}/{prefix}", strict=False)
        rows.append(("default", str(net.network_address + 1), "UGScg" if not k else "UGScIg", dev))
    rows += [("127", "127.0.0.1", "UCS", "lo0"), ("127.0.0.1", "127.0.0.1", "UH", "lo0")]
    for dev, ip, prefix, link in lan:
        net = ipaddress.ip_network(f"{ip}/{prefix}", strict=False)
        router = str(net.network_address + 1)
        rows += [
            (_short(net), f"link#{link}", "UCS", f"{dev}      !"),
            (f"{router}/32", f"link#{link}", "UCS", f"{dev}      !"),
            (router, f"a4:91:b1:{mac:02x}:00:01", "UHLWIir", f"{dev}   1187"),
            (f"{ip}/32", f"link#{link}", "UCS", f"{dev}      !"),
        ]
    for (m, name), (ip, prefix) in sorted(scene.cable_ips().items()):
        if m == mac:
            net = ipaddress.ip_network(f"{ip}/{prefix}", strict=False)
            link = 13 + int(name[2:])
            rows += [
                (_short(net), f"link#{link}", "UC", f"{name}      !"),
                (f"{ip}/32", f"link#{link}", "UCS", f"{name}      !"),
            ]
    rows += [
        ("169.254", "link#11", "UCS", "en0      !"),
        ("224.0.0/4", "link#11", "UmCS", "en0      !"),
        ("255.255.255.255/32", "link#11", "UCS", "en0      !"),
    ]
    lines = [f"{d:<19}{g:<19}{f:<20}{n}" for d, g, f, n in rows]
    return "Routing tables\n\nInternet:\n" + "\n".join(lines) + "\n"
