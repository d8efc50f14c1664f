"""The leader's per-request timing on a real engine (one rank, a tiny model): each request's
first delta carries its queue time and TTFT, the others their gap, the last the total; and the
timing survives the engine link's wire format."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from thunderpool.engine import link
from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.sequence import Counters, TextRequests
from thunderpool.engine.service import Delta


def test_queue_time_covers_the_wait_for_a_seat(tiny_models):
    runner, _, _ = load_shard(Path(tiny_models["llama"]), mx.distributed.init(), Layout())
    engine = Engine(runner, Control(runner.group), prefill_chunk=16, max_batch=1)
    counters = Counters()
    requests = TextRequests(engine, None, counters)
    out: dict[int, list[Delta]] = {0: [], 1: []}
    params = SamplingParams(max_tokens=5)
    for i in out:
        requests.submit([1, 2, 3, 4 + i], params, out[i].append)
    while engine.step():
        pass
    for deltas in out.values():
        assert [d.finish_reason for d in deltas] == [None] * 4 + ["length"]
        first, *rest = deltas
        assert first.queued_s is not None and first.queued_s >= 0 and first.gap_s is None
        assert all(d.queued_s is None and d.ttft_s is None and d.gap_s > 0 for d in rest)
        gaps = sum(d.gap_s for d in rest)
        assert first.ttft_s + gaps == pytest.approx(deltas[-1].elapsed_s, abs=1e-9)
    # One seat: request 1 waited in the queue through all of request 0's decoding.
    decoding_0 = sum(d.gap_s for d in out[0][1:])
    assert out[1][0].queued_s > decoding_0
    assert (counters.requests_total, counters.tokens_generated_total) == (2, 10)


def test_timing_crosses_the_engine_link():
    d = Delta("hi", tokens=(5,), queued_s=0.01, ttft_s=0.5)
    msg = link.ToGateway.validate_json(link.DeltaMsg(id=3, delta=d).model_dump_json())
    assert msg.delta == d
