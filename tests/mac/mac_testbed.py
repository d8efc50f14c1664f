"""Namespace hosts wired like a Thunderbolt mesh (or ring) of Macs (needs root):

    tm-h1 ... tm-hN   each with a LAN veth on the bridge tm-br0 (LAN.i/24, LAN a parameter
                      inside the testbed's own 10.213.0.0/16)
    one veth pair per cable, host to host (Thunderbolt cables are point-to-point links: a
    cable's address reaches the Mac at its other end only), addressed either from the start
    (its own /30 in 10.213.41.0/24) or, unaddressed, by `doctor --fix` run on each Mac
    (`fix_cables`: the commands it runs become the same addresses in the namespaces)

Each host's agent reports the recorded macOS outputs of one Mac of the scene (tests/mac/macs.py)
rendered with these addresses, so the planner sees Macs and their cables, and its ranks run
`ring` over the addresses a `jaccl` launch would use (tests/mac/mac_node.py). Built on the
testbed of tests/cluster/testbed.py (its prefix lock, teardown and process tracking).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from macs import Scene, iface, write

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from recorded.replay import Replay  # noqa: E402
from testbed import AGENT_PORT, SAFE_RANGE, Testbed, _ip  # noqa: E402

from thunderpool.cli.doctor import add_doctor_parser, run_doctor  # noqa: E402
from thunderpool.cluster.control.messages import NodeInfo  # noqa: E402

LAN = "10.213.40"
CABLES = "10.213.41"
MAC_NODE = Path(__file__).with_name("mac_node.py")


class MacTestbed(Testbed):
    """A Testbed whose hosts are the scene's Macs (host i+1 is Mac i), with its cables."""

    __test__ = False

    def __init__(self, scene: Scene, home: Path, addressed: bool = True, lan: str = LAN):
        if not lan.startswith(SAFE_RANGE) or lan == CABLES:
            raise ValueError(f"lan {lan!r} must be a /24 like '10.213.40' other than {CABLES}")
        super().__init__(scene.n, prefix="tm-", subnet=lan)
        self.ends: dict[tuple[int, str], tuple[str, int]] = {}
        self.veth: dict[tuple[int, str], str] = {}  # (mac, iface) -> its namespace's veth
        for k, (a, p, b, q) in enumerate(scene.wires):
            self.ends[(a, iface(p))] = (f"{CABLES}.{4 * k + 1}", 30)
            self.ends[(b, iface(q))] = (f"{CABLES}.{4 * k + 2}", 30)
            self.veth[(a, iface(p))] = f"{self.prefix}c{k}a"
            self.veth[(b, iface(q))] = f"{self.prefix}c{k}b"
        self.home = home
        self.addressed = addressed  # whether the cables have addresses (and the Macs print them)
        # Unaddressed: no cable end has an IPv4 address until `fix_cables` gives it one.
        lans = [(f"{lan}.{m + 1}", 24) for m in range(scene.n)]
        self.scene = Scene(scene.n, scene.wires, lans, dict(self.ends) if addressed else {})
        self.table = home / "addresses.json"
        self.log = home / "ranks.jsonl"
        self.recorded = self._render()

    def _render(self) -> list[Path]:
        """The Macs' recordings and the address table mac_node.py reads, as the cables are now."""
        table: dict[int, dict[str, str]] = {m: {} for m in range(self.scene.n)}
        for (m, name), (ip, _) in self.scene.addresses.items():
            table[m][name] = ip
        self.table.write_text(json.dumps(table))
        return write(self.scene, self.home / "recorded")

    def up(self) -> MacTestbed:
        super().up()
        for k in range(len(self.scene.wires)):
            _ip(
                "link",
                "add",
                f"{self.prefix}c{k}a",
                "type",
                "veth",
                "peer",
                "name",
                f"{self.prefix}c{k}b",
            )
        for (mac, name), dev in self.veth.items():
            ns = self.host(mac + 1).netns
            _ip("link", "set", dev, "netns", ns)
            if (mac, name) in self.scene.addresses:
                ip, prefix = self.scene.addresses[(mac, name)]
                _ip("-n", ns, "addr", "add", f"{ip}/{prefix}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        return self

    def fix_cables(self, nodes: Sequence[NodeInfo], mac_of: dict[str, int]) -> dict[int, list]:
        """`thunderpool doctor --fix` on every Mac, its peers as their agents report them
        (`nodes`, `mac_of` naming each node's Mac): each `ifconfig enX inet IP netmask M` it
        runs sets that address on the cable's veth in the Mac's namespace, and from then on
        the Mac's tools print it. Returns the commands each Mac ran."""
        ran: dict[int, list] = {}
        for node in nodes:
            mac = mac_of[node.node_id]
            ran[mac] = []

            def run(argv, mac=mac, log=ran[mac]):
                log.append(tuple(argv))
                if argv[:2] == ("sudo", "ifconfig") and argv[2] != "bridge0":
                    name, ip, mask = argv[2], argv[4], argv[6]
                    prefix = ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen
                    ns = self.host(mac + 1).netns
                    _ip(
                        "-n", ns, "addr", "replace", f"{ip}/{prefix}", "dev", self.veth[(mac, name)]
                    )
                    self.scene.addresses[(mac, name)] = (ip, prefix)
                    self._render()
                return 0, ""  # `route change`: the cable's /30 routes its peer here too

            parser = argparse.ArgumentParser(prog="thunderpool")
            add_doctor_parser(parser.add_subparsers(dest="command"))
            args = parser.parse_args(["doctor", "--fix"])
            peers = [n for n in nodes if n.node_id != node.node_id]
            probes = {
                "bind": lambda port: None,
                "connect": lambda *a: None,
                "mlx": lambda: ("0.0", True, ""),
                "jaccl": lambda: True,
                "working_set": lambda: None,
            }
            quiet = lambda _: None  # noqa: E731
            run_doctor(
                args, "Darwin", Replay(self.recorded[mac]), run, node, peers, quiet, **probes
            )
        self.addressed = True
        return ran

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
