"""Where a quantized matrix may be cut along its input features, for every MLX format.

MLX packs each row's `bits`-bit values into uint32 words, back to back: at 3, 5 and 6 bits a
value can straddle two words (8 values fill 3 bytes at 3 bits), so only every 32 / gcd(bits,
32) values does a word end on a value boundary (32 values = 3 words at 3 and 5 bits' 5, 16 at
6 bits, 8 at 4 bits, 4 at 8 bits). Scales (and, for affine, biases) hold one entry per
`group_size` values. A cut must fall on both: every lcm(group_size, 32 / gcd(bits, 32)) values.
Affine groups of 32, 64 and 128, mxfp4/mxfp8's 32 and nvfp4's 16 are all multiples of the
word run, so in practice the step is the group size; the rule is kept general all the same.

Pure arithmetic (no mlx): the loader (parallel/tensor.py), the fabric (cluster/weights/shards.py)
and the planner use the same steps, so they cut at the same places.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import gcd, lcm

from thunderpool.errors import ShardingError
from thunderpool.models import shape

# The modes mx.quantize knows, with the (bits, group_size) each allows: affine takes any of
# 2..8 bits at groups of 32, 64 or 128; the microscaling formats exactly one pair each.
MODES = {
    "affine": None,
    "mxfp4": (4, 32),
    "nvfp4": (4, 16),
    "mxfp8": (8, 32),
}


@dataclass(frozen=True, slots=True)
class Packing:
    """How one matrix is quantized: `bits` per value, one scale per `group_size` values."""

    bits: int
    group_size: int
    mode: str = "affine"

    @property
    def step(self) -> int:
        """The smallest run of input features that ends on both a word and a group."""
        return lcm(self.group_size, 32 // gcd(self.bits, 32))

    @property
    def has_biases(self) -> bool:
        """Affine stores a bias per group beside each scale; the mx/nv formats do not."""
        return self.mode == "affine"

    def words(self, values: int) -> int:
        """uint32 words that hold `values` packed values (a multiple of the word run)."""
        if values * self.bits % 32:
            raise ShardingError(f"{values} values of {self} do not fill whole uint32 words")
        return values * self.bits // 32

    def bits_per_weight(self, scale_bytes: float) -> float:
        """Stored bits per weight, scales (and biases) included; `scale_bytes`: the float
        width of affine scales and biases (mx/nv scales are one byte)."""
        per_group = 2 * scale_bytes if self.has_biases else 1
        return self.bits + 8 * per_group / self.group_size

    def __str__(self) -> str:
        if self.mode == "affine":
            return f"{self.bits}-bit affine (group {self.group_size})"
        return self.mode


def from_shapes(in_features: int, weight_cols: int, scale_cols: int, mode: str) -> Packing:
    """The packing of a stored matrix from its shapes (as mlx-lm's infer_quant_config)."""
    return Packing(weight_cols * 32 // in_features, in_features // scale_cols, mode)


# (bits, group_size) that to_quantized takes for a mode when an entry leaves them out.
DEFAULTS = {"affine": (4, 64), "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


def from_config(q: dict | None) -> Packing | None:
    """The packing a config.json `quantization` entry names (the top-level one, or a
    per-module one: mlx's to_quantized reads a missing mode as affine, missing bits and group
    as the mode's defaults); None for False/absent."""
    if not isinstance(q, dict):
        return None
    mode = q.get("mode") or "affine"
    bits, group = DEFAULTS.get(mode, (4, 64))
    return Packing(int(q.get("bits") or bits), int(q.get("group_size") or group), mode)


def check_cut(a: int, b: int, packing: Packing, what: str) -> tuple[int, int]:
    """The word range [a', b') holding input features [a, b); raises where a cut would split
    a word or a group."""
    step = packing.step
    if a % step or b % step:
        raise ShardingError(
            f"cannot cut input features [{a}, {b}) of {what} ({packing}): cuts must fall every "
            f"{step} features (whole groups and uint32 words); use an even split, other "
            "--tp-weights, or --parallel pp"
        )
    return packing.words(a), packing.words(b)


def head_unit(head_dim: int, steps: Iterable[int]) -> int:
    """Whole heads per cut of a column-sliced attention output (o_proj) whose quantized
    input must be cut every lcm(steps) features: 1 for a plain model or head_dim 128."""
    step = lcm(1, *steps)
    return step // gcd(step, head_dim)


def config_head_unit(config: dict) -> int:
    """head_unit of a GQA model as its config.json quantizes the layers' o_proj (for the
    planner and the layout description, which have no loaded model)."""
    q = config.get("quantization")
    heads = shape.heads(config, 0)
    if not isinstance(q, dict) or not heads or config.get("kv_lora_rank"):
        return 1  # plain, or MLA (split in equal shares by mlx-lm's own shard())
    head_dim = shape.head_dim(config)
    steps = []
    for i in range(shape.n_layers(config)):
        p = from_config(q.get(f"model.layers.{i}.self_attn.o_proj", q))
        if p is not None and heads * head_dim % p.group_size == 0:  # else left in float
            steps.append(p.step)
    return head_unit(head_dim, steps)
