"""`thunderpool doctor`: check this node for a working cluster and say how to fix each problem.

`run_checks` is pure given its probes (`run` for commands, `bind`/`connect` for sockets), so
tests replay recorded macOS outputs on Linux. The Mac checks follow MLX's RDMA-over-Thunderbolt
setup: macOS 26.2+, RDMA enabled from Recovery, TB5 links, no Thunderbolt Bridge.
"""

from __future__ import annotations

import errno
import re
import sys
from collections.abc import Callable, Sequence

from thunderpool import __version__
from thunderpool.cluster.control.messages import NodeInfo
from thunderpool.cluster.node.capabilities import Runner, node_info
from thunderpool.cluster.node.checks import Check, Status
from thunderpool.cluster.node.doctor_gpu import check_wired_limit
from thunderpool.cluster.node.doctor_held import IOREG_RDMA, PS_ALL, check_rdma_held
from thunderpool.cluster.node.doctor_rdma import (
    check_cable_ends,
    check_cable_plan,
    check_host_ids,
    check_jaccl,
    check_mesh,
    check_rdma_links,
    cluster_nodes,
)
from thunderpool.cluster.node.facts import (
    RDMA_MIN_MACOS,
    parse_ibv_devices,
    parse_ifconfig,
    parse_macos_version,
    parse_rdma_ctl,
    parse_thunderbolt_text,
    version_text,
)
from thunderpool.cluster.node.probes import (
    probe_blas,
    probe_jaccl,
    probe_mlx,
    probe_working_set,
    try_bind,
    try_connect,
)
from thunderpool.cluster.node.thunderbolt import TB5_GBPS
from thunderpool.config import blas_choice
from thunderpool.engine.blas import kind_of
from thunderpool.launch.blas import INSTALL

# Mirrors `thunderpool node --port` (the probe listens on port+1) and the start of the
# coordinator's ring port range (RING_PORT_BASE); a sample of it is checked.
AGENT_PORT = 7070
RING_PORTS = (29500, 29531)
FIREWALL = "/usr/libexec/ApplicationFirewall/socketfilterfw"
RECOVERY = (
    "RDMA can only be enabled from Recovery: shut down, hold the power button until "
    "'Loading startup options', choose Options → Terminal, run `rdma_ctl enable`, reboot"
)


Bind = Callable[[int], OSError | None]
Connect = Callable[[str, int, float], OSError | None]
MlxProbe = Callable[[], tuple[str | None, bool, str]]
JacclProbe = Callable[[], bool | None]  # mx.distributed.is_available(backend="jaccl")
WorkingSetProbe = Callable[[], int | None]  # Metal's recommended working set, bytes
BlasProbe = Callable[[], dict[str, str]]  # the rank environment's BLAS (launch/blas.py)


# ---- macOS checks ---------------------------------------------------------------------------


def check_macos(version: tuple[int, ...] | None) -> Check:
    name = "macOS version"
    fix = "RDMA over Thunderbolt needs macOS 26.2 or later: Software Update"
    if version is None:
        return Check(name, "FAIL", "cannot read `sw_vers -productVersion`", fix)
    if version < RDMA_MIN_MACOS:
        return Check(name, "FAIL", f"macOS {version_text(version)} < 26.2", fix)
    return Check(name, "PASS", f"macOS {version_text(version)}")


def check_rdma(version: tuple[int, ...] | None, code: int, out: str) -> Check:
    name = "RDMA enabled"
    if version is None or version < RDMA_MIN_MACOS or code == 127:
        return Check(name, "SKIP", "no `rdma_ctl` before macOS 26.2", "update macOS first")
    if code == 0 and parse_rdma_ctl(out):
        return Check(name, "PASS", "`rdma_ctl status`: enabled")
    said = out.strip() or f"exit code {code}"
    return Check(name, "FAIL", f"`rdma_ctl status`: {said}", RECOVERY)


