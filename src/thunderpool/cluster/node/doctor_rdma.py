"""`thunderpool doctor`'s checks of what stops jaccl (RDMA over Thunderbolt) between Macs.

This node's: MLX has jaccl, every cable end has an IPv4 address on a subnet of its own that
routes to the Mac at the other end, the GPU wired limit covers a shard. The cluster's (this
node's fresh report with its peers' NodeInfo from their agents): every pair of Macs is cabled
(or a ring is, for jaccl's ring mode), every cable is addressed, and no two machines share a
host id. Pure functions over NodeInfo and command output; a check whose fix is a command
carries it, for `doctor --fix` (cluster/node/doctor_fix.py).

Cable addresses are MLX's per-cable /30s (thunderbolt.cable_addresses), skipping every /30 that
overlaps a network or route of any node, with the nodes in one order every node computes alike,
by node id: each Mac applies its own cable ends and the two ends of every cable agree without a
central step.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Sequence

from thunderpool import __version__
from thunderpool.cluster.control.messages import Interface, NodeInfo
from thunderpool.cluster.node.checks import Check
from thunderpool.cluster.node.facts import parse_ibv_devinfo
from thunderpool.cluster.node.thunderbolt import (
    TB5_GBPS,
    Cable,
    Network,
    cable_addresses,
    cables,
    network,
    route,
    route_network,
    taken_networks,
)

NETMASK = "255.255.255.252"  # the per-cable /30 MLX assigns (thunderbolt.CABLE_PREFIX)
FIX_HERE = "`thunderpool doctor --fix`"
STALE = (
    "peers' addresses are as their agents last read them (every 15 s): wait a moment after "
    "a change, then run `thunderpool doctor` again"
)


def check_jaccl(available: bool | None, mlx_version: str | None) -> Check:
    """`available`: mx.distributed.is_available(backend="jaccl"); None where this MLX cannot
    be asked about one backend (it predates jaccl)."""
    name = "jaccl backend"
    upgrade = 'pip install -U "mlx>=0.30" (MLX with jaccl; RDMA needs macOS 26.2+)'
    if mlx_version is None:
        return Check(name, "SKIP", "MLX does not import")
    if available is None:
        detail = f"mlx {mlx_version} cannot be asked for one backend: it predates jaccl"
        return Check(name, "FAIL", detail, upgrade)
    if available:
        return Check(name, "PASS", "mx.distributed.is_available('jaccl') is True")
    detail = f"mx.distributed.is_available('jaccl') is False (mlx {mlx_version})"
    return Check(name, "FAIL", detail, f"{upgrade}; with RDMA enabled (see 'RDMA enabled')")


def check_rdma_links(local: NodeInfo, code: int, out: str) -> Check:
    """Each cabled Thunderbolt port's RDMA device, as `ibv_devinfo` and system_profiler see
    it: macOS lists an rdma_enX for every port, so only a PORT_ACTIVE port on a Thunderbolt 5
    link carries jaccl; the planner uses no other (thunderbolt.live_rdma)."""
    name = "RDMA links"
    cabled = [p for p in local.thunderbolt if p.connected_to]
    if not cabled or not local.rdma_devices:
        return Check(name, "SKIP", "no cabled Thunderbolt port with an RDMA device")
    if code != 0:
        fix = "run `ibv_devinfo` by hand; it ships with macOS 26.2 beside `ibv_devices`"
        return Check(name, "WARN", f"cannot read `ibv_devinfo` (exit code {code})", fix)
    states = parse_ibv_devinfo(out)
    bad, good = [], []
    for port in cabled:
        device = f"rdma_{port.iface}"
        state, mtu = states.get(device, ("not listed", None))
        if port.speed_gbps is not None and port.speed_gbps < TB5_GBPS:
            bad.append(f"{device} is a Thunderbolt 4 link ({port.speed_gbps} Gb/s)")
        elif state != "PORT_ACTIVE":
            bad.append(f"{device} is {state}")
        else:
            good.append(f"{device} PORT_ACTIVE" + (f" (MTU {mtu})" if mtu else ""))
    if bad:
        fix = (
            "RDMA needs a Thunderbolt 5 cable straight between two TB5 ports (no dock or hub): "
            "reseat or replace the cable named, then check `ibv_devinfo` shows PORT_ACTIVE; "
            "until then ranks over that link run ring over TCP"
        )
        return Check(name, "FAIL", "; ".join(bad), fix)
    return Check(name, "PASS", ", ".join(good))


# ---- cable addresses ------------------------------------------------------------------------


def cluster_nodes(local: NodeInfo, peers: Sequence[NodeInfo]) -> list[NodeInfo]:
    """This node (its fresh report) and its peers (as their agents reported), one per node id,
    in the order every node computes alike: by node id."""
    by_id = {p.node_id: p for p in peers}
    by_id[local.node_id] = local
    return sorted(by_id.values(), key=lambda n: n.node_id)


def _ipv4(node: NodeInfo, iface: str) -> list[Interface]:
    return [x for x in node.interfaces if x.name == iface and ":" not in x.address]


def _far_ends(x: Interface, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> list[str]:
    """Addresses on `x`'s network other than its own: on a /30 the other end of the cable, on
    a wider one its first and last host."""
    if net.prefixlen >= 31:
        hosts = [net.network_address, net.broadcast_address]
    else:
        hosts = [net.network_address + 1, net.broadcast_address - 1]
    return [str(h) for h in dict.fromkeys(hosts) if str(h) != x.address]


def clashes(node: NodeInfo, net: Network, own: set[str]) -> list[str]:
    """`node`'s interfaces and routes (but those by the interfaces `own`, and default routes)
    whose network overlaps `net`, each named, e.g. "en0 (192.168.0.0/24)"."""
    found, attached = [], set()
    for x in node.interfaces:
        theirs = network(x)
        if x.name not in own and theirs is not None and theirs.version == net.version:
            attached.add((x.name, theirs))
            if theirs.overlaps(net):
                found.append(f"{x.name} ({theirs})")
    for r in node.routes:
        theirs = route_network(r)
        if r.interface in own or theirs is None or theirs.prefixlen == 0:
            continue
        if any(i == r.interface and theirs.subnet_of(n) for i, n in attached):
            continue  # within the interface's own network (its hosts), named above
        if theirs.version == net.version and theirs.overlaps(net):
            found.append(f"its route to {theirs} by {r.interface}")
    return list(dict.fromkeys(found))


def end_problem(node: NodeInfo, iface: str, peer_ip: str | None) -> str | None:
    """Why `node`'s cable end `iface` does not carry traffic to the Mac at the other end (at
    `peer_ip`; None: unknown, then the other end of its /30), or None: it does."""
    mine = _ipv4(node, iface)
    if not mine:
        return f"{node.name}'s {iface} has no IPv4 address"
    net = network(mine[0])
    if net is None:
        return f"{node.name}'s {iface} has {mine[0].address} without a netmask"
    cabled = {p.iface for p in node.thunderbolt if p.connected_to}
    others = [c for c in clashes(node, net, {iface}) if c.split()[0] in cabled]
    if others:
        share = f"{node.name}'s {iface} ({net}) and {others[0]} share a subnet"
        return f"{share}: each cable needs its own"
    lan = clashes(node, net, cabled)
    if lan:
        return (
            f"{node.name}'s {iface} ({net}) overlaps {', '.join(lan)}: a cable's subnet must "
            "be clear of every other network the Mac is on"
        )
    if peer_ip is not None and ipaddress.ip_address(peer_ip) not in net:
        return f"the far end's {peer_ip} is not on {node.name}'s {iface} subnet {net}"
    for target in [peer_ip] if peer_ip else _far_ends(mine[0], net):
        via = route(node.interfaces, target)
        if via is None or via.name != iface:
            by = f"{via.name} ({network(via)})" if via else "no attached network"
            return f"on {node.name}, {target} leaves by {by}, not by the cable {iface}"
    return None


def _peer_end(nodes: Sequence[NodeInfo], me: int, iface: str) -> tuple[Cable, int, str] | None:
    """The cable on node `me`'s port `iface`, the node at its other end and that node's port."""
    for c in cables(nodes):
        if (c.i, c.a) == (me, iface):
            return c, c.j, c.b
        if (c.j, c.b) == (me, iface):
            return c, c.i, c.a
    return None


def cable_problems(nodes: Sequence[NodeInfo], c: Cable, first: int | None = None) -> list[str]:
    """What stops cable `c`, seen from both its ends (the same from every node); node
    `first`'s end is named first. A cable whose subnet overlaps a network another node is on
    fails too: the plan that renumbers it keeps clear of every node's networks."""
    a_ips, b_ips = _ipv4(nodes[c.i], c.a), _ipv4(nodes[c.j], c.b)
    found = [
        end_problem(nodes[c.i], c.a, b_ips[0].address if b_ips else None),
        end_problem(nodes[c.j], c.b, a_ips[0].address if a_ips else None),
    ]
    net = network(a_ips[0]) if a_ips else None
    if net is not None and not any(found):
        everyone = cables(nodes)
        for k, node in enumerate(nodes):
            own = {c.a if c.i == k else c.b for c in everyone if k in (c.i, c.j)}
            if k not in (c.i, c.j) and (theirs := clashes(node, net, own)):
                found.append(
                    f"{nodes[c.i].name}:{c.a}-{nodes[c.j].name}:{c.b} ({net}) overlaps "
                    f"{node.name}'s {', '.join(theirs)}"
                )
    return [p for p in (found[::-1] if first == c.j else found) if p]


