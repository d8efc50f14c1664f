"""Settings read from the environment and the per-user state directory (nowhere else)."""

from __future__ import annotations

import os
from pathlib import Path

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
