"""From the engine's Deltas to OpenAI answers: one collected body, or a stream of SSE chunks.

Both paths close the engine's iterator when they stop for any reason; closing is what cancels
the request and frees its seat in the batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace

from pydantic import BaseModel

from thunderpool.api import choices
from thunderpool.api.errors import APIError
from thunderpool.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    ErrorBody,
    PromptTokensDetails,
    Usage,
)
from thunderpool.api.sse import DONE, close_quietly, event
from thunderpool.engine.logits import TokenLogprob
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import Delta

log = logging.getLogger("thunderpool.api")


@dataclass(frozen=True, slots=True)
class Job:
    """One admitted request: what the engine gets and how the answer is labelled."""

    id: str
    created: int
    model: str
    prompt: list[int]
    params: SamplingParams
    include_usage: bool = False
    n: int = 1  # choices, each its own engine request on the same prompt
    tool_call: bool = False  # the output is a forced tool call (structured.py)
    token_text: Callable[[int], str] | None = None  # a token's text, for logprobs

    def usage(self, last: Delta) -> Usage:
        # The engine counts what it prefilled; our own count stands in if it reports none.
        p = last.prompt_tokens or len(self.prompt)
        return Usage(
            prompt_tokens=p,
            completion_tokens=last.completion_tokens,
            total_tokens=p + last.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=last.cached_tokens),
        )

    def choice_params(self, i: int) -> SamplingParams:
        """Choice i's parameters: a seeded request gives each choice its own seed."""
        p = self.params
        return p if i == 0 or p.seed is None else replace(p, seed=p.seed + i)


def total_usage(usages: list[Usage]) -> Usage:
    """The prompt counts once (it is the same prompt), completions add up."""
    p, c = usages[0].prompt_tokens, sum(u.completion_tokens for u in usages)
    details = usages[0].prompt_tokens_details
    return Usage(
        prompt_tokens=p, completion_tokens=c, total_tokens=p + c, prompt_tokens_details=details
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    text: str
    finish_reason: str
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()


def engine_error(message: str | None) -> APIError:
    return APIError(500, f"generation failed: {message or 'unknown engine error'}", "server_error")


NO_FINISH = "the engine ended the request without a finish reason"


async def collect(deltas: AsyncIterator[Delta], job: Job) -> Outcome:
    """The whole answer; an engine failure becomes a 500 with its message (no traceback)."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    try:
        async for d in deltas:
            parts.append(d.text)
            logprobs.extend(d.logprobs)
            if d.finish_reason == "error":
                raise engine_error(d.error)
            if d.finish_reason is not None:
                return Outcome("".join(parts), d.finish_reason, job.usage(d), tuple(logprobs))
    except APIError:
        raise
    except Exception as e:
        log.exception("generation %s failed", job.id)
        raise engine_error(str(e)) from e
    finally:
        await close_quietly(deltas)
    raise engine_error(NO_FINISH)


async def collect_all(streams: list[AsyncIterator[Delta]], job: Job) -> list[Outcome]:
    """Every choice's answer; one that fails cancels the others (closing their requests)."""
    if len(streams) == 1:
        return [await collect(streams[0], job)]
    tasks = [asyncio.ensure_future(collect(s, job)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _chat_choice(job: Job, i: int, out: Outcome) -> ChatChoice:
    message, reason = AssistantMessage(content=out.text), out.finish_reason
    if job.tool_call and reason == "stop" and (calls := choices.tool_calls(out.text)):
        message, reason = AssistantMessage(content=None, tool_calls=calls), "tool_calls"
    lps = None
    if job.params.logprobs and job.token_text is not None:
        lps = choices.chat_logprobs(out.logprobs, job.token_text)
    return ChatChoice(index=i, message=message, finish_reason=reason, logprobs=lps)


def chat_body(job: Job, outs: list[Outcome]) -> ChatCompletion:
    return ChatCompletion(
        id=job.id,
        created=job.created,
        model=job.model,
        choices=[_chat_choice(job, i, out) for i, out in enumerate(outs)],
        usage=total_usage([o.usage for o in outs]),
    )


def completion_body(job: Job, outs: list[Outcome]) -> Completion:
    picks = []
    for i, out in enumerate(outs):
        lps = None
        if job.params.logprobs and job.token_text is not None:
            lps = choices.completion_logprobs(out.logprobs, job.token_text)
        picks.append(
            CompletionChoice(index=i, text=out.text, finish_reason=out.finish_reason, logprobs=lps)
        )
    return Completion(
        id=job.id,
        created=job.created,
        model=job.model,
        choices=picks,
        usage=total_usage([o.usage for o in outs]),
    )


class ChatFrames:
    """chat.completion.chunk framing: a role chunk first, content chunks, an empty finish
    (per choice `index`); a forced tool call comes whole in one tool_calls chunk at its end."""

    def __init__(self, job: Job):
        self.job = job

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> BaseModel:
        j = self.job
        return ChatCompletionChunk(
            id=j.id, created=j.created, model=j.model, choices=choices, usage=usage
        )

    def start(self, index: int = 0) -> BaseModel | None:
        delta = ChatDelta(role="assistant", content="")
        return self._chunk([ChatChunkChoice(index=index, delta=delta)])

    def text(self, text: str, index: int = 0, logprobs: tuple = ()) -> BaseModel:
        lps = None
        if self.job.params.logprobs and self.job.token_text is not None:
            lps = choices.chat_logprobs(logprobs, self.job.token_text)
        delta = ChatDelta(content=text)
        return self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=lps)])

    def calls(self, text: str, index: int = 0) -> BaseModel | None:
        """The tool call a finished constrained output holds (None when cut short)."""
        calls = choices.tool_calls(text, index=0)
        if calls is None:
            return None
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=calls))])

    def finish(self, reason: str, index: int = 0) -> BaseModel:
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)