def check_thunderbolt(code: int, out: str) -> Check:
    name = "Thunderbolt 5"
    tb5_fix = (
        "connect the Macs with Thunderbolt 5 ports and TB5 cables (80 Gb/s); Thunderbolt 4 "
        "works, but at half the bandwidth and without RDMA"
    )
    ports = parse_thunderbolt_text(out) if code == 0 else []
    if not ports:
        return Check(name, "WARN", "no Thunderbolt ports found by system_profiler", tb5_fix)
    links = [gbps for connected, gbps, _ in ports if connected]
    if not links:
        fastest = max(gbps for _, gbps, _ in ports)
        detail = f"no Thunderbolt device connected (ports up to {fastest} Gb/s)"
        return Check(name, "WARN", detail, tb5_fix)
    slow = [gbps for gbps in links if gbps < TB5_GBPS]
    speeds = ", ".join(f"{gbps} Gb/s" for gbps in links)
    if slow:
        return Check(name, "WARN", f"Thunderbolt 4 link(s): {speeds}", tb5_fix)
    return Check(name, "PASS", f"{len(links)} Thunderbolt 5 link(s): {speeds}")


def check_bridge(services: tuple[int, str], ifconfig: tuple[int, str]) -> Check:
    name = "Thunderbolt Bridge"
    fix = (
        'sudo networksetup -setnetworkserviceenabled "Thunderbolt Bridge" off  '
        "(RDMA needs each Thunderbolt link on its own network, not one bridge over all)"
    )
    # --fix: the service off (kept across restarts), then bridge0 down now, as MLX's setup does.
    down = ("sudo", "ifconfig", "bridge0", "down")
    service_off = ("sudo", "networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off")
    code, out = services
    if code == 0:
        # networksetup marks a disabled service with a leading '*'.
        for line in out.splitlines():
            if line.strip() == "Thunderbolt Bridge":
                detail = "the Thunderbolt Bridge service is enabled"
                return Check(name, "FAIL", detail, fix, (service_off, down))
            if line.strip() == "*Thunderbolt Bridge":
                return Check(name, "PASS", "the Thunderbolt Bridge service is disabled")
    bridge = parse_ifconfig(ifconfig[1]).get("bridge0") if ifconfig[0] == 0 else None
    if bridge and bridge["members"] and bridge["active"]:
        members = ", ".join(bridge["members"])
        fix = f"sudo ifconfig bridge0 down, and {fix}"
        return Check(name, "FAIL", f"bridge0 is active and bridges {members}", fix, (down,))
    return Check(name, "PASS", "no active Thunderbolt Bridge")


def check_ibv(version: tuple[int, ...] | None, rdma_check: Check, code: int, out: str) -> Check:
    name = "RDMA devices"
    if version is None or version < RDMA_MIN_MACOS or code == 127:
        return Check(name, "SKIP", "no `ibv_devices` before macOS 26.2", "update macOS first")
    if rdma_check.status != "PASS":
        return Check(name, "SKIP", "RDMA is not enabled (see above)", RECOVERY)
    devices = parse_ibv_devices(out) if code == 0 else ()
    if not devices:
        fix = (
            "connect another Mac with a Thunderbolt 5 cable straight between the two (no dock "
            "or hub); `ibv_devices` lists one rdma_enN per live TB5 link"
        )
        return Check(name, "FAIL", "`ibv_devices` lists no device", fix)
    return Check(name, "PASS", "`ibv_devices`: " + ", ".join(devices))


def check_firewall(code: int, out: str) -> Check:
    name = "firewall"
    python = sys.executable
    fix = (
        f'allow incoming connections to Python: sudo {FIREWALL} --add "{python}" && sudo '
        f'{FIREWALL} --unblockapp "{python}"  (or System Settings → Network → Firewall → off)'
    )
    state = re.search(r"State = (\d)", out) if code == 0 else None
    if state is None:
        return Check(name, "WARN", "cannot read the application firewall's state", fix)
    match state.group(1):
        case "0":
            return Check(name, "PASS", "application firewall is off")
        case "1":
            return Check(name, "WARN", "application firewall is on: it may block the ports", fix)
    block_all = (
        'System Settings → Network → Firewall → Options: untick "Block all incoming connections"'
    )
    return Check(name, "FAIL", "application firewall blocks all incoming connections", block_all)


# ---- checks that apply everywhere -----------------------------------------------------------


