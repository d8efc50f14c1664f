"""Thunderbolt cabling as MLX sees it, and the RDMA devices and addresses that follow from it.

Each Mac reports its Thunderbolt ports (`system_profiler SPThunderboltDataType -json`: a bus per
port with its domain UUID, and the peer's domain UUID where a Mac is cabled to it) and which
network interface each port is (`networksetup -listallhardwareports`: "Thunderbolt N" -> enX).
Matching one Mac's peer UUID with another's port UUID finds every cable. The order of cables and
their addresses follow mlx.distributed_config (mlx/_distributed_utils/config.py), so a cluster
set up by MLX's tool and one set up by `thunderpool doctor --fix` agree; tests/mac checks both
against MLX's own code. Pure functions over NodeInfo: nothing here runs a command.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass

from thunderpool.cluster.control.messages import Interface, NodeInfo, Route, ThunderboltPort

# The per-cable networks mlx.distributed_config assigns: 192.168.<a>.<b+1|b+2>/30, b in steps of 4.
CABLE_PREFIX = 30
CABLE_SPACE = "192.168.0.0/16"  # where MLX numbers them from; we skip what a node is on
TB5_GBPS = 80  # RDMA runs over Thunderbolt 5 links only (MLX's docs)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _link_speed(text: str | None) -> int | None:
    """A connected port's "80 Gb/s" -> 80; an idle port's "Up to 120 Gb/s" is no link."""
    if not text or text.startswith("Up to"):
        return None
    head = text.split()[0]
    return int(head) if head.isdigit() else None


def parse_thunderbolt(text: str | None, ports: dict[str, str]) -> tuple[ThunderboltPort, ...]:
    """`system_profiler SPThunderboltDataType -json` and {device: hardware port} ->
    this Mac's Thunderbolt ports, each with the domain UUID of the Mac cabled to it (if any),
    sorted by interface as MLX sorts them. A drive or dock on a port has no domain UUID and
    is not a peer; a bus whose "Thunderbolt N" port has no interface is skipped."""
    try:
        buses = json.loads(text or "{}").get("SPThunderboltDataType", [])
    except (json.JSONDecodeError, AttributeError):
        return ()
    iface_of = {port: device for device, port in ports.items()}
    found = []
    for bus in buses:
        uuid = bus.get("domain_uuid_key")
        tag = (bus.get("receptacle_1_tag") or {}).get("receptacle_id_key")
        iface = iface_of.get(f"Thunderbolt {tag}")
        if uuid is None or iface is None:
            continue
        peers = [
            item["domain_uuid_key"] for item in bus.get("_items", []) if "domain_uuid_key" in item
        ]
        speed = _link_speed((bus.get("receptacle_1_tag") or {}).get("current_speed_key"))
        found.append(
            ThunderboltPort(
                iface=iface,
                uuid=uuid,
                connected_to=peers[0] if peers else None,
                speed_gbps=speed if peers else None,
            )
        )
    return tuple(sorted(found, key=lambda p: p.iface))


@dataclass(frozen=True, slots=True)
class Cable:
    """One Thunderbolt cable between node i's port `a` and node j's port `b` (i < j)."""

    i: int
    a: str  # interface on node i, e.g. "en3"
    j: int
    b: str


def cables(nodes: Sequence[NodeInfo]) -> list[Cable]:
    """Every cable between the nodes, in the order mlx.distributed_config numbers them: by the
    lower node, then its ports by interface. A port cabled to a Mac outside `nodes` is ignored."""
    where = {p.uuid: (n, p.iface) for n, node in enumerate(nodes) for p in node.thunderbolt}
    seen: set[tuple[int, str]] = set()
    found = []
    for n, node in enumerate(nodes):
        for port in node.thunderbolt:
            if port.connected_to not in where or (n, port.iface) in seen:
                continue
            m, peer_iface = where[port.connected_to]
            if m == n:
                continue
            seen |= {(n, port.iface), (m, peer_iface)}
            found.append(
                Cable(n, port.iface, m, peer_iface)
                if n < m
                else Cable(m, peer_iface, n, port.iface)
            )
    return found


def ends(found: Sequence[Cable], i: int, j: int) -> list[str]:
    """Node i's interfaces on its cables to node j, in cable order."""
    return [c.a if c.i == i else c.b for c in found if {c.i, c.j} == {i, j}]


