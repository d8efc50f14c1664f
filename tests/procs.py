"""What this host runs, read from /proc: rank processes under a parent, listening ports."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# A rank's command line (`python -m thunderpool.rank JOB`); mpirun's own mentions the
# module too, inside the boot script it runs.
RANK = b"\x00-m\x00thunderpool.rank\x00"


def _processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry.name)] = (ppid, cmd)
    return found


def workers_under(pid: int, deep: bool = False) -> set[int]:
    """Rank processes (thunderpool.rank) whose parent is `pid`, or with `deep` any
    ancestor (ranks under mpirun are its grandchildren)."""
    procs = _processes()

    def below(p: int) -> bool:
        seen = set()
        while p in procs and p not in seen:
            seen.add(p)
            p = procs[p][0]
            if p == pid:
                return True
            if not deep:
                return False
        return False

    return {p for p, (_, cmd) in procs.items() if RANK in cmd and below(p)}


def alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (dead, its parent not yet reaping it) does not. Ranks under
    mpirun that outlive it are reaped by init a moment after they die."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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
