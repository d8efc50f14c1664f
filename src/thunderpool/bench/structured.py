"""What constrained decoding costs: decode tok/s of one row with a JSON-schema grammar against
the same row free, on one rank, alternated, median of the repeats.

    thunderpool bench --constrained [--model M] [--max-tokens 64] [--repeats 3]

Both rows decode exactly `--max-tokens` tokens (the engine is given no EOS; the schema forces a
string longer than that), so the two differ only by the grammar mask and its matcher.
"""

from __future__ import annotations

import statistics
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
}
PROMPT = "Write a long story about a cat, as JSON with one key, story."


def decode_tps(requests, prompt: list[int], params) -> float:
    from thunderpool.engine.sequence import TextEdge

    engine = requests.engine
    done = []
    edge = TextEdge(requests.tokenizer, params, done.append, engine.cancel)
    engine.generate(prompt, params, edge)
    n = done[-1].completion_tokens
    return (n - 1) / (edge.last_at - edge.first_at)


def constrained_cost(model_dir: Path, tokens: int = 64, repeats: int = 3) -> dict:
    """Free and constrained decode tok/s, alternated, and the median's relative cost."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from thunderpool.engine.constraint import check_schema
    from thunderpool.engine.control import Control
    from thunderpool.engine.engine import Engine
    from thunderpool.engine.loader import Layout, load_shard
    from thunderpool.engine.sampling import SamplingParams
    from thunderpool.engine.sequence import TextRequests

    group = mx.distributed.init()
    runner, config, _ = load_shard(Path(model_dir), group, Layout())
    tokenizer = load_tokenizer(Path(model_dir), eos_token_ids=config.get("eos_token_id"))
    engine = Engine(runner, Control(group), max_context=1 << 62, tokenizer=tokenizer)
    requests = TextRequests(engine, tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    free = SamplingParams(max_tokens=tokens)
    constrained = SamplingParams(max_tokens=tokens, json_schema=check_schema(SCHEMA))
    decode_tps(requests, prompt, free)  # warm-up: kernels, and the grammar's tokenizer
    decode_tps(requests, prompt, constrained)
    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(repeats):
        runs["free"].append(decode_tps(requests, prompt, free))
        runs["constrained"].append(decode_tps(requests, prompt, constrained))
    engine.shutdown()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "model": str(model_dir),
        "tokens": tokens,
        "decode_tps": runs,
        "median_tps": med,
        "cost": 1 - med["constrained"] / med["free"],
    }
