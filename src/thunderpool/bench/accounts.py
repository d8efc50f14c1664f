"""`bench`'s step accounts: one more run of each mode with the leader's StepAccount on
(engine/account.py), printed as where a step's time goes, beside the unaccounted step."""

from __future__ import annotations

from collections.abc import Callable

from thunderpool.engine.account import PARTS, StepAccount

SOLO_STEPS = 5  # forwards per rank timed alone, for the split of a TP step's forward


def accounted(engine, run: Callable[[], object]) -> dict:
    """`run()` with the leader's step account on; the account's summary."""
    ex = engine.executor
    ex.account = StepAccount()
    try:
        run()
        return ex.account.summary()
    finally:
        ex.account = None


def solo_forward(engine, prompt: list[int], rows: int, width: int) -> list[float]:
    """Each rank's ms for the step's forward alone (rows x width tokens, the accounted
    steps' median width; collectives stood in for: measure.solo_step_ms), after the prompt
    alone; none on one rank or hybrid, whose hand-offs cannot be stood in for."""
    if engine.control.size == 1 or getattr(engine.control, "topo", None) is not None:
        return []
    return engine.measure("solo", prompt, SOLO_STEPS, rows, width)


def forward_split(account: dict, solo: list[float]) -> dict[str, float]:
    """A TP step's forward (median ms) split: the leader's compute alone, the wait for the
    slowest rank's compute, and the rest (the collectives, their latency and transfer)."""
    forward = account.get("forward", {}).get("median_ms")
    if not solo or forward is None:
        return {}
    slowest = max(solo)
    return {
        "compute alone": solo[0],
        "waiting": slowest - solo[0],
        "collectives": max(0.0, forward - slowest),
    }


def print_accounts(results: list[dict], console) -> None:
    """One table per layout and row count: each part's median [min-max] ms per step by mode,
    then the accounted total per delivered token (per row's token for batches) and the
    unaccounted ms per token of the timed runs."""
    from rich.table import Table

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        for a in r.get("accounts", []):
            if a["account"]:
                groups.setdefault((r["parallel"], r["world_size"], a["rows"]), []).append(a)
    for (parallel, size, rows), accts in groups.items():
        table = Table(title=f"step account: {parallel} {size}, {rows} row(s), ms per step")
        table.add_column("part")
        for a in accts:
            table.add_column(a["mode"], justify="right")
        for part in [p for p in (*PARTS, "total") if any(p in a["account"] for a in accts)]:
            table.add_row(part, *(_cell(a["account"].get(part)) for a in accts))
            if part == "forward" and any(a.get("solo_ms") for a in accts):
                splits = [forward_split(a["account"], a.get("solo_ms", [])) for a in accts]
                for name in ("compute alone", "waiting", "collectives"):
                    table.add_row(f"  {name}", *(_ms(s.get(name)) for s in splits))
        table.add_row("tokens/step", *(f"{a['account']['tokens_per_step']:.2f}" for a in accts))
        table.add_row("ms/token", *(f"{a['account']['total']['per_token_ms']:.1f}" for a in accts))
        table.add_row("timed ms/token", *(f"{a['timed_ms_per_token']:.1f}" for a in accts))
        console.print(table)
    if groups:
        console.print(
            "Accounted steps evaluate each part at its end (no overlap); 'timed' is the ms "
            "per delivered token of the timed runs. TP's forward holds its all_sums and the "
            "wait for the slower rank; host is the plan and scheduler work between steps. "
            "Under forward: the leader's forward timed alone (collectives stood in for), "
            "the slowest rank's extra, and the rest (collectives)."
        )


def _cell(part: dict | None) -> str:
    if not part:
        return "-"
    return f"{part['median_ms']:.1f} [{part['min_ms']:.1f}-{part['max_ms']:.1f}]"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
