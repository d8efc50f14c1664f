"""Each row's draft length from its own measured acceptance (speculate.lead asks per step).

A drafted position pays when the odds that it is accepted (the row's per-token acceptance to
the power of its place) beat its cost in plain steps: on a quiet 2-core x86 rank (1.1 B fp32
target, 1-layer draft) a draft token costs ~19 ms and each verified position ~14 ms against a
160 ms plain step, so ~0.2 (docs/benchmarks.md §14). A row whose drafts keep failing drops to
one draft position; one whose drafts hold keeps --spec-k. Greedy tokens do not depend on the
length (the accept rule is exact at any length), only the work does.
"""

from __future__ import annotations

MIN_ODDS = 0.2  # a place is drafted while acceptance ** place stays at least this
DECAY = 0.8  # weight of the earlier steps in each row's counts (about the last 5 steps)


class DraftLengths:
    """Per row: decayed counts of accepted drafts and of rejections (a step that stopped
    short); the acceptance estimate is accepted / (accepted + rejections)."""

    def __init__(self):
        self._counts: dict[int, tuple[float, float]] = {}

    def length(self, sid: int, k: int) -> int:
        """The draft length for row `sid`, 1 to k; k until its first verify."""
        if sid not in self._counts:
            return k
        accepted, rejected = self._counts[sid]
        rate = accepted / (accepted + rejected)  # each observed step adds to one of them
        n = 1
        while n < k and rate ** (n + 1) >= MIN_ODDS:
            n += 1
        return n

    def observe(self, sid: int, proposed: int, accepted: int) -> None:
        """One verify step of row `sid`: `accepted` of its `proposed` drafts kept."""
        if proposed <= 0:
            return
        a, r = self._counts.get(sid, (0.0, 0.0))
        self._counts[sid] = (DECAY * a + accepted, DECAY * r + (accepted < proposed))

    def drop(self, sid: int) -> None:
        self._counts.pop(sid, None)