def commands_for(ends: Sequence[tuple[str, str, str]]) -> tuple[tuple[str, ...], ...]:
    """What mlx.distributed_config --auto-setup runs per cable end (iface, address, peer)."""
    found: list[tuple[str, ...]] = []
    for iface, ip, peer in ends:
        found.append(("sudo", "ifconfig", iface, "inet", ip, "netmask", NETMASK))
        found.append(("sudo", "route", "change", peer, "-interface", iface))
    return tuple(found)


def planned_ends(nodes: Sequence[NodeInfo], me: int) -> list[tuple[str, str, str]]:
    """Node `me`'s cable ends as (iface, address, the far end's address), in the order MLX's
    setup walks them (by peer, then cable), with the nodes numbered as `nodes` are."""
    found = cables(nodes)
    addresses = cable_addresses(found, taken_networks(nodes, found))
    ends = []
    for j in range(len(nodes)):
        for c in found:
            if {c.i, c.j} == {me, j} and me != j:
                mine, theirs = ((c.i, c.a), (c.j, c.b)) if c.i == me else ((c.j, c.b), (c.i, c.a))
                ends.append((mine[1], addresses[mine], addresses[theirs]))
    return ends


def _is_set(node: NodeInfo, iface: str, ip: str, peer: str) -> bool:
    """Whether `iface` holds just `ip`/30 and the far end's `peer` routes by it."""
    via = route(node.interfaces, peer)
    held = [(x.address, x.prefix) for x in _ipv4(node, iface)]
    return held == [(ip, 30)] and via is not None and via.name == iface


