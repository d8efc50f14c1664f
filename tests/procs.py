"""What this host runs, read from /proc: rank processes under a parent, listening ports."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def workers_under(pid: int) -> set[int]:
    """Rank processes (thunderpool.engine.worker) whose parent is `pid`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"thunderpool.engine.worker" in cmd:
            found.add(int(entry.name))
    return found


def listening(pid: int | None = None) -> set[int]:
    """Every TCP port some process on this host listens on, or only process `pid` (closed
    connections in TIME_WAIT still block a plain bind, so a bind is not the test)."""
    inodes = None if pid is None else _sockets(pid)
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and (inodes is None or f[9] in inodes):  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _sockets(pid: int) -> set[str]:
    """Inodes of the sockets process `pid` holds open (none once it has gone)."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    found.add(target[8:-1])
    except OSError:
        pass
    return found
