"""`serve`'s flags for several models: which are known, how long an idle one stays loaded,
how many may be loaded at once."""

from __future__ import annotations

import argparse
import math

from thunderpool.cli.flags import parse_positive
from thunderpool.errors import ThunderpoolError


def parse_keep_alive(text: str) -> float:
    """Seconds, or a duration like Ollama's ("5m", "1h30m"); negative: forever."""
    from thunderpool.api.errors import APIError
    from thunderpool.api.ollama_models import keep_alive

    try:
        seconds = keep_alive(text)
    except APIError as e:
        raise argparse.ArgumentTypeError(e.message.replace("keep_alive=", "")) from None
    return math.inf if seconds is None else seconds


def add_models_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--known-model",
        action="append",
        default=[],
        metavar="MODEL",
        help="a model requests may name, loaded when one does (repeatable; like --model, "
        "which also loads at start; with only --known-model, nothing loads before a request)",
    )
    p.add_argument(
        "--keep-alive",
        type=parse_keep_alive,
        metavar="DURATION",
        help="how long a model stays loaded once idle, e.g. 5m, 300 (seconds), 0, -1 for "
        "forever (default: forever); Ollama's keep_alive field sets it per request",
    )
    p.add_argument(
        "--max-loaded",
        type=parse_positive,
        metavar="N",
        help="models loaded at once; loading one more unloads the least recently used idle "
        "one (default: no limit; the first N --model flags load at start)",
    )
    p.add_argument(
        "--max-memory-gb",
        type=float,
        metavar="GIB",
        help="weights of the loaded models together, at most (the planner's estimate); loading "
        "one more unloads the least recently used idle ones until it fits (default: no limit)",
    )


def check_budget(name: str, weight_bytes: int, max_gb: float | None) -> None:
    """A model that alone exceeds --max-memory-gb could never load: refused at start."""
    if max_gb is not None and weight_bytes > max_gb * 2**30:
        raise ThunderpoolError(
            f"{name}'s weights are {weight_bytes / 2**30:.2f} GiB, over --max-memory-gb "
            f"{max_gb:g}; raise it or leave {name} out"
        )
