"""Settings read from the environment and the per-user state directory (nowhere else)."""

from __future__ import annotations

import os
from pathlib import Path

from thunderpool.errors import ThunderpoolError

TOKEN_ENV = "THUNDERPOOL_TOKEN"


def state_dir() -> Path:
    """Where a node keeps its identity and cluster token: $THUNDERPOOL_HOME or ~/.thunderpool."""
    env = os.environ.get("THUNDERPOOL_HOME")
    return Path(env).expanduser() if env else Path.home() / ".thunderpool"


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


LINK_TOKEN_ENV = "THUNDERPOOL_LINK_TOKEN"
API_KEY_ENV = "THUNDERPOOL_API_KEY"


def link_token_from_env() -> str | None:
    """The secret a leader rank checks on the engine link (set by whoever starts the rank)."""
    return os.environ.get(LINK_TOKEN_ENV) or None


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


HOST_ID_ENV = "THUNDERPOOL_HOST_ID"


def host_id_from_env() -> str | None:
    """The machine identity an agent reports instead of the boot id (`node --host-id`)."""
    return os.environ.get(HOST_ID_ENV, "").strip() or None


def blas_choice() -> str:
    """THUNDERPOOL_BLAS: "auto" (default), "reference" (the wheel's own), or a library path."""
    return os.environ.get("THUNDERPOOL_BLAS", "auto")


def _count(name: str, auto: str, example: str) -> int | None:
    """A positive whole number from environment variable `name`; None when unset or "auto"."""
    value = os.environ.get(name, "auto").strip()
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ThunderpoolError(
            f"{name}={value!r} is not a positive whole number; "
            f"unset it or set it to auto ({auto}) or e.g. {example}"
        )
    return int(value)


def decode_ways() -> int | None:
    """THUNDERPOOL_DECODE_WAYS: the CPU streams a compiled decode step splits its one-row
    products over (engine/rowsplit.py); None (unset or "auto") means one per core."""
    return _count("THUNDERPOOL_DECODE_WAYS", "one per core", "1 (no split)")


def decode_graphs() -> int | None:
    """THUNDERPOOL_DECODE_GRAPHS: how many input shapes keep their compiled decode graph
    (engine/compiled.py); None (unset or "auto") means its default."""
    return _count("THUNDERPOOL_DECODE_GRAPHS", "32", "8 (less memory, more retracing)")


def kmajor_choice() -> bool | None:
    """THUNDERPOOL_KMAJOR: 1 or 0 forces input-major weights on or off (engine/kmajor.py);
    None (unset or "auto") means on for a CPU rank."""
    return _switch("THUNDERPOOL_KMAJOR", "set 0 to keep MLX's (out, in) weight layout")


def draft_shards_choice() -> bool | None:
    """THUNDERPOOL_DRAFT_SHARDS: 0 keeps a TP layout's draft whole on the leader; 1 shards it
    like the target where every rank holds its files; unset (or "auto") shards it there
    where its token is timed faster sharded (engine/draft_load.py)."""
    return _switch("THUNDERPOOL_DRAFT_SHARDS", "set 0 to draft on the leader alone")


def cpu_exp_choice() -> bool | None:
    """THUNDERPOOL_CPU_EXP: 1 or 0 forces the compiled step's arithmetic exp on or off
    (engine/cpu_exp.py); None (unset or "auto") means on for a CPU rank."""
    return _switch("THUNDERPOOL_CPU_EXP", "set 0 to keep MLX's own exp")


def cpu_only(choice: bool | None, cpu: bool, refusal: str) -> bool:
    """A CPU-only path's switch: unset means on where the rank is a CPU; 1 on a GPU rank,
    where the path is untested, is refused with `refusal`."""
    if choice and not cpu:
        raise ThunderpoolError(refusal)
    return cpu if choice is None else choice


def _switch(name: str, hint: str) -> bool | None:
    """An environment switch of 0, 1 or auto (or unset: None), any other value refused."""
    value = os.environ.get(name, "auto").strip().lower()
    if value == "auto":
        return None
    if value not in ("0", "1"):
        raise ThunderpoolError(f"{name}={value!r} is not 0, 1 or auto; unset it, or {hint}")
    return value == "1"


def lifeline_fd() -> int | None:
    """THUNDERPOOL_LIFELINE_FD: in a rank, the file its launcher's lifeline arrives on
    (launch/lifeline.py); None for a rank started by hand."""
    value = os.environ.get("THUNDERPOOL_LIFELINE_FD", "")
    return int(value) if value.isdigit() else None