def cable_addresses(
    found: Sequence[Cable], taken: Sequence[Network] = (), space: str = CABLE_SPACE
) -> dict[tuple[int, str], str]:
    """(node, interface) -> the IPv4 address of that cable end: the k-th cable takes the k-th
    /30 of `space` that overlaps no network in `taken`, node i its first host, node j its
    second. With nothing taken this is mlx.distributed_config's numbering (192.168.0.4k/30);
    a LAN on 192.168.0.0/24 pushes the cables past it, where MLX would put them on it."""
    out: dict[tuple[int, str], str] = {}
    nets = ipaddress.ip_network(space).subnets(new_prefix=CABLE_PREFIX)
    for c in found:
        net = next((n for n in nets if not any(n.overlaps(t) for t in taken)), None)
        if net is None:
            raise ValueError(
                f"{len(found)} cables do not fit {space} in /30s clear of the nodes' networks "
                f"({', '.join(map(str, taken))}); free part of {space}"
            )
        out[(c.i, c.a)] = str(net.network_address + 1)
        out[(c.j, c.b)] = str(net.network_address + 2)
    return out


def route_network(r: Route) -> Network | None:
    try:
        return ipaddress.ip_network(r.destination, strict=False)
    except ValueError:
        return None


def taken_networks(nodes: Sequence[NodeInfo], found: Sequence[Cable]) -> list[Network]:
    """Every IPv4 network any of `nodes` is on or routes to, but for the cable ends `found`
    (their addresses are the plan's to give) and default routes (they hold everything)."""
    ends = {(c.i, c.a) for c in found} | {(c.j, c.b) for c in found}
    taken: list[Network] = []
    for n, node in enumerate(nodes):
        for x in node.interfaces:
            net = network(x)
            if (n, x.name) not in ends and net is not None and net.version == 4:
                taken.append(net)
        for r in node.routes:
            net = route_network(r)
            if (n, r.interface) not in ends and net is not None and net.prefixlen > 0:
                taken.append(net)
    # Loopback and multicast routes never meet a private range; kept out of messages.
    taken = [t for t in taken if not (t.is_loopback or t.is_multicast)]
    return sorted(set(taken), key=lambda t: (t.network_address, t.prefixlen))


def default_interface(routes: Sequence[Route]) -> str | None:
    """The interface this node's default route leaves by (the first, as the kernel picks)."""
    return next((r.interface for r in routes if r.destination == "0.0.0.0/0"), None)


def own_address(node: NodeInfo) -> str | None:
    """The address peers should reach this node at: the IPv4 address of the interface its
    default route leaves by, else its first LAN (Ethernet, Wi-Fi) address; never a cable's,
    which only the Mac at the cable's other end reaches. None: no such address."""
    cabled = {p.iface for p in node.thunderbolt if p.connected_to}
    v4 = [x for x in node.interfaces if "." in x.address and not x.address.startswith("127.")]
    out = default_interface(node.routes)
    for x in v4:
        if x.name == out and x.name not in cabled:
            return x.address
    lan = [x for x in v4 if x.kind in ("ethernet", "wifi") and x.name not in cabled]
    rest = [x for x in v4 if x.name not in cabled and x.kind not in ("rdma", "thunderbolt")]
    return next((x.address for x in [*lan, *rest]), None)


def network(iface: Interface) -> Network | None:
    if iface.prefix is None:
        return None
    return ipaddress.ip_network(f"{iface.address}/{iface.prefix}", strict=False)


def route(interfaces: Sequence[Interface], address: str) -> Interface | None:
    """The interface a packet to `address` leaves by, as the kernel picks it: the longest prefix
    that holds the address (a /30 cable beats a /24 LAN on the same 192.168.0.x); None: no
    directly attached network holds it (it would need a gateway)."""
    target = ipaddress.ip_address(address)
    best: tuple[int, Interface] | None = None
    for iface in interfaces:
        net = network(iface)
        if net is not None and target.version == net.version and target in net:
            if best is None or net.prefixlen > best[0]:
                best = (net.prefixlen, iface)
    return best[1] if best else None


Devices = list[list[str | list[str] | None]]


@dataclass(frozen=True, slots=True)
class RdmaPlan:
    """MLX_IBV_DEVICES for an ordered set of nodes, and whether jaccl runs in ring mode."""

    devices: Devices
    ring: bool  # MLX_JACCL_RING: only neighbours are cabled


