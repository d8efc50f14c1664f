"""OpenAI chat completions into a Conversation, and the answers of a turn that may call tools:
`message.tool_calls` collected, `delta.tool_calls` streamed, finish_reason "tool_calls".

Requests without tools keep generation.py's framing; both share the Conversation's prompt.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from thunderpool.api import prompts
from thunderpool.api.conversation import Admitted, Conversation, Finish, Turn, turn
from thunderpool.api.errors import APIError, bad_request
from thunderpool.api.generation import _error_event
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
    PromptTokensDetails,
    Usage,
)
from thunderpool.api.sse import DONE, event
from thunderpool.api.tools import Call, Text, function_tool
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
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
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
    return Conversation(
        messages=tuple(messages(req)),
        sampling=sampling,
        tools=tools(req),
        tool_choice=tool_choice(req.tool_choice),
        stream=bool(req.stream),
    )


def _called(calls: tuple[Call, ...] | list[Call]) -> list[CalledTool]:
    return [
        CalledTool(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def _usage(f: Finish) -> Usage:
    return Usage(
        prompt_tokens=f.prompt_tokens,
        completion_tokens=f.completion_tokens,
        total_tokens=f.prompt_tokens + f.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=f.cached_tokens),
    )


def body(a: Admitted, t: Turn) -> ChatCompletion:
    content = t.text if t.text or not t.calls else None  # null beside calls, as OpenAI's
    message = AssistantMessage(content=content, tool_calls=_called(t.calls) or None)
    choice = ChatChoice(message=message, finish_reason=t.finish.reason)
    j = a.job
    return ChatCompletion(
        id=j.id, created=j.created, model=j.model, choices=[choice], usage=_usage(t.finish)
    )


async def chunks(
    engine: EngineClient, a: Admitted, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    """chat.completion.chunk events: a role chunk, content and tool_calls deltas (one whole
    call per delta, each with its `index`), an empty finish, usage if asked, [DONE]."""
    j = a.job

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        c = ChatCompletionChunk(
            id=j.id, created=j.created, model=j.model, choices=choices, usage=usage
        )
        return event(c.model_dump_json())

    yield chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    index = 0
    try:
        async for ev in turn(engine, a):
            match ev:
                case Text() if ev.text:
                    yield chunk([ChatChunkChoice(delta=ChatDelta(content=ev.text))])
                case Call():
                    function = CalledFunction(name=ev.name, arguments=ev.arguments)
                    call = CalledToolDelta(index=index, id=ev.id, function=function)
                    index += 1
                    yield chunk([ChatChunkChoice(delta=ChatDelta(tool_calls=[call]))])
                case Finish():
                    yield chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=ev.reason)])
                    if include_usage:
                        yield chunk([], _usage(ev))
                    yield DONE
    except APIError as e:
        yield _error_event(e)
