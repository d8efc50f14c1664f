"""Which model families run sharded: mlx-lm model type -> layouts proven equal to one rank.

One rank runs mlx-lm's own model, so it is allowed for every family mlx-lm ships. A sharded
layout (world > 1) outside VERIFIED is refused before any rank starts, unless the user passes
--allow-untested: a silent wrong answer is worse than a refusal.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from thunderpool.errors import UnverifiedLayoutError

# Every entry must be backed by tests/parallel matrix cases (sharded == unsharded model).
# tests/parallel/test_family_matrix.py checks this table against its cells ("ep": against
# tests/parallel/test_expert_parallel.py's; "hybrid": against tests/parallel/test_hybrid.py's).
# The families beyond it come from verified.json (below).
MATRIX: dict[str, tuple[str, ...]] = {
    "llama": ("tp", "pp", "hybrid"),
    "qwen2": ("tp", "pp"),
    "qwen3": ("tp", "pp", "hybrid"),
    "qwen3_moe": ("tp", "pp", "ep", "hybrid"),
    "gemma3_text": ("tp", "pp"),
    # TP in equal shares only (MLA): tensor.check refuses the rest; EP's attention likewise.
    "deepseek_v3": ("tp", "pp", "ep"),
    "deepseek_v32": ("tp", "pp"),  # DeepSeek V3.2; TP in equal shares only (MLA)
    "glm_moe_dsa": ("tp", "pp"),  # GLM-5; TP in equal shares only (MLA)
    "glm4_moe": ("tp", "pp", "ep"),
    "gpt_oss": ("tp", "pp", "ep"),  # TP (and EP's attention) in equal shares only (sinks)
    "mixtral": ("tp", "pp", "ep"),
    "phi3": ("tp", "pp"),  # TP: a fused qkv/gate_up share per rank (parallel/blocks.py)
    "qwen3_next": ("tp", "pp"),  # TP: whole DeltaNet key heads per rank (linear_attn.py)
}

# What the all-families matrix proved with the mlx-lm release it names (tests/all_families.py
# writes it; tests/parallel/test_all_families.py proves every "ok" cell again on each run):
# {family: {layout: "ok" | the one-line reason it is not}}.
PROVEN_JSON = Path(__file__).with_name("verified.json")
PROVEN_WORLD = 2  # the ranks each of its layouts ran on
# A recorded refusal's own advice ("; use --parallel tp ..."), cut where it is quoted: what
# runs instead is the verified list after it, and the advice may name a refused layout.
_ADVICE = re.compile(r"[:;,] use --(parallel|nodes) .*$")


@cache
def proven() -> dict[str, dict[str, str]]:
    try:
        return json.loads(PROVEN_JSON.read_text())["families"]
    except (OSError, ValueError, KeyError):
        return {}


def _verified() -> dict[str, tuple[str, ...]]:
    table = {k: list(v) for k, v in MATRIX.items()}
    for family, cells in proven().items():
        for layout in ("tp", "pp", "ep"):
            have = table.setdefault(family, [])
            if cells.get(layout) == "ok" and layout not in have:
                have.append(layout)
    return {k: tuple(v) for k, v in table.items() if v}


VERIFIED: dict[str, tuple[str, ...]] = _verified()

LAYOUTS = ("tp", "pp")  # what --parallel launches
MOE_LAYOUTS = ("ep",)  # --parallel ep: MoE models only, so `describe` offers it only when verified
# --parallel hybrid and the planner's hybrid plans (TP groups joined as PP stages): offered,
# like ep, only where verified.
HYBRID_LAYOUTS = ("hybrid",)


@dataclass(frozen=True, slots=True)
class Family:
    """A config's model type and the mlx-lm model that runs it."""

    model_type: str  # as config.json names it
    name: str  # the mlx-lm module that builds it (after mlx-lm's aliases, e.g. mistral -> llama)
    supported: bool  # mlx-lm ships a model for it

    @property
    def label(self) -> str:
        return (
            self.name if self.name == self.model_type else f"{self.model_type} (mlx-lm {self.name})"
        )

    @property
    def verified(self) -> tuple[str, ...]:
        return VERIFIED.get(self.name, ())