def _cabled_ends(nodes: Sequence[NodeInfo], i: int, j: int, found: list[Cable]) -> list[str]:
    """Node i's RDMA-capable, addressed interfaces towards node j: its cable ends where both
    nodes report their Thunderbolt ports, else (an agent that could not read them) its RDMA
    interfaces whose network holds one of j's RDMA addresses."""
    if nodes[i].thunderbolt and nodes[j].thunderbolt:
        mine = ends(found, i, j)
    else:
        theirs = [x.address for x in nodes[j].interfaces if x.rdma_device]
        mine = []
        for address in theirs:
            via = route(nodes[i].interfaces, address)
            if via is not None and via.rdma_device and via.name not in mine:
                mine.append(via.name)
    # jaccl pairs the two ends by their addresses (as mlx.distributed_config sets them up):
    # an end without an IPv4 address is not usable yet (`doctor --fix` gives it one).
    addressed = {x.name for x in nodes[i].interfaces if "." in x.address}
    return [n for n in mine if live_rdma(nodes[i], n) and n in addressed]


def live_rdma(node: NodeInfo, iface: str) -> bool:
    """Whether `iface` carries RDMA now: macOS lists an rdma_enX for every Thunderbolt port,
    cabled or not, so its port must be PORT_ACTIVE (where ibv_devinfo was read) and its link
    Thunderbolt 5 (where system_profiler says the speed)."""
    device = f"rdma_{iface}"
    active = node.rdma_active if node.rdma_active is not None else node.rdma_devices
    speed = next((p.speed_gbps for p in node.thunderbolt if p.iface == iface), None)
    return device in node.rdma_devices and device in active and (speed or TB5_GBPS) >= TB5_GBPS


def rdma_plan(nodes: Sequence[NodeInfo]) -> RdmaPlan | str:
    """The jaccl device matrix for `nodes` in rank order, as mlx.distributed_config writes it:
    devices[i][j] is node i's device on its cable to node j, a list of devices where every
    pair has several cables (the fewest any pair has). A full mesh runs jaccl; where only
    consecutive ranks are cabled, jaccl's ring mode. Else the reason it cannot run."""
    n = len(nodes)
    if n < 2:
        return "one node"
    found = cables(nodes)
    per_pair = {
        (i, j): _cabled_ends(nodes, i, j, found) for i in range(n) for j in range(n) if i != j
    }
    mesh = all(per_pair.values())
    neighbours = {(i, (i + d) % n) for i in range(n) for d in (1, -1)}
    ring = not mesh and n > 2 and all(per_pair[p] for p in neighbours)
    if not mesh and not ring:
        missing = [
            f"{nodes[i].name}-{nodes[j].name}" for (i, j), e in per_pair.items() if i < j and not e
        ]
        return f"no RDMA cable between {', '.join(missing)}"
    wanted = [p for p in per_pair if mesh or p in neighbours]
    count = min(len(per_pair[p]) for p in wanted)
    devices: Devices = []
    for i in range(n):
        row: list[str | list[str] | None] = []
        for j in range(n):
            if (i, j) not in wanted:
                row.append(None)
                continue
            names = [f"rdma_{x}" for x in per_pair[i, j][:count]]
            row.append(names[0] if count == 1 else names)
        devices.append(row)
    return RdmaPlan(devices, ring)


def coordinator_candidates(leader: NodeInfo, contact_host: str) -> list[str]:
    """Rank 0's addresses an MLX coordinator could listen on, best first: the address its
    agent is reached at (its LAN address, as MLX's launcher uses en0's), then its other
    non-Thunderbolt addresses, then the rest. A cable's /30 reaches one peer only."""
    cabled = {p.iface for p in leader.thunderbolt}
    rest = [x for x in leader.interfaces if x.address != contact_host]
    lan = [
        x.address for x in rest if x.name not in cabled and x.kind not in ("rdma", "thunderbolt")
    ]
    tb = [x.address for x in rest if x.address not in lan]
    return list(dict.fromkeys([contact_host, *lan, *tb]))


def reaches(node: NodeInfo, address: str) -> bool:
    """Whether `node` has a directly attached network holding `address` (no gateway needed)."""
    return route(node.interfaces, address) is not None
