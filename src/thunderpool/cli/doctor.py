"""`thunderpool doctor [--fix]`: its arguments, the cluster it asks, the table it prints.

The cluster-wide checks (RDMA mesh, cable addresses, host ids, versions) compare this node's
fresh report with its peers' as the local agent (or `--join`) knows them; without a running
`thunderpool node` they are skipped and say so.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Sequence

from thunderpool.cluster.control.messages import NodeInfo
from thunderpool.cluster.node.capabilities import Runner, node_info, subprocess_runner
from thunderpool.cluster.node.checks import Check
from thunderpool.cluster.node.doctor import AGENT_PORT, RING_PORTS, parse_peer, run_checks
from thunderpool.cluster.node.doctor_fix import (
    Say,
    apply_fixes,
    fix_commands,
    interactive_runner,
    left_to_a_person,
)
from thunderpool.cluster.node.doctor_gpu import GB


def _peer_arg(text: str) -> str:
    try:
        parse_peer(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _range_arg(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    if first.isdigit() and (last or first).isdigit() and 0 < int(first) <= int(last or first):
        if int(last or first) < 65536:
            return int(first), int(last or first)
    raise argparse.ArgumentTypeError(f"'{text}' is not a port range like 29500-29531")


def _gb_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size in GB, e.g. 200")
    return value


def add_doctor_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this node for a working cluster (RDMA over Thunderbolt on Macs) and print "
        "a fix for each problem; --fix runs the fixes that are commands",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        default=[],
        type=_peer_arg,
        metavar="HOST:PORT",
        help="other nodes' agents to try a TCP connection to",
    )
    p.add_argument(
        "--port", type=int, default=AGENT_PORT, help=f"agent port to check (default {AGENT_PORT})"
    )
    p.add_argument(
        "--ring-ports",
        type=_range_arg,
        default=RING_PORTS,
        metavar="FIRST-LAST",
        help=f"MLX ring ports to check (default {RING_PORTS[0]}-{RING_PORTS[1]})",
    )
    p.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a cluster node whose agent reports the peers for the cluster-wide checks "
        "(default: this machine's agent at 127.0.0.1:PORT)",
    )
    p.add_argument("--token", help="cluster token (else $THUNDERPOOL_TOKEN or this machine's)")
    p.add_argument(
        "--shard-gb",
        type=_gb_arg,
        metavar="GB",
        help="the shard this Mac will hold, for the GPU wired limit check (default: the most "
        "the planner may put here, its memory less an 8 GB OS reserve)",
    )
    p.add_argument(
        "--fix",
        action="store_true",
        help="on macOS, run (with sudo, each printed first) the fixes that are commands: "
        "Thunderbolt Bridge off, each cable end's /30 address and route (as "
        "`mlx.distributed_config --auto-setup` sets them; run it on every Mac, with "
        "`thunderpool node` running on each), the GPU wired limit, and a kill of any "
        "leftover rank whose agent is gone that still holds an RDMA device",
    )


STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


def print_checks(checks: Sequence[Check]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="thunderpool doctor", show_lines=False)
    for column in ("check", "result", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for c in checks:
        table.add_row(
            escape(c.name), f"[{STYLE[c.status]}]{c.status}[/]", escape(c.detail), escape(c.fix)
        )
    console = Console()
    console.print(table)
    counts = {s: sum(c.status == s for c in checks) for s in STYLE}
    console.print(", ".join(f"{n} {s.lower()}" for s, n in counts.items()))


def stored_identity() -> tuple[str, str | None]:
    """(node id, token) that `thunderpool node` stored here, without creating any."""
    from thunderpool.config import state_dir

    try:
        stored = json.loads((state_dir() / "identity.json").read_text())
        return str(stored.get("node_id") or "this-node"), stored.get("token")
    except (OSError, ValueError, AttributeError):
        return "this-node", None


def cluster_peers(
    args: argparse.Namespace, node_id: str, token: str | None
) -> tuple[list[NodeInfo], str, bool]:
    """The other nodes' reports as the cluster's agents know them (or why there are none), and
    whether this machine's agent is among the cluster's."""
    from thunderpool.cluster.control.coordinator import Coordinator
    from thunderpool.config import token_from_env
    from thunderpool.errors import ThunderpoolError

    token = args.token or token_from_env() or token
    seeds = args.join or [f"127.0.0.1:{args.port}"]
    if token is None:
        return [], "cluster checks: no cluster token here (start `thunderpool node` first)", False
    try:
        state = Coordinator(seeds, token).discover()
    except ThunderpoolError as e:
        return [], f"cluster checks: no agent answered at {', '.join(seeds)} ({e})", False
    peers = [n for key, n in state.nodes.items() if key != node_id]
    return peers, "", node_id in state.nodes


def run_doctor(
    args: argparse.Namespace,
    system: str,
    run: Runner,
    fix_run: Runner,
    local: NodeInfo | None,
    peer_infos: Sequence[NodeInfo],
    say: Say = print,
    agent_here: bool = False,
    **probes,
) -> tuple[list[Check], int]:
    """The checks, printed; with --fix their commands run through `fix_run`. The exit code:
    0 none failed (or --fix ran every failing check's fix), 1 a failure, 2 --fix off macOS."""
    shard = None if args.shard_gb is None else int(args.shard_gb * GB)
    checks = run_checks(
        system,
        run,
        peers=args.peers,
        peer_infos=peer_infos,
        local=local,
        shard_bytes=shard,
        agent_here=agent_here,
        port=args.port,
        ring_ports=args.ring_ports,
        **probes,
    )
    print_checks(checks)
    failed = [c for c in checks if c.status == "FAIL"]
    if not args.fix:
        if fix_commands(checks) and system == "Darwin":
            say("`thunderpool doctor --fix` runs the fixes that are commands (with sudo)")
        return checks, 1 if failed else 0
    code = apply_fixes(checks, system, fix_run, say)
    if code:
        return checks, code
    if any(cmd[1] == "ifconfig" and cmd[2] != "bridge0" for cmd in fix_commands(checks)):
        say(
            "cable addresses changed: run `thunderpool doctor --fix` on every other Mac too; "
            "the agents pick up the new addresses within 15 s, no restart needed"
        )
    return checks, 1 if left_to_a_person(checks) else 0


def doctor_main(args: argparse.Namespace, peer_infos: Sequence[NodeInfo] | None = None) -> int:
    """Print the checks (and run the fixes with --fix); exit 0 when none failed, else 1."""
    system = platform.system()
    node_id, token = stored_identity()
    note, here = "", False
    if peer_infos is None:
        peer_infos, note, here = cluster_peers(args, node_id, token)
    local = node_info(args.port, node_id, measure=False)
    _, code = run_doctor(
        args,
        system,
        subprocess_runner,
        interactive_runner,
        local,
        peer_infos,
        agent_here=here,
    )
    if note:
        print(note)
    return code
