"""The one stream every API renders: each choice's engine Deltas as Text (with its logprobs)
and Call events, then one Finish that names the matched stop string.

Tool calls come from the family's parser (tool_choice "auto"), or whole from a constrained
output (a forced choice). Every path closes the engine's iterator however it ends: closing is
what cancels the request and frees its seat in the batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from thunderpool.api.choices import merge
from thunderpool.api.conversation import NO_FINISH, Admitted, Finish, Turn, engine_error
from thunderpool.api.errors import APIError
from thunderpool.api.sse import close_quietly
from thunderpool.api.tools import Call, Text, forced_call
from thunderpool.engine.service import Delta, EngineClient

log = logging.getLogger("thunderpool.api")
Event = Text | Call | Finish


async def turn(
    engine: EngineClient, admitted: Admitted, *, replayable: bool = False, index: int = 0
) -> AsyncIterator[Event]:
    """Choice `index`'s events, ending with its Finish; an engine failure raises APIError(500)."""
    job, splitter = admitted.job, admitted.splitter
    deltas = engine.generate(job.prompt, job.choice_params(index), replayable=replayable)
    shown, tokens, calls = [], [], 0
    try:
        async for d in deltas:
            if d.finish_reason == "error":
                raise engine_error(d.error)
            tokens.extend(d.tokens)
            shown.append(d.text)
            if admitted.forced:  # the constrained call is whole only at its end
                pieces = _forced(d, "".join(shown)) if d.finish_reason is not None else []
            else:
                pieces = _pieces(splitter, d)
            for p in pieces:
                calls += isinstance(p, Call)
                yield replace(p, tokens=len(tokens)) if isinstance(p, Text) else p
            if d.finish_reason is not None:
                yield _finish(engine, admitted, d, tokens, "".join(shown), calls)
                return
    except APIError:
        raise
    except Exception as e:
        log.exception("generation %s failed", job.id)
        raise engine_error(str(e)) from e
    finally:
        await close_quietly(deltas)
    raise engine_error(NO_FINISH)


def _pieces(splitter, d: Delta) -> list[Text | Call]:
    if splitter is None:
        return [Text(d.text, tuple(d.logprobs))] if d.text or d.logprobs else []
    pieces = splitter.feed(d.text)
    if d.finish_reason is not None:
        pieces += splitter.finish()
    if d.logprobs:  # the parser holds text back: the token's logprobs go out as they come
        texts = [i for i, p in enumerate(pieces) if isinstance(p, Text)]
        if texts:
            pieces[texts[0]] = Text(pieces[texts[0]].text, tuple(d.logprobs))
        else:
            pieces.insert(0, Text("", tuple(d.logprobs)))
    return pieces


def _forced(last: Delta, text: str) -> list[Text | Call]:
    """The forced call in a finished constrained output; the text as is when cut short."""
    call = forced_call(text) if last.finish_reason == "stop" else None
    if call is not None:
        return [call]
    return [Text(text)] if text else []


def _stop_sequence(tokenizer: Any, tokens: list[int], shown: str, stops: tuple[str, ...]) -> str:
    """Which stop string ended the text (the engine reports only "stop"): the earliest one in
    what was generated past the text shown; "" when the model's end token stopped it."""
    if not stops:
        return ""
    try:
        tail = tokenizer.decode(tokens)[len(shown) :]
    except Exception:  # a tokenizer that cannot decode its own ids: say nothing rather than fail
        return ""
    found = [(i, s) for s in stops if (i := tail.find(s)) >= 0]
    return min(found)[1] if found else ""


def _finish(
    engine: EngineClient, a: Admitted, last: Delta, tokens: list[int], shown: str, calls: int
) -> Finish:
    # The engine counts what it prefilled; our own count stands in if it reports none.
    prompt = last.prompt_tokens or len(a.job.prompt)
    reason, stop = last.finish_reason or "stop", None
    if reason == "stop" and calls:
        reason = "tool_calls"
    elif reason == "stop":
        stop = _stop_sequence(engine.tokenizer, tokens, shown, a.stops) or None
    return Finish(reason, prompt, last.completion_tokens, stop, last.cached_tokens)


async def choices(
    engine: EngineClient, admitted: Admitted, *, replayable: bool = False
) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) from each of the job's `n` choices as they come."""
    streams = [
        turn(engine, admitted, replayable=replayable, index=i) for i in range(admitted.job.n)
    ]
    merged = merge(streams)
    try:
        async for pair in merged:
            yield pair
    finally:
        await close_quietly(merged)
        for s in streams:  # those merge never started
            await close_quietly(s)


async def collect_turn(engine: EngineClient, admitted: Admitted, index: int = 0) -> Turn:
    text, calls, logprobs = [], [], []
    async for ev in turn(engine, admitted, replayable=True, index=index):
        match ev:
            case Text():
                text.append(ev.text)
                logprobs.extend(ev.logprobs)
            case Call():
                calls.append(ev)
            case Finish():
                return Turn("".join(text), tuple(calls), ev, tuple(logprobs))
    raise engine_error(NO_FINISH)  # turn() always ends with Finish or raises


async def collect_turns(engine: EngineClient, admitted: Admitted) -> list[Turn]:
    """Every choice's whole turn; one that fails cancels the others (closing their requests)."""
    n = admitted.job.n
    if n == 1:
        return [await collect_turn(engine, admitted)]
    tasks = [asyncio.ensure_future(collect_turn(engine, admitted, i)) for i in range(n)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage_of(finishes: list[Finish]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of a request's choices: the prompt counts once
    (it is the same prompt), completions add up."""
    first = finishes[0]
    return first.prompt_tokens, sum(f.completion_tokens for f in finishes), first.cached_tokens
