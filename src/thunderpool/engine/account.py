"""Where the leader's decode steps spend their time, part by part (`bench`'s step accounts).

An account is off (None) in serving. Where bench turns it on, the leader evaluates each part's
arrays at the part's end, so the time between two marks is that part's own: the draft
forwards, the exchange of tokens (TP: its all_sum), the KV trim, the forward (TP: with the
model's all_sums and the wait for the slowest rank), sampling or the accept rule, delivery,
and the host's plan and scheduler work between steps. Accounted steps therefore run without
overlap; bench states the unaccounted step time beside them.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

# The parts in the order a step runs them (a part a step does not run is absent).
PARTS = ("host", "draft", "exchange", "trim", "forward", "sample", "accept", "deliver", "settle")


class StepAccount:
    def __init__(self):
        self.steps: list[dict[str, float]] = []  # seconds by part, one dict per step
        self.rows: list[int] = []  # decoding rows of each step
        self.widths: list[int] = []  # positions each row's forward takes (verify: n+1)
        self.tokens: list[int] = []  # tokens each step delivered
        self.outside = 0  # tokens delivered outside any step (a prefill's first token)
        self._last: float | None = None

    def begin(self, rows: int, width: int = 1) -> None:
        """A step starts: the time since the previous step's end is the host's."""
        now = time.perf_counter()
        host = now - self._last if self._last is not None else 0.0
        self.steps.append({"host": host})
        self.rows.append(rows)
        self.widths.append(width)
        self.tokens.append(0)
        self._last = now

    def mark(self, part: str, *arrays) -> None:
        """The part that just ran ends here, once its arrays are computed."""
        if arrays:
            mx.eval(*[a for a in arrays if a is not None])
        now = time.perf_counter()
        step = self.steps[-1]
        step[part] = step.get(part, 0.0) + now - self._last
        self._last = now

    def delivered(self, n: int) -> None:
        if self._last is None:
            self.outside += n
        else:
            self.tokens[-1] += n

    def end(self) -> None:
        """The burst ended: the next step's host time starts from scratch."""
        self._last = None

    def summary(self) -> dict:
        """Per part: median [min, max] ms per step and per delivered token, over every step
        but each burst's first (its host time includes the prefill and plan)."""
        keep = [i for i, s in enumerate(self.steps) if s.get("host", 0.0) > 0.0]
        keep = keep or list(range(len(self.steps)))
        if not keep:
            return {}
        steps = [self.steps[i] for i in keep]
        tokens = statistics.median(self.tokens[i] for i in keep)
        out: dict = {"steps": len(steps), "tokens_per_step": tokens}
        out["rows"] = statistics.median(self.rows[i] for i in keep)
        out["width"] = statistics.median(self.widths[i] for i in keep)
        for part in (*PARTS, "total"):
            if part == "total":
                values = [sum(s.values()) for s in steps]
            else:
                values = [s.get(part, 0.0) for s in steps]
                if not any(values):
                    continue
            ms = [v * 1e3 for v in values]
            out[part] = {
                "median_ms": statistics.median(ms),
                "min_ms": min(ms),
                "max_ms": max(ms),
                "per_token_ms": statistics.median(ms) / tokens if tokens else 0.0,
            }
        return out
