"""Lockstep generation: the leader (rank 0) decides, the followers execute.

Invariant: every rank issues the same collectives in the same order. Each step the leader
broadcasts one command (control.py), then every rank runs the same forward. A rank that skips
one hangs the cluster, so a rank that fails exits non-zero and the launcher kills the instance.

Decoding one sequence: after the JSON command of the last prefill chunk (which says how many
decode steps follow), step k is the token exchange C_k (one int32 all_sum inside the graph)
and the forward F_k built on it. Where batch.overlaps says so, each rank builds step k+1 while
step k computes; on CPU TP ranks pinned to one core step k+1 is built once step k is done.
Followers issue F_k before they know whether C_k said stop, so a leader that stops early sends
stop and runs one dummy forward too.

Serve's continuous batching (scheduler.py) sends a JSON "step" (rows to drop and join, each
row's token) when the batch changes; when it says `more`, a decode burst follows with no JSON:
step k is the exchange of [last, each row's token] (one int32 all_sum inside the graph) and
the batch forward on it. Followers read `last` after issuing step k's forward; the leader set
it when it issued the step, so no rank ever runs a dummy forward. Bursts are pipelined the
same way where batch.overlaps says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from thunderpool.engine.batch import BatchState, overlaps
from thunderpool.engine.control import STOP, Control
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
        steps = params.max_tokens - 1  # forwards after the prefill
        for i in range(0, len(prompt), self.prefill_chunk):
            chunk = prompt[i : i + self.prefill_chunk]
            last = i + self.prefill_chunk >= len(prompt)
            # The last chunk's command also starts the followers' decode loop: no JSON after
            # it, as another stream (Metal's) may still be running its collectives.
            logits = self._forward(chunk, cache, steps if last else 0)
            if not last:
                mx.eval(logits)
                mx.clear_cache()
        y = sample(logits)
        mx.async_eval(y)
        issued, decode_start, nxt = 0, start, None
        pipeline = overlaps(self.runner)
        try:
            for n in range(1, params.max_tokens + 1):
                if pipeline and issued < steps:
                    # Build step n+1 on the lazy token before waiting for it (as mlx-lm does).
                    nxt_logits, nxt = self._sampled_step(y, cache, sample)
                    mx.async_eval(nxt)
                    issued += 1
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
                if not pipeline:
                    # Pinned CPU TP ranks (batch.overlaps): step n+1 once token n is out.
                    nxt_logits, nxt = self._sampled_step(y, cache, sample)
                    mx.eval(nxt)
                    issued += 1
                y, logits = nxt, nxt_logits
        finally:
            if issued < steps and self.control.size > 1:
                # Followers already run the step after the last one issued: match it.
                pending = [] if nxt is None else [nxt]
                mx.eval(*pending, self._decode_step(mx.array([STOP]), cache))

    def _sampled_step(self, y: mx.array, cache: list, sample: Sampler):
        """The next decode step on token y, lazily: (its logits, its sampled token)."""
        logits = self._decode_step(y, cache)
        return logits, sample(logits)

    def _decode_step(self, y: mx.array, cache: list) -> mx.array:
        """One decode forward on the token y (1,); on several ranks, through the exchange."""
        if self.control.size == 1:
            return self.runner.forward(y[:, None], cache)
        return self.runner.forward(_token_ids(self.control.step_token(y)), cache)

    def _forward(self, tokens: list[int], cache: list, decode: int = 0) -> mx.array:
        """A prefill chunk; `decode` > 0 tells followers that this many decode steps follow."""
        self.control.send({"op": "fwd", "t": tokens, **({"dec": decode} if decode else {})})
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

    def probe(self, shape: tuple[int, ...], repeats: int, op: str = "all_sum") -> float:
        """Median seconds of one `op` (all_sum or all_gather) of `shape` floats across the
        group (all ranks join)."""
        self.control.send({"op": "probe", "shape": list(shape), "n": repeats, "c": op})
        return collective_latency(self.control.group, shape, repeats, op)

    def shutdown(self) -> None:
        self.control.send({"op": "stop"})


PROBES = {"all_sum": mx.distributed.all_sum, "all_gather": mx.distributed.all_gather}


def collective_latency(
    group: mx.distributed.Group, shape: tuple[int, ...], repeats: int, op: str = "all_sum"
) -> float:
    if op not in PROBES:
        raise RuntimeError(f"cannot probe {op!r}; one of {sorted(PROBES)}")
    x, collective = mx.zeros(shape), PROBES[op]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(collective(x, group=group))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _token_ids(exchanged: mx.array) -> mx.array:
    """The exchanged (1,) int32 as the next input ids (1, 1); stop (0) feeds token 0."""
    return mx.maximum(exchanged - 1, 0)[:, None]


def follow_decode(runner: Runner, control: Control, cache: list, steps: int) -> None:
    """Up to `steps` decode steps (pipelined where batch.overlaps says so); the leader's
    exchange says token or stop."""
    out, pipeline = None, overlaps(runner)
    for _ in range(steps):
        exchanged = control.step_token(None)
        if runner.stage is not None:
            # PP: the exchange must complete before this stage's recv, as on the leader.
            mx.eval(exchanged)
        out = runner.forward(_token_ids(exchanged), cache)
        step = [exchanged, *([out] if out is not None else [])]
        (mx.async_eval if pipeline else mx.eval)(*step)
        if exchanged.item() == 0:
            break  # stop: `out` was the leader's dummy step
    if out is not None:
        mx.eval(out)


def follow_burst(runner: Runner, control: Control, batch: BatchState, out: mx.array | None) -> None:
    """Batch decode steps after a "step" command that said `more` (its forward is `out`),
    until the leader's exchange says last; pipelined where batch.overlaps says so."""
    rows, pipeline = len(batch.rows), overlaps(runner)
    if out is not None:
        (mx.async_eval if pipeline else mx.eval)(out)
    while True:
        exchanged = control.burst_step(None, rows)
        if runner.stage is not None:
            # PP: the exchange must complete before this stage's recv, as on the leader.
            mx.eval(exchanged)
        out = batch.decode(exchanged[1:])
        step = [exchanged, *([out] if out is not None else [])]
        if pipeline:
            mx.async_eval(*step)
        else:
            mx.eval(*step)  # this step's compute has the core before the next step is built
        if exchanged[0].item():
            break
    if out is not None:
        mx.eval(out)


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
                if command.get("dec"):
                    mx.eval(out)
                    follow_decode(runner, control, cache, command["dec"])
                    out = None
            case "solo":
                from thunderpool.bench.breakdown import solo_compute

                solo_compute(runner, control.group, command["t"], command["n"])
            case "pre":
                out = batch.prefill(command["sid"], command["t"])
            case "step":
                out = batch.step(command["drop"], command["join"], command["t"])
                if command.get("more"):
                    follow_burst(runner, control, batch, out)
                    out = None
            case "probe":
                shape = tuple(command["shape"])
                collective_latency(control.group, shape, command["n"], command.get("c", "all_sum"))
            case op:
                raise RuntimeError(f"unknown command {op!r} from the leader")
        if out is not None:
            mx.eval(out)