def check_mlx(mlx: tuple[str | None, bool, str], macos: bool) -> list[Check]:
    version, ring, error = mlx
    install = 'pip install "mlx"' if macos else 'pip install "mlx[cpu]"'
    if version is None:
        return [
            Check("MLX", "FAIL", f"`import mlx.core` failed: {error}", install),
            Check("ring backend", "SKIP", "MLX does not import"),
        ]
    ring_check = (
        Check("ring backend", "PASS", "mx.distributed ring is available")
        if ring
        else Check(
            "ring backend",
            "FAIL",
            "mx.distributed.is_available('ring') is False",
            f"reinstall a full MLX build: {install} --force-reinstall",
        )
    )
    return [Check("MLX", "PASS", f"mlx {version} imports"), ring_check]


def check_blas(env: dict[str, str], choice: str) -> Check:
    """Ranks on Linux run the BLAS that passed the self-test, or the mlx[cpu] wheel's own."""
    name = "BLAS"
    if library := env.get("LD_PRELOAD", "").split()[:1]:
        return Check(name, "PASS", f"ranks preload {kind_of(library[0]) or 'a BLAS'}: {library[0]}")
    slow = "ranks run mlx's bundled reference BLAS, ~30x slower at prefill"
    if choice == "reference":
        return Check(name, "WARN", f"{slow} (THUNDERPOOL_BLAS=reference)", "unset THUNDERPOOL_BLAS")
    if choice != "auto":
        return Check(
            name, "WARN", f"{slow}: THUNDERPOOL_BLAS={choice} fails its self-test", INSTALL
        )
    return Check(name, "WARN", f"{slow}: no BLIS or OpenBLAS is installed", INSTALL)


def _bind_failure(err: OSError) -> Status:
    return "WARN" if err.errno == errno.EADDRINUSE else "FAIL"


def check_ports(
    port: int, ring_ports: tuple[int, int], bind: Bind, agent_here: bool = False
) -> list[Check]:
    """`agent_here`: this machine's agent answered (so it holds the agent and probe ports)."""
    checks = []
    for label, p in (("agent port", port), ("probe port", port + 1)):
        err = bind(p)
        if err is None:
            checks.append(Check(label, "PASS", f"{p} can be bound"))
        elif agent_here and err.errno == errno.EADDRINUSE:
            checks.append(Check(label, "PASS", f"{p} is held by this machine's agent"))
        else:
            fix = (
                f"if `thunderpool node` runs here it holds {p}; otherwise stop what holds it "
                f"or use `thunderpool node --port` with a free port"
            )
            checks.append(Check(label, _bind_failure(err), f"cannot bind {p}: {err}", fix))
    first, last = ring_ports
    failed = {p: err for p in range(first, last + 1) if (err := bind(p)) is not None}
    if not failed:
        checks.append(Check("ring ports", "PASS", f"{first}-{last} can be bound"))
    else:
        status: Status = "FAIL" if "FAIL" in map(_bind_failure, failed.values()) else "WARN"
        listed = ", ".join(str(p) for p in list(failed)[:8]) + (", ..." if len(failed) > 8 else "")
        detail = f"{len(failed)} of {first}-{last} cannot be bound: {listed}"
        fix = "stop the processes holding them (`lsof -i :PORT`) or rank processes left running"
        checks.append(Check("ring ports", status, detail, fix))
    return checks


def parse_peer(text: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port); ValueError naming the bad value."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer '{text}' is not host:port, e.g. 192.168.1.20:{AGENT_PORT}")
    return host, int(port)


def check_peers(peers: Sequence[str], connect: Connect) -> list[Check]:
    checks = []
    for peer in peers:
        try:
            host, port = parse_peer(peer)
        except ValueError as e:
            checks.append(Check(f"peer {peer}", "FAIL", str(e), "pass --peers HOST:PORT"))
            continue
        err = connect(host, port, 2.0)
        if err is None:
            checks.append(Check(f"peer {peer}", "PASS", f"TCP connect to {host}:{port}"))
        else:
            fix = (
                f"start `thunderpool node --port {port}` on {host}, check that both machines "
                f"share a network, and that {host}'s firewall allows the port"
            )
            detail = f"cannot connect to {host}:{port} within 2 s: {err}"
            checks.append(Check(f"peer {peer}", "FAIL", detail, fix))
    return checks


