"""OpenAI (legacy) text completions: the prompt as a Conversation without a chat template, and
its choices' turns as one `text_completion` body or a stream of them, with logprobs."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from thunderpool.api import structured
from thunderpool.api.choices import completion_logprobs
from thunderpool.api.conversation import Admitted, Conversation, Finish, Turn
from thunderpool.api.errors import APIError
from thunderpool.api.openai_chat import error_event, running, usage
from thunderpool.api.schemas import Completion, CompletionChoice, CompletionRequest, Usage
from thunderpool.api.sse import DONE, event
from thunderpool.api.tools import Text
from thunderpool.api.turns import choices
from thunderpool.engine.service import EngineClient


def to_conversation(req: CompletionRequest) -> Conversation:
    return Conversation(
        messages=(),
        sampling=req,
        raw=req.prompt,
        prompt_field="prompt",
        stream=bool(req.stream),
        n=structured.check_n(req),
    )


def _logprobs(a: Admitted, lps: tuple, at: int = 0):
    j = a.job
    if not (j.params.logprobs and j.token_text):
        return None
    return completion_logprobs(lps, j.token_text, at)


def body(a: Admitted, turns: list[Turn]) -> Completion:
    picks = [
        CompletionChoice(
            index=i, text=t.text, finish_reason=t.finish.reason, logprobs=_logprobs(a, t.logprobs)
        )
        for i, t in enumerate(turns)
    ]
    j, total = a.job, usage([t.finish for t in turns])
    return Completion(id=j.id, created=j.created, model=j.model, choices=picks, usage=total)


async def chunks(
    engine: EngineClient, a: Admitted, include_usage: bool, continuous: bool = False
) -> AsyncGenerator[bytes, None]:
    """text_completion events: each choice's text chunks, then an empty one carrying its
    finish reason; usage if asked, and [DONE]. `continuous` (vLLM's continuous_usage_stats):
    every chunk also carries its choice's usage so far."""
    j = a.job
    so_far: dict[int, int] = {}  # choice -> completion tokens so far

    def chunk(picks: list[CompletionChoice], total: Usage | None = None) -> bytes:
        if continuous and total is None and picks:
            total = running(len(j.prompt), so_far.get(picks[0].index, 0))
        c = Completion(id=j.id, created=j.created, model=j.model, choices=picks, usage=total)
        return event(c.model_dump_json())

    offsets: dict[int, int] = {}  # choice -> its text offset so far (logprobs' text_offset)
    finishes: dict[int, Finish] = {}
    try:
        async for i, ev in choices(engine, a):
            match ev:
                case Text() if ev.text or ev.logprobs:
                    so_far[i] = ev.tokens
                    lps = _logprobs(a, ev.logprobs, offsets.get(i, 0))
                    if lps is not None:
                        offsets[i] = offsets.get(i, 0) + sum(len(t) for t in lps.tokens)
                    yield chunk([CompletionChoice(index=i, text=ev.text, logprobs=lps)])
                case Finish():
                    so_far[i] = ev.completion_tokens
                    yield chunk([CompletionChoice(index=i, text="", finish_reason=ev.reason)])
                    finishes[i] = ev
        if include_usage:
            yield chunk([], usage([finishes[k] for k in sorted(finishes)]))
        yield DONE
    except APIError as e:
        yield error_event(e)
