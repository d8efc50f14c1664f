"""How one model is spread over the ranks of a job: the one layout type, from the planner's
plan (planner/placement.py `Plan.layout`) through the RankJob to the rank's loader.

A validating pydantic dataclass: frozen, positional like `Layout("pp", layer_split=(10, 6))`,
and checked wherever it is built or read from the wire.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Layout:
    # "tp", "pp", "ep" (TP with whole routed experts) or "hybrid" (TP groups as PP stages)
    parallel: Literal["tp", "pp", "ep", "hybrid"] = "tp"
    tp_weights: tuple[float, ...] | None = None
    layer_split: tuple[int, ...] | None = None
    expert_split: tuple[int, ...] | None = None  # EP: routed experts per rank (default: weights)
    compile: bool | None = None  # compiled decode steps (engine/compiled.py); None: wanted()
    # PP: the last stage hands the leader every prefill position's hidden state, not only
    # the last one's (an MTP draft reads them all: engine/mtp.py).
    every_position: bool = False
    # EP: (layer, expert, rank) copies of hot experts on ranks besides their owner
    expert_replicas: tuple[tuple[int, int, int], ...] | None = None
    # Hybrid TP×PP (parallel/hybrid.py): ranks per stage (each stage its own MLX world); the
    # launcher sets each rank's stage and every rank's hand-off address (host:port, in order).
    groups: tuple[int, ...] | None = None
    stage: int = Field(0, ge=0)
    handoff: tuple[str, ...] = ()
    # --kv-bits: every rank's KV cache quantized alike (engine/kv_quant.py); None: plain.
    kv_bits: Literal[4, 8] | None = None
    kv_group_size: Literal[32, 64, 128] = 64

    @property
    def equal_shares(self) -> bool:
        """Every rank an equal share of heads and experts, and no hot-expert copies: what the
        all-families matrix proves (models/families.py)."""
        return (
            len(set(self.tp_weights or ())) <= 1
            and len(set(self.expert_split or ())) <= 1
            and not self.expert_replicas
        )
