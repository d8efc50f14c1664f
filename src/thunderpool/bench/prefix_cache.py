"""`thunderpool bench --prefix-cache-turns N`: what the prefix cache saves, on one rank.

Two-turn chat: turn 1 is a `first_turn`-token prompt; turn 2 is turn 1, its answer and a short
new message. Turn 2's TTFT with the cache is compared with turn 1's (and with turn 2 without
the cache), median over the repeats; each repeat is a new conversation. Agent replay: a system
prompt, then N turns that each append the model's answer and a tool result; the prompt tokens
the engine prefills (prompt minus cached tokens) are counted with and without the cache.
Synthetic token ids (fixed seeds): the time depends on the count, not the text. The greedy
tokens with and without the cache are compared too (they must be identical).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx

from thunderpool.bench.engine_bench import model_dims, synthetic_prompt
from thunderpool.engine.engine import Engine
from thunderpool.engine.sampling import SamplingParams

ANSWER_TOKENS = 32
NEW_MESSAGE_TOKENS = 40
SYSTEM_TOKENS, TOOL_RESULT_TOKENS, CALL_TOKENS = 800, 120, 24


def bench_prefix_cache(
    model_dir: Path, first_turn: int = 1500, repeats: int = 3, turns: int = 20, budget_gb=1.0
) -> dict:
    from thunderpool.engine.control import Control
    from thunderpool.engine.loader import Layout, load_shard, read_config
    from thunderpool.engine.prefix import budget_tokens

    runner, _, _ = load_shard(Path(model_dir), mx.distributed.init(), Layout())
    budget = budget_tokens(budget_gb * 2**30, read_config(Path(model_dir)))
    vocab = model_dims(runner.model)[0]

    def engine(cached: bool) -> Engine:
        return Engine(
            runner, Control(runner.group), max_context=1 << 62, prefix_cache_tokens=budget * cached
        )

    def chat(e: Engine, seed: int) -> tuple[float, float, int, list]:
        """(turn-1 TTFT, turn-2 TTFT, turn-2 cached tokens, both turns' tokens)."""
        turn1 = synthetic_prompt(first_turn, vocab, seed)
        t1, answer, _ = timed(e, turn1, ANSWER_TOKENS)
        turn2 = turn1 + answer + synthetic_prompt(NEW_MESSAGE_TOKENS, vocab, seed + 1000)
        t2, again, cached = timed(e, turn2, ANSWER_TOKENS)
        return t1, t2, cached, [answer, again]

    chat(engine(True), 999)  # warm-up
    rows = []
    for r in range(repeats):
        # Alternated, each on a fresh engine: turn 1 is never a hit.
        on, off = chat(engine(True), r), chat(engine(False), r)
        rows.append(
            {
                "turn1_s": on[0],
                "turn2_s": on[1],
                "turn2_nocache_s": off[1],
                "cached": on[2],
                "same_tokens": on[3] == off[3],
            }
        )
    ratio = [row["turn2_s"] / row["turn1_s"] for row in rows]
    two_turn = {
        "first_turn_tokens": first_turn,
        "turn2_tokens": first_turn + ANSWER_TOKENS + NEW_MESSAGE_TOKENS,
        "turn1_ttft_ms": statistics.median(row["turn1_s"] for row in rows) * 1e3,
        "turn2_ttft_ms": statistics.median(row["turn2_s"] for row in rows) * 1e3,
        "turn2_nocache_ttft_ms": statistics.median(row["turn2_nocache_s"] for row in rows) * 1e3,
        "ratio_median": statistics.median(ratio),
        "ratios": ratio,
        "turn2_cached_tokens": rows[0]["cached"],
        "identical_tokens": all(row["same_tokens"] for row in rows),
    }
    replay = {"turns": turns}
    for name, cached in (("cache", True), ("nocache", False)):
        replay[name] = agent_replay(engine(cached), vocab, turns)
    replay["identical_tokens"] = replay["cache"].pop("tokens") == replay["nocache"].pop("tokens")
    return {
        "model": str(model_dir),
        "budget_tokens": budget,
        "two_turn": two_turn,
        "agent_replay": replay,
    }


def agent_replay(e: Engine, vocab: int, turns: int) -> dict:
    """`turns` agent steps: each prompt is the last one plus its answer and a tool result."""
    prompt = synthetic_prompt(SYSTEM_TOKENS, vocab, 7)
    prompt_total = prefilled = 0
    ttfts, tokens = [], []
    start = time.perf_counter()
    for turn in range(turns):
        ttft, answer, cached = timed(e, prompt, CALL_TOKENS)
        prompt_total, prefilled = prompt_total + len(prompt), prefilled + len(prompt) - cached
        ttfts.append(ttft)
        tokens.append(answer)
        prompt = prompt + answer + synthetic_prompt(TOOL_RESULT_TOKENS, vocab, 100 + turn)
    return {
        "prompt_tokens": prompt_total,
        "prefilled_tokens": prefilled,
        "wall_s": time.perf_counter() - start,
        "median_ttft_ms": statistics.median(ttfts) * 1e3,
        "last_prompt_tokens": len(prompt),
        "tokens": tokens,
    }


def timed(e: Engine, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT, greedy tokens, cached prompt tokens) of one request."""
    out, first, cached = [], [], [0]
    start = time.perf_counter()

    def on_event(ev) -> None:
        if not first:
            first.append(time.perf_counter())
        out.append(ev.token)
        cached[0] = ev.cached_tokens

    e.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), on_event)
    return first[0] - start, out, cached[0]


def print_prefix_report(result: dict, console) -> None:
    t, a = result["two_turn"], result["agent_replay"]
    console.print(
        f"two-turn chat ({t['first_turn_tokens']}-token turn 1, {t['turn2_tokens']}-token "
        f"turn 2): TTFT turn 1 {t['turn1_ttft_ms']:.0f} ms, turn 2 {t['turn2_ttft_ms']:.0f} ms "
        f"with the cache ({t['turn2_cached_tokens']} tokens cached), "
        f"{t['turn2_nocache_ttft_ms']:.0f} ms without; turn 2 / turn 1 = "
        f"{t['ratio_median']:.3f} (median of {len(t['ratios'])}); identical tokens: "
        f"{t['identical_tokens']}"
    )
    c, n = a["cache"], a["nocache"]
    console.print(
        f"{a['turns']}-turn agent replay ({c['last_prompt_tokens']} tokens at the end): "
        f"{c['prefilled_tokens']:,} of {c['prompt_tokens']:,} prompt tokens prefilled with the "
        f"cache, {n['prefilled_tokens']:,} without; wall {c['wall_s']:.1f} s vs "
        f"{n['wall_s']:.1f} s; identical tokens: {a['identical_tokens']}"
    )
