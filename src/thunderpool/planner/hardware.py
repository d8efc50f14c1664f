"""What the cost model knows of machines and links: NodeSpec, LinkSpec, and the constants their
measurements and prices share (cost.py prices layouts over them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from thunderpool.errors import ThunderpoolError

LinkKind = Literal["rdma", "thunderbolt", "ethernet", "wifi", "loopback"]


LINK_KINDS = ("rdma", "thunderbolt", "ethernet", "wifi", "loopback")


# Weight rows (floats) of the two GEMVs agents time. CPU BLASes stream short rows slower (BLIS
# here: 14 GB/s at 576, 25 at 2048 and 4096); rows of FULL_ROW or more stream at the full rate.
SHORT_ROW = 512


FULL_ROW = 2048


LONG_ROW = 4096


CONTROL_BYTES = 512  # engine/control.py's header: one per decode step on >1 rank


# Unfused attention (head widths MLX's fused decode kernel lacks, e.g. MLA's 576) writes and
# reads 2-byte scores per head per cached token ~8 times: QK, mask, softmax, PV.
SCORE_BYTES = 16


# Prefill runs in chunks of PREFILL_CHUNK tokens (mlx-lm's prefill_step_size, which every
# published prefill figure used); a routed expert sees chunk x k / E of them, and a matmul
# over m rows reaches m / (m + EXPERT_ROWS_HALF) of the rate dense matmuls over a whole chunk
# reach (flops_efficiency). Fitted on mlx-lm's Qwen3-30B-A3B prefill ladder (docs/simulator.md).
PREFILL_CHUNK = 2048


EXPERT_ROWS_HALF = 52.0


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A machine: memory (bytes), sustained memory bandwidth (B/s) and matmul FLOP/s.

    A plan's use of a node (weights + KV + activations + os_reserve_bytes) must stay within
    available_bytes, the memory the agent reports free for models.
    """

    name: str
    memory_bytes: int
    available_bytes: int
    mem_bw_Bps: float
    flops: float
    os_reserve_bytes: int = 0
    # Seconds a decode step pays per weight matmul whatever its size (launch + sync).
    op_latency_s: float = 0.0
    # And per matmul for each row (or verified position) beyond the first: the host and
    # kernel work a batched step repeats per row besides its products (presets.toml).
    row_op_latency_s: float = 0.0
    # Each such row also re-pays this fraction of the weights' read time: a few-row CPU
    # product streams its weights slower than a one-row one (presets.toml).
    row_read_fraction: float = 0.0
    # Nodes with the same non-empty `host` share one machine (e.g. several agents on one box):
    # its memory, its `cores`, and `host_mem_bw_Bps`, the bandwidth all its cores reach together.
    host: str = ""
    cores: int = 0
    host_mem_bw_Bps: float = 0.0
    # A rank pinned to one core (see pins_cores) streams and computes at these rates instead.
    core_mem_bw_Bps: float = 0.0
    core_flops: float = 0.0
    core_op_latency_s: float = 0.0  # 0: op_latency_s
    # mem_bw_Bps is measured with weight rows of LONG_ROW floats; this with SHORT_ROW (0: the
    # same). A model whose rows are shorter than FULL_ROW streams between the two (row_rate).
    short_row_mem_bw_Bps: float = 0.0
    # An unpinned rank's compiled decode step splits each product over the cores
    # (engine/rowsplit.py) and streams at this rate instead (0: not measured, no split).
    split_mem_bw_Bps: float = 0.0

    def __post_init__(self):
        if self.mem_bw_Bps <= 0 or self.flops <= 0:
            raise ThunderpoolError(
                f"node {self.name!r} has mem_bw_Bps={self.mem_bw_Bps} and flops={self.flops}; "
                "both must be positive (measure them with `thunderpool node`)"
            )
        if self.available_bytes > self.memory_bytes:
            raise ThunderpoolError(
                f"node {self.name!r} reports {self.available_bytes} bytes available but only "
                f"{self.memory_bytes} in total; fix available_bytes"
            )


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A link between nodes a and b; latency_s is one-way (half the measured RTT).

    overhead_s is the fixed software cost of one collective over it (the backend call and
    the GPU/CPU stream sync around it), paid once per all-reduce or hop.
    """

    a: str
    b: str
    latency_s: float
    bandwidth_Bps: float
    kind: LinkKind
    overhead_s: float = 0.0

    def __post_init__(self):
        if self.kind not in LINK_KINDS:
            raise ThunderpoolError(
                f"link {self.a}-{self.b} has kind {self.kind!r}; use one of {', '.join(LINK_KINDS)}"
            )
        if self.latency_s < 0 or self.bandwidth_Bps <= 0:
            raise ThunderpoolError(
                f"link {self.a}-{self.b} has latency {self.latency_s} s and bandwidth "
                f"{self.bandwidth_Bps} B/s; latency must be >= 0 and bandwidth > 0"
            )

    def hop_s(self, nbytes: float) -> float:
        """One point-to-point message."""
        return self.overhead_s + self.latency_s + nbytes / self.bandwidth_Bps

    def all_gather_s(self, nbytes: float, n: int) -> float:
        """All-gather of nbytes in all, each of n ranks contributing nbytes / n: one latency
        over RDMA's mesh, n - 1 ring steps over TCP."""
        moved = (n - 1) / n * nbytes / self.bandwidth_Bps
        steps = 1 if self.kind == "rdma" else n - 1
        return self.overhead_s + steps * self.latency_s + moved

    def all_reduce_s(self, nbytes: float, n: int) -> float:
        """All-reduce of nbytes over n ranks.

        RDMA (MLX jaccl's mesh) sends the whole buffer to every peer at once: one latency,
        but each rank sends and sums n-1 copies (jaccl's mesh all_reduce), priced here as
        moving at one link's rate together: priced as parallel, exo's GLM-5 TP4 prefill of
        123 MB all_sums came out 28% fast (TP2 +9%). Ring (TCP): 2(n-1) steps of nbytes/n.
        """
        if self.kind == "rdma":
            return self.overhead_s + self.latency_s + (n - 1) * nbytes / self.bandwidth_Bps
        ring = 2 * (n - 1) / n * nbytes / self.bandwidth_Bps + 2 * (n - 1) * self.latency_s
        return self.overhead_s + ring


def pins_cores(ranks_on_host: int, cores: int) -> bool:
    """Ranks sharing a machine each get a core of their own when there are enough: ring ranks
    busy-poll, so two on one core stall each other's collectives (coordinator.core_assignment)."""
    return 1 < ranks_on_host <= cores


def row_rate(node: NodeSpec, row: int) -> float:
    """The share of its long-row GEMV rate the node reaches on weight rows of `row` floats:
    geometric between the two measured lengths up to FULL_ROW; 1 if only one was measured."""
    if node.short_row_mem_bw_Bps <= 0 or row >= FULL_ROW:
        return 1.0
    ratio = min(1.0, node.short_row_mem_bw_Bps / node.mem_bw_Bps)
    t = max(0.0, math.log(row / SHORT_ROW) / math.log(FULL_ROW / SHORT_ROW))
    return ratio ** (1.0 - t)


def link_between(links: list[LinkSpec], a: str, b: str) -> list[LinkSpec]:
    """Every link joining a and b, in either direction."""
    return [x for x in links if {x.a, x.b} == {a, b}]
