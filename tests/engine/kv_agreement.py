"""Greedy-token agreement of quantized KV caches with the plain one on the embedded SmolLM2, in
a process of its own with the ranks' fast BLAS: `python kv_agreement.py OUT.json BITS...`.

The plain cache's greedy answer (the engine's decode) is the reference. Each cache then reads
the prompt and that answer (a chunked prefill), and its greedy token at every position is compared
with the reference's next token: teacher-forced, so one early near-tie does not make every
later position differ. The state bytes per context token are read from the filled caches.
"""

from __future__ import annotations

import thunderpool

if __name__ == "__main__":
    thunderpool.hide_torch()

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_tokenizer

from thunderpool.engine import kv_quant
from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.sampling import SamplingParams
from thunderpool.models.source import resolve_model

# 128 tokens: an 8-bit cache agrees on 98% of them, a 4-bit one on 81% (over 256: 98% and
# 78%), so the test's 95% still tells them apart, at half the decode.
TOKENS = 128
# Read in chunks, as a prefill is: longer products can stall a CPU whose cores are busy.
CHUNK = 64
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main(out: str, bits: list[int]) -> None:
    model_dir = resolve_model(None, progress=False)
    tokenizer = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    runner, _, _ = load_shard(model_dir, mx.distributed.init(), Layout())
    reference: list[int] = []
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    Engine(runner, Control(runner.group)).generate(
        prompt, params, lambda ev: reference.append(ev.token)
    )
    result = {"reference": reference, "agreement": {}, "bytes_per_token": {}}
    for b in [None, *bits]:
        runner.kv_bits = b  # make_cache reads it: the same weights, another cache
        cache, seq, greedy = runner.make_cache(), prompt + reference[:-1], []
        for i in range(0, len(seq), CHUNK):
            logits = runner.verify(mx.array([seq[i : i + CHUNK]]), cache)
            greedy.extend(mx.argmax(logits[0], axis=-1).tolist())
        greedy = np.array(greedy[len(prompt) - 1 :])
        key = str(b or "plain")
        result["agreement"][key] = float(np.mean(greedy == np.array(reference)))
        result["bytes_per_token"][key] = kv_quant.bytes_per_token(cache)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], [int(b) for b in sys.argv[2:]])
