"""One `thunderpool doctor` check's result: what was found and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    # The fix as commands `doctor --fix` may run (with sudo), in order; empty: a person's job.
    commands: tuple[tuple[str, ...], ...] = ()
