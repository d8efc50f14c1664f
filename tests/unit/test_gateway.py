"""The gateway across a lost instance, against real engine-link servers with fake schedulers.

A streamed request that showed tokens ends with an error; a non-streamed one (the client has
seen nothing) and a queued one start over on the next instance, with no token from the lost
instance leaking into their answers.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from thunderpool.engine.link import FrameError, LeaderServer
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import Delta, EngineInfo
from thunderpool.serving.gateway import Gateway

TOKEN = "link-secret"


class FakeScheduler:
    """Emits `words` for each request: all of them, or only the first `stall_after` (then hangs
    the way a rank waiting on a dead peer does)."""

    def __init__(self, words: list[str], stall_after: int | None = None):
        self.words, self.stall_after = words, stall_after
        self.prompts: list[list[int]] = []
        self.counters = None
        self._ids = 0

    def submit(self, prompt, params, emit) -> int:
        self.prompts.append(list(prompt))
        self._ids += 1

        def run() -> None:
            n = len(self.words) if self.stall_after is None else self.stall_after
            for w in self.words[:n]:
                emit(Delta(w, tokens=(1,)))
            if self.stall_after is None:
                emit(Delta("", "stop", len(prompt), len(self.words)))

        threading.Thread(target=run, daemon=True).start()
        return self._ids

    def cancel(self, sid: int) -> None:
        pass


def leader(scheduler: FakeScheduler) -> LeaderServer:
    return LeaderServer("127.0.0.1", TOKEN, scheduler, 64, lambda: {}).start()


async def drain(gen) -> list[Delta]:
    return [d async for d in gen]


def test_a_loss_ends_streams_and_replays_the_rest():
    async def main() -> None:
        first = FakeScheduler(["one ", "two ", "three"], stall_after=2)
        server = leader(first)
        gateway = Gateway(EngineInfo("m", 64), None, TOKEN)
        gateway.attach("127.0.0.1", server.port)
        params = SamplingParams(max_tokens=3)
        streamed = gateway.generate([1, 2], params)
        seen = [await anext(streamed), await anext(streamed)]
        assert [d.text for d in seen] == ["one ", "two "]
        collected = asyncio.create_task(drain(gateway.generate([3], params, replayable=True)))
        queued = asyncio.create_task(drain(gateway.generate([4], params, replayable=True)))
        await asyncio.sleep(0.3)  # both reached the first instance, which streamed two words
        assert sorted(map(tuple, first.prompts)) == [(1, 2), (3,), (4,)]

        gateway.lost("node b lost")
        assert gateway.status().state == "recovering"
        rest = await drain(streamed)
        assert [(d.finish_reason, d.error) for d in rest] == [
            ("error", "node b lost; the request was interrupted")
        ]
        second = FakeScheduler(["alpha ", "beta ", "gamma"])
        server2 = leader(second)
        gateway.attach("127.0.0.1", server2.port)
        assert gateway.status().state == "ready"
        for task in (collected, queued):
            deltas = await asyncio.wait_for(task, 10)
            assert "".join(d.text for d in deltas) == "alpha beta gamma"
            assert deltas[-1].finish_reason == "stop"
        assert sorted(map(tuple, second.prompts)) == [(3,), (4,)]
        server.shutdown()
        server2.shutdown()

    asyncio.run(main())


def test_a_gateway_with_the_wrong_token_is_refused():
    server = leader(FakeScheduler(["x"]))
    gateway = Gateway(EngineInfo("m", 64), None, "not-the-secret")
    with pytest.raises(FrameError, match="wrong token"):
        gateway.attach("127.0.0.1", server.port)
    assert gateway.status().state == "loading"
    server.shutdown()
