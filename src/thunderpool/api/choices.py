"""What a choice carries besides its text: logprobs in OpenAI's two shapes; and n > 1 choices
as n streams merged into one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from thunderpool.api.schemas import (
    ChoiceLogprobs,
    CompletionLogprobs,
    LogprobContent,
    TopLogprob,
)
from thunderpool.api.sse import close_quietly
from thunderpool.engine.logits import TokenLogprob

TokenText = Callable[[int], str]
T = TypeVar("T")


def chat_logprobs(lps: Sequence[TokenLogprob], text_of: TokenText) -> ChoiceLogprobs:
    def entry(token: int, logprob: float) -> TopLogprob:
        s = text_of(token)
        return TopLogprob(token=s, logprob=logprob, bytes=list(s.encode()))

    content = []
    for lp in lps:
        head = entry(lp.token, lp.logprob)
        tops = [entry(t, v) for t, v in lp.top]
        content.append(LogprobContent(**head.model_dump(), top_logprobs=tops))
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    lps: Sequence[TokenLogprob], text_of: TokenText, offset: int = 0
) -> CompletionLogprobs:
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        tokens.append(s := text_of(lp.token))
        offset += len(s)
    tops = [{text_of(t): v for t, v in lp.top} for lp in lps]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=tops if any(lp.top for lp in lps) else None,
        text_offset=offsets,
    )


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(choice index, item) from every stream as they come; closing this closes them all.
    A stream's exception is re-raised here."""
    if len(streams) == 1:
        try:
            async for d in streams[0]:
                yield 0, d
        finally:
            await close_quietly(streams[0])
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[T]) -> None:
        try:
            async for d in s:
                await queue.put((i, d))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await close_quietly(s)
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            i, d = await queue.get()
            if d is None:
                ended += 1
            elif isinstance(d, Exception):
                raise d
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
