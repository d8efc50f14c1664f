"""Namespace hosts wired like a Thunderbolt mesh of Macs (needs root):

    tm-h1 ... tm-hN   each with a LAN veth on the bridge tm-br0 (10.213.40.i/24)
    one veth pair per cable, host to host, with its own /30 in 10.213.41.0/24 (Thunderbolt
    cables are point-to-point links: a cable's address reaches the Mac at its other end only)

Each host's agent reports the recorded macOS outputs of one Mac of the scene (tests/mac/macs.py)
rendered with these addresses, so the planner sees Macs and their cables, and its ranks run
`ring` over the addresses a `jaccl` launch would use (tests/mac/mac_node.py). Built on the
testbed of tests/cluster/testbed.py (its prefix lock, teardown and process tracking).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from macs import Scene, iface, write

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from testbed import AGENT_PORT, Testbed, _ip  # noqa: E402

LAN = "10.213.40"
CABLES = "10.213.41"
MAC_NODE = Path(__file__).with_name("mac_node.py")


class MacTestbed(Testbed):
    """A Testbed whose hosts are the scene's Macs (host i+1 is Mac i), with its cables."""

    __test__ = False

    def __init__(self, scene: Scene, home: Path, addressed: bool = True):
        super().__init__(scene.n, prefix="tm-", subnet=LAN)
        ends = {}
        for k, (a, p, b, q) in enumerate(scene.wires):
            ends[(a, iface(p))] = (f"{CABLES}.{4 * k + 1}", 30)
            ends[(b, iface(q))] = (f"{CABLES}.{4 * k + 2}", 30)
        self.scene = Scene(
            scene.n, scene.wires, [(f"{LAN}.{m + 1}", 24) for m in range(scene.n)], ends
        )
        self.home = home
        self.addressed = addressed  # whether the Macs' tools print their cables' addresses
        # Unaddressed: the Macs report their cables without IPv4 addresses (as before
        # `doctor --fix`), though the namespaces' links have them.
        unaddressed = Scene(scene.n, scene.wires, self.scene.lan, {})
        self.recorded = write(self.scene if addressed else unaddressed, home / "recorded")
        self.table = home / "addresses.json"
        table: dict[int, dict[str, str]] = {m: {} for m in range(scene.n)}
        for (m, name), (ip, _) in ends.items():
            table[m][name] = ip
        self.table.write_text(json.dumps(table))
        self.log = home / "ranks.jsonl"

    def up(self) -> MacTestbed:
        super().up()
        for k, (a, _, b, _) in enumerate(self.scene.wires):
            left, right = f"{self.prefix}c{k}a", f"{self.prefix}c{k}b"
            _ip("link", "add", left, "type", "veth", "peer", "name", right)
            for mac, dev, host in ((a, left, 4 * k + 1), (b, right, 4 * k + 2)):
                ns = self.host(mac + 1).netns
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{CABLES}.{host}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        return self

    def address_cables(self) -> None:
        """What `doctor --fix` does to each Mac: from now on its tools print the addresses."""
        write(self.scene, self.home / "recorded")
        self.addressed = True

    def node_cmd(self, mac: int, *extra: str) -> list[str]:
        """`thunderpool node` on Mac `mac` (host mac+1), as that Mac."""
        i = mac + 1
        return [
            "env",
            f"THUNDERPOOL_HOME={self.home}/home{i}",
            "MAC_NODE_REFRESH_S=1",
            sys.executable,
            str(MAC_NODE),
            str(self.recorded[mac]),
            str(mac),
            str(self.table),
            str(self.log),
            "--",
            "--host",
            self.host(i).ip,
            "--port",
            str(AGENT_PORT),
            "--no-mdns",
            "--no-measure",
            *extra,
        ]

    def ranks_seen(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]
