"""Anthropic Messages (`POST /v1/messages`): text, system prompts, stop sequences and tool use,
collected or streamed as Anthropic's named SSE events, over the shared Conversation.

Errors are Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from thunderpool.api import openapi, prompts
from thunderpool.api.conversation import Admitted, Conversation, Finish, Turn, admit, render
from thunderpool.api.errors import APIError, bad_request
from thunderpool.api.models import Served
from thunderpool.api.schemas import SamplingFields
from thunderpool.api.sse import EventStream, until_disconnect
from thunderpool.api.tools import Call, Text, function_tool
from thunderpool.api.turns import collect_turn, turn
from thunderpool.api.wire import Strict, parse
from thunderpool.engine.service import EngineClient

CLIENT_CLOSED = 499


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a caching hint; our prefix cache is automatic
    citations: list[Any] | None = None  # echoed back from an earlier answer; not model input


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: Any = None  # echoed back from an earlier answer (who made the call)
    toolset_name: str | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(Strict):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # e.g. user_id: for the caller's records
    cache_control: dict[str, Any] | None = None  # a caching hint; our prefix cache is automatic
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_response(e: APIError) -> JSONResponse:
    kind = ERROR_TYPES.get(e.status, "api_error")
    body = AnthropicError(error=AnthropicErrorDetail(type=kind, message=e.message))
    return JSONResponse(body.model_dump(mode="json"), status_code=e.status, headers=e.headers)


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts = [b.text for b in m.content if isinstance(b, TextBlock)]
        calls = [b for b in m.content if isinstance(b, ToolUseBlock)]
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                out.append(
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
                )
        if m.role == "assistant" and calls:
            out.append(
                {
                    "role": "assistant",
                    "content": "\n".join(texts),
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.input},
                        }
                        for c in calls
                    ],
                }
            )
        elif texts or not out or out[-1]["role"] != "tool":
            out.append({"role": m.role, "content": "\n".join(texts)})
    return out


def _tool_choice(choice: AnthropicToolChoice | None) -> str:
    match choice:
        case None:
            return "auto"
        case AnthropicToolChoice(type="any"):
            return "required"
        case AnthropicToolChoice(type="tool", name=str(name)):
            return name
        case AnthropicToolChoice(type="tool"):
            raise bad_request("tool_choice of type 'tool' needs a 'name'", param="tool_choice")
    return choice.type


class TokenCount(BaseModel):
    input_tokens: int


def to_conversation(req: MessagesRequest) -> Conversation:
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    if req.stop_sequences is not None and any(not s for s in req.stop_sequences):
        raise bad_request("stop_sequences must not be empty strings", param="stop_sequences")
    sampling = SamplingFields(
        model=req.model,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
    )
    tools = tuple(
        function_tool(t.name, t.description, t.input_schema, f"tools.{i}")
        for i, t in enumerate(req.tools or [])
    )
    return Conversation(
        messages=tuple(_messages(req)),
        sampling=sampling,
        tools=tools,
        tool_choice=_tool_choice(req.tool_choice),
        stream=bool(req.stream),
    )


def _stop(f: Finish) -> tuple[str, str | None]:
    if f.stop_sequence:
        return "stop_sequence", f.stop_sequence
    return STOP_REASONS.get(f.reason, "end_turn"), None


def _tool_use(c: Call) -> dict[str, Any]:
    return {"type": "tool_use", "id": c.id, "name": c.name, "input": c.input}


def body(a: Admitted, t: Turn) -> MessageResponse:
    content: list[dict[str, Any]] = [{"type": "text", "text": t.text}] if t.text else []
    content += [_tool_use(c) for c in t.calls]
    reason, sequence = _stop(t.finish)
    usage = AnthropicUsage(
        input_tokens=t.finish.prompt_tokens, output_tokens=t.finish.completion_tokens
    )
    return MessageResponse(
        id=a.job.id,
        model=a.job.model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=usage,
    )


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


async def events(engine: EngineClient, a: Admitted) -> AsyncGenerator[bytes, None]:
    """message_start, content blocks (start, deltas, stop), message_delta, message_stop."""
    start = {"id": a.job.id, "type": "message", "role": "assistant", "model": a.job.model}
    start |= {"content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": len(a.job.prompt), "output_tokens": 0}
    yield _event("message_start", {"message": start})
    index, open_text = 0, False
    try:
        async for ev in turn(engine, a):
            match ev:
                case Text() if ev.text:
                    if not open_text:
                        block = {"type": "text", "text": ""}
                        yield _event(
                            "content_block_start", {"index": index, "content_block": block}
                        )
                        open_text = True
                    delta = {"type": "text_delta", "text": ev.text}
                    yield _event("content_block_delta", {"index": index, "delta": delta})
                case Call():
                    if open_text:
                        yield _event("content_block_stop", {"index": index})
                        index, open_text = index + 1, False
                    block = {**_tool_use(ev), "input": {}}
                    yield _event("content_block_start", {"index": index, "content_block": block})
                    delta = {"type": "input_json_delta", "partial_json": ev.arguments}
                    yield _event("content_block_delta", {"index": index, "delta": delta})
                    yield _event("content_block_stop", {"index": index})
                    index += 1
                case Finish():
                    if open_text:
                        yield _event("content_block_stop", {"index": index})
                    reason, sequence = _stop(ev)
                    delta = {"stop_reason": reason, "stop_sequence": sequence}
                    yield _event(
                        "message_delta",
                        {"delta": delta, "usage": {"output_tokens": ev.completion_tokens}},
                    )
                    yield _event("message_stop", {})
    except APIError as e:
        error = {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}
        yield _event("error", {"error": error})


def mount(
    app: FastAPI, served: Served, require_key: Callable[[Request], None], keyed: bool
) -> None:
    """Adds `POST /v1/messages`; the key may come as `x-api-key` (Anthropic's) or a bearer."""

    def anthropic_errors(handler: Callable[[Request], Awaitable[Response]]):
        async def wrapped(request: Request) -> Response:
            try:
                require_key(request)
                return await handler(request)
            except APIError as e:
                return error_response(e)

        return wrapped

    example = {
        "model": served.names()[0],
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    doc = openapi.route(
        {"model": MessageResponse, "content": openapi.named_events()},
        (400, 404, 429, 503),
        MessagesRequest,
        example,
        guarded=keyed,
        error="AnthropicError",
    )

    @app.post("/v1/messages", **doc)
    @anthropic_errors
    async def messages(request: Request) -> Response:
        req = await parse(request, MessagesRequest)
        engine = await served.acquire(prompts.check_model(req.model, served.names()))
        admitted = await admit(engine, to_conversation(req), "msg_")
        if req.stream:
            return EventStream(events(engine, admitted))
        t = await until_disconnect(request.receive, lambda: collect_turn(engine, admitted))
        if t is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body(admitted, t).model_dump(mode="json"))

    count_doc = openapi.route(
        {"model": TokenCount},
        (400, 404, 503),
        CountTokensRequest,
        {k: v for k, v in example.items() if k != "max_tokens"},
        guarded=keyed,
        error="AnthropicError",
    )

    @app.post("/v1/messages/count_tokens", **count_doc)
    @anthropic_errors
    async def count_tokens(request: Request) -> Response:
        """The prompt's length, as agents ask before sending a long conversation."""
        req = await parse(request, CountTokensRequest)
        engine = await served.acquire(prompts.check_model(req.model, served.names()))
        full = MessagesRequest(**dict(req), max_tokens=1)
        ids = await render(engine, to_conversation(full))
        return JSONResponse(TokenCount(input_tokens=len(ids)).model_dump())
