"""`bench`'s step accounts: one more run of each mode with the leader's StepAccount on
(engine/account.py), printed as where a step's time goes, beside the unaccounted step."""

from __future__ import annotations

from collections.abc import Callable

from thunderpool.engine.account import PARTS, StepAccount


def accounted(engine, run: Callable[[], object]) -> dict:
    """`run()` with the leader's step account on; the account's summary."""
    ex = engine.executor
    ex.account = StepAccount()
    try:
        run()
        return ex.account.summary()
    finally:
        ex.account = None


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
        table.add_row("tokens/step", *(f"{a['account']['tokens_per_step']:.2f}" for a in accts))
        table.add_row("ms/token", *(f"{a['account']['total']['per_token_ms']:.1f}" for a in accts))
        table.add_row("timed ms/token", *(f"{a['timed_ms_per_token']:.1f}" for a in accts))
        console.print(table)
    if groups:
        console.print(
            "Accounted steps evaluate each part at its end (no overlap); 'timed' is the ms "
            "per delivered token of the timed runs. TP's forward holds its all_sums and the "
            "wait for the slower rank; host is the plan and scheduler work between steps."
        )


def _cell(part: dict | None) -> str:
    if not part:
        return "-"
    return f"{part['median_ms']:.1f} [{part['min_ms']:.1f}-{part['max_ms']:.1f}]"
