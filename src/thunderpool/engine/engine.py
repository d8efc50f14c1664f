"""Lockstep generation: the leader (rank 0) decides, the followers execute.

Invariant: every rank issues the same collectives in the same order. Each step the leader
broadcasts one command (control.py), then every rank runs the same forward. A rank that skips
one hangs the cluster, so a rank that fails exits non-zero and the launcher kills the instance.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from thunderpool.engine.batch import BatchState
from thunderpool.engine.control import Control
from thunderpool.engine.runner import Runner
from thunderpool.engine.sampling import Sampler, SamplingParams
from thunderpool.engine.sequence import TextStream


@dataclass(slots=True)
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = "length"

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s else 0.0

    @property
    def decode_tps(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_s": self.ttft_s,
            "prefill_tps": self.prefill_tps,
            "decode_tps": self.decode_tps,
            "finish_reason": self.finish_reason,
        }


@dataclass(slots=True)
class Step:
    token: int
    logits: mx.array | None = None  # kept only when the caller asks for them


@dataclass(slots=True)
class Leader:
    runner: Runner
    control: Control
    prefill_chunk: int = 512
    stats: GenerationStats = field(default_factory=GenerationStats)

    def generate_ids(
        self, prompt: list[int], params: SamplingParams, keep_logits: bool = False
    ) -> Iterator[Step]:
        """Yields sampled tokens; closing the generator early ends the request."""
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        sample = Sampler(params)
        self.stats = stats = GenerationStats(prompt_tokens=len(prompt))
        start = time.perf_counter()
        self.control.send({"op": "new"})
        cache = self.runner.make_cache()
        for i in range(0, len(prompt), self.prefill_chunk):
            chunk = prompt[i : i + self.prefill_chunk]
            logits = self._forward(chunk, cache)
            if i + self.prefill_chunk < len(prompt):
                mx.eval(logits)
                mx.clear_cache()
        # One rank has no followers to tell, so it can build step k+1 while step k computes.
        pipelined = self.control.size == 1
        y = sample(logits)
        mx.async_eval(y)
        decode_start = start
        for n in range(1, params.max_tokens + 1):
            nxt = None
            if pipelined and n < params.max_tokens:
                nxt_logits = self.runner.forward(y[:, None], cache)
                nxt = sample(nxt_logits)
                mx.async_eval(nxt)
            token = y.item()
            now = time.perf_counter()
            if n == 1:
                stats.ttft_s = now - start
                decode_start = now
            stats.generated_tokens = n
            stats.decode_s = now - decode_start
            yield Step(token, logits if keep_logits else None)
            if n == params.max_tokens:
                break
            if pipelined:
                y, logits = nxt, nxt_logits
            else:
                logits = self._forward([token], cache)
                y = sample(logits)

    def _forward(self, tokens: list[int], cache: list) -> mx.array:
        self.control.send({"op": "fwd", "t": tokens})
        return self.runner.forward(mx.array([tokens]), cache)

    def generate_text(self, prompt: list[int], params: SamplingParams, tokenizer) -> Iterator[str]:
        """Yields text deltas; stops on EOS, stop strings or max_tokens (see self.stats)."""
        text = TextStream(tokenizer, params.stop)
        eos = set(tokenizer.eos_token_ids or [])
        steps = self.generate_ids(prompt, params)
        reason = "length"
        for step in steps:
            if step.token in eos:
                reason = "stop"
                break
            delta = text.add(step.token)
            if delta:
                yield delta
            if text.stopped:
                reason = "stop"
                break
        steps.close()
        tail = text.finish()
        if tail:
            yield tail
        self.stats.finish_reason = reason

    def probe(self, shape: tuple[int, ...], repeats: int) -> float:
        """Median seconds of one all_sum of `shape` floats across the group (all ranks join)."""
        self.control.send({"op": "probe", "shape": list(shape), "n": repeats})
        return all_sum_latency(self.control.group, shape, repeats)

    def shutdown(self) -> None:
        self.control.send({"op": "stop"})


def all_sum_latency(group: mx.distributed.Group, shape: tuple[int, ...], repeats: int) -> float:
    x = mx.zeros(shape)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def follow(runner: Runner, control: Control) -> None:
    """Follower loop: execute the leader's commands until it says stop."""
    cache, batch = None, BatchState(runner)
    while True:
        command = control.receive()
        out = None
        match command["op"]:
            case "stop":
                return
            case "new":
                cache = runner.make_cache()
            case "fwd":
                out = runner.forward(mx.array([command["t"]]), cache)
            case "pre":
                out = batch.prefill(command["sid"], command["t"])
            case "step":
                out = batch.step(command["drop"], command["join"], command["t"])
            case "probe":
                all_sum_latency(control.group, tuple(command["shape"]), command["n"])
            case op:
                raise RuntimeError(f"unknown command {op!r} from the leader")
        if out is not None:
            mx.eval(out)
