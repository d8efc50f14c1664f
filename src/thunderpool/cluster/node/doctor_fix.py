"""`thunderpool doctor --fix`: run the commands that fix what the checks found, with sudo,
each printed before it runs, so a user never types `ifconfig` by hand.

Only checks that did not pass and whose fix is a command take part (cluster/node/checks.py):
the Thunderbolt Bridge down, every cable end of this Mac on its /30 with its peer routed
by the cable (what `mlx.distributed_config --auto-setup` runs), the GPU wired limit, and
`kill -9` of a leftover rank still holding an RDMA device (cluster/node/doctor_held.py). The
commands are macOS's; on any other system --fix runs nothing and says so.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Sequence

from thunderpool.cluster.node.capabilities import Runner
from thunderpool.cluster.node.checks import Check

Say = Callable[[str], None]
NOT_MACOS = (
    "doctor --fix sets up a Mac's Thunderbolt cables, Thunderbolt Bridge and GPU wired limit; "
    "on {system} it runs nothing: follow each check's fix by hand"
)


def interactive_runner(argv: Sequence[str]) -> tuple[int, str]:
    """Run argv on this terminal (sudo may ask for the password): no capture, no timeout."""
    try:
        return subprocess.run(list(argv), check=False).returncode, ""
    except FileNotFoundError:
        return 127, ""


def fix_commands(checks: Sequence[Check]) -> list[tuple[str, ...]]:
    """The commands of the checks that did not pass, in the checks' order, each once."""
    found: list[tuple[str, ...]] = []
    for c in checks:
        if c.status in ("FAIL", "WARN"):
            found += [cmd for cmd in c.commands if cmd not in found]
    return found


def left_to_a_person(checks: Sequence[Check]) -> list[Check]:
    """The failed checks --fix does nothing for. A failing cable end is fixed by the cluster's
    cable plan ("cable addresses") where that carries commands for this Mac."""
    planned = any(c.name == "cable addresses" and c.commands for c in checks)
    return [
        c
        for c in checks
        if c.status == "FAIL" and not c.commands and not (planned and c.name.startswith("cable "))
    ]


def apply_fixes(checks: Sequence[Check], system: str, run: Runner, say: Say = print) -> int:
    """Run the fixes of `checks` through `run`, each printed first; stop at the first that
    fails. 0: all ran (or none was needed); 1: one failed; 2: not macOS (nothing ran)."""
    if system != "Darwin":
        say(NOT_MACOS.format(system=system or "this system"))
        return 2
    todo = fix_commands(checks)
    if not todo:
        say("doctor --fix: no check's fix is a command to run")
        return 0
    say(f"doctor --fix runs {len(todo)} command(s):")
    for argv in todo:
        say(f"  $ {shlex.join(argv)}")
        code, out = run(argv)
        if code != 0 and argv[1:3] == ("route", "change"):
            # No route to that peer to change ("not in table"): the cable's /30 routes it.
            # mlx.distributed_config --auto-setup goes on past this too.
            say(f"  (exit code {code}: no other route to {argv[3]}; the cable's network routes it)")
            continue
        if code != 0:
            said = f": {out.strip()}" if out.strip() else ""
            say(f"  failed with exit code {code}{said}; the rest were not run")
            return 1
    return 0
