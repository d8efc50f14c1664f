"""The pure scheduler and the plan on the wire, without MLX: which plans a request makes, when
a burst must end, and that a plan survives its JSON bytes exactly."""

from __future__ import annotations

import json

import pytest

from thunderpool.engine.plan import Prefill, StepPlan
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.scheduler import Emitted, Scheduler


def test_a_plan_is_small_json_and_round_trips():
    hot = SamplingParams(max_tokens=5, temperature=0.7, top_k=3, seed=9, stop=("END",))
    plan = StepPlan(drop=(1, 2), prefill=Prefill(7, (5, 6, 7), True, hot), join=(7,), decode=True)
    data = plan.encode()
    assert json.loads(data)["op"] == "step" and len(data) < 200
    assert StepPlan.decode_bytes(data) == plan
    probe = StepPlan("probe", args=([1, 1, 64], 50, "all_sum"))
    assert StepPlan.decode_bytes(probe.encode()) == probe
    with pytest.raises(ValueError, match="must be the sid of a prefill"):
        StepPlan(join=(3,), decode=True)
    with pytest.raises(ValueError, match="unknown plan op"):
        StepPlan.decode_bytes(b'{"op":"exec"}')


def test_one_request_chunked_prefill_burst_and_drop():
    s = Scheduler(prefill_chunk=16, max_batch=4, max_context=1000)
    params = SamplingParams(max_tokens=3)
    s.add(0, list(range(40)), params)
    plans = [s.schedule(), s.schedule(), s.schedule()]
    assert [p.prefill.tokens for p in plans] == [
        tuple(range(16)),
        tuple(range(16, 32)),
        tuple(range(32, 40)),
    ]
    assert [p.prefill.sampling for p in plans] == [params, None, None]  # on the first chunk
    assert [(p.prefill.last, p.join, p.decode) for p in plans] == [
        (False, (), False),
        (False, (), False),
        (True, (0,), True),
    ]
    # Token 1 comes from the prefill; step 1 makes token 2, step 2 token 3 (max_tokens): last.
    assert [s.last_step(), s.last_step()] == [False, True]
    got = [s.postprocess([0], [t]) for t in (11, 12, 13, 14)]  # 14: a step past the end
    assert got == [
        [Emitted(0, 11, None, 40, 1)],
        [Emitted(0, 12, None, 40, 2)],
        [Emitted(0, 13, "length", 40, 3)],
        [],
    ]
    assert s.schedule() == StepPlan(drop=(0,))
    assert s.schedule() is None and not s.busy


def test_a_burst_ends_for_news_cancels_eos_and_a_first_token_that_is_the_last():
    s = Scheduler(prefill_chunk=64, max_batch=2, max_context=1000, eos={99})
    s.add(0, [1, 2], SamplingParams(max_tokens=50))
    s.schedule()
    assert s.last_step() is False
    assert s.last_step(news=True) is True  # a request waits and there is room
    s.cancel(0)
    assert s.last_step() is True and s.postprocess([0], [5]) == []  # cancelled: nothing more
    assert s.schedule() == StepPlan(drop=(0,))
    s.add(1, [3], SamplingParams(max_tokens=50))
    s.schedule()
    assert s.postprocess([1], [99]) == [Emitted(1, None, "stop", 1, 1)]  # eos: no text
    s.add(2, [4, 5], SamplingParams(max_tokens=1))
    plan = s.schedule()  # drops 1, prefills 2, which never joins: its first token is its last
    assert (plan.drop, plan.prefill.last, plan.join, plan.decode) == ((1,), True, (), False)
    assert s.postprocess([2], [7]) == [Emitted(2, 7, "length", 2, 1)]
    assert s.schedule() == StepPlan(drop=(2,))
    assert s.schedule() is None
