"""From the engine's Deltas to OpenAI answers: one collected body, or a stream of SSE chunks.

Both paths close the engine's iterator when they stop for any reason; closing is what cancels
the request and frees its seat in the batch.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel

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

    def usage(self, last: Delta) -> Usage:
        # The engine counts what it prefilled; our own count stands in if it reports none.
        p = last.prompt_tokens or len(self.prompt)
        return Usage(
            prompt_tokens=p,
            completion_tokens=last.completion_tokens,
            total_tokens=p + last.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=last.cached_tokens),
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    text: str
    finish_reason: str
    usage: Usage


def engine_error(message: str | None) -> APIError:
    return APIError(500, f"generation failed: {message or 'unknown engine error'}", "server_error")


NO_FINISH = "the engine ended the request without a finish reason"


async def collect(deltas: AsyncIterator[Delta], job: Job) -> Outcome:
    """The whole answer; an engine failure becomes a 500 with its message (no traceback)."""
    parts: list[str] = []
    try:
        async for d in deltas:
            parts.append(d.text)
            if d.finish_reason == "error":
                raise engine_error(d.error)
            if d.finish_reason is not None:
                return Outcome("".join(parts), d.finish_reason, job.usage(d))
    except APIError:
        raise
    except Exception as e:
        log.exception("generation %s failed", job.id)
        raise engine_error(str(e)) from e
    finally:
        await close_quietly(deltas)
    raise engine_error(NO_FINISH)


def chat_body(job: Job, out: Outcome) -> ChatCompletion:
    choice = ChatChoice(message=AssistantMessage(content=out.text), finish_reason=out.finish_reason)
    return ChatCompletion(
        id=job.id, created=job.created, model=job.model, choices=[choice], usage=out.usage
    )


def completion_body(job: Job, out: Outcome) -> Completion:
    choice = CompletionChoice(text=out.text, finish_reason=out.finish_reason)
    return Completion(
        id=job.id, created=job.created, model=job.model, choices=[choice], usage=out.usage
    )


class ChatFrames:
    """chat.completion.chunk framing: a role chunk first, content chunks, an empty finish."""

    def __init__(self, job: Job):
        self.job = job

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> BaseModel:
        j = self.job
        return ChatCompletionChunk(
            id=j.id, created=j.created, model=j.model, choices=choices, usage=usage
        )

    def start(self) -> BaseModel | None:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])

    def text(self, text: str) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(content=text))])

    def finish(self, reason: str) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)


class CompletionFrames:
    """text_completion framing: text chunks, then an empty one carrying the finish reason."""

    def __init__(self, job: Job):
        self.job = job

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
        j = self.job
        return Completion(id=j.id, created=j.created, model=j.model, choices=choices, usage=usage)

    def start(self) -> BaseModel | None:
        return None

    def text(self, text: str) -> BaseModel:
        return self._chunk([CompletionChoice(text=text)])

    def finish(self, reason: str) -> BaseModel:
        return self._chunk([CompletionChoice(text="", finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)


def _error_event(err: APIError) -> bytes:
    return event(ErrorBody(error=err.detail()).model_dump_json())


async def stream(
    deltas: AsyncIterator[Delta], job: Job, frames: ChatFrames | CompletionFrames
) -> AsyncGenerator[bytes, None]:
    """SSE bytes for one request; an engine failure is an `{"error": ...}` event, then the end."""
    try:
        if (first := frames.start()) is not None:
            yield event(first.model_dump_json())
        async for d in deltas:
            if d.finish_reason == "error":
                yield _error_event(engine_error(d.error))
                return
            if d.text:
                yield event(frames.text(d.text).model_dump_json())
            if d.finish_reason is not None:
                yield event(frames.finish(d.finish_reason).model_dump_json())
                if job.include_usage:
                    yield event(frames.usage(job.usage(d)).model_dump_json())
                yield DONE
                return
        yield _error_event(engine_error(NO_FINISH))
    except Exception as e:
        log.exception("generation %s failed mid-stream", job.id)
        yield _error_event(engine_error(str(e)))
    finally:
        await close_quietly(deltas)
