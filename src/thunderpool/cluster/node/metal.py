"""What Metal lets a Mac node hold: the planner's memory budget and the rank's wired limit.

macOS wires GPU memory only up to a limit: Metal's recommended working set
(`mx.metal.device_info()["max_recommended_working_set_size"]`, about 2/3 to 3/4 of RAM), or
`sysctl iogpu.wired_limit_mb` where the user raised it (0: not set). A Mac node's budget for
weights, KV and activations is that limit, and never more than its RAM less OS_RESERVE_BYTES,
the one reserve macOS keeps: `doctor` checks a shard against it and `doctor --fix` raises the
limit to RAM less it, so the planner's budget, doctor's room and --fix's limit agree. Ranks
raise MLX's wired limit to the recommended working set once their shard is loaded, as mlx-lm's
`generate.wired_limit` does, so the shard stays resident instead of being paged.
The inputs are passed in (a device_info dict, sysctl's text) so recorded Macs replay here.
"""

from __future__ import annotations

from dataclasses import dataclass

OS_RESERVE_BYTES = 8 * 10**9  # RAM macOS keeps (window server, apps, buffers in flight)
WIRED_LIMIT = ("sysctl", "-n", "iogpu.wired_limit_mb")
RAISE_HINT = "sudo sysctl iogpu.wired_limit_mb=<MB>"
MiB = 2**20


@dataclass(frozen=True, slots=True)
class Budget:
    """A Mac node's memory budget for the planner, and where it came from."""

    bytes: int
    wired_limit_bytes: int  # what Metal will wire
    source: str  # "recommended working set" | "iogpu.wired_limit_mb"

    def describe(self, gb: float = 1e9) -> str:
        return (
            f"{self.bytes / gb:.1f} GB: Metal wires {self.wired_limit_bytes / gb:.1f} GB "
            f"({self.source}), at most RAM less {OS_RESERVE_BYTES / gb:.1f} GB for macOS"
        )


def parse_wired_limit_mb(text: str | None) -> int:
    """`sysctl -n iogpu.wired_limit_mb` in bytes; 0 where unset (0), absent or unreadable."""
    text = (text or "").strip()
    return int(text) * MiB if text.isdigit() else 0


def budget(total_bytes: int, device_info: dict | None, wired_limit_mb: str | None) -> Budget | None:
    """The budget of a Mac with `total_bytes` of RAM, Metal's `device_info` and sysctl's
    iogpu.wired_limit_mb text; None without Metal (device_info None: plain RAM applies)."""
    if not device_info:
        return None
    recommended = int(device_info.get("max_recommended_working_set_size") or 0)
    raised = parse_wired_limit_mb(wired_limit_mb)
    if raised > recommended:
        limit, source = raised, "iogpu.wired_limit_mb"
    else:
        limit, source = recommended or total_bytes, "recommended working set"
    usable = max(0, min(limit, total_bytes - OS_RESERVE_BYTES))
    return Budget(usable, limit, source)


def device_info() -> dict | None:
    """This machine's Metal device_info, or None where MLX has no Metal (Linux, CUDA)."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    if not mx.metal.is_available():
        return None
    return dict(mx.metal.device_info())


def raise_wired_limit(info: dict | None = None) -> int | None:
    """In a rank on Metal: let MLX wire up to the recommended working set, as mlx-lm does
    around generation; returns that limit, or None off Metal (nothing to do)."""
    info = device_info() if info is None else info
    if not info:
        return None
    import mlx.core as mx

    limit = int(info["max_recommended_working_set_size"])
    mx.set_wired_limit(limit)
    return limit
