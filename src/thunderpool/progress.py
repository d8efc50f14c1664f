"""A terminal progress bar over every rank's loading, fed by the ranks' "progress" events."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TimeElapsedColumn


class LoadBar:
    """Shows the mean load fraction of `ranks` ranks until each has reported "loaded"."""

    def __init__(self, ranks: int, label: str, console: Console):
        self.ranks, self.fractions = ranks, {}
        self.bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.bar.add_task(label, total=1.0)
        self.bar.start()

    def update(self, event: dict, rank: int) -> None:
        if event["kind"] == "progress":
            self.fractions[rank] = event["fraction"]
        elif event["kind"] == "loaded":
            self.fractions[rank] = 1.0
        self.bar.update(self.task, completed=sum(self.fractions.values()) / self.ranks)
        if len([f for f in self.fractions.values() if f >= 1.0]) == self.ranks:
            self.close()

    def close(self) -> None:
        self.bar.stop()

    def __enter__(self) -> LoadBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
