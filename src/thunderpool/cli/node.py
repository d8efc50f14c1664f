"""`thunderpool node`: start the agent, print the token once, join peers, serve until stopped."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

from rich.console import Console

from thunderpool import __version__
from thunderpool.cluster.control.agent import Agent, create_agent_app, join_all
from thunderpool.cluster.control.auth import load_identity
from thunderpool.cluster.control.probe import ProbeServer
from thunderpool.cluster.control.ranks import RankManager

log = logging.getLogger("thunderpool.node")

DEFAULT_PORT = 7070


def add_node_parser(sub) -> None:
    p = sub.add_parser(
        "node",
        help="run this machine's agent: report capabilities, join the "
        "cluster, run ranks for the coordinator",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default all)")
    p.add_argument(
        "--advertise",
        help="address peers should use (default: --host, else the address of the interface "
        "the default route leaves by, else the first Ethernet or Wi-Fi one; never a "
        "Thunderbolt cable's)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"control port (default {DEFAULT_PORT}); the link probe uses port+1",
    )
    p.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="join the cluster through this node (repeatable)",
    )
    p.add_argument(
        "--token",
        help="cluster token (else $THUNDERPOOL_TOKEN, else the stored "
        "one, else a new one printed once)",
    )
    p.add_argument(
        "--host-id",
        metavar="ID",
        help="this agent's machine identity (else $THUNDERPOOL_HOST_ID, else the kernel's boot "
        "id): agents on one machine share its cores and memory in the planner; give each agent "
        "with its own cores and memory (containers with cpusets) an id of its own",
    )
    p.add_argument("--no-mdns", action="store_true", help="do not announce or browse on mDNS")
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="skip the memory-bandwidth and FLOP/s measurement at start",
    )


def host_override(args: argparse.Namespace) -> str | None:
    """--host-id, else $THUNDERPOOL_HOST_ID; None: the agent reports its kernel's boot id."""
    from thunderpool.config import host_id_from_env

    return (args.host_id or "").strip() or host_id_from_env()


REFRESH_S = 15.0  # how often a node re-reads its addresses and cables (no measurement)


def _refresh_network(agent, args: argparse.Namespace, node_info) -> None:
    """Re-read this node's network facts now and then, so a cable plugged or addressed
    (`doctor --fix`) after the agent started reaches the planner without a restart."""
    while True:
        time.sleep(REFRESH_S)
        try:
            fresh = node_info(
                args.port, agent.identity.node_id, measure=False, host=host_override(args)
            )
            agent.refresh(fresh)
        except Exception as e:  # noqa: BLE001 - a failed re-read keeps the last facts
            log.warning("could not re-read this node's network: %s", e)


def node_main(args: argparse.Namespace) -> int:
    import uvicorn

    from thunderpool.cluster.node.capabilities import node_info
    from thunderpool.cluster.node.thunderbolt import own_address
    from thunderpool.models.source import resolve_model

    err = Console(stderr=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    identity = load_identity(args.token)
    if identity.created:
        err.print(
            f"cluster token (shown once; pass it to every other node with --token): "
            f"[bold]{identity.token}[/]"
        )
    info = node_info(
        args.port, identity.node_id, measure=not args.no_measure, host=host_override(args)
    )
    address = args.advertise or (
        args.host if args.host != "0.0.0.0" else own_address(info) or "127.0.0.1"
    )
    probe = ProbeServer(args.host, args.port + 1, (identity.node_id, identity.token)).start()
    ranks = RankManager(
        resolve_model=lambda m: resolve_model(m, progress=False), link_token=identity.token
    )
    agent = Agent(identity, info, f"{address}:{args.port}", args.port + 1, ranks)
    server = uvicorn.Server(
        uvicorn.Config(create_agent_app(agent), host=args.host, port=args.port, log_level="warning")
    )
    discovery = None
    # Stopping the node stops every rank it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        thread = threading.Thread(target=server.run, name="agent", daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                err.print(f"error: cannot listen on {args.host}:{args.port}; pass another --port")
                return 2
            thread.join(0.05)
        join_all(agent, args.join, say=err.print)
        threading.Thread(
            target=_refresh_network, args=(agent, args, node_info), name="refresh", daemon=True
        ).start()
        if not args.no_mdns:
            from thunderpool.cluster.control.discovery import Discovery

            discovery = Discovery(
                identity.node_id, __version__, address, args.port, agent.join
            ).start()
        err.print(
            f"node {info.name} ({identity.node_id}) at {address}:{args.port}: "
            f"{len(agent.state.nodes)} node(s) known"
        )
        thread.join()
        return 0
    finally:
        if discovery is not None:
            discovery.close()
        ranks.stop_all()
        probe.shutdown()