@cache
def _remapping() -> tuple[dict, dict]:
    # mlx-lm's own alias tables, so a new mlx-lm's aliases are honoured without a change here.
    import mlx_lm.utils as u

    return getattr(u, "MODEL_REMAPPING", {}), getattr(u, "MODEL_ARCHITECTURE_REMAPPING", {})


def family_of(config: dict) -> Family:
    """The family mlx-lm builds for this config.json (mirrors mlx_lm.utils._get_classes)."""
    model_type = str(config.get("model_type", ""))
    by_type, by_arch = _remapping()
    archs = config.get("architectures") or ()
    archs = (archs,) if isinstance(archs, str) else archs
    name = next(
        (by_arch[(model_type, a)] for a in archs if (model_type, a) in by_arch),
        by_type.get(model_type, model_type),
    )
    return Family(model_type, name, _ships(name))


@cache
def _ships(name: str) -> bool:
    try:
        return bool(name) and importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        return False


def unverified(family: Family, world: int, layout: str, equal: bool = True) -> str | None:
    """Why `layout` on `world` ranks (in `equal` shares, or not) is not verified for this
    family; None when it is."""
    if world <= 1:
        return None
    found = proven().get(family.name, {}).get(layout)
    # The hand-built matrix ran 2 and 3 ranks, equal and unequal shares; the all-families
    # one, PROVEN_WORLD ranks in equal shares.
    by_hand = family.name in MATRIX or found is None
    if layout in family.verified and (by_hand or (world == PROVEN_WORLD and equal)):
        return None
    if found == "ok" and world == PROVEN_WORLD:
        why = ": proven in equal shares only (no --tp-weights, --expert-split or hot-expert copies)"
    elif found == "ok":  # the all-families matrix runs 2 ranks
        why = f": proven on {PROVEN_WORLD} ranks only"
    else:
        why = f": {_ADVICE.sub('', found)}" if found else ""
    return (
        f"{family.label} with {layout} on {world} ranks is not verified against the unsharded "
        f"model{why} (verified for {family.name}: {_verified_text(family)})"
    )


def check_layout(
    config: dict,
    world: int,
    layout: str,
    allow_untested: bool = False,
    flag: str = "--parallel",
    equal: bool = True,
) -> str | None:
    """Raise UnverifiedLayoutError for an unverified sharded layout; with `allow_untested`,
    return the reason for a warning instead. A family mlx-lm does not ship passes: the
    loader refuses it with its own message."""
    family = family_of(config)
    reason = unverified(family, world, layout, equal) if family.supported else None
    if reason is None or allow_untested:
        return reason
    fix = f"use {flag} {family.verified[0]}" if family.verified else "use --nodes 1"
    raise UnverifiedLayoutError(f"{reason}; {fix}, or --allow-untested to run it anyway")


def guard(
    config: dict,
    world: int,
    layout: str,
    allow_untested: bool,
    console=None,
    flag: str = "--parallel",
) -> None:
    """check_layout, printing the loud warning when --allow-untested lets it through."""
    reason = check_layout(config, world, layout, allow_untested, flag)
    if reason is not None:
        warn_untested(reason, console)


def warn_untested(reason: str, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(stderr=True)
    console.print(
        f"[bold red]WARNING (--allow-untested):[/] [bold yellow]{escape(reason)}; "
        "its output may be wrong[/]",
        soft_wrap=True,
    )


def describe(family: Family) -> str:
    """One line for `plan`/`simulate`: the verified layouts and what needs the flag."""
    if not family.supported:
        return (
            f"verified layouts for {family.label}: none (mlx-lm has no {family.name} model, "
            "so it cannot run here)"
        )
    rest = [x for x in LAYOUTS if x not in family.verified]
    done = ", ".join(family.verified) or "none (single rank only)"
    text = f"verified layouts for {family.label}: {done}"
    if rest:
        text += f"; {' and '.join(rest)} need{'s' if len(rest) == 1 else ''} --allow-untested"
    return text


def _verified_text(family: Family) -> str:
    return ", ".join(family.verified) or "none, single rank only"
