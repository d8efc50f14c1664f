"""How many cores sizing work should count on this machine (ground floor: engine and cluster).

Linux: the cores this process may run on (a container's cpuset or `taskset` gives fewer than
the machine has). macOS: the performance cores only (`sysctl -n hw.perflevel0.physicalcpu`):
a product split over all cores runs at the pace of its parts on the slower efficiency cores,
and Apple Silicon's efficiency cores are a third to a half of them. Elsewhere, os.cpu_count.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

Run = Callable[[Sequence[str]], tuple[int, str]]
PERFORMANCE_CORES = ("sysctl", "-n", "hw.perflevel0.physicalcpu")


def _sysctl(argv: Sequence[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 127, ""
    return done.returncode, done.stdout


def parse_count(text: str) -> int | None:
    """A positive whole number as sysctl prints it ("12\\n"), else None."""
    text = text.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def performance_cores(run: Run = _sysctl) -> int | None:
    """macOS: the performance cores (`hw.perflevel0.physicalcpu`), or None where the machine
    has no performance levels (Intel Macs) or the command failed."""
    code, out = run(PERFORMANCE_CORES)
    return parse_count(out) if code == 0 else None


def work_cores(platform: str | None = None, run: Run | None = None) -> int:
    """The cores to size work by (product splits, the planner's cores): on `platform`
    (sys.platform's names; None: this one), `run` replaying a recorded machine (None: asks
    this one, macOS once per process)."""
    if (platform or sys.platform) == "darwin":
        found = performance_cores(run) if run is not None else _performance_cores_here()
        return found or os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))  # may change (pinning): asked every time
    return os.cpu_count() or 1


@functools.cache
def _performance_cores_here() -> int | None:
    return performance_cores()
