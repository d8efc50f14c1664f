"""`thunderpool doctor`'s check for RDMA devices still held: jaccl fails with EBUSY on a device
whose queue pairs a process still holds, most often a rank left from a crashed run.

Who holds what is read from the IOKit registry, `ioreg -a -l -r -c AppleThunderboltIPPort`: a
Thunderbolt IP port, its network interface (`BSD Name` en2) and, below it, the RDMA interface
whose user clients name the process that opened them (`IOUserClientCreator` = "pid 4242,
Python") and whose queue pairs are listed beside them. `ps -axo pid=,ppid=,command=` then says
what each holder is: a thunderpool rank whose agent is gone (its parent is launchd, pid 1) is a
leftover to kill; anything else is named for a person to judge. Queue pairs that no process
holds are stale resources only a restart frees.
"""

from __future__ import annotations

import plistlib
import re
from dataclasses import dataclass, field

from thunderpool.cluster.node.checks import Check, Status

IOREG_RDMA = ("ioreg", "-a", "-l", "-r", "-c", "AppleThunderboltIPPort")
PS_ALL = ("ps", "-axo", "pid=,ppid=,command=")
RANK_MODULE = "-m thunderpool.rank"  # how an agent starts a rank (cluster/control/ranks.py)
_CREATOR = re.compile(r"pid (\d+), (.*)")


@dataclass
class DeviceUse:
    """One RDMA device's holders (pid, process name) and queue pairs, as the registry lists."""

    holders: list[tuple[int, str]] = field(default_factory=list)
    queue_pairs: int = 0


def _walk(entry: dict, use: DeviceUse) -> None:
    for child in entry.get("IORegistryEntryChildren", []):
        if m := _CREATOR.fullmatch(str(child.get("IOUserClientCreator", ""))):
            use.holders.append((int(m.group(1)), m.group(2)))
        if str(child.get("IOObjectClass", "")).endswith("QueuePair"):
            use.queue_pairs += 1
        _walk(child, use)


def parse_rdma_use(text: str) -> dict[str, DeviceUse] | None:
    """`ioreg -a ...` (an XML plist) -> {"rdma_en2": DeviceUse}, for each interface that has an
    RDMA interface below it; None: not a plist ioreg prints."""
    try:
        ports = plistlib.loads(text.encode())
    except (plistlib.InvalidFileException, ValueError):
        return None
    found: dict[str, DeviceUse] = {}
    for port in ports if isinstance(ports, list) else [ports]:
        for iface in port.get("IORegistryEntryChildren", []):
            name = iface.get("BSD Name")
            rdma = [
                c
                for c in iface.get("IORegistryEntryChildren", [])
                if "RDMA" in str(c.get("IOObjectClass", ""))
            ]
            if name and rdma:
                use = found.setdefault(f"rdma_{name}", DeviceUse())
                for r in rdma:
                    _walk(r, use)
    return found


def parse_ps(text: str) -> dict[int, tuple[int, str]]:
    """`ps -axo pid=,ppid=,command=` -> {pid: (ppid, command)}."""
    table = {}
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = (int(parts[1]), parts[2] if len(parts) > 2 else "")
    return table


def check_rdma_held(ioreg: tuple[int, str], ps: tuple[int, str]) -> Check:
    """Whether any process, or any stale queue pair, holds this Mac's RDMA devices."""
    name = "RDMA in use"
    use = parse_rdma_use(ioreg[1]) if ioreg[0] == 0 else None
    if use is None:
        fix = "run `ioreg -l -r -c AppleThunderboltIPPort` by hand to see who holds rdma_en*"
        return Check(name, "SKIP", f"cannot read `{' '.join(IOREG_RDMA)}`", fix)
    if not use:
        return Check(name, "SKIP", "the IOKit registry lists no RDMA device (see 'RDMA enabled')")
    table = parse_ps(ps[1]) if ps[0] == 0 else {}
    leftovers, others, stale = [], [], []
    for device, u in sorted(use.items()):
        if u.queue_pairs and not u.holders:
            stale.append(f"{device} has {u.queue_pairs} queue pair(s) that no process holds")
        for pid, process in dict.fromkeys(u.holders):
            ppid, command = table.get(pid, (None, ""))
            said = f"{device} is held by pid {pid} ({process}{': ' + command if command else ''})"
            if RANK_MODULE in command and ppid == 1:
                leftovers.append((pid, f"{said}, a thunderpool rank whose agent is gone"))
            else:
                others.append((pid, said))
    if not (leftovers or others or stale):
        return Check(name, "PASS", f"no process holds {', '.join(sorted(use))}")
    status: Status = "FAIL" if leftovers or stale else "WARN"
    detail = "; ".join([s for _, s in leftovers] + [s for _, s in others] + stale)
    fixes = []
    if leftovers:
        pids = sorted({pid for pid, _ in leftovers})
        fixes.append(f"kill the leftover rank(s): kill -9 {' '.join(map(str, pids))}")
    if others:
        pids = " ".join(str(p) for p in sorted({pid for pid, _ in others}))
        fixes.append(
            f"if no model should be running on this Mac now, quit pid {pids} (kill {pids}): "
            "a new jaccl launch here fails with EBUSY while its queue pairs are held"
        )
    if stale:
        fixes.append("restart this Mac: only a restart frees queue pairs no process holds")
    commands = tuple(("kill", "-9", str(pid)) for pid in sorted({p for p, _ in leftovers}))
    return Check(name, status, detail, "; ".join(fixes), commands)