class CompletionFrames:
    """text_completion framing: text chunks, then an empty one carrying the finish reason."""

    def __init__(self, job: Job):
        self.job = job
        self.offsets: dict[int, int] = {}  # choice -> text offset so far (logprobs)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
        j = self.job
        return Completion(id=j.id, created=j.created, model=j.model, choices=choices, usage=usage)

    def start(self, index: int = 0) -> BaseModel | None:
        return None

    def text(self, text: str, index: int = 0, logprobs: tuple = ()) -> BaseModel:
        lps = None
        if self.job.params.logprobs and self.job.token_text is not None:
            at = self.offsets.get(index, 0)
            lps = choices.completion_logprobs(logprobs, self.job.token_text, at)
            self.offsets[index] = at + sum(len(t) for t in lps.tokens)
        return self._chunk([CompletionChoice(index=index, text=text, logprobs=lps)])

    def calls(self, text: str, index: int = 0) -> BaseModel | None:
        return None

    def finish(self, reason: str, index: int = 0) -> BaseModel:
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)


def _error_event(err: APIError) -> bytes:
    return event(ErrorBody(error=err.detail()).model_dump_json())


async def stream(
    streams: list[AsyncIterator[Delta]], job: Job, frames: ChatFrames | CompletionFrames
) -> AsyncGenerator[bytes, None]:
    """SSE bytes for one request's choices; an engine failure is an `{"error": ...}` event,
    then the end."""
    merged = choices.merge(streams)
    held: dict[int, list[str]] = {i: [] for i in range(len(streams))}  # forced tool calls
    usages: dict[int, Usage] = {}
    try:
        for i in range(len(streams)):
            if (first := frames.start(i)) is not None:
                yield event(first.model_dump_json())
        async for i, d in merged:
            if d.finish_reason == "error":
                yield _error_event(engine_error(d.error))
                return
            if job.tool_call:
                held[i].append(d.text)
            elif d.text or d.logprobs:
                yield event(frames.text(d.text, i, d.logprobs).model_dump_json())
            if d.finish_reason is not None:
                reason = d.finish_reason
                if job.tool_call:
                    text = "".join(held[i])
                    calls = frames.calls(text, i) if reason == "stop" else None
                    if calls is not None:
                        yield event(calls.model_dump_json())
                        reason = "tool_calls"
                    elif text:
                        yield event(frames.text(text, i).model_dump_json())
                yield event(frames.finish(reason, i).model_dump_json())
                usages[i] = job.usage(d)
                if len(usages) == len(streams):
                    if job.include_usage:
                        total = total_usage([usages[k] for k in sorted(usages)])
                        yield event(frames.usage(total).model_dump_json())
                    yield DONE
                    return
        yield _error_event(engine_error(NO_FINISH))
    except Exception as e:
        log.exception("generation %s failed mid-stream", job.id)
        yield _error_event(engine_error(str(e)))
    finally:
        await close_quietly(merged)
        for s in streams:  # those merge never started
            await close_quietly(s)
