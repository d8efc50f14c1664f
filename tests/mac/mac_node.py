"""`thunderpool node` as a Mac of the Mac-shaped testbed: run inside one namespace host.

    python mac_node.py RECORDED_DIR MAC ADDRESSES_JSON LOG_JSONL -- <thunderpool node args>

The agent reports the platform facts of RECORDED_DIR (a Mac's recorded macOS outputs, whose
addresses are this namespace's), so the coordinator plans jaccl over the cables. Linux has no
jaccl, so each rank the agent starts with jaccl settings is started on `ring` instead, over
exactly the addresses jaccl would use: rank r listens on its address on the cable its
MLX_IBV_DEVICES row names towards rank r-1, and dials rank r+1 on that cable's other end. The
coordinator address is checked the way jaccl uses it: rank 0 binds it (it must be its own
address) and every other rank connects to it from its own namespace. What each rank was given
is appended to LOG_JSONL for the test to compare.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from recorded.replay import Replay  # noqa: E402

from thunderpool.cluster.control import ranks  # noqa: E402
from thunderpool.cluster.node import capabilities  # noqa: E402

COORDINATOR_WAIT_S = 30.0


def far_end(address: str) -> str:
    """The other host of a /30 (.1 <-> .2)."""
    return str(ipaddress.ip_address(int(ipaddress.ip_address(address)) ^ 3))


def ring_addresses(devices: list, me: int, rank: int, table: dict[int, dict[str, str]]) -> list:
    """Each rank's listening address (its end of the cable from its predecessor), found by
    walking the ring from this Mac along the cables the device matrix names."""
    n = len(devices)
    owner = {ip: (mac, name) for mac, ifaces in table.items() for name, ip in ifaces.items()}
    macs = {rank: me}
    for k in range(1, n):
        r = (rank + k - 1) % n
        device = devices[r][(r + 1) % n]
        name = (device if isinstance(device, str) else device[0]).removeprefix("rdma_")
        macs[(r + 1) % n] = owner[far_end(table[macs[r]][name])][0]
    out = []
    for r in range(n):
        device = devices[r][(r - 1) % n]
        name = (device if isinstance(device, str) else device[0]).removeprefix("rdma_")
        out.append(table[macs[r]][name])
    return out


def check_coordinator(rank: int, coordinator: str) -> None:
    host, port = coordinator.rsplit(":", 1)
    if rank == 0:
        listener = socket.create_server((host, int(port)))  # fails unless it is our address

        def serve() -> None:
            listener.settimeout(COORDINATOR_WAIT_S)
            try:
                while True:
                    listener.accept()[0].close()
            except OSError:
                listener.close()

        threading.Thread(target=serve, daemon=True).start()
        return
    deadline = time.monotonic() + COORDINATOR_WAIT_S
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} cannot reach the coordinator {coordinator}") from e
            time.sleep(0.2)


def main() -> None:
    recorded, me, table_file, log_file = sys.argv[1:5]
    args = sys.argv[sys.argv.index("--") + 1 :]
    real_info, real_spawn = capabilities.node_info, ranks._spawn

    def node_info(*a, **kw):
        return real_info(*a, **kw, run=Replay(Path(recorded)), system="Darwin")

    def spawn(argv, env, *rest, **kw):
        if "MLX_IBV_DEVICES" in env:
            devices = json.loads(Path(env.pop("MLX_IBV_DEVICES")).read_text())
            coordinator = env.pop("MLX_JACCL_COORDINATOR")
            rank = int(env["MLX_RANK"])
            # Read now: `doctor --fix` may have addressed the cables since the agent started.
            table = {int(k): v for k, v in json.loads(Path(table_file).read_text()).items()}
            addresses = ring_addresses(devices, int(me), rank, table)
            base = int(coordinator.rsplit(":", 1)[1]) + 1
            hostfile = Path(argv[-1]).with_name(f"ring-{rank}.json")
            hostfile.write_text(json.dumps([[f"{a}:{base + r}"] for r, a in enumerate(addresses)]))
            env["MLX_HOSTFILE"] = str(hostfile)
            job = json.loads(Path(argv[-1]).read_text())
            assert job["backend"] == "jaccl", job["backend"]
            Path(argv[-1]).write_text(json.dumps({**job, "backend": "ring"}))
            entry = {
                "mac": int(me),
                "rank": rank,
                "devices": devices,
                "coordinator": coordinator,
                "ring": addresses,
                "ring_mode": env.get("MLX_JACCL_RING") == "1",
            }
            with open(log_file, "a") as f:
                f.write(json.dumps(entry) + "\n")
            check_coordinator(rank, coordinator)
        return real_spawn(argv, env, *rest, **kw)

    capabilities.node_info = node_info
    ranks._spawn = spawn
    ranks.POSIX_SPAWN = True  # as on macOS: ranks start by posix_spawn, the agent never forks
    from thunderpool.cli import node

    node.REFRESH_S = float(os.environ.get("MAC_NODE_REFRESH_S", node.REFRESH_S))
    import thunderpool

    thunderpool.hide_torch()
    from thunderpool.cli import main as cli_main

    sys.exit(cli_main(["node", *args]))


if __name__ == "__main__":
    main()
