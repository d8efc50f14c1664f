"""The recorded Mac meshes as `thunderpool doctor` sees them (tests/mac/macs.py scenes):
each Mac's agent view, doctor run on one Mac with its peers, and --fix's recorded
commands; shared by test_doctor_mac.py and test_doctor_fix_mac.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.recorded.replay import Replay
from macs import Scene, write

from thunderpool.cli.doctor import add_doctor_parser, run_doctor
from thunderpool.cluster.control.messages import NodeInfo
from thunderpool.cluster.node.capabilities import node_info
from thunderpool.cluster.node.checks import Check
from thunderpool.cluster.node.thunderbolt import cable_addresses

MEMORY = 549755813888  # the scenes' Mac Studios: 512 GiB
FULL_LIMIT = (MEMORY - 8 * 10**9) // 2**20  # what --fix sets: memory less the OS reserve


def node_id(mac: int) -> str:
    """Ids whose order is not the Macs' (mac0 -> "7", mac1 -> "4", mac2 -> "1", mac3 -> "8"),
    so the plan's node-id order is tested, not the recordings' order."""
    return f"{7 * (mac + 1) % 10}-studio"


def macs(scene: Scene, where: Path) -> tuple[list[Path], list[NodeInfo]]:
    dirs = write(scene, where)
    nodes = [
        node_info(7070, node_id(m), measure=False, run=Replay(d), system="Darwin").model_copy(
            update={"name": f"studio-{m}"}
        )
        for m, d in enumerate(dirs)
    ]
    return dirs, nodes


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="thunderpool")
    add_doctor_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["doctor", *argv])


class Recorder:
    """The sudo runner for --fix: remembers each command, runs nothing."""

    def __init__(self):
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv):
        self.calls.append(tuple(argv))
        return 0, ""


def doctor(
    dirs: list[Path], nodes: list[NodeInfo], mac: int, *argv: str, **probes
) -> tuple[dict[str, Check], list[tuple[str, ...]], int, list[str]]:
    """`thunderpool doctor ARGV` on Mac `mac`, its peers as their agents report them:
    (checks by name, the commands --fix ran, the exit code, what it said)."""
    probes = {
        "bind": lambda port: None,
        "connect": lambda host, port, timeout: None,
        "mlx": lambda: ("0.32.4", True, ""),
        "jaccl": lambda: True,
        "working_set": lambda: None,
    } | probes
    fixer, said = Recorder(), []
    peers = [n for m, n in enumerate(nodes) if m != mac]
    checks, code = run_doctor(
        args_of(*argv),
        "Darwin",
        Replay(dirs[mac]),
        fixer,
        nodes[mac],
        peers,
        said.append,
        **probes,
    )
    by_name = {c.name: c for c in checks}
    assert len(by_name) == len(checks), "check names must be unique"
    return by_name, fixer.calls, code, said


def rdma_statuses(checks: dict[str, Check]) -> dict[str, str]:
    keep = ("RDMA", "cable", "Thunderbolt Bridge", "jaccl", "GPU", "host ids")
    return {k: c.status for k, c in checks.items() if k.startswith(keep)}


def mlx_addresses(scene: Scene) -> dict[tuple[int, str], tuple[str, int]]:
    return {k: (ip, 30) for k, ip in cable_addresses(scene.cables()).items()}
