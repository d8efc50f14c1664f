"""The contract between the HTTP API and the engine running on the leader rank.

The API never touches MLX: it tokenizes with `tokenizer`, submits token ids, and reads
`Delta`s. Closing the async iterator (a client that disconnected) cancels the request, which
leaves the running batch at the next step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from thunderpool.engine.logits import TokenLogprob
from thunderpool.engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of one request. The last delta has `finish_reason` set ("stop" | "length" |
    "error") and the token counts; `error` carries a message when finish_reason is "error"."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    tokens: tuple[int, ...] = ()  # the token ids behind this delta
    # Timing measured where tokens are made (the leader), so a gateway that holds deltas back
    # does not distort it: queue time and TTFT on the first token, the gap since the previous
    # token on later ones, submit-to-last-token on the last.
    queued_s: float | None = None
    ttft_s: float | None = None
    gap_s: float | None = None
    elapsed_s: float | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked
    cached_tokens: int = 0  # of prompt_tokens, reused from the prefix cache (last delta)


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """What /health reports: `state` is "loading" | "ready" | "failed"."""

    state: str
    progress: float = 0.0  # 0..1 while loading
    detail: str = ""
    # While nodes fetch weights: per node {node, bytes_done, bytes_total, rate_Bps, eta_s}.
    fetch: tuple[dict, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str  # the id served under /v1/models
    max_context: int  # prompt + completion tokens the plan allows per request
    created: int = 0
    cluster: dict[str, Any] = field(default_factory=dict)  # nodes, links, placement


class EngineClient(Protocol):
    info: EngineInfo
    tokenizer: Any  # mlx-lm TokenizerWrapper: encode, decode, apply_chat_template, eos ids

    def status(self) -> EngineStatus: ...

    def metrics(self) -> dict[str, float]:
        """Counters and gauges: requests_total, tokens_generated_total, prompt_tokens_total,
        prefix_cache_hit_tokens_total, ttft_seconds (last), decode_tokens_per_second (recent),
        queue_depth, active_requests, and rank{N}_memory_bytes per rank."""
        ...

    def generate(
        self, prompt: list[int], params: SamplingParams, *, replayable: bool = False
    ) -> AsyncIterator[Delta]:
        """`replayable`: the caller shows nothing before the last delta (a non-streamed
        answer), so after a lost node the engine may run the request again from the start."""
        ...


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One known model as /api/ps, /v1/models and /v1/cluster tell it."""

    name: str
    state: str  # "unloaded" | "loading" | "ready" | "recovering" | "failed"
    progress: float = 0.0
    detail: str = ""
    in_flight: int = 0  # generations running now
    expires_at: float | None = None  # unix time it unloads when idle; None: never
    memory_bytes: int | None = None  # what its ranks hold now (RSS, else weights)
    cluster: dict[str, Any] = field(default_factory=dict)  # placement, nodes, instance


class ModelRegistry(Protocol):
    """The models a server knows, by the name a request's `model` field gives; `names()[0]`
    is the default one (examples, /metrics)."""

    def names(self) -> list[str]: ...

    def client(self, name: str) -> EngineClient:
        """The model's engine without loading it: info and tokenizer always hold."""
        ...

    async def acquire(self, name: str, keep_alive: float | None = None) -> EngineClient:
        """The model's engine, loaded first when it is not (the caller waits); `keep_alive`:
        seconds it stays loaded once idle (negative: forever; None: as before)."""
        ...

    def entries(self) -> list[ModelEntry]: ...

    def keep(self, name: str, keep_alive: float) -> None:
        """Set how long a loaded model stays once idle, without loading it (0: unload now,
        or as soon as its requests finish)."""
        ...
