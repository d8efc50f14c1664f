"""`thunderpool doctor`'s GPU wired limit check: whether what Metal wires covers a shard, with
the one OS reserve the planner's budget keeps too (cluster/node/metal.py); `doctor --fix` raises
the limit to RAM less that reserve."""

from __future__ import annotations

from thunderpool.cluster.node.checks import Check
from thunderpool.cluster.node.metal import OS_RESERVE_BYTES

MiB = 2**20
GB = 10**9


def gb(size: int) -> str:
    return f"{size / GB:.0f} GB"


def default_working_set(memory: int) -> int:
    """macOS's default GPU wired limit, Metal's recommended working set, where MLX cannot be
    asked: about 2/3 of memory up to 36 GB, 3/4 above."""
    return memory * 2 // 3 if memory <= 36 * 2**30 else memory * 3 // 4


def check_wired_limit(
    code: int, out: str, memory: int, shard: int | None, working_set: int | None
) -> Check:
    """`sysctl -n iogpu.wired_limit_mb` (0: Metal's default) against the shard this Mac holds:
    `shard` bytes (`doctor --shard-gb`), else the largest the planner may put here (memory
    less the OS reserve). `working_set`: Metal's recommended working set, None: estimated."""
    name = "GPU wired limit"
    target = (memory - OS_RESERVE_BYTES) // MiB  # sysctl counts whole MiB
    room = target * MiB
    command = ("sudo", "sysctl", f"iogpu.wired_limit_mb={target}")
    if code != 0 or not out.strip().isdigit():
        return Check(
            name, "WARN", "cannot read `sysctl -n iogpu.wired_limit_mb`", " ".join(command)
        )
    limit_mb = int(out.strip())
    if limit_mb == 0:
        wired = working_set or default_working_set(memory)
        how = "Metal's recommended working set" if working_set else "Metal's default, estimated"
        have = f"iogpu.wired_limit_mb is 0: {how}, ≈ {gb(wired)} of {gb(memory)}"
    else:
        wired = limit_mb * MiB
        have = f"iogpu.wired_limit_mb is {limit_mb} ({gb(wired)} of {gb(memory)})"
    if shard is not None and shard > room:
        reserve = gb(OS_RESERVE_BYTES)
        detail = f"a {gb(shard)} shard does not fit {gb(memory)} less the {reserve} OS reserve"
        return Check(name, "FAIL", detail, "plan more nodes or a smaller model")
    need = shard if shard is not None else room
    what = (
        f"the {gb(shard)} shard (--shard-gb)"
        if shard is not None
        else f"a shard of up to {gb(room)} (memory less the {gb(OS_RESERVE_BYTES)} OS reserve; "
        "--shard-gb checks the planned one)"
    )
    if wired >= need:
        return Check(name, "PASS", f"{have}: covers {what}")
    fix = f"{' '.join(command)} (until the next restart; `thunderpool doctor --fix` runs it)"
    status = "FAIL" if shard is not None else "WARN"
    return Check(name, status, f"{have}: below {what}", fix, (command,))
