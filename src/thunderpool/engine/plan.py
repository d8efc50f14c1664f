"""The one message of the engine: what every rank executes next (scheduler.py makes it).

A StepPlan crosses the wire as small JSON bytes through Control's broadcast (no pickle). Every
rank runs `Executor.execute(plan)` on the same plans in the same order, so every rank issues the
same collectives by construction.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

from pydantic import TypeAdapter

from thunderpool.engine.sampling import SamplingParams

Op = Literal["step", "park", "stop", "probe", "solo"]
OPS = ("step", "park", "stop", "probe", "solo")
_SAMPLING = TypeAdapter(SamplingParams)  # the API's schema, all the way to the rank
_DEFAULTS = asdict(SamplingParams())


def _sampling_json(p: SamplingParams) -> dict:
    """Only the fields that differ from the defaults: plans stay small as SamplingParams grows."""
    return {k: v for k, v in asdict(p).items() if v != _DEFAULTS[k]}


@dataclass(frozen=True, slots=True)
class Prefill:
    """One prompt chunk of request `sid`; `sampling` rides on its first chunk (the leader
    makes the request's sampler from it) and `last` marks the prompt's last chunk.
    Prefix cache (prefix.py): `reuse` (entry, n) starts the row from the entry's first n
    tokens (this chunk starts at n); after the chunk, `evict` entries are freed and the
    prompt's KV is kept as entry `store`."""

    sid: int
    tokens: tuple[int, ...]
    last: bool
    sampling: SamplingParams | None = None
    reuse: tuple[int, int] | None = None
    store: int | None = None
    evict: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepPlan:
    """op "step": drop finished rows, run one prefill chunk, join the rows in `join` (their
    prefill is done), then, when `decode`, a decode burst of every row: steps whose tokens are
    exchanged inside the graph until the leader's exchange says last (control.py).
    "park": no work; followers sleep until woken (wake.py). "probe"/"solo": measurements."""

    op: Op = "step"
    drop: tuple[int, ...] = ()
    prefill: Prefill | None = None
    join: tuple[int, ...] = ()
    decode: bool = False
    # probe: (shape, repeats, op); solo: (prompt, steps[, rows, width]); park: wake address
    args: tuple = ()
    # Speculation, the scheduler's choice: each row's most drafts per verify step (0: the row
    # takes one token of its own sampler per step); empty: plain decode steps.
    spec: tuple[int, ...] = ()

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown plan op {self.op!r}; one of {OPS}")
        if self.join and (self.prefill is None or self.join != (self.prefill.sid,)):
            raise ValueError(f"join={self.join} must be the sid of a prefill's last chunk")
        if self.spec and not (self.decode and max(self.spec) > 0 and min(self.spec) >= 0):
            raise ValueError(f"spec={self.spec} needs decode and a positive draft length")

    def encode(self) -> bytes:
        d: dict = {"op": self.op}
        if self.drop:
            d["drop"] = list(self.drop)
        if self.prefill is not None:
            p = self.prefill
            d["pre"] = [p.sid, list(p.tokens), int(p.last)]
            if p.sampling is not None:
                d["pre"].append(_sampling_json(p.sampling))
            if p.reuse is not None:
                d["reuse"] = list(p.reuse)
            if p.store is not None:
                d["store"] = p.store
            if p.evict:
                d["evict"] = list(p.evict)
        if self.join:
            d["join"] = list(self.join)
        if self.decode:
            d["dec"] = 1
        if self.args:
            d["args"] = list(self.args)
        if self.spec:
            d["spec"] = list(self.spec)
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode_bytes(cls, data: bytes) -> StepPlan:
        d = json.loads(data)
        prefill = None
        if "pre" in d:
            sid, tokens, last, *sampling = d["pre"]
            params = _SAMPLING.validate_python(sampling[0]) if sampling else None
            prefill = Prefill(
                int(sid),
                tuple(int(t) for t in tokens),
                bool(last),
                params,
                reuse=(int(d["reuse"][0]), int(d["reuse"][1])) if "reuse" in d else None,
                store=int(d["store"]) if "store" in d else None,
                evict=tuple(int(e) for e in d.get("evict", ())),
            )
        return cls(
            op=d["op"],
            drop=tuple(int(s) for s in d.get("drop", ())),
            prefill=prefill,
            join=tuple(int(s) for s in d.get("join", ())),
            decode=bool(d.get("dec")),
            args=tuple(d.get("args", ())),
            spec=tuple(int(k) for k in d.get("spec", ())),
        )


PARK = StepPlan("park")
STOP_PLAN = StepPlan("stop")
