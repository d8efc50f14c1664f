"""`thunderpool doctor`'s checks of what stops jaccl (RDMA over Thunderbolt) between Macs.

This node's: MLX has jaccl, every cable end has an IPv4 address on a subnet of its own that
routes to the Mac at the other end, the GPU wired limit covers a shard. The cluster's (this
node's fresh report with its peers' NodeInfo from their agents): every pair of Macs is cabled
(or a ring is, for jaccl's ring mode), every cable is addressed, and no two machines share a
host id. Pure functions over NodeInfo and command output; a check whose fix is a command
carries it, for `doctor --fix` (cluster/node/doctor_fix.py).

Cable addresses are MLX's per-cable /30s (thunderbolt.cable_addresses) with the nodes in one
order every node computes alike, by node id: each Mac applies its own cable ends and the two
ends of every cable agree without a central step.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Sequence

from thunderpool import __version__
from thunderpool.cluster.control.messages import Interface, NodeInfo
from thunderpool.cluster.node.checks import Check
from thunderpool.cluster.node.thunderbolt import Cable, cable_addresses, cables, network, route

MiB = 2**20
GB = 10**9
OS_RESERVE_BYTES = 8 * GB  # what the planner's presets keep for macOS (os_reserve_gb)
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
    for other in node.interfaces:
        theirs = network(other)
        if other.name not in cabled - {iface} or theirs is None or theirs.version != net.version:
            continue
        if theirs.overlaps(net):
            return (
                f"{node.name}'s {iface} ({net}) and {other.name} ({theirs}) share a subnet: "
                "each cable needs its own"
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
    `first`'s end is named first."""
    a_ips, b_ips = _ipv4(nodes[c.i], c.a), _ipv4(nodes[c.j], c.b)
    found = [
        end_problem(nodes[c.i], c.a, b_ips[0].address if b_ips else None),
        end_problem(nodes[c.j], c.b, a_ips[0].address if a_ips else None),
    ]
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
    addresses = cable_addresses(found)
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
    fix = f"{FIX_HERE} on every Mac (MLX's per-cable /30s, nodes in node-id order); here: {here}"
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


# ---- GPU wired limit ------------------------------------------------------------------------


def gb(size: int) -> str:
    return f"{size / GB:.0f} GB"


def default_working_set(memory: int) -> int:
    """macOS's default GPU wired limit, Metal's recommended working set, where MLX cannot be
    asked: about 2/3 of memory up to 36 GB, 3/4 above."""
    return memory * 2 // 3 if memory <= 36 * 2**30 else memory * 3 // 4


def check_wired_limit(
    code: int, out: str, memory: int, shard: int | None, working_set: int | None
) -> Check:
    """`sysctl -n iogpu.wired_limit_mb` (0: Metal's default) against the shard this Mac holds:
    `shard` bytes (`doctor --shard-gb`), else the largest the planner may put here (memory
    less the OS reserve). `working_set`: Metal's recommended working set, None: estimated."""
    name = "GPU wired limit"
    target = (memory - OS_RESERVE_BYTES) // MiB  # sysctl counts whole MiB
    room = target * MiB
    command = ("sudo", "sysctl", f"iogpu.wired_limit_mb={target}")
    if code != 0 or not out.strip().isdigit():
        return Check(
            name, "WARN", "cannot read `sysctl -n iogpu.wired_limit_mb`", " ".join(command)
        )
    limit_mb = int(out.strip())
    if limit_mb == 0:
        wired = working_set or default_working_set(memory)
        how = "Metal's recommended working set" if working_set else "Metal's default, estimated"
        have = f"iogpu.wired_limit_mb is 0: {how}, ≈ {gb(wired)} of {gb(memory)}"
    else:
        wired = limit_mb * MiB
        have = f"iogpu.wired_limit_mb is {limit_mb} ({gb(wired)} of {gb(memory)})"
    if shard is not None and shard > room:
        reserve = gb(OS_RESERVE_BYTES)
        detail = f"a {gb(shard)} shard does not fit {gb(memory)} less the {reserve} OS reserve"
        return Check(name, "FAIL", detail, "plan more nodes or a smaller model")
    need = shard if shard is not None else room
    what = (
        f"the {gb(shard)} shard (--shard-gb)"
        if shard is not None
        else f"a shard of up to {gb(room)} (memory less the {gb(OS_RESERVE_BYTES)} OS reserve; "
        "--shard-gb checks the planned one)"
    )
    if wired >= need:
        return Check(name, "PASS", f"{have}: covers {what}")
    fix = f"{' '.join(command)} (until the next restart; `thunderpool doctor --fix` runs it)"
    status = "FAIL" if shard is not None else "WARN"
    return Check(name, status, f"{have}: below {what}", fix, (command,))
