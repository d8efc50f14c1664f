"""Decode bursts on two real ranks (ring on loopback): requests that join, finish and are
cancelled while a burst runs get exactly the tokens and text of the same requests run alone
on one rank, and those equal the engine's tokens for each request run by itself."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from batch_ranks import run_ranks, run_scenario
from mlx_lm.utils import load_tokenizer

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard, read_config
from thunderpool.engine.sampling import SamplingParams

GREEDY = 0  # request indices
SEEDED, CANCELLED, STOPPED, EOS, LATE = 1, 2, 3, 4, 5
CANCEL_AT = 6


@pytest.fixture(scope="module")
def one_rank(tiny_chat):
    runner, _, _ = load_shard(tiny_chat, mx.distributed.init(), Layout())
    eos = read_config(tiny_chat).get("eos_token_id")
    return runner, load_tokenizer(tiny_chat, eos_token_ids=eos)


def alone(one_rank, spec: dict, i: int) -> dict:
    """Request i of `spec` alone on one rank (with its own cancellation, if any)."""
    runner, tokenizer = one_rank
    request = spec["requests"][i] | {"after": None}
    cancel = [[0, n] for j, n in spec.get("cancel", []) if j == i]
    single = spec | {"requests": [request], "cancel": cancel}
    return run_scenario(runner, Control(runner.group), tokenizer, single)["out"][0]


def engine_tokens(one_rank, request: dict) -> list[int]:
    """The engine's tokens for the request by itself (a batch of one row, no eos, no text)."""
    runner, _ = one_rank
    engine, tokens = Engine(runner, Control(runner.group), prefill_chunk=16), []
    params = SamplingParams(**request["params"])
    engine.generate(request["prompt"], params, lambda ev: tokens.append(ev.token))
    return tokens


def scenario(tiny_chat: Path, one_rank) -> tuple[dict, list[list[int]]]:
    """Six staggered requests; the stop string and the eos id are picked from the engine's
    own answers so that they land mid-answer."""
    _, tokenizer = one_rank
    prompt = [tokenizer.encode(f"Question {i}: what comes after {i * 7}?") for i in range(6)]
    greedy = {"temperature": 0.0}
    requests = [
        {"prompt": prompt[0], "params": greedy | {"max_tokens": 40}},
        {
            "prompt": prompt[1],
            "params": {"max_tokens": 20, "temperature": 0.9, "top_k": 50, "seed": 7},
            "after": [GREEDY, 3],
        },
        {"prompt": prompt[2], "params": greedy | {"max_tokens": 40}, "after": [GREEDY, 5]},
        {"prompt": prompt[3], "params": greedy | {"max_tokens": 30}, "after": [SEEDED, 4]},
        {"prompt": prompt[4], "params": greedy | {"max_tokens": 30}, "after": [CANCELLED, 2]},
        {"prompt": prompt[5], "params": greedy | {"max_tokens": 12}, "after": [STOPPED, 9]},
    ]
    refs = [engine_tokens(one_rank, r) for r in requests]
    # eos: a token of EOS's answer from its 9th on that it has not produced before.
    k = next(k for k in range(8, len(refs[EOS])) if refs[EOS][k] not in refs[EOS][:k])
    spec = {"model": str(tiny_chat), "tokenizer": True, "eos": [refs[EOS][k]]}
    spec |= {"requests": requests, "cancel": [[CANCELLED, CANCEL_AT]]}
    # The stop string: three characters from the middle of STOPPED's text, first seen there.
    text = alone(one_rank, spec, STOPPED)["text"]
    at = next(a for a in range(len(text) // 2, len(text) - 3) if text.find(text[a : a + 3]) == a)
    requests[STOPPED]["stop"] = [text[at : at + 3]]
    return spec, refs


def until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    return next((tokens[:k] for k, t in enumerate(tokens) if t in eos), tokens)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallel", "pipeline"), [("tp", None), ("tp", True), ("pp", None)], ids=str
)
def test_requests_joining_and_leaving_bursts_equal_alone(
    tiny_chat, one_rank, tmp_path, parallel, pipeline
):
    """`pipeline` None: each rank's default (batch.overlaps: steps one after the other on pinned CPU
    ranks); True: every rank builds step k+1 while step k computes."""
    spec, refs = scenario(tiny_chat, one_rank)
    expected = [alone(one_rank, spec, i) for i in range(len(spec["requests"]))]
    # Alone equals the single-stream engine: exactly, up to each request's end.
    eos = spec["eos"]
    for i in (GREEDY, SEEDED, LATE):
        assert expected[i]["tokens"] == until_eos(refs[i], eos)
    assert expected[CANCELLED]["tokens"] == refs[CANCELLED][:CANCEL_AT]
    assert expected[CANCELLED]["reason"] is None
    assert expected[EOS]["tokens"] == until_eos(refs[EOS], eos)
    assert expected[EOS]["reason"] == "stop" and 8 <= len(expected[EOS]["tokens"]) < 30
    stopped, stop = expected[STOPPED], spec["requests"][STOPPED]["stop"][0]
    assert stopped["reason"] == "stop" and stop not in stopped["text"]
    assert stopped["tokens"] == refs[STOPPED][: len(stopped["tokens"])]
    assert len(stopped["tokens"]) < 30

    got = run_ranks(spec | {"parallel": parallel, "pipeline": pipeline}, tmp_path)
    assert got["out"] == expected
    assert got["left"] == [[], True, 0]  # every row left the batch on the leader
    # Every arrival, the cancellation and every end came inside a burst (after its "step+"
    # command or a burst step, never after a plain "step"); most steps were burst steps.
    events = got["events"]
    for at, e in enumerate(events):
        if isinstance(e, list) and at > 0:
            assert [c for c in events[:at] if isinstance(c, str)][-1] in ("x", "step+"), (e, events)
    control = [e for e in events if isinstance(e, str)]
    assert control.count("x") > 2 * (control.count("step") + control.count("step+"))
