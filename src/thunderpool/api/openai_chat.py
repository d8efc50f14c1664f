"""OpenAI chat completions: the request as a Conversation, and its choices' turns as one
`chat.completion` body or a stream of `chat.completion.chunk` events, with logprobs and tool
calls (`message.tool_calls` collected, `delta.tool_calls` streamed, finish_reason "tool_calls").
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from thunderpool.api import prompts, structured
from thunderpool.api.choices import chat_logprobs
from thunderpool.api.conversation import Admitted, Conversation, Finish, Turn
from thunderpool.api.errors import APIError, bad_request
from thunderpool.api.schemas import (
    AssistantMessage,
    CalledFunction,
    CalledTool,
    CalledToolDelta,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatRequest,
    ErrorBody,
    PromptTokensDetails,
    Usage,
)
from thunderpool.api.sse import DONE, event
from thunderpool.api.tools import SERVED_CHOICES, Call, Text, function_tool
from thunderpool.api.turns import choices, usage_of
from thunderpool.engine.service import EngineClient


def _arguments(text: str, where: str) -> Any:
    """Templates take an earlier call's arguments as an object, OpenAI sends them as text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"{where} is not valid JSON: {e}", param=where) from e


def messages(req: ChatRequest) -> list[dict[str, Any]]:
    out = prompts.chat_messages(req.messages)
    for i, (m, msg) in enumerate(zip(req.messages, out, strict=True)):
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request("only assistant messages carry tool_calls", f"messages.{i}")
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(
                            c.function.arguments,
                            f"messages.{i}.tool_calls.{j}.function.arguments",
                        ),
                    },
                }
                for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request(
                    "a 'tool' message needs the 'tool_call_id' it answers",
                    param=f"messages.{i}.tool_call_id",
                )
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
    return out


def tools(req: ChatRequest) -> tuple[dict[str, Any], ...]:
    out = []
    for i, t in enumerate(req.tools or []):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f"{where}: only tools of type 'function' are supported", where)
        f = t.get("function")
        if not isinstance(f, dict):
            raise bad_request(f"{where}: a function tool needs a 'function' object", where)
        out.append(function_tool(f.get("name"), f.get("description"), f.get("parameters"), where))
    return tuple(out)


def tool_choice(choice: str | dict[str, Any] | None) -> str:
    """ "auto" | "none" | "required" | a function's name."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(
                f"tool_choice={choice!r} is not one of 'auto', 'none', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None  # any JSON may stand there
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return name


def to_conversation(req: ChatRequest) -> Conversation:
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    limit = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    sampling = req.model_copy(update={"max_tokens": limit})
    choice = tool_choice(req.tool_choice)
    return Conversation(
        messages=tuple(messages(req)),
        sampling=sampling,
        tools=tools(req),
        tool_choice=choice,
        stream=bool(req.stream),
        n=structured.check_n(req),
        # A forced call ("required" or a named function) is constrained decoding's
        # (structured.py); "auto" lets the model choose, parsed by the family's tool parser.
        forced=choice not in SERVED_CHOICES,
    )


def _called(calls: tuple[Call, ...] | list[Call]) -> list[CalledTool]:
    return [
        CalledTool(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def usage(finishes: list[Finish]) -> Usage:
    prompt, completion, cached = usage_of(finishes)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def running(prompt: int, completion: int) -> Usage:
    """A choice's usage so far, for vLLM's continuous_usage_stats."""
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def error_event(err: APIError) -> bytes:
    return event(ErrorBody(error=err.detail()).model_dump_json())


def _logprobs(a: Admitted, lps: tuple):
    j = a.job
    return chat_logprobs(lps, j.token_text) if j.params.logprobs and j.token_text else None


def body(a: Admitted, turns: list[Turn]) -> ChatCompletion:
    picks = []
    for i, t in enumerate(turns):
        content = t.text if t.text or not t.calls else None  # null beside calls, as OpenAI's
        message = AssistantMessage(content=content, tool_calls=_called(t.calls) or None)
        lps = _logprobs(a, t.logprobs)
        picks.append(
            ChatChoice(index=i, message=message, finish_reason=t.finish.reason, logprobs=lps)
        )
    j = a.job
    total = usage([t.finish for t in turns])
    return ChatCompletion(id=j.id, created=j.created, model=j.model, choices=picks, usage=total)


async def chunks(
    engine: EngineClient, a: Admitted, include_usage: bool, continuous: bool = False
) -> AsyncGenerator[bytes, None]:
    """chat.completion.chunk events: each choice's role chunk, content (with logprobs) and
    tool_calls deltas (one whole call per delta, each with its `index`), its empty finish;
    then usage if asked, and [DONE]. `continuous` (vLLM's continuous_usage_stats): every
    chunk also carries its choice's usage so far."""
    j = a.job
    so_far: dict[int, int] = {}  # choice -> completion tokens so far

    def chunk(picks: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        if continuous and usage is None and picks:
            usage = running(len(j.prompt), so_far.get(picks[0].index, 0))
        c = ChatCompletionChunk(
            id=j.id, created=j.created, model=j.model, choices=picks, usage=usage
        )
        return event(c.model_dump_json())

    for i in range(j.n):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    calls: dict[int, int] = {}
    finishes: dict[int, Finish] = {}
    try:
        async for i, ev in choices(engine, a):
            match ev:
                case Text() if ev.text or ev.logprobs:
                    so_far[i] = ev.tokens
                    lps = _logprobs(a, ev.logprobs)
                    delta = ChatDelta(content=ev.text)
                    yield chunk([ChatChunkChoice(index=i, delta=delta, logprobs=lps)])
                case Call():
                    function = CalledFunction(name=ev.name, arguments=ev.arguments)
                    call = CalledToolDelta(index=calls.get(i, 0), id=ev.id, function=function)
                    calls[i] = calls.get(i, 0) + 1
                    yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(tool_calls=[call]))])
                case Finish():
                    so_far[i] = ev.completion_tokens
                    finish = ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=ev.reason)
                    yield chunk([finish])
                    finishes[i] = ev
        if include_usage:
            yield chunk([], usage([finishes[k] for k in sorted(finishes)]))
        yield DONE
    except APIError as e:
        yield error_event(e)