def check_cable_ends(local: NodeInfo, peers: Sequence[NodeInfo]) -> list[Check]:
    """One check per cabled Thunderbolt port of this node ("cable en2")."""
    nodes = cluster_nodes(local, peers)
    me = next(i for i, n in enumerate(nodes) if n.node_id == local.node_id)
    plan = {iface: (ip, peer) for iface, ip, peer in planned_ends(nodes, me)}
    checks = []
    for port in local.thunderbolt:
        if port.connected_to is None:
            continue
        name, mine = f"cable {port.iface}", _ipv4(local, port.iface)
        found = _peer_end(nodes, me, port.iface)
        if found is None:
            problem = end_problem(local, port.iface, None)
            who = "a Mac that is not in the cluster"
            if problem is None:
                detail = f"{mine[0].address}/{mine[0].prefix} to {who}"
                checks.append(Check(name, "PASS", detail))
                continue
            fix = (
                "start `thunderpool node` on every Mac (joined over the LAN), then run "
                f"{FIX_HERE} on each: it gives every cable end its own /30"
            )
            checks.append(Check(name, "FAIL", f"{problem} (cable to {who})", fix))
            continue
        c, j, far = found
        problems = cable_problems(nodes, c, first=me)
        peer = nodes[j]
        if not problems:
            theirs = _ipv4(peer, far)[0].address
            detail = (
                f"{mine[0].address}/{mine[0].prefix} to {peer.name}'s {far} at {theirs}, "
                f"routed by {port.iface}"
            )
            checks.append(Check(name, "PASS", detail))
            continue
        ip, peer_ip = plan[port.iface]
        fix = (
            f"{FIX_HERE} on {local.name} and on {peer.name} (here: "
            + "; ".join(" ".join(cmd) for cmd in commands_for([(port.iface, ip, peer_ip)]))
            + f"); {STALE}"
        )
        checks.append(Check(name, "FAIL", "; ".join(problems), fix))
    return checks


def check_cable_plan(local: NodeInfo, peers: Sequence[NodeInfo]) -> Check:
    """The cluster's cables as one: where any fails, every Mac re-addresses all its cable ends
    to the plan every node computes alike (renumbering some would collide with the rest)."""
    name = "cable addresses"
    if not peers:
        return Check(name, "SKIP", "no peer reports (start `thunderpool node` on every Mac)")
    nodes = cluster_nodes(local, peers)
    me = next(i for i, n in enumerate(nodes) if n.node_id == local.node_id)
    found = cables(nodes)
    if not found:
        return Check(name, "SKIP", "no Thunderbolt cable between the cluster's nodes")
    failing = [
        f"{nodes[c.i].name}:{c.a}-{nodes[c.j].name}:{c.b}"
        for c in found
        if cable_problems(nodes, c)
    ]
    if not failing:
        detail = f"{len(found)} cable(s), each on a subnet of its own"
        return Check(name, "PASS", detail)
    todo = [end for end in planned_ends(nodes, me) if not _is_set(local, *end)]
    detail = f"{len(failing)} of {len(found)} cable(s) do not work: {', '.join(failing)}"
    if not todo:
        fix = f"this Mac's ends are set; run {FIX_HERE} on the other Macs; {STALE}"
        return Check(name, "FAIL", detail, fix)
    here = "; ".join(" ".join(cmd) for cmd in commands_for(todo))
    fix = (
        f"{FIX_HERE} on every Mac (MLX's per-cable /30s clear of every node's networks, nodes "
        f"in node-id order); here: {here}"
    )
    return Check(name, "FAIL", detail, fix, commands_for(todo))


