"""Who holds a Mac's RDMA devices, in the forms two macOS tools print it (tests/mac/README.md says
where each shape comes from):

- `ioreg -a -l -r -c AppleThunderboltIPPort`: an XML plist array, one dict per Thunderbolt IP
  port; below it the port's network interface (`BSD Name`), below that the RDMA interface,
  whose children are the user clients a process opened (`IOUserClientCreator` = "pid N, name")
  and its queue pairs.
- `ps -axo pid=,ppid=,command=`: no header; pid and ppid right-aligned in 5 columns.

Scene knobs (macs.Scene): `holders`, processes holding a port's device; `stale`, ports whose
queue pairs outlived every process.
"""

from __future__ import annotations

import plistlib
from dataclasses import dataclass

AGENT_PID = 812
PYTHON = "/Users/studio/.venv/bin/python3"


@dataclass(frozen=True)
class Holder:
    """A process holding Thunderbolt `port`'s RDMA device on Mac `mac`."""

    mac: int
    port: int
    pid: int
    ppid: int  # 1: launchd adopted it (whoever started it is gone)
    command: str  # as `ps -o command=` prints it
    name: str = "Python"  # the process name IOKit records (p_comm)
    queue_pairs: int = 2


def rank_command(rank: int) -> str:
    """A rank as the agent starts it (cluster/control/ranks.py), its job in the agent's dir."""
    job = f"/var/folders/x1/q8z0000gn/T/thunderpool-agent-3kx9_p2a/job-{rank}.json"
    return f"{PYTHON} -m thunderpool.rank {job}"


def _entry(cls: str, ident: int, **props) -> dict:
    return {"IOObjectClass": cls, "IORegistryEntryID": ident, "IORegistryEntryName": cls, **props}


def ioreg_rdma(scene, mac: int) -> str:
    from macs import PORTS, iface

    ports = []
    for p in range(1, PORTS + 1):
        peer = scene.peer(mac, p)
        base = 0x100000A00 + 0x40 * p
        clients = []
        for n, h in enumerate(x for x in scene.holders if (x.mac, x.port) == (mac, p)):
            creator = f"pid {h.pid}, {h.name}"
            clients.append(
                _entry("AppleThunderboltRDMAUserClient", base + 8 + n, IOUserClientCreator=creator)
            )
            qps = range(h.queue_pairs)
            clients += [_entry("AppleThunderboltRDMAQueuePair", base + 16 + 4 * n + q) for q in qps]
        if (mac, p) in scene.stale:
            clients += [_entry("AppleThunderboltRDMAQueuePair", base + 32 + q) for q in range(2)]
        rdma = _entry("AppleThunderboltRDMAInterface", base + 3, IORegistryEntryChildren=clients)
        if not clients:
            del rdma["IORegistryEntryChildren"]
        interface = _entry(
            "AppleThunderboltIPInterface",
            base + 2,
            **{
                "BSD Name": iface(p),
                "IOInterfaceUnit": p + 1,
                "IOLinkActiveCount": int(bool(peer)),
            },
            IORegistryEntryChildren=[] if scene.rdma_off else [rdma],  # RDMA off: no interface
        )
        port = _entry(
            "AppleThunderboltIPPort",
            base + 1,
            IOLinkStatus=2 if peer else 0,
            IOLinkSpeed=scene.speed(mac, p) or 0,
            IORegistryEntryChildren=[interface],
        )
        ports.append(port)
    return plistlib.dumps(ports, fmt=plistlib.FMT_XML).decode()


def ps(scene, mac: int) -> str:
    rows = [
        (1, 0, "/sbin/launchd"),
        (341, 1, "/usr/libexec/logd"),
        (AGENT_PID, 1, f"{PYTHON} /Users/studio/.venv/bin/thunderpool node"),
    ]
    rows += [(h.pid, h.ppid, h.command) for h in scene.holders if h.mac == mac]
    rows.append((4410, 4402, "ps -axo pid=,ppid=,command="))
    return "".join(f"{pid:>5} {ppid:>5} {command}\n" for pid, ppid, command in sorted(set(rows)))
