"""The leader sampler's logits processing against references computed directly: mlx-lm's own
processors and numpy for penalties and logit bias, numpy for the min-p cut."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from thunderpool.engine.logits import Penalties
from thunderpool.engine.sampling import Sampler, SamplingParams

V = 64
PROMPT = [1, 2, 3, 5, 5]
BIAS = ((3, 5.0), (10, -100.0), (40, 2.5))


def steps(n: int, seed: int = 0) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    # Peaked rows with a few repeats of the same winners, so penalties change the choice.
    return [mx.array(rng.normal(0, 3, (1, V)).astype(np.float32)) for _ in range(n)]


def numpy_reference(logits: np.ndarray, generated: list[int], p: SamplingParams) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for t, b in p.logit_bias:
        out[t] += b
    seen = sorted(set(PROMPT) | set(generated))
    out[seen] = np.where(
        out[seen] > 0, out[seen] / p.repetition_penalty, out[seen] * p.repetition_penalty
    )
    counts = np.bincount(generated, minlength=V)
    return out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_and_bias_match_numpy_and_mlx_lm():
    p = SamplingParams(
        frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3, logit_bias=BIAS
    )
    sampler = Sampler(p)
    sampler.observe_prompt(PROMPT)
    generated: list[int] = []
    changed = 0
    for logits in steps(12):
        raw = np.array(logits[0])
        token = int(sampler(logits).item())
        ref = numpy_reference(raw, generated, p)
        assert token == int(ref.argmax())
        changed += token != int(raw.argmax())
        # mlx-lm's processors in their own order: bias, repetition (prompt + generated),
        # presence and frequency (generated only, whole history as the context).
        history = PROMPT + generated
        procs = make_logits_processors(
            dict(BIAS), p.repetition_penalty, len(history), None, None, None, None
        )
        mine = Penalties(0.0, 0.0, p.repetition_penalty, BIAS)
        mine.observe_prompt(PROMPT)
        mine(logits)
        for t in generated:
            mine.add(mx.array([t]))
        want = mx.array(np.array(logits))  # mlx-lm's processors write in place
        for proc in procs:
            want = proc(mx.array(history), want)
        np.testing.assert_allclose(np.array(mine(logits)), np.array(want), atol=1e-5)
        freq = make_logits_processors(
            None, None, None, p.presence_penalty, 10**6, p.frequency_penalty, 10**6
        )
        only = Penalties(p.frequency_penalty, p.presence_penalty)
        only(logits)
        for t in generated:
            only.add(mx.array([t]))
        want = mx.array(np.array(logits))  # mlx-lm's processors write in place
        for proc in freq:
            want = proc(mx.array(generated), want) if generated else want
        np.testing.assert_allclose(np.array(only(logits)), np.array(want), atol=1e-5)
        generated.append(token)
    assert changed >= 2  # the penalties did change some choices
    assert 10 not in generated


def test_min_p_draws_only_tokens_above_the_cut():
    probs = np.array([0.40, 0.22, 0.13, 0.11, 0.09] + [0.05 / (V - 5)] * (V - 5))
    logits = mx.array(np.log(probs)[None].astype(np.float32))
    allowed = set(np.nonzero(probs >= 0.3 * probs.max())[0].tolist())  # {0, 1, 2}
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=4))
    drawn = {int(sampler(logits).item()) for _ in range(300)}
    assert drawn == allowed
    plain = Sampler(SamplingParams(temperature=1.0, seed=4))
    assert len({int(plain(logits).item()) for _ in range(300)} - allowed) > 0


def test_logprobs_are_the_raw_log_softmax_in_delivery_order():
    p = SamplingParams(logprobs=True, top_logprobs=3, logit_bias=((7, 50.0),))
    sampler = Sampler(p)
    rows = steps(3, seed=2)
    tokens = [int(sampler(x).item()) for x in rows]
    assert tokens == [7, 7, 7]  # the bias picks, the logprobs stay the model's
    for x, t in zip(rows, tokens, strict=True):
        raw = np.array(x[0], dtype=np.float64)
        ref = raw - np.log(np.exp(raw - raw.max()).sum()) - raw.max()
        lp = sampler.take_logprob()
        assert lp.token == t and abs(lp.logprob - ref[t]) < 1e-5
        assert [i for i, _ in lp.top] == np.argsort(-ref)[:3].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(ref)[::-1][:3], atol=1e-5)
    assert sampler.take_logprob() is None