# ---- the cluster ----------------------------------------------------------------------------


def _ring(n: int, pairs: set[tuple[int, int]]) -> list[int] | None:
    """An order of the nodes in which each is cabled to the next and the last to the first."""
    if n < 3 or n > 9:
        return None
    for rest in itertools.permutations(range(1, n)):
        order = [0, *rest]
        if all(tuple(sorted((a, order[k - 1]))) in pairs for k, a in enumerate(order)):
            return order
    return None


def check_mesh(nodes: Sequence[NodeInfo]) -> Check:
    """Whether jaccl can join the cluster's nodes: every one runs it and every pair is cabled
    (a ring through all of them is jaccl's ring mode)."""
    name = "RDMA mesh"
    if len(nodes) < 2:
        note = "no peer reports: start `thunderpool node` on every Mac, then run doctor again"
        return Check(name, "SKIP", note)
    if not any(n.thunderbolt for n in nodes):
        return Check(name, "SKIP", "no node reports Thunderbolt ports")
    no_jaccl = [n.name for n in nodes if "jaccl" not in n.backends and n.os.startswith("macOS")]
    if no_jaccl:
        names = ", ".join(no_jaccl)
        detail = f"{names} cannot run jaccl: the cluster's ranks run ring over TCP"
        fix = f"run `thunderpool doctor` on {names} (RDMA enabled from Recovery, macOS 26.2+)"
        return Check(name, "FAIL", detail, fix)
    others = [n.name for n in nodes if not n.os.startswith("macOS")]
    if others:
        detail = f"{', '.join(others)}: not macOS, so ranks that span them run ring over TCP"
        return Check(name, "WARN", detail, "jaccl (RDMA) joins Macs only")
    found = cables(nodes)
    pairs = {(c.i, c.j) for c in found}
    n = len(nodes)
    missing = [(i, j) for i in range(n) for j in range(i + 1, n) if (i, j) not in pairs]
    if not missing:
        return Check(name, "PASS", f"a full mesh: {len(found)} cable(s) join all {n} Macs")
    names = ", ".join(f"{nodes[i].name}-{nodes[j].name}" for i, j in missing)
    ring = _ring(n, pairs)
    if ring is not None:
        loop = "-".join(nodes[i].name for i in [*ring, ring[0]])
        detail = (
            f"a ring ({loop}), not a full mesh (no cable {names}): jaccl runs in ring mode "
            "where the ranks follow the ring, else ring over TCP"
        )
        return Check(name, "WARN", detail, f"for a full mesh, cable {names}")
    detail = f"no cable between {names}: jaccl needs one between every pair of Macs (or a ring)"
    fix = f"connect a Thunderbolt 5 cable straight between {names} (no dock or hub)"
    return Check(name, "FAIL", detail, fix)


def check_host_ids(nodes: Sequence[NodeInfo]) -> Check:
    """Two machines that report one host id are packed into one machine's memory by the
    planner. Agents that share a machine (same name and ports) may share one."""
    name = "host ids"
    if len(nodes) < 2:
        return Check(name, "SKIP", "no peer reports to compare")
    by_id: dict[str, list[NodeInfo]] = {}
    for n in nodes:
        if n.host_id:
            by_id.setdefault(n.host_id, []).append(n)
    clashes = []
    for host, group in by_id.items():
        machines = {(n.name, tuple(sorted(p.uuid for p in n.thunderbolt))) for n in group}
        if len(machines) > 1:
            clashes.append((host, group))
    if not clashes:
        return Check(name, "PASS", f"{len(by_id)} machine(s) among {len(nodes)} node(s)")
    detail = "; ".join(
        f"{', '.join(n.name for n in group)} report one host id {host}" for host, group in clashes
    )
    detail += ": the planner packs them into one machine's memory"
    outdated = [n.name for _, g in clashes for n in g if n.version != __version__]
    update = f"update thunderpool to {__version__} on {', '.join(outdated)} (it reads each Mac's "
    update += "IOPlatformUUID), or "
    fix = (update if outdated else "") + (
        "restart `thunderpool node --host-id NAME` on each with a name of its own"
    )
    return Check(name, "FAIL", detail, fix)
