"""Reaching the cluster from a command: --join/--token, and the coordinator they make."""

from __future__ import annotations

import argparse

from thunderpool.cluster.control.coordinator import Coordinator
from thunderpool.cluster.control.state import ClusterState
from thunderpool.errors import ThunderpoolError


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="any node of the cluster (default 127.0.0.1:7070, this machine's agent)",
    )
    p.add_argument("--token", help="cluster token (else $THUNDERPOOL_TOKEN or this machine's)")


def coordinator(args: argparse.Namespace) -> Coordinator:
    from thunderpool.cluster.control.auth import load_identity
    from thunderpool.config import state_dir, token_from_env

    token = args.token or token_from_env()
    if token is None and (state_dir() / "identity.json").is_file():
        token = load_identity().token
    if token is None:
        raise ThunderpoolError(
            "no cluster token: pass --token (printed by the first "
            "`thunderpool node`) or set $THUNDERPOOL_TOKEN"
        )
    return Coordinator(args.join or ["127.0.0.1:7070"], token)


def measured_state(coord: Coordinator) -> ClusterState:
    return coord.probe(coord.discover())