def check_versions(mlx_version: str | None, peer_infos: Sequence[NodeInfo]) -> Check:
    name = "same versions"
    if not peer_infos:
        note = "no peer reports to compare (a running cluster compares them when nodes join)"
        return Check(name, "SKIP", note)
    ours = f"thunderpool {__version__} / mlx {mlx_version}"
    odd = [
        f"{p.name} has thunderpool {p.version} / mlx {p.mlx_version}"
        for p in peer_infos
        if (p.version, p.mlx_version) != (__version__, mlx_version)
    ]
    if odd:
        fix = f"on every node: pip install thunderpool=={__version__} mlx=={mlx_version}"
        return Check(name, "FAIL", f"this node has {ours}; " + "; ".join(odd), fix)
    return Check(name, "PASS", f"{len(peer_infos)} peer(s) run {ours}")


def run_checks(
    platform_name: str,
    run: Runner,
    peers: Sequence[str] = (),
    peer_infos: Sequence[NodeInfo] = (),
    *,
    local: NodeInfo | None = None,
    shard_bytes: int | None = None,
    agent_here: bool = False,
    port: int = AGENT_PORT,
    ring_ports: tuple[int, int] = RING_PORTS,
    bind: Bind = try_bind,
    connect: Connect = try_connect,
    mlx: MlxProbe = probe_mlx,
    blas: BlasProbe = probe_blas,
    jaccl: JacclProbe = probe_jaccl,
    working_set: WorkingSetProbe = probe_working_set,
) -> list[Check]:
    """Every check for a node on `platform_name` (platform.system(): "Darwin", "Linux").
    `local`: this node's NodeInfo (on macOS read through `run` when not given); `peer_infos`:
    the other nodes', as their agents report them; `shard_bytes`: the shard this node holds;
    `agent_here`: this machine's agent answered (it holds the agent port)."""
    macos = platform_name == "Darwin"
    checks: list[Check] = []
    if macos:
        version = parse_macos_version(run(("sw_vers", "-productVersion"))[1])
        rdma = check_rdma(version, *run(("rdma_ctl", "status")))
        local = local or node_info(port, "this-node", measure=False, run=run, system="Darwin")
        checks += [
            check_macos(version),
            rdma,
            check_thunderbolt(*run(("system_profiler", "SPThunderboltDataType"))),
            check_bridge(run(("networksetup", "-listallnetworkservices")), run(("ifconfig",))),
            check_ibv(version, rdma, *run(("ibv_devices",))),
            check_rdma_links(local, *run(("ibv_devinfo",))),
            check_rdma_held(run(IOREG_RDMA), run(PS_ALL)),
            *check_cable_ends(local, peer_infos),
        ]
    else:
        names = ("macOS version", "RDMA enabled", "Thunderbolt 5", "Thunderbolt Bridge")
        checks += [Check(n, "SKIP", "not macOS") for n in (*names, "RDMA devices")]
    mlx_info = mlx()
    checks += check_mlx(mlx_info, macos)
    if macos and local is not None:
        wired = run(("sysctl", "-n", "iogpu.wired_limit_mb"))
        checks += [
            check_jaccl(jaccl() if mlx_info[0] else False, mlx_info[0]),
            check_wired_limit(*wired, local.memory_total_bytes, shard_bytes, working_set()),
        ]
    else:
        checks += [Check(n, "SKIP", "not macOS") for n in ("jaccl backend", "GPU wired limit")]
    if platform_name == "Linux":
        code, _ = run(("ip", "-V"))
        checks.append(
            Check("ip command", "PASS", "`ip` (iproute2) is installed")
            if code == 0
            else Check(
                "ip command", "FAIL", "`ip` not found", "apt-get install iproute2 (or dnf ...)"
            )
        )
        checks.append(check_blas(blas(), blas_choice()))
    checks += check_ports(port, ring_ports, bind, agent_here)
    if macos:
        checks.append(check_firewall(*run((FIREWALL, "--getglobalstate"))))
    else:
        checks.append(Check("firewall", "SKIP", "not macOS"))
    checks += check_peers(peers, connect)
    checks.append(check_versions(mlx_info[0], peer_infos))
    nodes = cluster_nodes(local, peer_infos) if local is not None else list(peer_infos)
    if macos and local is not None:
        checks += [check_mesh(nodes), check_cable_plan(local, peer_infos)]
    else:
        checks += [Check(n, "SKIP", "not macOS") for n in ("RDMA mesh", "cable addresses")]
    checks.append(check_host_ids(nodes))
    return checks
